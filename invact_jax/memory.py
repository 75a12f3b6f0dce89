"""Memory figures: what autodiff keeps, what XLA allocates, what the device peaked at.

Example:
  >>> import jax, jax.numpy as jnp, invact_jax
  >>> from invact_jax import memory
  >>> w = jnp.ones((16, 64)); x = jnp.ones((4, 16))
  >>> loss = lambda x, w: invact_jax.gelu(x @ w).sum()
  >>> [r.shape for r in memory.residuals(loss, x, w) if r.source.startswith("output")]
  [(4, 64), (4, 8)]
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable

import jax
import jax.extend.core
import numpy as np

from invact_jax import targets

__all__ = ["jaxpr_flops", "Residual", "residuals", "residual_table", "CompiledMemory", "compiled", "compiled_for", "analysed", "analysis_options", "flops",
           "reports_peak", "device_peak"]


@dataclasses.dataclass(frozen=True)
class Residual:
  """One array that reverse-mode autodiff keeps for the backward pass."""
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  source: str  # "from the argument x", "output of mul from file:line (fn)", ...

  @property
  def is_argument(self) -> bool:
    return self.source.startswith("from the argument")


def _saved_residuals():
  try:
    from jax.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  except ImportError:
    from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  return saved_residuals


def residuals(fn: Callable[..., Any], *args, **kwargs) -> list[Residual]:
  """The residuals JAX saves when differentiating ``fn`` (scalar output) w.r.t. ``args``.

  Constants (literals) are left out; arguments are included and marked.

  Raises:
    TypeError: ``fn`` is not callable.
  """
  _callable("residuals", fn)
  out = []
  for aval, source in _saved_residuals()(fn, *args, **kwargs):
    if source.startswith("from a literal") or source.startswith("from a constant"):
      continue
    shape = tuple(int(d) for d in aval.shape)
    itemsize, name = _itemsize(aval.dtype)
    out.append(Residual(shape, name, math.prod(shape) * itemsize, source))
  return out


def _callable(where: str, fn) -> None:
  if not callable(fn):
    raise TypeError(f"invact_jax.memory.{where}: argument `fn` must be callable, got "
                    f"{type(fn).__name__}")


def _itemsize(dtype) -> tuple[int, str]:
  """Bytes per element and a name; PRNG keys count their key data (threefry: 2 x uint32)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    impl = getattr(dtype, "_impl", None)
    key_shape = getattr(impl, "key_shape", (2,))
    return math.prod(key_shape) * 4, str(dtype)
  return np.dtype(dtype).itemsize, str(np.dtype(dtype))


def residual_table(rows: list[Residual]) -> str:
  """Markdown table of residuals, with a total over non-argument rows."""
  lines = ["| shape | dtype | bytes | source |", "|---|---|---:|---|"]
  for r in rows:
    lines.append(f"| {r.shape} | {r.dtype} | {r.bytes} | {r.source} |")
  kept = sum(r.bytes for r in rows if not r.is_argument)
  lines.append(f"| **saved (non-argument)** | | **{kept}** | |")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """XLA's ``memory_analysis()`` of the compiled function, in bytes."""
  temp: int
  argument: int
  output: int
  alias: int
  generated_code: int

  @property
  def total(self) -> int:
    return self.temp + self.argument + self.output - self.alias


def compiled(fn: Callable[..., Any], *args, **kwargs) -> CompiledMemory:
  """Compile ``fn`` with ``jax.jit`` for ``args`` and report its memory analysis, for the
  current target (:func:`invact_jax.targets.current`: this machine unless inside
  :func:`invact_jax.targets.compiling_for`; :func:`compiled_for` names one).

  ``fn`` may already be jitted.  On CPU, unrolled layers are fused and reordered
  freely, so temp figures follow residuals most faithfully with ``lax.scan``.
  """
  _callable("compiled", fn)
  return _memory_of(fn, args, kwargs, None)


def compiled_for(device: str | targets.Target, fn: Callable[..., Any], *args,
                 **kwargs) -> CompiledMemory:
  """:func:`compiled` for ``device``: its compiler's memory analysis on any machine.

  Args:
    device: what to compile for (:func:`invact_jax.targets.resolve`): ``"h100"``,
      ``"h200"``, ``"h100x8"`` (per-device figures of a program sharded over eight), a
      ``GpuTargetConfigProto`` file, ``"v5e:2x2"``, or ``"cpu"``.  A GPU or TPU is compiled
      for without one (deviceless; docs/deviceless.md).
    fn: the function (``jax.jit`` applied where it is not jitted).
    *args, **kwargs: its arguments: arrays or ``jax.ShapeDtypeStruct`` s; a sharding over a
      mesh of as many devices as the target has is carried over to the target's devices,
      other arguments are replicated.

  Returns:
    The :class:`CompiledMemory` XLA reports for one device of the target.  Inside, the
    current target is ``device``: code choosing implementations by
    :func:`invact_jax.targets.platform` (cuDNN's attention, the LM head's tiles) and
    ``invact_jax.invert``'s measuring compiles choose for it.

  Raises:
    ValueError: ``device`` names no target.
    RuntimeError: its compiler is not installed here (the message says what to install).

  Example:
    >>> import jax.numpy as jnp
    >>> from invact_jax import memory
    >>> x = jnp.ones((256, 256))
    >>> memory.compiled_for("cpu", lambda a: (a @ a).sum(), x).argument
    262144
  """
  _callable("compiled_for", fn)
  with targets.compiling_for(device):
    return _memory_of(fn, args, kwargs, None)


@functools.cache
def _has_fusion_emitter_switch() -> bool:
  """Whether this jaxlib's XLA:CPU takes ``xla_cpu_use_fusion_emitters`` (0.10 does; 0.11.2
  and 0.12 removed it and always use the fusion emitters): a compile of the identity on the
  CPU with it, once."""
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  lowered = jax.jit(lambda x: x).lower(jax.ShapeDtypeStruct((), np.float32, sharding=cpu))
  try:
    lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": False})
  except Exception:  # pylint: disable=broad-except  # "No such compile option"
    return False
  return True


def exact_analysis_options() -> dict[str, Any]:
  """XLA compile options under which the memory analysis is exactly the default compile's,
  reached sooner: the buffers are assigned before the backend generates code, so on CPU
  LLVM runs at -O0 and in one piece (``tests/test_memory.py``).  Empty for other targets (a
  GPU's compile is measured as it is)."""
  if targets.platform() != "cpu":
    return {}
  return {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}


def analysis_options() -> dict[str, Any]:
  """The options of the measuring compiles (planner, ``invert``'s checks): those of
  :func:`exact_analysis_options` and, where jaxlib has the switch (0.10), XLA:CPU's
  elemental emitters instead of its fusion emitters, 2-3x faster to compile.  They fuse a few
  small ops differently: the temp is never below the default compile's and at most
  :func:`analysis_excess` above it (``tests/test_memory.py``: 256 bytes on a small inverted
  bfloat16 GPT-2)."""
  options = exact_analysis_options()
  if options and _has_fusion_emitter_switch():
    options["xla_cpu_use_fusion_emitters"] = False
  return options


def analysis_excess(temp: int) -> int:
  """A bound on how far a temp measured at :func:`analysis_options` can lie above the default
  compile's (``temp`` the measured figure): 64 KiB + 0.1 %, many times what was measured; 0
  where the two compile alike (no switch, or ``XLA_FLAGS`` turn the fusion emitters off for
  every compile of the process, as the test suite does).  A comparison of such figures
  closer than this is made again at :func:`exact_analysis_options`."""
  if ("xla_cpu_use_fusion_emitters" not in analysis_options()
      or re.search(r"--xla_cpu_use_fusion_emitters=(false|0)\b",
                   os.environ.get("XLA_FLAGS", ""), re.IGNORECASE)):
    return 0
  return 64 * 1024 + temp // 1000


def undecided(a: int, b: int) -> bool:
  """Whether two temps measured at :func:`analysis_options` lie too close for their order to
  be the default compile's (within :func:`analysis_excess`): measure them again at
  :func:`exact_analysis_options` before comparing (``b`` may be a budget)."""
  return abs(a - b) <= analysis_excess(max(a, b))


def analysed(fn: Callable[..., Any], *args, exact: bool = False) -> CompiledMemory:
  """:func:`compiled`'s figures of ``fn`` at ``args``, compiled with
  :func:`analysis_options` (``exact``: :func:`exact_analysis_options`); the executable is
  for measuring, never run."""
  return _memory_of(fn, args, {}, exact_analysis_options() if exact else analysis_options())


def _memory_of(fn, args, kwargs, options) -> CompiledMemory:
  """The current target's compiled memory of ``fn`` at ``args`` (``options``: XLA's compile
  options)."""
  target = targets.current()
  m = target.compile(target.lower(fn, *args, **kwargs), options).memory_analysis()
  if m is None:
    raise RuntimeError(f"XLA's memory_analysis() is not available for target {target.name!r}")
  return CompiledMemory(temp=int(m.temp_size_in_bytes), argument=int(m.argument_size_in_bytes),
                        output=int(m.output_size_in_bytes), alias=int(m.alias_size_in_bytes),
                        generated_code=int(m.generated_code_size_in_bytes))


def flops(fn: Callable[..., Any], *args, **kwargs) -> float:
  """XLA's FLOP count of ``jax.jit(fn)`` for ``args`` on the current target: the lowered
  module's cost analysis where the platform gives one (CPU: no compile), else the compiled
  module's (a GPU; compiled deviceless, XLA's HLO cost analysis of the optimized module,
  which counts a custom call's FLOPs only where XLA knows its kind: cuBLAS's matmuls, not
  cuDNN's attention).  XLA counts a loop's body once, whatever its trip count.

  Raises:
    RuntimeError: the platform reports no FLOP count.
  """
  target = targets.current()
  lowered = target.lower(fn, *args, **kwargs)
  for analysis in (lowered.cost_analysis, lambda: _compiled_cost(target.compile(lowered))):
    try:
      got = analysis()
    except Exception:  # pylint: disable=broad-except  # (JAX 0.12 raises deviceless: none)
      got = None
    if isinstance(got, (list, tuple)):
      got = got[0] if got else None
    if got:
      return float(got.get("flops", 0.0))  # (none where it has only moves or transcendentals)
  raise RuntimeError(f"XLA reports no FLOP count for target {target.name!r}")


def _compiled_cost(compiled) -> dict | None:
  """The compiled module's cost analysis; compiled deviceless (which has none of its own),
  XLA's HLO cost analysis of its optimized module, run by this machine's client, plus the
  FLOPs of the library calls it cannot see into (:func:`custom_call_flops`)."""
  try:
    got = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # (JAX 0.12 raises deviceless: none)
    got = None
  if isinstance(got, (list, tuple)):
    got = got[0] if got else None
  if got:
    return got
  try:
    from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
    module = compiled.runtime_executable().hlo_modules()[0]
    got = dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))
  except Exception:  # pylint: disable=broad-except  # (private API of this jaxlib)
    return None
  got["flops"] = float(got.get("flops", 0.0)) + custom_call_flops(compiled.as_text())
  return got


_HLO_VALUE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\s*(\w+)\[([\d,]*)\]", re.M)
_CALL = re.compile(r'custom-call\(([^)]*)\).*?custom_call_target="([^"]+)"(.*)$', re.M)


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def custom_call_flops(hlo: str) -> float:
  """FLOPs of the library calls in an optimized HLO module (``hlo``, its text) that XLA's
  cost analysis counts none of: cuBLAS's matmuls 2·M·N·K from their shapes and contracting
  dimensions; cuDNN's fused attention 4·B·H·Tq·Tk·D forward and 10·B·H·Tq·Tk·D backward
  (its five matmuls: the probabilities recomputed).  Each call once, as XLA counts a loop's
  body once."""
  shapes = {name: _dims(dims) for name, _, dims in _HLO_VALUE.findall(hlo)}
  total = 0.0
  for line in hlo.splitlines():
    m = _CALL.search(line)
    head = _HLO_VALUE.match(line)
    if m is None or head is None:
      continue
    operands, target, rest = m.groups()
    out = _dims(head.group(3))
    if target.startswith("__cublas$"):
      names = [o.strip().lstrip("%").split(" ")[-1].lstrip("%") for o in operands.split(",")]
      contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
      lhs = shapes.get(names[0]) if names else None
      if lhs is None or contracting is None:
        continue
      k = math.prod(lhs[int(c.strip('" '))] for c in contracting.group(1).split(",") if c)
      total += 2.0 * math.prod(out) * k
    elif target.startswith("__cudnn$fmha"):
      inter = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', rest)
      if inter is None or not out:
        continue
      b_h_tq_tk = [int(d.strip('" ')) for d in inter.group(1).split(",") if d.strip()]
      per = math.prod(b_h_tq_tk) * out[-1]
      total += (10.0 if "Backward" in target else 4.0) * per
  return total


# Primitives XLA's cost analysis counts as transcendentals (no FLOPs), and those that only
# move, re-lay or index values (no FLOPs either).
_TRANSCENDENTAL = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "sin", "cos", "tan", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan2", "sqrt", "rsqrt", "cbrt",
    "erf", "erfc", "erf_inv", "pow", "lgamma", "digamma"})
_MOVES = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "scatter", "iota",
    "copy", "copy_p", "rev", "select_and_gather_add", "stop_gradient",
    "name", "pvary", "pcast", "device_put", "optimization_barrier", "random_bits",
    "random_seed", "random_wrap", "random_unwrap", "threefry2x32", "sharding_constraint",
    "mesh_cast", "get", "swap", "program_id", "num_programs"})
# Primitives lowered to several operations per element.
_PER_ELEMENT = {"logistic": 3.0, "one_minus_square": 3.0}
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin"})


def _elements(aval) -> int:
  return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def jaxpr_flops(jaxpr, *, per_iteration: bool = False) -> float:
  """FLOPs of ``jaxpr`` (open or closed) counted the way XLA's cost analysis counts the
  lowered module, without lowering it: a matmul 2·M·N·K, an elementwise operation one per
  output element (``logistic`` three, ``integer_pow`` its multiplications, JAX 0.12's
  ``polynomial`` two per coefficient), a reduction its
  input's elements less its output's, a transcendental or a move none; cuDNN's fused
  attention as :func:`custom_call_flops` counts it; a Pallas kernel its ``cost_estimate``
  (else its body once per grid step); equations whose
  outputs nothing reads left out (as lowering leaves them out); nested jaxprs counted once
  each (a loop's body once, as XLA does; a ``cond`` its costliest branch).

  Args:
    jaxpr: a ``jax.core.Jaxpr`` or ``ClosedJaxpr`` (``jax.make_jaxpr(f)(*args)``).
    per_iteration: count a ``scan``'s body once per iteration (its ``length``) instead of
      once: the FLOPs the program runs, not XLA's figure.

  Returns:
    The FLOP count: :func:`flops`'s to a few operations on scalars for each tested op, and
    within 0.1 % on a scanned layer's gradient under JAX's remat policies
    (``tests/test_memory.py``; XLA's simplifier also drops a product with a broadcast one,
    a gradient's seed).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  if not all(hasattr(jaxpr, a) for a in ("eqns", "invars", "outvars")):
    raise TypeError(f"invact_jax.memory.jaxpr_flops: argument `jaxpr` must be a jaxpr "
                    f"(jax.make_jaxpr(f)(*args)), got {type(jaxpr).__name__}")
  return _counted(jaxpr, [True] * len(jaxpr.outvars), [False] * len(jaxpr.invars),
                  per_iteration)


def _literal(v) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def _counted(jaxpr, live_out: list, const_in: list, per_iteration: bool) -> float:
  """FLOPs of the equations of ``jaxpr`` that its live outputs (``live_out``) need; inputs
  flagged in ``const_in`` are constants (a literal passed into a call), and an equation of
  constants only is folded (no FLOPs), as XLA folds it."""
  consts = {v for v, c in zip(jaxpr.invars, const_in) if c}
  const = lambda v: _literal(v) or v in consts  # noqa: E731
  folded = set()
  for e in jaxpr.eqns:
    if e.invars and all(const(v) for v in e.invars) and not e.effects:
      consts.update(e.outvars)
      folded.add(id(e))
  live = {v for v, keep in zip(jaxpr.outvars, live_out) if keep and not _literal(v)}
  total = 0.0
  for e in reversed(jaxpr.eqns):
    outs = [v in live for v in e.outvars]
    if not any(outs) and not e.effects:
      continue
    live.update(v for v in e.invars if not _literal(v))
    if id(e) not in folded:
      total += _eqn_flops(e, outs, [const(v) for v in e.invars], per_iteration)
  return total


def _eqn_flops(e, live_out: list, const_in: list, per_iteration: bool) -> float:
  """XLA's FLOPs for one equation: a Pallas call's cost estimate (or its kernel per grid step),
  cuDNN's attention from its shapes, a nested body's (a scan's per iteration, or times its
  length; a cond's costliest branch), else XLA's count of the equation alone."""
  name = e.primitive.name
  inner = [getattr(v, "jaxpr", v) for v in e.params.values()
           if hasattr(getattr(v, "jaxpr", v), "eqns")]
  branches = e.params.get("branches")
  if name == "pallas_call":  # its cost estimate where it gives one, else its kernel per step
    estimate = e.params.get("cost_estimate")
    if estimate is not None:
      return float(estimate.flops)
    grid = getattr(e.params.get("grid_mapping"), "grid", ()) or ()
    kernel = e.params["jaxpr"]
    return math.prod(int(g) for g in grid if isinstance(g, int)) * _counted(
        kernel, [True] * len(kernel.outvars), [False] * len(kernel.invars), per_iteration)
  if branches:  # (the first input is the index)
    return max(_counted(b.jaxpr, live_out, const_in[1:], per_iteration) for b in branches)
  if inner:
    if (len(inner) == 1 and len(inner[0].outvars) == len(e.outvars)
        and len(inner[0].invars) == len(e.invars) and name != "scan"):
      # a call: what its live outputs need
      return _counted(inner[0], live_out, const_in, per_iteration)
    trips = e.params["length"] if name == "scan" and per_iteration else 1
    return trips * sum(_counted(j, [True] * len(j.outvars), [False] * len(j.invars),
                                per_iteration) for j in inner)
  out = sum(_elements(v.aval) for v in e.outvars)
  if name == "dot_general":
    (lhs_contract, _), _ = e.params["dimension_numbers"]
    k = int(np.prod([e.invars[0].aval.shape[d] for d in lhs_contract], dtype=np.int64))
    return 2.0 * out * k
  if name == "conv_general_dilated":
    rhs = e.invars[1].aval.shape
    dn = e.params["dimension_numbers"]
    out_feature = dn.rhs_spec[0] if dn is not None else 0
    return 2.0 * out * int(np.prod(rhs, dtype=np.int64)) / rhs[out_feature]
  if name in _REDUCTIONS:
    return sum(_elements(v.aval) for v in e.invars) - out
  if name in _PER_ELEMENT:
    return _PER_ELEMENT[name] * out
  if name.startswith("dot_product_attention_"):  # cuDNN's fused attention (custom_call_flops)
    return _cudnn_attention_flops(e)
  if name == "polynomial":  # (JAX 0.12) Horner's rule: a product and a sum per coefficient
    return 2.0 * (len(e.invars) - 2) * out
  if name == "integer_pow":
    y = int(e.params["y"])
    return (max(abs(y) - 1, 0) + (y < 0)) * out
  return 0.0 if name in _TRANSCENDENTAL or name in _MOVES else float(out)


def _cudnn_attention_flops(e) -> float:
  """FLOPs of a cuDNN attention equation as :func:`custom_call_flops` counts its call:
  4·B·N·T·S·H forward, 10·B·N·T·S·H backward (``layout`` 0: [B, T, N, H], 1: [B, N, T, H]);
  the FP8 variants likewise."""
  q, k = e.invars[0].aval.shape, e.invars[1].aval.shape
  if len(q) != 4 or len(k) != 4:
    return 0.0
  bnth = int(getattr(e.params.get("layout", 0), "value", e.params.get("layout", 0))) == 1
  s = k[2] if bnth else k[1]
  per = math.prod(q) * s
  return (10.0 if "_bwd" in e.primitive.name else 4.0) * per


def reports_peak(device=None) -> bool:
  """Whether ``device`` (default: the first local one) keeps allocator statistics (GPU)."""
  device = device or jax.local_devices()[0]
  return "peak_bytes_in_use" in (device.memory_stats() or {})


def device_peak(fn: Callable[..., Any], *args, device=None, **kwargs) -> dict[str, int]:
  """Run ``fn`` once (compiled beforehand) and read ``Device.memory_stats()``.

  Returns ``{"peak_bytes_in_use", "bytes_in_use_before", "peak_increase", "output_bytes",
  "temp_bytes"}`` (the last two from the same executable's ``memory_analysis()``).  The
  allocator's peak is process-wide and never resets: ``peak_bytes_in_use`` is this
  run's peak only if it exceeds every earlier one, so measure one configuration per
  process (``scripts/benchmark_memory.py`` does).

  Raises:
    RuntimeError: the platform keeps no memory statistics (e.g. CPU).
  """
  device = device or jax.local_devices()[0]
  if not reports_peak(device):
    raise RuntimeError(f"device {device} ({device.platform}) reports no memory_stats(); "
                       "use invact_jax.memory.compiled() for XLA's static figures instead")
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  exe = jitted.lower(*args, **kwargs).compile()
  before = device.memory_stats()
  jax.block_until_ready(exe(*args, **kwargs))
  after = device.memory_stats()
  return {"peak_bytes_in_use": int(after["peak_bytes_in_use"]),
          "bytes_in_use_before": int(before["bytes_in_use"]),
          "peak_increase": int(after["peak_bytes_in_use"] - before["bytes_in_use"]),
          "output_bytes": int(exe.memory_analysis().output_size_in_bytes),
          "temp_bytes": int(exe.memory_analysis().temp_size_in_bytes)}
