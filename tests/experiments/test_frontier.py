"""The frontier's stacks and policies: every policy keeps what it names, gradients unchanged."""
import jax
import numpy as np

from invact_jax import memory
from models.experiments import frontier


def _temp(stack, policy, invact=False):
  loss, args = frontier.build(frontier.STACKS[stack], policy, invact, np.float32)
  return memory.compiled(jax.grad(loss), *args).temp


def test_policies_keep_what_they_name_and_leave_the_gradient(stack="dry-llama"):
  s = frontier.STACKS[stack]
  grads = {}
  for policy in ("none", "full", "minimal", "save_out_proj"):
    loss, args = frontier.build(s, policy, False, np.float32)
    grads[policy] = jax.jit(jax.grad(loss))(*args)
  for policy in ("full", "minimal", "save_out_proj"):
    for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  temp = {p: _temp(stack, p) for p in ("none", "full", "save_out_proj", "minimal")}
  assert temp["full"] < temp["save_out_proj"] < temp["minimal"] < temp["none"], temp


def test_invact_keeps_less_without_remat_and_the_same_under_a_names_policy():
  """Without remat invert keeps less; under MaxText's ``minimal`` the policy already keeps
  only the projections, and invert keeps exactly those: nothing is left for it to drop."""
  assert _temp("dry-llama", "none", True) < _temp("dry-llama", "none")
  kept = {}
  for invact in (False, True):
    loss, args = frontier.build(frontier.STACKS["dry-llama"], "minimal", invact, np.float32)
    kept[invact] = sorted((r.shape, r.dtype) for r in memory.residuals(loss, *args))
  assert kept[True] == kept[False]


def test_offload_only_where_the_device_has_memory_kinds():
  rows = frontier.rows(["dry-llama"], dtype="float32", policies=["none", "minimal_offloaded"],
                       repeats=1, in_process=True, torch_variants=())
  assert {r["configuration"] for r in rows} == (
      {"default", "minimal_offloaded"} if frontier.has_memory_kinds() else {"default"})


def test_pareto_marks_rows_no_other_row_beats():
  rows = [{"model": "m", "activation_bytes": b, "step_ms": t} for b, t in
          [(10, 5.0), (5, 10.0), (10, 10.0), (20, 4.0)]] + [{"model": "m", "error": "oom"},
                                                          {"model": "n", "activation_bytes": 30,
                                                           "step_ms": 30.0}]
  marked = [r["pareto"] for r in frontier.pareto(rows)]
  assert marked == [True, True, False, True, False, True]
