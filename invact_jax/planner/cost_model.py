"""What a plan costs: one layer's FLOPs under a policy (traced, counted as XLA counts), a
program's compiled temp, the layer profile the integer program solves over, the byte scale
fitted to compiled plans, and the fixed choices (JAX's policies, MaxText's presets) costed the
same way."""
from __future__ import annotations

import dataclasses

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


from invact_jax import memory, targets
from invact_jax.planner import apply, layer_loop
from invact_jax.planner.integer_program import LayerProfile
from invact_jax.planner.layer_loop import Loop

# FLOPs counted per (the tagged layer's jaxpr, keep, fixed, transposed): planning one program
# at several budgets (scripts/plan_memory.py, the frontier's plan rows) counts each layer
# policy once.
_FLOPS: dict = {}


_FLOPS_SIZE = 4096


def layer_flops(loop: Loop, keep: Sequence[str], fixed: str | None = None) -> float:
  """FLOPs of one layer's forward and backward under the names policy keeping ``keep`` (or
  the JAX policy ``fixed``).

  Counted on the layer's linearization (the forward, the recompute the policy asks for and
  the tangent equations), plus the layer's transposed-against-tangent difference measured
  once on its gradient: the recompute is the only part a policy changes, and a gradient's
  trace (its transpose) takes twice a linearization's (GPT-2's layer: 0.10 vs 0.05 s)."""
  return (_counted(loop, keep, fixed) + _counted(loop, (), None, transposed=True)
          - _counted(loop, (), None))


def _counted(loop: Loop, keep: Sequence[str], fixed: str | None,
             transposed: bool = False) -> float:
  """:func:`count_layer_flops`, each (layer, policy, transposed) traced once."""
  key = (loop.signature, tuple(keep), fixed, transposed)
  if key not in _FLOPS:
    if len(_FLOPS) >= _FLOPS_SIZE:
      _FLOPS.clear()
    _FLOPS[key] = count_layer_flops(loop, keep, fixed, transposed)
  return _FLOPS[key]


def count_layer_flops(loop: Loop, keep: Sequence[str], fixed: str | None,
                      transposed: bool = False) -> float:
  """XLA's FLOP count of one layer's gradient (``transposed``) or linearization under the
  policy."""
  scalar, structs = layer_loop.layer_scalar(loop, keep, fixed)

  def linearized(*diff):
    value, tangents = jax.linearize(scalar, *diff)
    return value, tangents(*diff)
  f = jax.value_and_grad(scalar, argnums=tuple(range(len(structs)))) if transposed else linearized
  return memory.jaxpr_flops(jax.make_jaxpr(f)(*structs))


def compiled_temp(fn: Callable, args, grad, keep, budget: int, offload=(), fixed=None) -> int:
  """Compiled temp of ``jit(grad(fn planned with keep/offload))`` (``grad``: the program's
  ``jax.value_and_grad`` with its ``argnums`` and ``has_aux``): see :func:`measured_temp`."""
  return measured_temp(grad(apply.apply_plan(fn, keep, offload, fixed)), args, budget)


def measured_temp(gradient: Callable, args, budget: int) -> int:
  """``gradient``'s compiled temp at ``args`` as compared with ``budget``: measured at
  :func:`memory.analysis_options`, never below the default compile's figure, so what fits by
  it fits; where it lies above ``budget`` by no more than it can be above the default
  compile's (:func:`memory.analysis_excess`), the default compile's figure (measured again
  at :func:`memory.exact_analysis_options`)."""
  temp = memory.analysed(gradient, *args).temp
  if budget < temp and memory.undecided(temp, budget):
    temp = memory.analysed(gradient, *args, exact=True).temp
  return temp


def _has_pinned_host() -> bool:
  """Whether the current target's device has host memory to offload to (XLA:CPU's host
  memory is its own; a GPU compiled for without one has, but its transfer rates are not
  measured here: :func:`offload_rate`)."""
  target = targets.current()
  if target.platform == "cpu":
    return False
  if target.deviceless:
    return target.platform == "gpu"
  try:
    kinds = jax.devices()[0].addressable_memories()
  except Exception:  # pylint: disable=broad-except
    return False
  return any(getattr(m, "kind", "") == "pinned_host" for m in kinds)


def _measured_rates() -> tuple[float, float]:
  """(bytes/s of a device -> pinned_host -> device round trip per byte each way, FLOP/s of a
  4096^3 bfloat16 matmul), timed on the device."""
  import time  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  x = jnp.ones((64, 2**20), jnp.float32)  # 256 MiB
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  back = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  jax.block_until_ready(jax.device_put(jax.device_put(x, host), back))
  t0 = time.perf_counter()
  jax.block_until_ready(jax.device_put(jax.device_put(x, host), back))
  bandwidth = 2 * x.nbytes / (time.perf_counter() - t0)
  a = jnp.ones((4096, 4096), jnp.bfloat16)
  mm = jax.jit(lambda a: a @ a)
  jax.block_until_ready(mm(a))
  t0 = time.perf_counter()
  for _ in range(10):
    out = mm(a)
  jax.block_until_ready(out)
  return bandwidth, 10 * 2 * 4096**3 / (time.perf_counter() - t0)


def layer_profile(loop: Loop, low: int, offload_rate: float | None,
                  scale: float = 1.0) -> LayerProfile:
  """The layer loop's :class:`invact_jax.planner.LayerProfile`: ``low`` the compiled temp
  keeping nothing; a kept tensor adds its bytes times ``scale`` per layer (measured by
  compiling the plans that keep nothing and everything: XLA:CPU keeps 16-bit values as
  float32, say, and a program whose peak lies outside its layers adds less).
  ``offload_rate``: FLOPs the device computes in the time one byte goes to the host and back
  (None: offloading is not a choice)."""
  names = tuple(t.name for t in loop.tensors)
  f0 = layer_flops(loop, ())
  gain = tuple(max(f0 - layer_flops(loop, (n,)), 0.0) for n in names)
  full = max(f0 - layer_flops(loop, names), 0.0)
  offload_cost = (tuple(offload_rate * t.bytes for t in loop.tensors)
                  if offload_rate is not None else ())
  # Keeping a tensor also takes it out of the layer the backward recomputes: one layer's
  # worth of it comes off the peak (the planner counts the largest among those kept).
  return scaled_profile(loop, LayerProfile(
      configuration="as written", depth=loop.length, base_bytes=low, tags=names,
      tag_bytes=(0,) * len(names), tag_gain=gain, full_cost=full,
      tag_offload_cost=offload_cost), scale)


def offload_rate(offload: bool | None, host_bandwidth: float | None,
                 flop_rate: float | None) -> float | None:
  """FLOPs per offloaded byte (out and back), or None where offloading is not a choice
  (compiling for a device without it: only where asked for, with both rates given)."""
  target = targets.current()
  if offload is False or (offload is None and (not _has_pinned_host() or target.deviceless)):
    return None
  if offload and not _has_pinned_host():
    raise ValueError(f"argument `offload`: the device ({target.device_kind}) has no "
                     "pinned_host memory to offload to")
  if target.deviceless and (host_bandwidth is None or flop_rate is None):
    raise ValueError(f"argument `{'host_bandwidth' if host_bandwidth is None else 'flop_rate'}`"
                     f": offloading on {target.name}, compiled for without the device, needs "
                     "the host's bandwidth and the device's FLOP rate given (they are measured "
                     "on the device only)")
  if host_bandwidth is None or flop_rate is None:
    measured = _measured_rates()
    host_bandwidth = measured[0] if host_bandwidth is None else host_bandwidth
    flop_rate = measured[1] if flop_rate is None else flop_rate
  for name, value in (("host_bandwidth", host_bandwidth), ("flop_rate", flop_rate)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"argument `{name}` must be a positive number, got {value!r}")
  return 2.0 * flop_rate / host_bandwidth


def bytes_scale(loop: Loop, observed: Sequence[tuple[Sequence[str], int]],
                low: int) -> float | None:
  """The bytes a kept tensor adds to the compiled temp per byte it holds, fitted to the
  compiled plans ``observed`` ((set kept, compiled temp) each; least squares on the relative
  error, so that no one plan's figure decides it alone); None where none keeps anything to
  measure by."""
  bytes_of = {t.name: t.bytes for t in loop.tensors}
  num = den = 0.0
  for keep, compiled in observed:
    nominal = loop.length * sum(bytes_of.get(t, 0) for t in keep)
    added = nominal - max((bytes_of.get(t, 0) for t in keep), default=0)
    if added > 0 and compiled > 0:
      num += added * max(compiled - low, 0) / compiled**2
      den += added**2 / compiled**2
  return num / den if den else None


def observed_sets(known: dict) -> list[tuple[frozenset, int]]:
  return [(k, t) for k, t in known.items() if isinstance(k, frozenset) and k]


def scaled_profile(loop: Loop, profile: LayerProfile, scale: float) -> LayerProfile:
  nbytes = tuple(int(round(t.bytes * scale)) for t in loop.tensors)
  return dataclasses.replace(profile, tag_bytes=nbytes, tag_relief=nbytes)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One way to run the layer loop: names kept/offloaded in every layer, or per run of layers
  (``runs``); a MaxText preset (``fixed`` its name, ``keep`` its names in the layer); or JAX's
  policy ``fixed`` (``"none"``: the layer without remat)."""
  label: str
  keep: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()
  fixed: str | None = None
  runs: tuple = ()

  @property
  def key(self) -> tuple:
    """What the compiled program depends on."""
    return (frozenset(self.keep), frozenset(self.offload),
            None if self.fixed in layer_loop.MAXTEXT_PRESETS else self.fixed, self.runs)

  def apply(self, fn: Callable) -> Callable:
    return apply.apply_plan(fn, self.keep, self.offload, self.fixed, self.runs)


def fixed_choices(loop: Loop) -> list[Choice]:
  """JAX's none / full / dots / dots_no_batch and MaxText's presets whose names the layer
  has (each with those of its names the layer has; presets alike there taken once)."""
  out = [Choice("none", fixed="none"), Choice("full")]
  out += [Choice(name, fixed=name) for name in layer_loop.FIXED_POLICIES]
  named = {n.params["name"] for n in loop.graph.nodes if n.prim.name == "name"}
  seen = set()
  for name, saved in layer_loop.MAXTEXT_PRESETS.items():
    keep = tuple(n for n in saved if n in named)
    if keep and frozenset(keep) not in seen:
      seen.add(frozenset(keep))
      out.append(Choice(name, keep, fixed=name))
  return out


class Costs:
  """The FLOPs and compiled temps of a program's choices, each counted or compiled once.

  Recompute: the planned gradient step's FLOPs less the step without remat's, every loop's
  body once per iteration, counted on its trace (:func:`memory.jaxpr_flops`: XLA's count of
  the compiled step to a few operations, a cuDNN attention's and a Pallas kernel's counted
  from their shapes); ``estimate``: the same from one layer's count (:func:`layer_flops`,
  cached per layer and policy) times the layers, which ranks the choices without tracing the
  program (it leaves out what remat adds outside the layer's own count, alike for every
  choice under a ``jax.checkpoint``).  Temps: :func:`measured_temp`."""

  def __init__(self, fn, args, grad, loop: Loop, budget: int):
    self.fn, self.args, self.grad, self.loop, self.budget = fn, args, grad, loop, budget
    self.temps: dict = {}
    self._flops: dict = {}

  def step(self, choice: Choice) -> float:
    if choice.key not in self._flops:
      closed = jax.make_jaxpr(self.grad(choice.apply(self.fn)))(*self.args)
      self._flops[choice.key] = memory.jaxpr_flops(closed, per_iteration=True)
    return self._flops[choice.key]

  def recompute(self, choice: Choice) -> float:
    return max(self.step(choice) - self.step(Choice("none", fixed="none")), 0.0)

  def counted(self, choice: Choice) -> bool:
    """Whether ``choice``'s step was traced (its recompute is counted, not estimated)."""
    return choice.key in self._flops

  def estimate(self, choice: Choice) -> float:
    fixed = None if choice.fixed in layer_loop.MAXTEXT_PRESETS else choice.fixed
    runs = choice.runs or ((choice.keep, choice.offload, self.loop.length),)
    none = layer_flops(self.loop, (), "none")
    return sum(n * max(layer_flops(self.loop, tuple(k) + tuple(o), fixed) - none, 0.0)
               for k, o, n in runs)

  def temp(self, choice: Choice) -> int:
    if choice.key not in self.temps:
      self.temps[choice.key] = measured_temp(self.grad(choice.apply(self.fn)), self.args,
                                         self.budget)
    return self.temps[choice.key]


def predicted_peak(loop: Loop, profile: LayerProfile, choice: Choice,
                   scale: float) -> int:
  """The compiled temp predicted for ``choice``: a names plan's by the profile; a JAX policy's
  from the residuals it keeps per layer, at the calibrated bytes per kept byte."""
  if choice.runs:
    keep = [k for k, _, n in choice.runs for _ in range(n)]
    off = [o for _, o, n in choice.runs for _ in range(n)]
    return profile.peak(keep, off)
  if choice.fixed is None or choice.fixed in layer_loop.MAXTEXT_PRESETS:
    keep = tuple(t for t in choice.keep if t in profile.tags)
    off = tuple(t for t in choice.offload if t in profile.tags)
    return profile.peak((keep,) * profile.depth, (off,) * profile.depth)
  kept = [r.bytes for r in layer_loop.layer_residuals(
      loop, (), "everything" if choice.fixed == "none" else choice.fixed)]
  return int(profile.base_bytes + scale * (loop.length * sum(kept) - max(kept, default=0)))


def least_step_flops(fn, args, grad) -> float:
  """The least FLOPs a planned gradient step of ``fn`` can do: its layer loop recomputing
  nothing (a program without one is as it is; :func:`api.plan_loop` then says so)."""
  return memory.jaxpr_flops(jax.make_jaxpr(grad(apply.apply_plan(fn, (), (), "none")))(*args),
                           per_iteration=True)
