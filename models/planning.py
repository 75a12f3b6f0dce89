"""Profiling the models for the memory planner, and checking its plans against XLA.

:func:`profile` measures, per configuration (a set of config overrides, e.g. standard vs
inverted activations), what ``invact_jax.planner`` needs:

* ``base_bytes``: compiled ``temp_size_in_bytes`` of the training step with every layer
  keeping nothing (all tags recomputed), at the real depth, layers scanned;
* ``tag_bytes[t]``: bytes each layer adds to the compiled peak when every layer keeps tag
  ``t``: the slope of compiled temp over depth (the step compiled at the real depth and at
  depth 2, keep {t}, minus the same for keep {}).  Measured, not the tensor's nominal size:
  XLA:CPU, for one, keeps emulated bfloat16 residuals in float32;
* ``tag_relief[t]``: the intercept: how far the peak falls below ``base + depth * bytes`` —
  keeping e.g. the MLP input removes its recompute workspace from the backward (counted
  once, the largest among kept tags);
* ``input_bytes``: the slope of ``base_bytes`` over depth: a layer's input, which a scan
  keeps for every layer whatever the plan;
* ``tag_gain[t]``: FLOPs of the step saved by keeping ``t`` (XLA cost analysis of the
  lowered 1-layer step, keep {} minus keep {t}); ``full_cost``: keep {} minus keep all.

:func:`measure` compiles a plan (or a fixed policy) and reports compiled temp bytes and
FLOPs beside the planner's prediction.  ``FIXED_POLICIES`` are the MaxText-style
policies as tag sets.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

from invact_jax import memory, planner
from models import options
from models import presets

FIXED_POLICIES: dict[str, tuple[str, ...]] = {
    "full": (),                                                       # recompute everything
    "save_qkv_proj": ("query", "key", "value"),
    "save_dot_except_mlp": ("query", "key", "value", "attn_context", "attn_out"),
    "minimal": ("query", "key", "value", "attn_context", "attn_out", "mlp_pre", "mlp_out"),
    "nothing": options.TAGS,                                           # keep every tag
}

# The configurations the planner chooses among (models.options.CONFIGURATIONS).
PLANNED_CONFIGURATIONS = ("standard", "inverted", "inverted-norms")


def _step(cfg, batch: int, seq_len: int):
  loss, params, x, y = presets.loss_and_inputs(cfg, batch, seq_len, jax.random.key(0))
  return jax.value_and_grad(loss), (params, x, y), loss


def head_recompute_flops(cfg, batch: int, seq_len: int) -> float:
  """FLOPs the chunked LM head (``invact_jax.linear_cross_entropy``) adds to a step: its
  backward recomputes the logits, one [tokens, hidden] x [hidden, vocab] matmul (analytic:
  XLA's cost analysis counts a loop's body once, not per chunk); 0 for other heads and for
  models without one."""
  if getattr(cfg, "head_mode", None) != "chunked" or not hasattr(cfg, "vocab"):
    return 0.0
  return 2.0 * batch * seq_len * cfg.hidden * cfg.vocab


def profile(cfg, batch: int, *, seq_len: int = 128, configurations: Sequence[str] = tuple(PLANNED_CONFIGURATIONS),
            tags: Sequence[str] = options.TAGS, head_modes: Sequence[str] | None = None,
            progress: Callable[[str], None] | None = None) -> list[planner.LayerProfile]:
  """One :class:`invact_jax.planner.LayerProfile` per configuration (see module doc); with
  ``head_modes`` (text models), one per configuration and LM head mode (the profile's
  ``head_mode``), each with the head's recompute FLOPs as its ``fixed_cost``
  (:func:`head_recompute_flops`)."""
  if head_modes is not None:
    if not hasattr(cfg, "vocab"):
      raise ValueError("argument `head_modes`: only the text models have LM head variants")
    bad = [h for h in head_modes if h not in options.HEAD_MODES]
    if bad or not head_modes:
      raise ValueError(f"argument `head_modes`: expected some of {options.HEAD_MODES}, got "
                       f"{list(head_modes)}")
  out = []
  for name in configurations:
    if name not in PLANNED_CONFIGURATIONS:
      raise ValueError(f"argument `configurations`: unknown configuration {name!r}; choose from {sorted(PLANNED_CONFIGURATIONS)}")
    for h in (head_modes or (None,)):
      out.append(_profile_one(cfg, batch, name, h, seq_len=seq_len, tags=tags,
                              progress=progress))
  return out


def label(configuration: str, head_mode: str | None = None) -> str:
  """How tables and progress lines name a configuration with its head mode."""
  return configuration if head_mode is None else f"{configuration} (head {head_mode})"


def _profile_one(cfg, batch: int, configuration: str, head_mode: str | None, *, seq_len: int,
                 tags: Sequence[str], progress: Callable[[str], None] | None
                 ) -> planner.LayerProfile:
  """The :class:`invact_jax.planner.LayerProfile` of ``configuration`` with ``head_mode``."""
  v = label(configuration, head_mode)
  c = cfg.replace(**options.configuration(configuration, head_mode=head_mode))
  if progress:
    progress(f"{v}: base (depth {c.depth}, keep nothing)")
  one = c.replace(depth=1, scan_layers=False)

  def temp(keep, depth):
    return compiled_temp(cfg.replace(depth=depth), batch, configuration, (tuple(keep),),
                         seq_len=seq_len, head_mode=head_mode)

  base, base2 = temp((), c.depth), temp((), 2)

  def flops(keep):
    step1, args1, _ = _step(one.replace(save_names=(tuple(keep),)), batch, seq_len)
    return memory.flops(step1, *args1)

  f0 = flops(())
  tag_bytes, tag_gain, tag_relief = [], [], []
  for t in tags:
    if progress:
      progress(f"{v}: tag {t}")
    at_depth, at_2 = temp((t,), c.depth) - base, temp((t,), 2) - base2
    slope = max((at_depth - at_2) // max(c.depth - 2, 1), 0) if c.depth > 2 else max(at_depth // 2, 0)
    tag_bytes.append(int(slope))
    tag_relief.append(int(max(c.depth * slope - at_depth, 0)))
    tag_gain.append(max(f0 - flops((t,)), 0.0))
  full_cost = max(f0 - flops(tuple(tags)), 0.0)
  return planner.LayerProfile(configuration=configuration, head_mode=head_mode, depth=c.depth, base_bytes=base, tags=tuple(tags),
                              tag_bytes=tuple(tag_bytes), tag_gain=tuple(tag_gain),
                              full_cost=full_cost, tag_relief=tuple(tag_relief),
                              input_bytes=_slope(base, base2, c.depth),
                              fixed_cost=head_recompute_flops(c, batch, seq_len))


def _slope(base: int, base2: int, depth: int) -> int:
  return max((base - base2) // (depth - 2), 0) if depth > 2 else 0


def with_input_bytes(cfg, batch: int, prof: planner.LayerProfile, *,
                     seq_len: int = 128) -> planner.LayerProfile:
  """``prof`` with ``input_bytes`` measured (one compile at depth 2), for profiles saved
  before it was part of :func:`profile`; a profile that has it is returned as is."""
  if prof.input_bytes or prof.depth <= 2:
    return prof
  at_2 = compiled_temp(cfg.replace(depth=2), batch, prof.configuration, ((),), seq_len=seq_len,
                       head_mode=prof.head_mode)
  return dataclasses.replace(prof, input_bytes=_slope(prof.base_bytes, at_2, prof.depth))


@dataclasses.dataclass(frozen=True)
class Measured:
  compiled_temp_bytes: int
  flops: float


def _planned(cfg, configuration: str, keep: Sequence[Sequence[str]], head_mode: str | None):
  """``cfg`` with ``configuration``, ``head_mode`` and a per-layer plan (one entry = every
  layer), layers scanned."""
  keep = tuple(tuple(k) for k in keep)
  return cfg.replace(**options.configuration(configuration, head_mode=head_mode),
                     save_names=keep if len(set(keep)) > 1 else keep[:1], scan_layers=True)


def compiled_temp(cfg, batch: int, configuration: str, keep: Sequence[Sequence[str]], *,
                  seq_len: int = 128, head_mode: str | None = None) -> int:
  """XLA's compiled temp bytes of the step under a per-layer plan (one entry = every layer)."""
  step, args, _ = _step(_planned(cfg, configuration, keep, head_mode), batch, seq_len)
  return memory.compiled(step, *args).temp


def measure(cfg, batch: int, configuration: str, keep: Sequence[Sequence[str]], *,
            seq_len: int = 128, head_mode: str | None = None) -> Measured:
  """Compile the step under a per-layer plan (one entry = every layer) and measure it."""
  c = _planned(cfg, configuration, keep, head_mode)
  temp = compiled_temp(cfg, batch, configuration, keep, seq_len=seq_len, head_mode=head_mode)
  # FLOPs from the unrolled program: XLA's cost analysis counts a loop body once.
  step_u, args_u, _ = _step(c.replace(scan_layers=False), batch, seq_len)
  return Measured(temp, memory.flops(step_u, *args_u))


def device_peak(cfg, batch: int, configuration: str, keep: Sequence[Sequence[str]], *,
                seq_len: int = 128, head_mode: str | None = None) -> dict[str, int]:
  """Run the step under a plan once and read the allocator (GPU; the check beside XLA's temp).

  Returns :func:`invact_jax.memory.device_peak`'s figures: ``peak_increase`` (peak minus what
  was in use before: the step's temporaries plus its outputs) and ``output_bytes``, so
  ``peak_increase - output_bytes`` is the device-side figure for the planner's prediction.
  The allocator's peak is process-wide and never resets: call this once per process
  (``scripts/plan_memory.py --device-peak`` runs one child process per row).

  Raises:
    RuntimeError: the device keeps no ``memory_stats()`` (e.g. CPU).
  """
  step, args, _ = _step(_planned(cfg, configuration, keep, head_mode), batch, seq_len)
  return memory.device_peak(step, *args)


def recompute_flops(cfg, batch: int, configuration: str, keep, *, seq_len: int = 128,
                    head_mode: str | None = None) -> float:
  """Measured recompute FLOPs of a plan: its step's FLOPs minus the keep-everything step's."""
  m = measure(cfg, batch, configuration, keep, seq_len=seq_len, head_mode=head_mode)
  ref = measure(cfg, batch, configuration, (options.TAGS,), seq_len=seq_len, head_mode=head_mode)
  return m.flops - ref.flops


def _fit_rounds(cfg, batch, budget, profiles, *, seq_len, max_rounds, uniform):
  """The first solved plan whose compiled step fits ``budget`` (None if no round gives one)."""
  target = int(budget)
  for _ in range(max_rounds):
    try:
      plan = planner.solve(profiles, target, uniform=uniform)
    except planner.InfeasibleBudget:  # the lowered target went below every plan
      return None
    m = measure(cfg, batch, plan.configuration, plan.keep, seq_len=seq_len,
                head_mode=plan.head_mode)
    if m.compiled_temp_bytes <= budget:
      return dataclasses.replace(plan, budget=int(budget)), m
    # Lower the target by the excess, and by at least 2 % of the budget per round.
    target -= max(m.compiled_temp_bytes - budget, budget // 50)
  return None


def plan_for_budget(cfg, batch: int, budget: int, profiles: Sequence[planner.LayerProfile], *,
                    seq_len: int = 128, max_rounds: int = 6,
                    uniform: bool | None = True) -> tuple[planner.Plan, Measured]:
  """Solve, compile, and re-solve with a tighter target while XLA's peak exceeds ``budget``.

  The model is calibrated, not exact (a tag's relief is measured alone, a set's can differ);
  each round lowers the target by the measured excess.  ``uniform`` (default): one set for
  every layer, one ``lax.scan``; ``uniform=False``: per-layer plans, one scan per run of
  equal layers over its own parameter stack (README "Memory-budget planner" has both
  measured against their predictions).  A per-layer search that finds no plan within the
  budget falls back to the uniform one, so ``uniform=False`` always fits where
  ``uniform=True`` does.
  ``uniform=None``: both searches, and the plan whose compiled step does fewer FLOPs (the
  uniform one on a tie) -- per-layer plans can fit and still recompute more than the uniform
  plan at the same budget, because the re-solve rounds lower their target (GPT-2, README).

  Where the re-solve rounds find none, the plans that keep nothing are compiled: the cheapest
  that fits is returned (so a budget the compiled ``full`` plan fits always gets a plan).

  Raises:
    planner.InfeasibleBudget: no plan compiles within ``budget`` (names ``budget`` and the
      least temp a plan compiles to).
  """
  def search(uniform_):
    return _fit_rounds(cfg, batch, budget, profiles, seq_len=seq_len, max_rounds=max_rounds,
                       uniform=uniform_)
  if uniform is None:
    found = [search(True)] + ([search(False)] if _per_layer_differs(profiles, budget) else [])
    found = min((f for f in found if f is not None),
                key=lambda f: (f[1].flops, not f[0].uniform), default=None)
  else:
    found = search(uniform)
    if found is None and not uniform:
      found = search(True)
  if found is None:  # the re-solve rounds went below every plan: keeping nothing, compiled
    found = _least_within(cfg, batch, budget, profiles, seq_len=seq_len)
  return found


def _least_within(cfg, batch, budget, profiles, *, seq_len):
  """Per configuration the plan that keeps nothing, compiled: the cheapest that fits
  ``budget``; InfeasibleBudget naming the least compiled temp when none does."""
  tried = []
  for p in profiles:
    keep = ((),) * p.depth
    peak, cost = planner.evaluate(p, ())
    m = measure(cfg, batch, p.configuration, keep, seq_len=seq_len, head_mode=p.head_mode)
    plan = planner.Plan(configuration=p.configuration, keep=keep, predicted_bytes=peak,
                        predicted_cost=cost, budget=int(budget), solve_seconds=0.0,
                        head_mode=p.head_mode)
    tried.append((plan, m))
  fits = [(plan, m) for plan, m in tried if m.compiled_temp_bytes <= budget]
  if not fits:
    raise planner.InfeasibleBudget(int(budget), min(m.compiled_temp_bytes for _, m in tried))
  return min(fits, key=lambda f: (f[0].predicted_cost, f[1].flops))


def _per_layer_differs(profiles, budget) -> bool:
  """Whether the per-layer solution at ``budget`` differs between layers (else its search
  would only repeat the uniform one)."""
  try:
    return not planner.solve(profiles, budget, uniform=False).uniform
  except planner.InfeasibleBudget:
    return False


def _plan_row(cfg, batch, b, profiles, fixed, ref, *, seq_len, uniform):
  try:
    plan, m = plan_for_budget(cfg, batch, b, profiles, seq_len=seq_len, uniform=uniform)
  except planner.InfeasibleBudget as e:
    return {"budget": int(b), "per_layer": not uniform, "infeasible": str(e)}
  key = (plan.configuration, plan.head_mode)
  fixed_cost = next(p.fixed_cost for p in profiles if (p.configuration, p.head_mode) == key)
  fits = [f for f in fixed if f["compiled_temp_bytes"] <= b]
  best = min(fits, key=lambda f: f["recompute_flops"]) if fits else None
  # A per-layer request that fell back to the uniform plan is reported as uniform.
  return {"budget": int(b), "per_layer": not plan.uniform, "configuration": plan.configuration,
          "head_mode": plan.head_mode, "keep": [list(k) for k in plan.keep],
          "predicted_bytes": plan.predicted_bytes,
          "compiled_temp_bytes": m.compiled_temp_bytes,
          "prediction_error": plan.predicted_bytes / m.compiled_temp_bytes - 1.0,
          "recompute_flops": m.flops - ref[key] + fixed_cost,
          "solve_seconds": plan.solve_seconds,
          "best_fixed": None if best is None else
          f"{best['policy']} ({label(best['configuration'], best['head_mode'])})",
          "best_fixed_recompute_flops": None if best is None else best["recompute_flops"]}


def frontier(cfg, batch: int, budgets: Sequence[int], profiles: Sequence[planner.LayerProfile],
             *, seq_len: int = 128, per_layer: bool = True,
             progress: Callable[[str], None] | None = None) -> dict:
  """Plans and fixed policies, each compiled: memory, recompute FLOPs, prediction error.

  Recompute FLOPs are measured: the step's FLOPs minus the keep-every-tag step's, plus the
  configuration's ``fixed_cost`` (a chunked LM head's second logits matmul).  With
  ``per_layer``, each budget where the per-layer solution differs between layers adds a row
  (``"per_layer": True``) compiled the same way; where no per-layer plan compiles within the
  budget, the uniform row gets ``"per_layer_fell_back": True`` instead.
  """
  ref = {(p.configuration, p.head_mode): measure(cfg, batch, p.configuration, (options.TAGS,),
                                                 seq_len=seq_len, head_mode=p.head_mode).flops
         for p in profiles}
  fixed = []
  for name, keep in FIXED_POLICIES.items():
    for p in profiles:
      if not set(keep) <= set(p.tags):  # a profile over a subset of the tags
        continue
      if progress:
        progress(f"fixed {name} {label(p.configuration, p.head_mode)}")
      m = measure(cfg, batch, p.configuration, (keep,), seq_len=seq_len, head_mode=p.head_mode)
      fixed.append({"policy": name, "configuration": p.configuration, "head_mode": p.head_mode,
                    "keep": list(keep), "compiled_temp_bytes": m.compiled_temp_bytes,
                    "predicted_bytes": planner.evaluate(p, keep)[0],
                    "recompute_flops": m.flops - ref[(p.configuration, p.head_mode)]
                                       + p.fixed_cost})
  plans = []
  for b in budgets:
    if progress:
      progress(f"plan at {b:,} bytes")
    plans.append(_plan_row(cfg, batch, b, profiles, fixed, ref, seq_len=seq_len, uniform=True))
    if per_layer:
      if _per_layer_differs(profiles, b):
        if progress:
          progress(f"per-layer plan at {b:,} bytes")
        row = _plan_row(cfg, batch, b, profiles, fixed, ref, seq_len=seq_len, uniform=False)
        if row.get("per_layer", True):
          plans.append(row)
        else:  # no per-layer plan compiled within the budget: the uniform row stands
          plans[-1]["per_layer_fell_back"] = True
  return {"fixed": fixed, "plans": plans}
