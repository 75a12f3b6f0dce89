"""The public planner: :func:`plan` on any JAX program, its :class:`Planned` result and
:class:`PlanReport`."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

from invact_jax import memory, targets
from invact_jax.planner import apply, choose, cost_model, integer_program, layer_loop

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclasses.dataclass(frozen=True)
class PlanReport:
  """What :func:`plan` chose and what it predicts.

  Attributes:
    loop: the planned layer loop (source line) and its length.
    depth: its number of layers.
    other_loops: the program's other layer loops, left as written.
    tensors: the candidates of one layer.
    keep, offload, recompute: the candidates' names by what every layer does with them.
    budget: the budget in bytes.
    predicted_bytes: the predicted compiled temp of ``jit(value_and_grad(planned))``.
    compiled_bytes: XLA's compiled temp of it.
    minimum_bytes: the compiled temp keeping nothing (every candidate recomputed).
    predicted_recompute_flops: FLOPs the plan recomputes per step (every layer): the
      planned step's FLOPs less those of the same step without remat, both counted on the
      traced gradient with XLA's cost-analysis conventions (:func:`memory.jaxpr_flops`: the
      compiled program's count, cuDNN's attention and Pallas kernels counted from their
      shapes).
    rounds: solves until the compiled temp fitted.
    as_written: whether the program as written fits: then it runs unchanged (every tensor
      kept, nothing recomputed) and ``predicted_bytes`` is its compiled temp.
    policy: the fixed choice the layers run under where it recomputes less than the solved
      plan and fits: JAX's (:data:`FIXED_POLICIES`), MaxText's preset (:data:`MAXTEXT_PRESETS`:
      ``keep`` holds its names), or ``"none"``: no remat, where the layer had a
      ``jax.checkpoint`` of its own (its ``predicted_bytes`` is its compiled temp); else None.
    runs: where layers differ (MONeT's and torchtitan's per-layer choice), ``(keep, offload,
      layers)`` per run of equal layers, first layers first (each run its own ``lax.scan``);
      then ``keep``/``offload`` name what every layer keeps/offloads.  Empty: every layer
      the same.
    compared: every choice weighed, one line each: what it recomputes and its compiled temp
      (or why it was not compiled): JAX's none / full / dots / dots_no_batch, MaxText's
      presets whose names the layer has, the solved plan(s).
    configuration: ``"as written"``, or ``"inverted"`` where ``plan(convert=True)`` took
      ``invact_jax.invert(fn)``.
    step_flops: FLOPs of the planned gradient step (XLA's cost-analysis conventions, every
      loop's body counted once per iteration: the layers, a chunked head's tiles), by which
      ``plan(convert=True)`` chooses between the programs (their backwards differ in more
      than the recompute); None without ``convert``.
    alternatives: with ``convert``, the other program: planned (its step's FLOPs and temp),
      infeasible (its minimum), or not planned (its step does more FLOPs than the chosen
      plan's even recomputing nothing).
  """
  loop: str
  depth: int
  other_loops: tuple[str, ...]
  tensors: tuple[layer_loop.Tensor, ...]
  keep: tuple[str, ...]
  offload: tuple[str, ...]
  recompute: tuple[str, ...]
  budget: int
  predicted_bytes: int
  compiled_bytes: int
  minimum_bytes: int
  predicted_recompute_flops: float
  rounds: int
  as_written: bool = False
  policy: str | None = None
  configuration: str = "as written"
  step_flops: float | None = None
  alternatives: tuple[str, ...] = ()
  runs: tuple[tuple[tuple[str, ...], tuple[str, ...], int], ...] = ()
  compared: tuple[str, ...] = ()

  def __str__(self) -> str:
    what = {**{n: "keep" for n in self.keep}, **{n: "offload" for n in self.offload}}
    if self.runs:
      first = 0
      for keep, off, layers in self.runs:
        for n in {*keep, *off} - set(what):
          what[n] = f"layers {first}-{first + layers - 1}: {'keep' if n in keep else 'offload'}"
        first += layers
    lines = [f"{self.configuration}: layer loop {self.loop} ({self.depth} layers)"
             + (": the program as written fits (nothing recomputed)" if self.as_written else "")
             + (": the layer fits without its own jax.checkpoint (no remat)"
                if self.policy == "none" else
                f": MaxText's {self.policy} preset fits and recomputes least"
                if self.policy in layer_loop.MAXTEXT_PRESETS else
                f": JAX's {self.policy} policy fits and recomputes least" if self.policy else "")
             + (f": {len(self.runs)} runs of layers (" + ", ".join(
                 str(r[2]) for r in self.runs) + ")" if self.runs else "")
             + "".join(f"\nleft as written: {w}" for w in self.other_loops)
             + "".join(f"\nnot taken: {a}" for a in self.alternatives),
             f"budget {self.budget:,} B: predicted {self.predicted_bytes:,} B, compiled "
             f"{self.compiled_bytes:,} B (keeping nothing: {self.minimum_bytes:,} B); recomputes "
             f"{self.predicted_recompute_flops:.3g} FLOPs per step",
             "| tensor | shape | dtype | bytes per layer | plan | where |", "|---|---|---|---:|---|---|"]
    lines += [f"| {t.name} | {list(t.shape)} | {t.dtype} | {t.bytes:,} | "
              f"{what.get(t.name, 'recompute')} | {t.where} |" for t in self.tensors]
    lines += [f"weighed: {c}" for c in self.compared]
    return "\n".join(lines)


def parse_budget(budget: int | float | str) -> int:
  """Bytes from a number or a string such as ``"300MiB"``, ``"1.5GB"``, ``"123456"``
  (fractions of a byte rounded down; any size of integer taken exactly).

  Raises:
    ValueError: not a finite number of at least one byte (the message names ``budget``).
    TypeError: not a number or a string.
  """
  value = budget
  if isinstance(budget, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
    if not m or m.group(2).lower() not in _UNITS:
      raise ValueError(f"argument `budget`: not a byte count: {budget!r} (e.g. 300MiB, 2GB, 123456)")
    number, unit = m.group(1), _UNITS[m.group(2).lower()]
    value = (int(number) * unit if re.fullmatch(r"[0-9]+", number)
             else float(number) * unit)
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"argument `budget` must be a number of bytes or a string such as '300MiB', "
                    f"got {budget!r}")
  if isinstance(value, (int, np.integer)):
    nbytes = int(value)
  elif not math.isfinite(float(value)):
    raise ValueError(f"argument `budget` must be a finite number of bytes, got {budget!r}")
  else:
    nbytes = math.floor(float(value))
  if nbytes < 1:
    raise ValueError(f"argument `budget` must be at least one byte, got {budget!r}")
  return nbytes


class Planned:
  """``fn`` with a memory plan applied to its layer loop: call it as ``fn``; ``.report`` is
  the :class:`PlanReport`."""

  def __init__(self, fn: Callable, report: PlanReport):
    self._fn = fn if report.as_written else apply.apply_plan(fn, report.keep, report.offload,
                                                   report.policy, report.runs)
    self.report = report
    self.__wrapped__ = fn
    self.__name__ = getattr(fn, "__name__", "planned")
    self.__doc__ = getattr(fn, "__doc__", None)

  def __call__(self, *args, **kwargs):
    return self._fn(*args, **kwargs)


def _check_options(has_aux, convert, offload, host_bandwidth, flop_rate) -> None:
  """One line naming the first of :func:`plan`'s options that is not of its kind."""
  for name, value in (("has_aux", has_aux), ("convert", convert)):
    if not isinstance(value, bool):
      raise TypeError(f"argument `{name}` must be a bool, got {value!r}")
  if offload is not None and not isinstance(offload, bool):
    raise TypeError(f"argument `offload` must be a bool or None, got {offload!r}")
  for name, value in (("host_bandwidth", host_bandwidth), ("flop_rate", flop_rate)):
    if value is None:
      continue
    if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(float(value)) or not value > 0):
      raise ValueError(f"argument `{name}` must be a positive finite number, got {value!r}")


def _check(fn, args, argnums) -> tuple[int, ...]:
  """``argnums`` as a tuple, after one line for a ``fn`` not callable, no example arguments, or
  argnums out of range."""
  if not callable(fn):
    raise TypeError(f"argument `fn` must be callable, got {type(fn).__name__}")
  if not args:
    raise ValueError("plan() needs example arguments: plan(fn, *example_args, budget=...)")
  nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
  if (not isinstance(nums, tuple) or not nums
      or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < len(args) for a in nums)):
    raise ValueError(f"argument `argnums` must be an int or a tuple of ints in [0, {len(args)}), "
                     f"got {argnums!r}")
  return nums


def plan_loop(fn, args, grad, budget: int, rate: float | None,
              configuration: str, with_step: bool = False) -> PlanReport:
  """The plan of one program (``configuration`` names it in the report; ``with_step``: its
  ``step_flops`` counted): the solved plan, or the choice of :func:`cost_model.fixed_choices` or of
  :func:`choose.per_run_choice` that recomputes less and fits compiled.

  Raises:
    ValueError: ``fn`` has no layer loop.
    integer_program.InfeasibleBudget: ``budget`` is below its compiled temp keeping nothing.
  """
  closed = jax.make_jaxpr(fn)(*args)
  _, loops, skipped = layer_loop.find_loops(closed)
  loop = layer_loop.read_by_the_backward(loops[0]) if loops else None
  if loop is None:
    raise ValueError("plan(): no layer loop in `fn`: it has no lax.scan over stacked inputs "
                     "(parameters) whose backward reads a matmul's or a checkpoint_name'd "
                     "value" + "".join(f"; {why}" for why in
                                       skipped + layer_loop.enclosed_loops(closed)))
  low = cost_model.compiled_temp(fn, args, grad, (), budget)
  if budget < low:
    raise integer_program.InfeasibleBudget(budget, low)
  profile, known, rounds = cost_model.layer_profile(loop, low, rate), {frozenset(): low}, 1
  first = integer_program.solve([profile], budget, uniform=True)
  as_written = None if any(first.offload or ()) else choose.written_temp(
      fn, args, grad, loop, profile, first.keep[0], budget, known)
  costs = cost_model.Costs(fn, args, grad, loop, budget)
  common = dict(loop=f"{loop.where}, {loop.length} iterations", depth=loop.length,
                other_loops=tuple(f"{l.where}, {l.length} iterations" for l in loops[1:])
                + tuple(skipped), tensors=loop.tensors, budget=budget, minimum_bytes=low,
                configuration=configuration)
  if as_written is not None and as_written <= budget:  # nothing recomputed fits: no more compiles
    step = (memory.jaxpr_flops(jax.make_jaxpr(grad(fn))(*args), per_iteration=True)
            if with_step else None)
    return PlanReport(**common, keep=tuple(t.name for t in loop.tensors), offload=(),
                      recompute=(), predicted_bytes=as_written, compiled_bytes=as_written,
                      rounds=rounds, predicted_recompute_flops=0.0, as_written=True,
                      step_flops=step)
  profile, keep, off, predicted, compiled, rounds, scale = choose.fitted_plan(
      fn, args, grad, loop, profile, budget, known, 1.0)
  costs.temps.update({(k, frozenset(), None, ()): t for k, t in known.items()
                      if isinstance(k, frozenset)})
  solved = cost_model.Choice("plan", keep, off)
  costs.temps[solved.key] = compiled
  # every set compiled on the way that fits (the profile's bytes are a model: a set it
  # predicted above another may fit and recompute less), then the fixed choices
  others = [cost_model.Choice(f"plan kept {', '.join(k) or 'nothing'}", k)
            for k in choose.fitting_sets(profile, known, budget)
            if frozenset(k) != frozenset(keep) or off]
  others += cost_model.fixed_choices(loop)
  uniform_cost = profile.cost((keep,) * profile.depth, (off,) * profile.depth)
  runs = choose.per_run_choice(profile, budget, uniform_cost,
                  compiled, costs)
  others += [runs] if runs is not None else []
  best, compared = choose.cheapest_choice(loop, profile, scale, costs, solved, others)
  if best is not solved:
    predicted = (cost_model.predicted_peak(loop, profile, best, scale) if best.runs
                 else costs.temps[best.key])
  every = lambda n: all(n in k for k, _, _ in best.runs)  # noqa: E731
  kept = (tuple(t.name for t in loop.tensors) if best.fixed == "none" else
          tuple(t.name for t in loop.tensors if every(t.name)) if best.runs else best.keep)
  offloaded = (tuple(t.name for t in loop.tensors if all(t.name in o for _, o, _ in best.runs))
               if best.runs else best.offload)
  return PlanReport(
      **common, keep=kept, offload=offloaded,
      recompute=tuple(t.name for t in loop.tensors if t.name not in set(kept) | set(offloaded)
                      and not (best.runs and any(t.name in {*k, *o} for k, o, _ in best.runs))),
      predicted_bytes=int(predicted), compiled_bytes=int(costs.temps[best.key]), rounds=rounds,
      predicted_recompute_flops=costs.recompute(best), policy=best.fixed, runs=best.runs,
      compared=compared, step_flops=costs.step(best) if with_step else None)


def plan(fn: Callable[..., Any], *example_args: Any, budget: int | float | str,
         argnums: int | Sequence[int] = 0, has_aux: bool = False, convert: bool = False,
         offload: bool | None = None,
         host_bandwidth: float | None = None, flop_rate: float | None = None,
         device: str | targets.Target | None = None) -> Planned:
  """``fn`` whose gradient's compiled temp fits ``budget``: the planner chooses what its layer
  loop keeps, recomputes or offloads (see the module doc).

  Args:
    fn: the loss (or any function whose gradient is taken), unmodified.
    *example_args: arguments to trace, profile and compile it with (arrays or shape structs).
    budget: bytes for the compiled temp of ``jax.jit(jax.value_and_grad(planned, argnums,
      has_aux=has_aux))``, or a string such as ``"300MiB"``.
    argnums: the arguments the gradient is taken of, as for ``jax.grad``.
    has_aux: ``fn`` returns ``(loss, auxiliary data)``, as for ``jax.grad``.
    convert: also plan ``invact_jax.invert(fn)`` (its activations, norms, softmax and LM head
      converted: MONeT's operator variants) and take the one whose planned step does fewer
      FLOPs within the budget (a program whose step, recomputing nothing, does at least the
      FLOPs of the plan made first is not planned: ``report.alternatives``).
    offload: whether tensors may go to host memory (None: where the device has
      ``pinned_host``).
    host_bandwidth: bytes/s between device and host, to cost offloading (None: measured).
    flop_rate: the device's FLOP/s, to weigh offloading against recomputing (None:
      measured).
    device: the target to plan for (:func:`invact_jax.targets.resolve`: ``"h100"``, ...;
      default: the current target, this machine unless inside
      :func:`invact_jax.targets.compiling_for`): ``fn`` is traced as for it and every
      profile and check is its compiler's (a GPU compiled for without one:
      docs/deviceless.md), so that the plan fits that device.  Offloading is off on such a
      device unless asked for with both rates.

  Returns:
    A :class:`Planned` function with ``fn``'s signature; ``.report`` holds the choice, the
    predicted and compiled temp and the predicted recompute FLOPs.

  Raises:
    ValueError: no layer loop in ``fn`` (a ``lax.scan`` over stacked inputs), or a bad
      argument (the message names it).
    integer_program.InfeasibleBudget: below the compiled temp of keeping nothing (the minimum, named).
  """
  nums = _check(fn, example_args, argnums)
  _check_options(has_aux, convert, offload, host_bandwidth, flop_rate)
  budget = parse_budget(budget)
  with targets.compiling_for(device):
    return _plan(fn, example_args, budget, nums, argnums, has_aux, convert, offload,
                 host_bandwidth, flop_rate)


def _plan(fn, example_args, budget: int, nums, argnums, has_aux: bool, convert: bool,
          offload, host_bandwidth, flop_rate) -> Planned:
  """:func:`plan` for the current target, its arguments checked."""
  grad = functools.partial(jax.value_and_grad, argnums=nums[0] if isinstance(argnums, int)
                           else nums, has_aux=has_aux)
  rate = cost_model.offload_rate(offload, host_bandwidth, flop_rate)
  programs = {"as written": fn}
  if convert:
    from invact_jax import convert  # pylint: disable=import-outside-toplevel
    programs["inverted"] = convert.inverted_for_plan(fn)
  # The step's FLOPs, not the recompute alone: the converted backward's own arithmetic (an
  # inverse, a chunked head's recomputed logits) differs from the original's.  A program whose
  # step does at least the best plan's FLOPs even recomputing nothing is not planned (no
  # compiles): the programs are planned from the least such bound up.
  least = ({name: cost_model.least_step_flops(p, example_args, grad)
            for name, p in programs.items()}
           if len(programs) > 1 else {"as written": 0.0})
  reports, infeasible, others = {}, [], []
  key = lambda n: (reports[n].step_flops or reports[n].predicted_recompute_flops,  # noqa: E731
                   reports[n].compiled_bytes)
  for name in sorted(programs, key=least.__getitem__):
    best = min(reports, key=key) if reports else None
    if best is not None and least[name] >= reports[best].step_flops:
      others.append(f"{name}: not planned: its step does {least[name]:.4g} FLOPs or more, "
                    f"against {reports[best].step_flops:.4g} planned")
      continue
    try:
      reports[name] = plan_loop(programs[name], example_args, grad, budget, rate, name,
                                with_step=len(programs) > 1)
    except integer_program.InfeasibleBudget as e:
      infeasible.append(e.minimum_bytes)
      others.append(f"{name}: infeasible: keeping nothing it needs {e.minimum_bytes:,} B")
  if not reports:
    raise integer_program.InfeasibleBudget(budget, min(infeasible))
  best = min(reports, key=key)
  others += [f"{n}: planned: its step does {r.step_flops:.4g} FLOPs in {r.compiled_bytes:,} B"
             for n, r in reports.items() if n != best]
  return Planned(programs[best], dataclasses.replace(reports[best], alternatives=tuple(others)))
