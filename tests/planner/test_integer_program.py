"""The memory planner's integer program (``invact_jax.planner``): plans, peaks, costs,
offloading and bad arguments, on profiles written by hand."""
import dataclasses
import itertools
import re
import time

import jax
import jax.numpy as jnp
import pytest

from invact_jax import planner

PROFILE = planner.LayerProfile(
    configuration="inverted", depth=4, base_bytes=1000, tags=("q", "k", "mlp"),
    tag_bytes=(100, 100, 300), tag_gain=(5.0, 5.0, 20.0), full_cost=30.0,
    tag_relief=(0, 0, 200))


def test_solve_picks_cheapest_within_budget_and_counts_one_relief():
  # Keeping "mlp" in every layer: 1000 + 4 * 300 - 200 = 2000.
  plan = planner.solve([PROFILE], 2000, uniform=True)
  assert plan.keep == (("mlp",),) * 4 and plan.predicted_bytes == 2000
  assert plan.predicted_cost == pytest.approx(4 * 10.0)
  # Brute force over uniform sets agrees with the MILP at several budgets.
  for budget in (1000, 1350, 1700, 2000, 2400, 3000, 3400):
    best = min((PROFILE.cost((s,) * 4), PROFILE.peak((s,) * 4)) for r in range(4)
               for s in itertools.combinations(PROFILE.tags, r)
               if PROFILE.peak((s,) * 4) <= budget)
    plan = planner.solve([PROFILE], budget, uniform=True)
    assert (plan.predicted_cost, plan.predicted_bytes) == pytest.approx(best)


def test_per_layer_plans_are_finer_than_uniform_ones():
  budget = 1000 + 2 * 300 - 200 + 2 * 100  # room for "mlp" in two layers and "q" in two
  uni = planner.solve([PROFILE], budget, uniform=True)
  per = planner.solve([PROFILE], budget, uniform=False)
  assert per.predicted_bytes <= budget and uni.predicted_bytes <= budget
  assert per.predicted_cost < uni.predicted_cost
  assert not per.uniform and len(per.save_names()) == 4
  # Equal layers are contiguous (one scan per run).
  runs = [k for i, k in enumerate(per.keep) if i == 0 or k != per.keep[i - 1]]
  assert len(runs) == len(set(per.keep))


def test_infeasible_budget_names_the_minimum():
  other = dataclasses.replace(PROFILE, configuration="standard", base_bytes=1200)
  with pytest.raises(planner.InfeasibleBudget, match="minimum feasible budget is 1,000 bytes"):
    planner.solve([PROFILE, other], 999)
  # The cheaper configuration wins where both fit.
  assert planner.solve([PROFILE, other], 5000).configuration == "inverted"


def test_relief_counts_only_where_every_layer_keeps_the_tag():
  # "mlp" relieves 200 bytes only if all four layers keep it; in one layer it costs 300.
  assert PROFILE.peak((("mlp",), (), (), ())) == 1300
  assert PROFILE.peak((("mlp",),) * 4) == 2000
  # A tag whose relief exceeds what it adds takes the minimum below base_bytes.
  cheap = dataclasses.replace(PROFILE, tag_bytes=(100, 100, 30), tag_relief=(0, 0, 200))
  assert cheap.minimum_bytes == 1000 + 4 * 30 - 200
  plan = planner.solve([cheap], 950)  # under base_bytes, yet feasible
  assert plan.keep == (("mlp",),) * 4 and plan.predicted_bytes == 920
  with pytest.raises(planner.InfeasibleBudget, match="minimum feasible budget is 920 bytes"):
    planner.solve([cheap], 919)


def _compositions(depth):
  """Run lengths of every plan shape the planner may choose (one run, or up to MAX_RUNS runs
  of at least MIN_RUN layers)."""
  out = {(depth,)}
  for k in range(2, planner.MAX_RUNS + 1):
    out |= {c for c in itertools.product(range(planner.MIN_RUN, depth + 1), repeat=k)
            if sum(c) == depth}
  return sorted(out)


def test_peak_is_the_largest_phase_of_the_runs():
  p = dataclasses.replace(PROFILE, depth=6, input_bytes=50)
  # "mlp" in the last two layers: that run's phase, 2 * 300 - 200, over base.
  assert p.peak(((),) * 4 + (("mlp",),) * 2) == 1000 + 600 - 200
  # Reversed, the keep-nothing run is last: nothing relieved, every input kept.
  assert p.peak((("mlp",),) * 2 + ((),) * 4) == 1000 + 600
  # Phases of "mlp" x4 then "q" x2: 4 * 300 - 200 - 2 inputs, then 4 * 300 + 2 * 100.
  assert p.peak((("mlp",),) * 4 + (("q",),) * 2) == 1000 + max(1200 - 200 - 100, 1400)
  # An earlier run binds when the last one relieves more than it adds: "q" x2 then a cheap
  # "mlp" x4 (30 bytes, relief 420): phases 200 - 0 - 4 inputs and 200 + 120 - 420.
  cheap = dataclasses.replace(p, tag_bytes=(100, 100, 30), tag_relief=(0, 0, 420))
  assert cheap.peak((("q",),) * 2 + (("mlp",),) * 4) == 1000 + max(200 - 200, 320 - 420)
  # One set for every layer: base + depth * bytes - relief, as before.
  assert p.peak((("mlp",),) * 6) == 1000 + 6 * 300 - 200


def test_per_layer_plans_match_brute_force_over_run_shapes():
  # Runs of at least MIN_RUN layers, at most MAX_RUNS runs; relief and inputs per phase.
  p = planner.LayerProfile(configuration="v", depth=6, base_bytes=1000, tags=("q", "k", "mlp"),
                           tag_bytes=(100, 60, 300), tag_gain=(5.0, 4.0, 20.0), full_cost=30.0,
                           tag_relief=(0, 150, 420), input_bytes=50)
  sets = [s for r in range(len(p.tags) + 1) for s in itertools.combinations(p.tags, r)]
  plans = [tuple(s for s, n in zip(choice, comp) for _ in range(n))
           for comp in _compositions(p.depth) for choice in itertools.product(sets, repeat=len(comp))]
  assert p.minimum_bytes == min(p.peak(k) for k in plans) < p.base_bytes
  for budget in range(900, 3200, 190):
    fits = [(round(p.cost(k), 9), p.peak(k)) for k in plans if p.peak(k) <= budget]
    if not fits:
      with pytest.raises(planner.InfeasibleBudget):
        planner.solve([p], budget)
      continue
    plan = planner.solve([p], budget)
    assert (round(plan.predicted_cost, 9), plan.predicted_bytes) == min(fits), budget
    runs = [len(list(g)) for _, g in itertools.groupby(plan.keep)]
    assert len(runs) <= planner.MAX_RUNS and (len(runs) == 1 or min(runs) >= planner.MIN_RUN)


@pytest.mark.parametrize("change, message", [
    (dict(tags=("q", "q", "mlp")), "names ['q'] more than once"),
    (dict(depth=0), "`depth` must be a positive integer"),
    (dict(full_cost=float("nan")), "`full_cost` must hold finite numbers"),
    (dict(tag_gain=(1.0, float("inf"), 2.0)), "`tag_gain` must hold finite numbers"),
    (dict(tag_bytes=(1, -5, 2)), "`tag_bytes` must hold finite numbers >= 0"),
    (dict(tag_bytes=(1, 2)), "`tag_bytes` has 2 entries for 3 tags"),
    (dict(tag_relief=(0,)), "`tag_relief` has 1 entries for 3 tags"),
    (dict(tags="qkv"), "`tags` must be a sequence"),
    (dict(configuration=""), "`configuration` must be a non-empty string"),
])
def test_profile_rejects_bad_figures_naming_the_argument(change, message):
  with pytest.raises((ValueError, TypeError), match=re.escape(message)):
    dataclasses.replace(PROFILE, **change)


def test_solve_rejects_bad_budgets_and_plans_an_empty_tag_list():
  for budget in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="argument `budget` must be a finite"):
      planner.solve([PROFILE], budget)
  with pytest.raises(TypeError, match="argument `budget`"):
    planner.solve([PROFILE], "1000")
  bare = planner.LayerProfile(configuration="v", depth=3, base_bytes=500, tags=(), tag_bytes=(),
                              tag_gain=(), full_cost=7.0)
  plan = planner.solve([bare], 600)
  assert plan.keep == ((), (), ()) and plan.predicted_bytes == 500 and plan.predicted_cost == 21.0
  with pytest.raises(planner.InfeasibleBudget, match="is 500 bytes"):
    planner.solve([bare], 499)


def test_equal_cost_plans_take_the_one_with_less_memory():
  # Instances where a single cost-only solve returned the heavier of two equally cheap plans.
  p = planner.LayerProfile(configuration="inverted", depth=1, base_bytes=1000, tags=("a", "b", "c"),
                           tag_bytes=(200, 300, 200), tag_gain=(1.0, 1.0, 3.0), full_cost=20.0)
  for uniform in (True, False):
    plan = planner.solve([p], 1500, uniform=uniform)  # {a, c} and {b, c} both gain 4
    assert plan.keep == (("a", "c"),) and plan.predicted_bytes == 1400, plan
    assert plan.predicted_cost == pytest.approx(16.0)
  p3 = dataclasses.replace(p, depth=3, tag_bytes=(200, 300, 100), tag_gain=(1.0, 3.0, 1.0))
  plan = planner.solve([p3], 1800, uniform=True)  # "a" or "c" in every layer: gain 3
  assert plan.keep == (("c",),) * 3 and plan.predicted_bytes == 1300, plan


def test_48_layer_solve_is_fast():
  big = dataclasses.replace(
      PROFILE, depth=48, tags=tuple(f"t{i}" for i in range(11)), tag_bytes=tuple(range(100, 1200, 100)),
      tag_gain=tuple(float(g) for g in range(11, 0, -1)), full_cost=66.0,
      tag_relief=(0,) * 11)
  planner.solve([big], big.base_bytes + 10_000)  # warm-up: scipy import
  t0 = time.perf_counter()
  plan = planner.solve([big], big.base_bytes + 48 * 1500, uniform=False)
  assert time.perf_counter() - t0 < 1.0
  assert plan.predicted_bytes <= plan.budget


def test_huge_budgets_and_unknown_tags_are_clear():
  """A budget of 2**64 bytes plans (before: a TypeError from isfinite); unknown tags and a
  string where a set of tags belongs are one-line errors naming the argument (before: a bare
  KeyError)."""
  assert planner.solve([PROFILE], 2**64).keep == (PROFILE.tags,) * PROFILE.depth
  with pytest.raises(ValueError, match=r"argument `keep`: unknown tags \['zz'\]"):
    planner.evaluate(PROFILE, ["zz"])
  with pytest.raises(ValueError, match="unknown tags"):
    PROFILE.peak([("nope",)] * PROFILE.depth)
  with pytest.raises(TypeError, match="argument `keep_per_layer` must be a sequence of tags"):
    planner.evaluate(PROFILE, "q")
  with pytest.raises(ValueError, match="`base_bytes` must hold finite numbers"):
    dataclasses.replace(PROFILE, base_bytes=float("inf"))
  assert dataclasses.replace(PROFILE, base_bytes=2**70).base_bytes == 2**70


def test_a_configurations_fixed_cost_decides_between_operator_variants():
  """Two LM-head variants: the chunked one needs less memory and recomputes its logits
  (fixed_cost); the planner takes the standard head where it fits and the chunked one where
  only it does."""
  standard = dataclasses.replace(PROFILE, configuration="inverted", head_mode="standard",
                                 base_bytes=1500)
  chunked = dataclasses.replace(PROFILE, configuration="inverted", head_mode="chunked",
                                fixed_cost=7.0)
  loose = planner.solve([chunked, standard], budget=10_000)
  assert (loose.configuration, loose.head_mode) == ("inverted", "standard")
  assert loose.predicted_cost == 0.0
  tight = planner.solve([chunked, standard], budget=1_400)
  assert (tight.configuration, tight.head_mode) == ("inverted", "chunked")
  assert tight.predicted_cost == chunked.cost(tight.keep) >= 7.0
  with pytest.raises(ValueError, match="`fixed_cost` must hold finite numbers >= 0"):
    dataclasses.replace(PROFILE, fixed_cost=-1.0)


def test_a_profile_is_named_by_its_configuration_and_head_mode():
  with pytest.raises(ValueError, match="configuration 'inverted' with head_mode 'chunked' "
                                       "appears more than once"):
    planner.solve([dataclasses.replace(PROFILE, configuration="inverted", head_mode="chunked")] * 2,
                  budget=10_000)
  with pytest.raises(ValueError, match="`head_mode` must be None or a non-empty string"):
    dataclasses.replace(PROFILE, head_mode="")


OFFLOAD = dataclasses.replace(PROFILE, depth=6, input_bytes=50, tag_relief=(0, 150, 420),
                              tag_bytes=(100, 60, 300), tag_gain=(5.0, 4.0, 20.0),
                              tag_offload_cost=(6.0, 1.0, 2.0))


def _choices(p):
  """Every (keep, offload) pair of disjoint tag sets of ``p``."""
  out = []
  for assign in itertools.product((None, "keep", "offload"), repeat=len(p.tags)):
    out.append((tuple(t for t, a in zip(p.tags, assign) if a == "keep"),
                tuple(t for t, a in zip(p.tags, assign) if a == "offload")))
  return out


def test_offloading_is_costed_by_its_transfers_and_counted_once_on_the_device():
  p = OFFLOAD
  keep, off = ((),) * 6, (("mlp",),) * 6
  # Each layer pays the transfer instead of the recompute; one layer's "mlp" is back on the
  # device (with its relief) in the phase, every layer's input kept.
  assert p.cost(keep, off) == pytest.approx(6 * (30.0 - 20.0 + 2.0))
  assert p.peak(keep, off) == 1000 + 300 - 420
  assert p.peak(keep) == p.peak(keep, ((),) * 6) and p.cost(keep) == p.cost(keep, ((),) * 6)
  with pytest.raises(ValueError, match=r"tags \['mlp'\] are both kept and offloaded"):
    p.peak((("mlp",),) * 6, off)
  with pytest.raises(ValueError, match="`offload` has 2 layers, `keep` 6"):
    p.cost(keep, (("mlp",),) * 2)
  with pytest.raises(ValueError, match="no `tag_offload_cost`"):
    PROFILE.peak(((),) * 4, (("mlp",),) * 4)
  with pytest.raises(ValueError, match="`tag_offload_cost` has 1 entries for 3 tags"):
    dataclasses.replace(PROFILE, tag_offload_cost=(1.0,))


def test_plans_with_offloading_match_brute_force_over_run_shapes():
  p = OFFLOAD
  plans = [(tuple(c[0] for c, n in zip(choice, comp) for _ in range(n)),
            tuple(c[1] for c, n in zip(choice, comp) for _ in range(n)))
           for comp in _compositions(p.depth)
           for choice in itertools.product(_choices(p), repeat=len(comp))]
  figures = [(round(p.cost(*k), 9), p.peak(*k)) for k in plans]
  offloaded = 0
  for budget in range(700, 3200, 230):
    fits = [f for f in figures if f[1] <= budget]
    if not fits:
      with pytest.raises(planner.InfeasibleBudget):
        planner.solve([p], budget)
      continue
    plan = planner.solve([p], budget)
    got = (plan.keep, plan.offload or ((),) * p.depth)
    assert (round(plan.predicted_cost, 9), plan.predicted_bytes) == min(fits), budget
    assert (p.cost(*got), p.peak(*got)) == pytest.approx(
        (plan.predicted_cost, plan.predicted_bytes))
    assert "q" not in {t for o in got[1] for t in o}  # moving it costs more than recomputing
    offloaded += any(got[1])
  assert offloaded  # some budgets are met best by offloading


def test_without_host_memory_nothing_is_offloaded_and_plans_are_unchanged():
  p = dataclasses.replace(OFFLOAD, tag_offload_cost=())
  for budget in (1200, 1800, 2600):
    plan = planner.solve([p], budget)
    assert plan.offload == ()
    assert plan.keep == planner.solve([dataclasses.replace(OFFLOAD, tag_offload_cost=())],
                                      budget).keep


def test_an_offloading_plans_policy_offloads_to_pinned_host():
  plan = planner.solve([OFFLOAD], 1200)
  assert plan.offload
  layer = next(i for i, o in enumerate(plan.offload) if o)
  names = set(plan.offload[layer])
  policy = plan.policy(layer)
  x = jnp.ones((4, 4))

  def f(x):
    from jax.ad_checkpoint import checkpoint_name  # pylint: disable=import-outside-toplevel
    return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), sorted(names)[0])))
  # the named value goes to host memory in the forward and comes back in the backward
  jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(x))
  assert "MemorySpace.Host" in jaxpr and "MemorySpace.Device" in jaxpr, jaxpr
  # the layer's keep set alone: nothing moved
  assert "MemorySpace" not in str(jax.make_jaxpr(jax.grad(jax.checkpoint(
      f, policy=planner.policy(plan.keep[layer]))))(x))


def test_profiles_any_iterable_budgets_beyond_any_peak_and_one_name_per_configuration():
  """A generator of profiles is read once; a budget of 10**400 bytes plans as no limit (it
  overflowed a float); two profiles of one configuration are refused (a plan names the one
  it chose)."""
  assert planner.solve((p for p in [PROFILE]), 10**400).keep == (PROFILE.tags,) * PROFILE.depth
  with pytest.raises(ValueError, match="configuration .* appears more than once"):
    planner.solve([PROFILE, dataclasses.replace(PROFILE, base_bytes=1)], 10**9)
  with pytest.raises(TypeError, match="argument `profiles` must be a sequence"):
    planner.solve(PROFILE, 10**9)

