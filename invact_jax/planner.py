"""Memory-budget planner (MONeT-style): what to keep, what to recompute, which variant.

Given per-tag figures of one transformer layer — bytes a tag costs if kept, and the
recompute cost saved by keeping it — and a budget in bytes, :func:`solve` picks per layer
the set of ``checkpoint_name`` tags to keep (the rest are recomputed in the backward) and
the operator variant (e.g. standard vs inverted activations) by a mixed-integer linear
program solved with HiGHS (``scipy.optimize.milp``), minimizing recompute cost subject to

    predicted peak = base[variant] + sum_layers sum_tags keep[l, t] * bytes[variant, t]
                     - max_{t kept in every layer} relief[variant, t] <= budget.

``base`` is the measured peak with nothing kept (every layer fully recomputed), so the
model is calibrated per platform; ``models.experiments.plan_profiles`` measures all of it and
checks the prediction against XLA's compiled memory.  ``relief`` is the backward's recompute
workspace that keeping a tag removes; it is counted only when every layer keeps the tag (a
layer that still recomputes it needs the workspace), which is exact for uniform plans and
errs high (safe) for the others.  Layers may differ (``uniform=False``): equal layers are made
contiguous, runs ordered longest first so that one-layer runs come last (``models`` runs each
run as its own ``lax.scan`` over its own parameter stack; XLA:CPU schedules a lone layer
followed by others like unrolled code); ``uniform=True`` gives one set for all layers.

Variants change ``base`` (the whole model's activations), so the program is solved once
per variant and the cheapest feasible plan wins; among equally cheap plans (also within a
variant), the one that uses less memory.

Example:
  >>> from invact_jax import planner
  >>> prof = planner.LayerProfile(variant="inverted", depth=4, base_bytes=1000,
  ...     tags=("q", "mlp"), tag_bytes=(100, 300), tag_gain=(5.0, 20.0), full_cost=40.0)
  >>> plan = planner.solve([prof], budget=1600)   # per layer: "mlp" kept in two layers
  >>> plan.keep, plan.predicted_bytes, plan.predicted_cost
  (((), (), ('mlp',), ('mlp',)), 1600, 120.0)
  >>> planner.solve([prof], budget=1600, uniform=True).keep[0]   # one set for all: "q"
  ('q',)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

__all__ = ["LayerProfile", "Plan", "InfeasibleBudget", "solve", "evaluate"]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Measured figures of one model variant.

  Attributes:
    variant: name of the operator variant (a model configuration).
    depth: number of layers.
    base_bytes: peak bytes with no tag kept in any layer.
    tags: tag names.
    tag_bytes: per tag, bytes one layer adds to the peak when it keeps it.
    tag_gain: per tag, recompute cost (FLOPs) one layer saves when it keeps it.
    full_cost: recompute cost of one layer that keeps nothing.
    tag_relief: per tag, bytes the peak drops by, once, when every layer keeps it: the
      backward's recompute workspace that keeping it removes (measured).  Only the largest
      relief among such tags counts (one layer is recomputed at a time).
  """
  variant: str
  depth: int
  base_bytes: int
  tags: tuple[str, ...]
  tag_bytes: tuple[int, ...]
  tag_gain: tuple[float, ...]
  full_cost: float
  tag_relief: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("tags", "tag_bytes", "tag_gain", "tag_relief"):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"LayerProfile argument `{name}` must be a sequence, got {value!r}")
      object.__setattr__(self, name, tuple(value))
    if not isinstance(self.variant, str) or not self.variant:
      raise ValueError(f"LayerProfile argument `variant` must be a non-empty string, got {self.variant!r}")
    if isinstance(self.depth, bool) or not isinstance(self.depth, (int, np.integer)) or self.depth < 1:
      raise ValueError(f"LayerProfile argument `depth` must be a positive integer, got {self.depth!r}")
    if not all(isinstance(t, str) and t for t in self.tags):
      raise ValueError(f"LayerProfile argument `tags` must hold non-empty strings, got {self.tags!r}")
    dup = sorted({t for t in self.tags if self.tags.count(t) > 1})
    if dup:
      raise ValueError(f"LayerProfile argument `tags` names {dup} more than once")
    for name in ("tag_bytes", "tag_gain") + (("tag_relief",) if self.tag_relief else ()):
      if len(getattr(self, name)) != len(self.tags):
        raise ValueError(f"LayerProfile argument `{name}` has {len(getattr(self, name))} entries "
                         f"for {len(self.tags)} tags")
    for name in ("base_bytes", "full_cost", "tag_bytes", "tag_gain", "tag_relief"):
      value = getattr(self, name)
      for v in (value if isinstance(value, tuple) else (value,)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
          raise TypeError(f"LayerProfile argument `{name}` must hold numbers, got {v!r}")
        if not np.isfinite(v) or v < 0:
          raise ValueError(f"LayerProfile argument `{name}` must hold finite numbers >= 0, got {v!r}")

  def relief(self, t: str) -> int:
    return dict(zip(self.tags, self.tag_relief)).get(t, 0) if self.tag_relief else 0

  def cost(self, keep: Sequence[Sequence[str]]) -> float:
    """Predicted recompute cost of keeping ``keep[l]`` in layer l (additive model)."""
    gain = dict(zip(self.tags, self.tag_gain))
    return float(sum(max(self.full_cost - sum(gain[t] for t in k), 0.0) for k in keep))

  def peak(self, keep: Sequence[Sequence[str]]) -> int:
    """Predicted peak of keeping ``keep[l]`` in layer l (see module doc)."""
    nbytes = dict(zip(self.tags, self.tag_bytes))
    everywhere = set.intersection(*(set(k) for k in keep)) if keep else set()
    relief = max((self.relief(t) for t in everywhere), default=0)
    return int(self.base_bytes + sum(nbytes[t] for k in keep for t in k) - relief)

  @property
  def minimum_bytes(self) -> int:
    """The least predicted peak of any plan (a tag whose relief exceeds its bytes can go
    below ``base_bytes``)."""
    return min([self.base_bytes] + [self.peak(((t,),) * self.depth) for t in self.tags])


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per layer, the tags to keep, and the variant; with the model's predictions."""
  variant: str
  keep: tuple[tuple[str, ...], ...]
  predicted_bytes: int
  predicted_cost: float
  budget: int
  solve_seconds: float

  @property
  def uniform(self) -> bool:
    return len(set(self.keep)) <= 1

  def save_names(self) -> tuple[tuple[str, ...], ...]:
    """The ``save_names`` model-config value (one entry when every layer is the same)."""
    return (self.keep[0],) if self.uniform else self.keep

  def policy(self, layer: int = 0):
    """The ``jax.checkpoint`` policy of ``layer``."""
    import jax  # pylint: disable=import-outside-toplevel
    return jax.checkpoint_policies.save_only_these_names(*self.keep[layer])


class InfeasibleBudget(ValueError):
  """No plan fits the budget; ``minimum_bytes`` is the smallest budget that does."""

  def __init__(self, budget: int, minimum_bytes: int):
    super().__init__(f"memory budget {budget:,} bytes is infeasible: the minimum feasible budget "
                     f"is {minimum_bytes:,} bytes")
    self.budget, self.minimum_bytes = budget, minimum_bytes


def _solve_one(p: LayerProfile, budget: int, uniform: bool):
  from scipy import optimize  # pylint: disable=import-outside-toplevel
  n_tags = len(p.tags)
  if n_tags == 0:  # nothing to choose: every layer recomputes everything
    return ((),) * p.depth if p.base_bytes <= budget else None
  n_layers = 1 if uniform else p.depth
  mult = p.depth if uniform else 1
  b = np.asarray(p.tag_bytes, float)
  g = np.asarray(p.tag_gain, float)
  tau = np.asarray([p.relief(t) for t in p.tags], float)
  nx = n_layers * n_tags
  # Variables: x[l, t] in {0, 1} (keep tag t in (group) layer l), then z[t] in {0, 1}
  # (t's relief is the one counted).  Maximize the kept recompute gain subject to
  #   sum mult * b[t] x[l, t] - sum tau[t] z[t] <= budget - base,
  #   sum z <= 1,  z[t] <= x[l, t] for every l (relief only where every layer keeps t).
  c = np.concatenate([-np.tile(g, n_layers) * mult, np.zeros(n_tags)])
  mem = np.concatenate([np.tile(b, n_layers) * mult, -tau])[None, :]
  one = np.concatenate([np.zeros(nx), np.ones(n_tags)])[None, :]
  link = np.zeros((n_layers * n_tags, nx + n_tags))
  for l in range(n_layers):
    for t in range(n_tags):
      link[l * n_tags + t, nx + t] = 1.0
      link[l * n_tags + t, l * n_tags + t] = -1.0
  cons = [optimize.LinearConstraint(mem, -np.inf, budget - p.base_bytes),
          optimize.LinearConstraint(one, -np.inf, 1.0),
          optimize.LinearConstraint(link, -np.inf, 0.0)]
  opts = dict(integrality=np.ones_like(c), bounds=optimize.Bounds(0, 1),
              options={"time_limit": 10.0})
  res = optimize.milp(c, constraints=cons, **opts)
  if res.x is None:
    return None
  # Among plans of the least cost, the one using least memory (a second, lexicographic solve).
  tie = optimize.LinearConstraint(c[None, :], -np.inf, res.fun + 1e-9 * max(1.0, abs(res.fun)))
  lean = optimize.milp(mem[0], constraints=cons + [tie], **opts)
  if lean.x is not None:
    res = lean
  x = np.round(res.x[:nx]).reshape(n_layers, n_tags).astype(bool)
  keep = [tuple(t for t, k in zip(p.tags, row) if k) for row in x]
  if uniform:
    return tuple(keep) * p.depth
  # Layers are interchangeable in the model: order them so equal plans are contiguous (each
  # run is then one lax.scan), longest runs first, so a run of one layer is never followed by
  # others (see module doc).
  runs = {k: keep.count(k) for k in keep}
  return tuple(sorted(keep, key=lambda k: (-runs[k], len(k), k)))


def solve(profiles: Sequence[LayerProfile], budget: int, *, uniform: bool = False) -> Plan:
  """The cheapest plan over ``profiles`` (variants) whose predicted peak fits ``budget``.

  Raises:
    InfeasibleBudget: when even keeping nothing exceeds the budget (the error states the
      minimum feasible budget).
    ValueError: bad arguments.
  """
  if not profiles:
    raise ValueError("argument `profiles` must hold at least one LayerProfile")
  if not all(isinstance(p, LayerProfile) for p in profiles):
    raise TypeError("argument `profiles` must hold LayerProfile objects")
  if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
    raise TypeError(f"argument `budget` must be a number of bytes, got {budget!r}")
  if not np.isfinite(budget):
    raise ValueError(f"argument `budget` must be a finite number of bytes, got {budget!r}")
  budget = int(budget)
  t0 = time.perf_counter()
  best = None
  for p in profiles:
    if p.minimum_bytes > budget:
      continue
    keep = _solve_one(p, budget, uniform)
    if keep is None:
      continue
    cand = (p.cost(keep), p.peak(keep), p, keep)
    if best is None or cand[:2] < best[:2]:
      best = cand
  if best is None:
    raise InfeasibleBudget(budget, min(p.minimum_bytes for p in profiles))
  cost, peak, p, keep = best
  return Plan(variant=p.variant, keep=tuple(keep), predicted_bytes=peak, predicted_cost=cost,
              budget=budget, solve_seconds=time.perf_counter() - t0)


def evaluate(profile: LayerProfile, keep_per_layer: Sequence[str]) -> tuple[int, float]:
  """(predicted peak, predicted cost) of one fixed set kept in every layer."""
  keep = (tuple(keep_per_layer),) * profile.depth
  return profile.peak(keep), profile.cost(keep)
