"""Memory-budget planner (MONeT-style): what to keep, what to recompute, which configuration.

Given per-tag figures of one transformer layer — bytes a tag costs if kept, and the
recompute cost saved by keeping it — and a budget in bytes, :func:`solve` picks per layer
the set of ``checkpoint_name`` tags to keep (the rest are recomputed in the backward) and
the configuration (e.g. standard vs inverted activations) by a mixed-integer linear
program solved with HiGHS (``scipy.optimize.milp``), minimizing recompute cost subject to a
predicted peak <= budget.  A plan is a sequence of runs (contiguous layers keeping the same
set; ``models`` runs each as its own ``lax.scan`` over its own parameter stack).  The backward
processes the runs last to first, and each run's stacked residuals stay alive until its
backward ends, so the peak is the largest of the runs' phases:

    peak = base[c] + max_r ( sum_{runs s <= r} layers[s] * sum_{t in s} bytes[c, t]
                             - max_{t in r} relief[c, t]
                             - input[c] * layers after r )        (c: the configuration)

``base`` is the measured peak with nothing kept (every layer fully recomputed), so the
model is calibrated per platform; :func:`invact_jax.plan` measures it for any program's
layer loop (and the GPU frontier, ``models.benchmarks.frontier``, from its own rows) and
checks the prediction against XLA's compiled memory.  ``relief`` is the backward's recompute
workspace that keeping a tag removes (one layer is recomputed at a time, so the largest of
the run's tags counts); ``input`` is a layer's input, which the scan keeps for every layer
(the layers after r are freed by then).  For one set in every layer this is
``base + depth * bytes - relief``.  A run of one layer is not modelled well (XLA unrolls a
one-trip scan and schedules its recompute freely; docs/planner.md has the measurements), so
runs have at least ``MIN_RUN`` layers, at most ``MAX_RUNS`` runs (each run is a compile of
its own).  ``uniform=True`` gives one set for all layers.

Where the device has host memory (``pinned_host``; a GPU, not XLA:CPU) and the profile gives
``tag_offload_cost``, a tag can also be *offloaded* (MaxText's third choice): copied to host
memory in the forward and back in the backward, so a layer neither keeps its bytes on the
device nor recomputes it, and pays the transfer time not hidden behind compute instead.  An
offloaded tag is on the device again only for the layer being differentiated: its bytes
count once in its run's phase (with its relief, like a kept tag's).

Configurations change ``base`` (the whole model's activations), so the program is solved once
per configuration and the cheapest feasible plan wins; among equally cheap plans (also within a
configuration), the one that uses less memory, then the one with fewer runs.

Example:
  >>> from invact_jax import planner
  >>> prof = planner.LayerProfile(configuration="inverted", depth=4, base_bytes=1000,
  ...     tags=("q", "mlp"), tag_bytes=(100, 300), tag_gain=(5.0, 20.0), full_cost=40.0)
  >>> plan = planner.solve([prof], budget=1600)   # per layer: "mlp" kept in two layers
  >>> plan.keep, plan.predicted_bytes, plan.predicted_cost
  (((), (), ('mlp',), ('mlp',)), 1600, 120.0)
  >>> planner.solve([prof], budget=1600, uniform=True).keep[0]   # one set for all: "q"
  ('q',)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from collections.abc import Iterable
from typing import Sequence

import numpy as np

__all__ = ["LayerProfile", "Plan", "InfeasibleBudget", "solve", "evaluate", "policy"]

MIN_RUN = 2   # layers per run in a plan of several runs (a lone layer compiles off the model)
MAX_RUNS = 3  # runs per plan (each is a lax.scan of its own)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Measured figures of one model configuration.

  Attributes:
    configuration: name of the configuration (a model configuration).
    depth: number of layers.
    base_bytes: peak bytes with no tag kept in any layer.
    tags: tag names.
    tag_bytes: per tag, bytes one layer adds to the peak when it keeps it.
    tag_gain: per tag, recompute cost (FLOPs) one layer saves when it keeps it.
    full_cost: recompute cost of one layer that keeps nothing.
    tag_relief: per tag, bytes the peak drops by, once, when every layer keeps it: the
      backward's recompute workspace that keeping it removes (measured).  Only the largest
      relief among a run's tags counts (one layer is recomputed at a time).
    input_bytes: bytes of one layer's input, which a scan keeps for every layer whatever the
      plan (the slope of ``base_bytes`` over depth); 0 if unknown (the model then errs high).
    fixed_cost: recompute cost outside the layers that the configuration's operator
      variants add, once per step (e.g. a chunked LM head recomputes its logits in the
      backward); part of every plan's cost, so configurations compete on it (MONeT's
      operator variants).
    tag_offload_cost: per tag, the cost one layer pays when it offloads the tag to host
      memory (the transfers' time not hidden behind compute, measured); empty: offloading
      is not a choice (a device without host memory kinds).
    head_mode: the LM head's operator variant this profile was measured with (e.g.
      ``"standard"`` or ``"chunked"``; None: the model has no choice of head).  A profile is
      named by its configuration and head mode together.
  """
  configuration: str
  depth: int
  base_bytes: int
  tags: tuple[str, ...]
  tag_bytes: tuple[int, ...]
  tag_gain: tuple[float, ...]
  full_cost: float
  tag_relief: tuple[int, ...] = ()
  input_bytes: int = 0
  fixed_cost: float = 0.0
  tag_offload_cost: tuple[float, ...] = ()
  head_mode: str | None = None

  def __post_init__(self):
    for name in ("tags", "tag_bytes", "tag_gain", "tag_relief", "tag_offload_cost"):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"LayerProfile argument `{name}` must be a sequence, got {value!r}")
      object.__setattr__(self, name, tuple(value))
    if not isinstance(self.configuration, str) or not self.configuration:
      raise ValueError(f"LayerProfile argument `configuration` must be a non-empty string, got {self.configuration!r}")
    if self.head_mode is not None and (not isinstance(self.head_mode, str) or not self.head_mode):
      raise ValueError(f"LayerProfile argument `head_mode` must be None or a non-empty string, got {self.head_mode!r}")
    if isinstance(self.depth, bool) or not isinstance(self.depth, (int, np.integer)) or self.depth < 1:
      raise ValueError(f"LayerProfile argument `depth` must be a positive integer, got {self.depth!r}")
    if not all(isinstance(t, str) and t for t in self.tags):
      raise ValueError(f"LayerProfile argument `tags` must hold non-empty strings, got {self.tags!r}")
    dup = sorted({t for t in self.tags if self.tags.count(t) > 1})
    if dup:
      raise ValueError(f"LayerProfile argument `tags` names {dup} more than once")
    for name in ("tag_bytes", "tag_gain") + tuple(
        n for n in ("tag_relief", "tag_offload_cost") if getattr(self, n)):
      if len(getattr(self, name)) != len(self.tags):
        raise ValueError(f"LayerProfile argument `{name}` has {len(getattr(self, name))} entries "
                         f"for {len(self.tags)} tags")
    for name in ("base_bytes", "full_cost", "tag_bytes", "tag_gain", "tag_relief", "input_bytes",
                 "fixed_cost", "tag_offload_cost"):
      value = getattr(self, name)
      for v in (value if isinstance(value, tuple) else (value,)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
          raise TypeError(f"LayerProfile argument `{name}` must hold numbers, got {v!r}")
        if not math.isfinite(float(v)) or v < 0:
          raise ValueError(f"LayerProfile argument `{name}` must hold finite numbers >= 0, got {v!r}")

  def relief(self, t: str) -> int:
    return dict(zip(self.tags, self.tag_relief)).get(t, 0) if self.tag_relief else 0

  def _check_keep(self, keep: Sequence[Sequence[str]], offload=None):
    """``offload`` as one (possibly empty) set per layer, after checking both arguments."""
    for name, value in (("keep", keep), ("offload", offload)):
      if value is None:
        continue
      if isinstance(value, str) or any(isinstance(k, str) for k in value):
        raise TypeError(f"argument `{name}` must hold one sequence of tags per layer, got "
                        f"{value!r}")
      unknown = sorted({t for k in value for t in k} - set(self.tags))
      if unknown:
        raise ValueError(f"argument `{name}`: unknown tags {unknown}; this profile has "
                         f"{list(self.tags)}")
    if offload is None:
      return ((),) * len(keep)
    if len(offload) != len(keep):
      raise ValueError(f"argument `offload` has {len(offload)} layers, `keep` {len(keep)}")
    if any(offload) and not self.tag_offload_cost:
      raise ValueError("argument `offload`: this profile has no `tag_offload_cost` (offloading "
                       "is not a choice on its device)")
    both = sorted({t for k, o in zip(keep, offload) for t in set(k) & set(o)})
    if both:
      raise ValueError(f"tags {both} are both kept and offloaded in a layer")
    return tuple(tuple(o) for o in offload)

  def cost(self, keep: Sequence[Sequence[str]], offload=None) -> float:
    """Predicted cost of keeping ``keep[l]`` and offloading ``offload[l]`` (None: nothing)
    in layer l (additive model: what is neither is recomputed), plus ``fixed_cost``."""
    offload = self._check_keep(keep, offload)
    gain = dict(zip(self.tags, self.tag_gain))
    moved = dict(zip(self.tags, self.tag_offload_cost))
    return float(sum(max(self.full_cost - sum(gain[t] for t in (*k, *o)), 0.0)
                     + sum(moved[t] for t in o) for k, o in zip(keep, offload))
                 + self.fixed_cost)

  def peak(self, keep: Sequence[Sequence[str]], offload=None) -> int:
    """Predicted peak of keeping ``keep[l]`` and offloading ``offload[l]`` in layer l: the
    largest phase of the backward (see module doc; forward order, equal neighbours form one
    run)."""
    offload = self._check_keep(keep, offload)
    nbytes = dict(zip(self.tags, self.tag_bytes))
    kept, layers, phases = 0, 0, []
    for (k, o), n in _runs(list(zip(keep, offload))):
      kept += n * sum(nbytes[t] for t in k)
      layers += n
      relief = max((self.relief(t) for t in (*k, *o)), default=0)
      back = sum(nbytes[t] for t in o)  # the differentiated layer's, brought back
      phases.append(kept + back - relief - self.input_bytes * (len(keep) - layers))
    return int(self.base_bytes + max(phases, default=0))

  @property
  def minimum_bytes(self) -> int:
    """The least predicted peak of any plan (a tag whose relief exceeds its bytes can go
    below ``base_bytes``)."""
    return _minimum(self, False)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per layer, the tags to keep (and to offload), and the configuration and head mode
  chosen (those of a :class:`LayerProfile`); with the model's predictions.  ``offload`` is
  empty when nothing is offloaded, else one set per layer."""
  configuration: str
  keep: tuple[tuple[str, ...], ...]
  predicted_bytes: int
  predicted_cost: float
  budget: int
  solve_seconds: float
  offload: tuple[tuple[str, ...], ...] = ()
  head_mode: str | None = None

  @property
  def uniform(self) -> bool:
    return len(set(zip(self.keep, self.offload or ((),) * len(self.keep)))) <= 1

  def save_names(self) -> tuple[tuple[str, ...], ...]:
    """The ``save_names`` model-config value (one entry when every layer is the same)."""
    return (self.keep[0],) if self.uniform else self.keep

  def policy(self, layer: int = 0):
    """The ``jax.checkpoint`` policy of ``layer`` (:func:`policy`)."""
    return policy(self.keep[layer], self.offload[layer] if self.offload else ())


def policy(keep: Sequence[str], offload: Sequence[str] = ()):
  """The ``jax.checkpoint`` policy that saves the names in ``keep`` and offloads those in
  ``offload`` to ``pinned_host``.

  Args:
    keep: ``checkpoint_name`` tags kept on the device.
    offload: tags copied to host memory in the forward and back in the backward.

  Returns:
    ``save_only_these_names(*keep)``, or ``save_and_offload_only_these_names`` where
    ``offload`` is not empty.
  """
  import jax  # pylint: disable=import-outside-toplevel
  if offload:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(keep), names_which_can_be_offloaded=list(offload),
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*keep)


class InfeasibleBudget(ValueError):
  """No plan fits the budget; ``minimum_bytes`` is the smallest budget that does."""

  def __init__(self, budget: int, minimum_bytes: int):
    super().__init__(f"memory budget {budget:,} bytes is infeasible: the minimum feasible budget "
                     f"is {minimum_bytes:,} bytes")
    self.budget, self.minimum_bytes = budget, minimum_bytes


def _runs(keep):
  """Contiguous runs of equal entries: [(set, number of layers)]."""
  return [(k, len(list(g))) for k, g in itertools.groupby(tuple(k) for k in keep)]


def _program(p: LayerProfile, uniform: bool):
  """The integer program over runs of layers (see module doc), as scipy.optimize.milp input.

  Variables, run r = 0..K-1 in forward order: n[r] layers, a[r] (run used), y[r, t] (run keeps
  t), w[r, t] = n[r] * y[r, t], v[r, t] (t's relief is the one counted in run r's phase),
  where offloading is a choice o[r, t] (run offloads t) and u[r, t] = n[r] * o[r, t], and the
  peak P over base.  Unused runs come first.  Bytes are scaled to O(1).
  """
  L, T = p.depth, len(p.tags)
  K = 1 if uniform or L < 2 * MIN_RUN else min(MAX_RUNS, L // MIN_RUN)
  lo = L if K == 1 else MIN_RUN
  off = bool(p.tag_offload_cost)
  scale = float(max(max(p.tag_bytes, default=0), max(p.tag_relief, default=0), p.input_bytes, 1))
  b = np.asarray(p.tag_bytes, float) / scale
  tau = np.asarray([p.relief(t) for t in p.tags], float) / scale
  u = p.input_bytes / scale
  big = (L + 1) * b.sum() + 2 * u * L + 2 * tau.max(initial=0.0) + 1.0
  # Variable layout.
  n0, a0, y0 = 0, K, 2 * K
  w0, v0 = y0 + K * T, y0 + 2 * K * T
  o0 = y0 + 3 * K * T
  u0 = o0 + (K * T if off else 0)
  iP = u0 + (K * T if off else 0)
  nv = iP + 1
  rows, lo_b, hi_b = [], [], []

  def row(coef, lower, upper):
    r = np.zeros(nv)
    for i, c in coef:
      r[i] += c
    rows.append(r)
    lo_b.append(lower)
    hi_b.append(upper)

  Y = lambda r, t: y0 + r * T + t  # pylint: disable=unnecessary-lambda-assignment
  W = lambda r, t: w0 + r * T + t  # pylint: disable=unnecessary-lambda-assignment
  V = lambda r, t: v0 + r * T + t  # pylint: disable=unnecessary-lambda-assignment
  O = lambda r, t: o0 + r * T + t  # pylint: disable=unnecessary-lambda-assignment
  U = lambda r, t: u0 + r * T + t  # pylint: disable=unnecessary-lambda-assignment
  row([(n0 + r, 1.0) for r in range(K)], L, L)
  for r in range(K):
    row([(n0 + r, 1.0), (a0 + r, -L)], -np.inf, 0.0)        # n <= L a
    row([(n0 + r, -1.0), (a0 + r, lo)], -np.inf, 0.0)       # n >= lo a
    if r + 1 < K:
      row([(a0 + r, 1.0), (a0 + r + 1, -1.0)], -np.inf, 0.0)  # used runs last
    row([(V(r, t), 1.0) for t in range(T)], -np.inf, 1.0)   # one relief per phase
    for t in range(T):
      row([(Y(r, t), 1.0), (a0 + r, -1.0)] + ([(O(r, t), 1.0)] if off else []),
          -np.inf, 0.0)                                      # keep or offload, not both
      row([(W(r, t), 1.0), (Y(r, t), -L)], -np.inf, 0.0)     # w = n y, linearized
      row([(W(r, t), 1.0), (n0 + r, -1.0)], -np.inf, 0.0)
      row([(W(r, t), -1.0), (n0 + r, 1.0), (Y(r, t), L)], -np.inf, L)
      row([(V(r, t), 1.0), (Y(r, t), -1.0)] + ([(O(r, t), -1.0)] if off else []),
          -np.inf, 0.0)
      if off:
        row([(U(r, t), 1.0), (O(r, t), -L)], -np.inf, 0.0)   # u = n o, linearized
        row([(U(r, t), 1.0), (n0 + r, -1.0)], -np.inf, 0.0)
        row([(U(r, t), -1.0), (n0 + r, 1.0), (O(r, t), L)], -np.inf, L)
    # Phase r (when used): kept bytes of runs <= r, plus its offloaded tags brought back for
    # the differentiated layer, minus its relief, minus the inputs of the later layers, is
    # at most P.
    coef = [(W(s, t), b[t]) for s in range(r + 1) for t in range(T)]
    coef += [(O(r, t), b[t]) for t in range(T)] if off else []
    coef += [(V(r, t), -tau[t]) for t in range(T)]
    coef += [(n0 + s, u) for s in range(r + 1)] + [(iP, -1.0), (a0 + r, big)]
    row(coef, -np.inf, u * L + big)
  lower, upper, integrality = _bounds(nv, K, T, L, (n0, w0, u0, iP),
                                      -(tau.max(initial=0.0) + u * L) - 1.0, big)
  gain = np.zeros(nv)
  for r in range(K):
    for t in range(T):
      gain[W(r, t)] = p.tag_gain[t]
      if off:  # the recompute it saves, less the transfers it costs
        gain[U(r, t)] = p.tag_gain[t] - p.tag_offload_cost[t]
  return dict(A=np.asarray(rows), lo=np.asarray(lo_b), hi=np.asarray(hi_b), lower=lower,
              upper=upper, integrality=integrality, gain=gain, scale=scale, K=K, iP=iP,
              n0=n0, a0=a0, Y=Y, O=O if off else None)


def _bounds(nv: int, K: int, T: int, L: int, offsets: tuple, p_lower: float, p_upper: float):
  """The variables' bounds and integrality: layer counts and their products with the 0/1
  choices up to ``L``, the choices 0/1, the peak P continuous in ``[p_lower, p_upper]``."""
  n0, w0, u0, iP = offsets
  lower = np.zeros(nv)
  upper = np.ones(nv)
  upper[n0:n0 + K] = L
  upper[w0:w0 + K * T] = L
  upper[u0:iP] = L
  lower[iP], upper[iP] = p_lower, p_upper
  integrality = np.ones(nv)
  integrality[iP] = 0
  return lower, upper, integrality


@contextlib.contextmanager
def _stdout_silenced():
  """File descriptor 1 sent to /dev/null for the block: HiGHS (scipy's MILP solver) prints a
  debug line from C++ on some time-limited solves, whatever ``disp`` says."""
  try:
    fd = sys.stdout.fileno()
  except (AttributeError, OSError, ValueError):  # (a captured or replaced stdout)
    yield
    return
  sys.stdout.flush()
  saved, null = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(null, fd)
    yield
  finally:
    os.dup2(saved, fd)
    os.close(saved)
    os.close(null)


def _milp(prog, objective, extra=(), p_upper=None, time_limit: float = 10.0):
  """HiGHS on the program ``prog`` minimizing ``objective`` (with the ``extra`` rows and the peak
  at most ``p_upper``), its stray stdout silenced; scipy's result."""
  from scipy import optimize  # pylint: disable=import-outside-toplevel
  cons = [optimize.LinearConstraint(prog["A"], prog["lo"], prog["hi"])]
  for coef, lower, upper in extra:
    cons.append(optimize.LinearConstraint(coef[None, :], lower, upper))
  upper = prog["upper"].copy()
  if p_upper is not None:
    upper[prog["iP"]] = p_upper
  if upper[prog["iP"]] < prog["lower"][prog["iP"]]:
    return None
  with _stdout_silenced():
    res = optimize.milp(objective, constraints=cons, integrality=prog["integrality"],
                        bounds=optimize.Bounds(prog["lower"], upper),
                        options={"time_limit": time_limit, "mip_rel_gap": 0.0, "disp": False})
  return res if res.x is not None else None


def _decode(p: LayerProfile, prog, x):
  """``(keep, offload)``: per layer, the tags kept and those offloaded."""
  keep, offload = [], []
  for r in range(prog["K"]):
    if x[prog["a0"] + r] > 0.5:
      n = int(round(x[prog["n0"] + r]))
      keep += [tuple(t for i, t in enumerate(p.tags) if x[prog["Y"](r, i)] > 0.5)] * n
      offload += [tuple(t for i, t in enumerate(p.tags)
                        if prog["O"] is not None and x[prog["O"](r, i)] > 0.5)] * n
  return tuple(keep), tuple(offload)


def _best(p: LayerProfile, prog, p_upper, time_limit: float = 10.0):
  """Least cost; among those the least peak; among those the fewest runs (each solve within
  ``time_limit`` seconds: past it, the best plan found so far)."""
  iP, a0, K = prog["iP"], prog["a0"], prog["K"]
  g = prog["gain"] / max(float(np.abs(prog["gain"]).max(initial=0.0)), 1.0)
  res = _milp(prog, -g, p_upper=p_upper, time_limit=time_limit)
  if res is None:
    return None
  tol = lambda v: 1e-6 * max(1.0, abs(v))  # pylint: disable=unnecessary-lambda-assignment
  tie = [(g, -res.fun - tol(res.fun), np.inf)]
  peak_obj = np.zeros_like(g)
  peak_obj[iP] = 1.0
  lean = _milp(prog, peak_obj, tie, p_upper, time_limit)
  if lean is not None:
    res = lean
    runs_obj = np.zeros_like(g)
    runs_obj[a0:a0 + K] = 1.0
    few = _milp(prog, runs_obj, tie, min(p_upper, lean.fun + tol(lean.fun)), time_limit)
    if few is not None:
      res = few
  return _decode(p, prog, res.x)


def _solve_one(p: LayerProfile, budget: int, uniform: bool, time_limit: float = 10.0):
  """``(keep, offload)`` of the cheapest plan of ``p`` within ``budget``, or None."""
  if not p.tags:  # nothing to choose: every layer recomputes everything
    return (((),) * p.depth,) * 2 if p.base_bytes <= budget else None
  prog = _program(p, uniform)
  room = (budget - p.base_bytes) / prog["scale"]
  for _ in range(3):  # the solver's tolerance can admit a plan a few bytes over
    got = _best(p, prog, room, time_limit)
    if got is None or p.peak(*got) <= budget:
      return got
    room -= (p.peak(*got) - budget) / prog["scale"] + 1e-6
  return None


@functools.lru_cache(maxsize=256)
def _minimum(p: LayerProfile, uniform: bool) -> int:
  """The least predicted peak of any plan (of one set for all layers, with ``uniform``)."""
  if not p.tags:
    return p.base_bytes
  prog = _program(p, uniform)
  objective = np.zeros(len(prog["gain"]))
  objective[prog["iP"]] = 1.0
  res = _milp(prog, objective)
  return min(p.base_bytes, p.peak(*_decode(p, prog, res.x))) if res is not None else p.base_bytes


#: A budget above every peak a model can have (bytes): larger ones mean the same.
_NO_LIMIT = 2**62


def solve(profiles: Sequence[LayerProfile], budget: int, *, uniform: bool = False,
          time_limit: float = 10.0) -> Plan:
  """The cheapest plan over ``profiles`` (configurations) whose predicted peak fits ``budget``.

  Args:
    profiles: one :class:`LayerProfile` per configuration.
    budget: bytes the predicted peak may reach.
    uniform: one set of tags for every layer (else runs of layers may differ).
    time_limit: seconds per integer-program solve (three per configuration: cost, then peak,
      then runs); past it the best plan found so far.

  Returns:
    The :class:`Plan`.

  Raises:
    InfeasibleBudget: when even keeping nothing exceeds the budget (the error states the
      minimum feasible budget).
    ValueError: bad arguments.
  """
  if isinstance(profiles, LayerProfile) or not isinstance(profiles, Iterable):
    raise TypeError("argument `profiles` must be a sequence of LayerProfile objects")
  profiles = tuple(profiles)  # a generator is read once
  if not profiles:
    raise ValueError("argument `profiles` must hold at least one LayerProfile")
  if not all(isinstance(p, LayerProfile) for p in profiles):
    raise TypeError("argument `profiles` must hold LayerProfile objects")
  names = [(p.configuration, p.head_mode) for p in profiles]
  twice = sorted({n for n in names if names.count(n) > 1}, key=str)
  if twice:
    what = repr(twice[0][0]) + ("" if twice[0][1] is None else f" with head_mode {twice[0][1]!r}")
    raise ValueError(f"argument `profiles`: configuration {what} appears more than once "
                     "(a plan names the configuration it chose)")
  if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
    raise TypeError(f"argument `budget` must be a number of bytes, got {budget!r}")
  if isinstance(budget, (float, np.floating)) and not math.isfinite(float(budget)):
    raise ValueError(f"argument `budget` must be a finite number of bytes, got {budget!r}")
  budget = min(int(budget), _NO_LIMIT)  # beyond any peak: no constraint
  t0 = time.perf_counter()
  best = None
  for p in profiles:
    got = _solve_one(p, budget, uniform, time_limit)
    if got is None:
      continue
    cand = (p.cost(*got), p.peak(*got), p, got)
    if best is None or cand[:2] < best[:2]:
      best = cand
  if best is None:
    raise InfeasibleBudget(budget, min(_minimum(p, uniform) for p in profiles))
  cost, peak, p, (keep, offload) = best
  return Plan(configuration=p.configuration, keep=tuple(keep), predicted_bytes=peak,
              predicted_cost=cost, budget=budget, solve_seconds=time.perf_counter() - t0,
              offload=tuple(offload) if any(offload) else (), head_mode=p.head_mode)


def evaluate(profile: LayerProfile, keep_per_layer: Sequence[str]) -> tuple[int, float]:
  """(predicted peak, predicted cost) of one fixed set kept in every layer."""
  if isinstance(keep_per_layer, str):
    raise TypeError(f"argument `keep_per_layer` must be a sequence of tags, got the string "
                    f"{keep_per_layer!r}")
  keep = (tuple(keep_per_layer),) * profile.depth
  return profile.peak(keep), profile.cost(keep)
