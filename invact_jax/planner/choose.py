"""Choosing a plan: the integer program's plan fitted to the compiled temp (re-solved where XLA
differs from the prediction), a plan by runs of layers where predicted to pay, and the choice
that recomputes least among those that fit."""
from __future__ import annotations

import itertools
from typing import Sequence

from invact_jax.planner import cost_model, integer_program
from invact_jax.planner.cost_model import Choice, Costs
from invact_jax.planner.integer_program import LayerProfile
from invact_jax.planner.layer_loop import Loop

# Re-solve rounds after the first when XLA's temp is above the budget or off the prediction.
_ROUNDS = 5


# A compiled plan further than this from its prediction recalibrates the bytes per tensor.
_TOLERANCE = 0.05


# Seconds per integer-program solve of a plan by runs of layers (past it, the best found: a
# 12-tensor, 8-layer profile took 9 s to prove its optimum).
_RUNS_SOLVE_SECONDS = 0.25


# A JAX policy or preset is compiled where its predicted temp is within this share above the
# budget (the prediction lists a layer's residuals; XLA fuses some away).
_SPARE = 0.15


def fitted_plan(fn, args, grad, loop: Loop, profile: LayerProfile, budget: int,
                known: dict, scale: float):
  """(profile, keep, offload, predicted bytes, compiled temp, rounds, scale) of the cheapest
  solved plan whose compiled temp fits ``budget`` (where no round both fits and holds its
  prediction: the compiled set that fits and is predicted to recompute least, keeping nothing
  at the worst).  ``known``: compiled temps already measured, by the set kept.  The bytes a
  kept tensor adds (``scale``) start at their nominal size and are calibrated by the compiled
  plans: one off its prediction by more than :data:`_TOLERANCE` re-solves with the scale
  fitted to every plan compiled (a plan above the budget at its prediction lowers the target
  instead)."""
  target, tried = budget, set()
  for rounds in range(1, _ROUNDS + 2):
    try:
      p = integer_program.solve([profile], target, uniform=True)
    except integer_program.InfeasibleBudget:  # the lowered target went below every plan
      break
    keep, off = p.keep[0], (p.offload[0] if p.offload else ())
    every = frozenset(profile.tags)
    if not keep and not off and "all" not in tried:
      # Nothing predicted to fit: calibrate on keeping every candidate (where the program's
      # peak lies outside its layers, keeping adds little or nothing).
      tried.add("all")
      if every not in known:
        known[every] = cost_model.compiled_temp(fn, args, grad, profile.tags, budget)
      measured = cost_model.bytes_scale(loop, [(profile.tags, known[every])], profile.base_bytes)
      if measured is not None and measured < scale * 0.98:
        scale = measured
        profile = cost_model.scaled_profile(loop, profile, scale)
        continue
    if not off and known.get(every, budget + 1) <= budget and _keeps_worth(profile, keep):
      # keeping every candidate is known to fit and recomputes no more: no compile
      everything = (profile.tags,) * profile.depth
      return profile, profile.tags, (), profile.peak(everything), known[every], rounds, scale
    compiled = (known[frozenset(keep)] if not off and frozenset(keep) in known
                else cost_model.compiled_temp(fn, args, grad, keep, budget, off))
    if not off:
      known[frozenset(keep)] = compiled
    observed = cost_model.observed_sets(known) + ([(keep, compiled)] if off else [])
    measured = cost_model.bytes_scale(loop, observed, profile.base_bytes)
    off_by = abs(p.predicted_bytes - compiled) > _TOLERANCE * compiled
    recalibrate = (measured is not None and off_by and abs(measured - scale) > 0.02 * scale
                   and (keep, off) not in tried)
    tried.add((keep, off))
    if compiled <= budget and not recalibrate:
      return profile, keep, off, p.predicted_bytes, compiled, rounds, scale
    if recalibrate:
      scale = measured
      profile = cost_model.scaled_profile(loop, profile, scale)
    else:
      target -= max(compiled - budget, budget // 50)
  # No round both fitted and held its prediction: the compiled plan that fits and is predicted
  # to recompute least (keeping nothing, which fits, at the worst).
  cost, keep = min((profile.cost((k,) * profile.depth), k) for k in fitting_sets(profile, known, budget))
  return (profile, keep, (), profile.peak((keep,) * profile.depth), known[frozenset(keep)],
          rounds, scale)


def fitting_sets(profile: LayerProfile, known: dict, budget: int) -> list[tuple[str, ...]]:
  """The sets kept (in the profile's order) whose compiled temp in ``known`` fits ``budget``."""
  return [tuple(t for t in profile.tags if t in k) for k, temp in known.items()
          if isinstance(k, frozenset) and temp <= budget]


def _keeps_worth(profile: LayerProfile, keep) -> bool:
  """Whether ``keep`` holds every tensor whose keeping spares recompute."""
  return set(keep) >= {t for t, g in zip(profile.tags, profile.tag_gain) if g > 0}


def written_temp(fn, args, grad, loop: Loop, profile: LayerProfile, keep, budget: int,
                 known: dict) -> int | None:
  """The compiled temp of the program as written (no recompute), where a plan keeping
  ``keep`` keeps every tensor worth keeping in a layer without its own ``jax.checkpoint`` (so
  that the program as written, if it fits, recomputes least); else None.  Compiled once per
  plan (``known["as written"]``), and only where keeping every candidate, which the layer as
  written keeps and more, is predicted to fit."""
  if loop.remat or not _keeps_worth(profile, keep):
    return None
  if "as written" not in known:
    if profile.peak((profile.tags,) * profile.depth) > budget:
      return None
    known["as written"] = cost_model.measured_temp(grad(fn), args, budget)
  return known["as written"]


def per_run_choice(profile: LayerProfile, budget: int, uniform_cost: float,
                   uniform_temp: int, costs: Costs) -> Choice | None:
  """A plan whose runs of layers differ (MONeT's per-layer choice: the integer program over
  runs), each run its own ``lax.scan``, compiled where the profile predicts it recomputes at
  least 5 % less than the uniform plan and the uniform plan's compiled temp leaves at least
  10 % of the budget (:func:`cheapest_choice` takes it where it fits).  Splitting a scan costs XLA
  memory the profile does not hold (GPT-2's 12 layers in two runs keeping the same: +54 MiB
  on XLA:CPU, +36 MiB on the H100 compiled for, docs/planner.md), so few fit."""
  if profile.depth < 2 * integer_program.MIN_RUN or budget - uniform_temp < 0.1 * budget:
    return None  # (a budget the uniform plan leaves less than 10 % of has no room to split)
  try:
    p = integer_program.solve([profile], budget, uniform=False, time_limit=_RUNS_SOLVE_SECONDS)
  except integer_program.InfeasibleBudget:
    return None
  if p.uniform or p.predicted_cost > 0.95 * uniform_cost:
    return None
  offload = p.offload or ((),) * len(p.keep)
  runs = tuple((tuple(keep), tuple(off), len(list(group)))
               for (keep, off), group in itertools.groupby(zip(p.keep, offload)))
  choice = Choice("per run", runs=runs)
  costs.temp(choice)
  return choice


def cheapest_choice(loop: Loop, profile: LayerProfile, scale: float, costs: Costs,
                    fits: Choice, others: Sequence[Choice]) -> tuple[Choice, tuple[str, ...]]:
  """The choice that recomputes least among ``fits`` (compiled, within the budget) and
  ``others`` whose compiled temp fits; and a line per choice weighed.  A choice is counted
  on the program's trace only where its estimate lies below the best's (+0.5 % of full
  remat's), compiled only where it recomputes less than the best and is predicted within
  :data:`_SPARE` of the budget: so the solved plan is never worse than a fixed choice that
  fits, and costs no compile where it recomputes least."""
  best, why = fits, {}
  margin = 0.005 * costs.estimate(Choice("full"))
  for c in sorted(others, key=costs.estimate):
    if costs.estimate(c) >= costs.estimate(best) + margin:
      why.setdefault(c.label, "estimated to recompute no less (not counted)")
      continue
    if costs.recompute(c) >= costs.recompute(best) * (1 - 1e-9):
      why.setdefault(c.label, "recomputes no less than the plan taken")
      continue
    if c.key not in costs.temps and (
        cost_model.predicted_peak(loop, profile, c, scale) > (1 + _SPARE) * costs.budget):
      why[c.label] = "predicted above the budget (not compiled)"
      continue
    if costs.temp(c) <= costs.budget:
      best = c
  lines = []
  for c in (fits, *others):
    temp = costs.temps.get(c.key)
    state = ("taken" if c is best else
             f"compiled {temp:,} B" + (" (above the budget)" if temp > costs.budget else "")
             if temp is not None else why.get(c.label, "not compiled"))
    flops = (f"recomputes {costs.recompute(c):.4g} FLOPs" if costs.counted(c)
             else f"estimated {costs.estimate(c):.4g} FLOPs")
    lines.append(f"{c.label}: {flops}; {state}")
  return best, tuple(lines)
