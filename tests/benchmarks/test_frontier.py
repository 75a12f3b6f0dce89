"""The frontier's stacks and policies: every policy keeps what it names, gradients unchanged."""
import dataclasses
import time

import jax
import numpy as np

from invact_jax import memory
from models.benchmarks import child, frontier
from models.benchmarks.frontier import model_stack


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
                       repeats=1, in_process=True, torch_configurations=())
  assert {r["configuration"] for r in rows} == (
      {"default", "minimal_offloaded"} if frontier.has_memory_kinds() else {"default"})


def test_pareto_marks_rows_no_other_row_beats():
  rows = [{"model": "m", "activation_bytes": b, "step_ms": t} for b, t in
          [(10, 5.0), (5, 10.0), (10, 10.0), (20, 4.0)]] + [{"model": "m", "error": "oom"},
                                                          {"model": "n", "activation_bytes": 30,
                                                           "step_ms": 30.0}]
  marked = [r["pareto"] for r in frontier.pareto(rows)]
  assert marked == [True, True, False, True, False, True]


def _synthetic(stack="dry-llama", scale=1.0):
  """Rows of both sides: ``full`` 100 bytes; q/k/v add 30, out 10, the MLP 60 (per stack of
  2 layers); keeping saves 6, 2, 8 ms; the default keeps 350 (the invact side 90 %)."""
  table = {"default": (350, 10.0), "full": (100, 20.0), "save_qkv_proj": (130, 14.0),
           "save_out_proj": (110, 18.0), "save_dot_except_mlp": (140, 12.0),
           "minimal": (200, 4.0)}
  return [{"model": stack, "framework": "jax", "invact": invact, "configuration": c,
           "activation_bytes": int(b * (0.9 if invact else 1.0) * scale), "step_ms": t,
           "layers": 2} for c, (b, t) in table.items() for invact in (False, True)]


def test_profile_from_rows_shares_each_group_by_tensor_size_and_matmul_work():
  s = frontier.STACKS["dry-llama"]  # d=64, ff=176
  p = frontier.profile_from_rows(_synthetic(), "dry-llama", False)
  b, g = dict(zip(p.tags, p.tag_bytes)), dict(zip(p.tags, p.tag_gain))
  assert p.base_bytes == 100 and p.depth == 2 and p.configuration == "standard"
  assert b["query_proj"] == b["key_proj"] == b["value_proj"] == 5 and b["out_proj"] == 5
  # the MLP's 30 bytes per layer: two ff-wide tensors and one d-wide
  np.testing.assert_allclose([b["mlpwi_0"], b["mlpwo"]],
                             [round(30 * s.ff / (2 * s.ff + s.d)), round(30 * s.d / (2 * s.ff + s.d))])
  np.testing.assert_allclose([g["query_proj"], g["out_proj"], g["mlpwi_0"] + g["mlpwi_1"] + g["mlpwo"]],
                             [1.0, 1.0, 4.0])
  assert p.full_cost == 8.0  # (full - minimal) per layer
  assert frontier.profile_from_rows(_synthetic()[:-2], "dry-llama", False) is None


def test_plan_specs_fit_the_budget_or_say_why():
  rs = _synthetic()
  specs = frontier.plan_specs(rs, "dry-llama", dtype="float32", repeats=1)
  assert [s["configuration"] for s in specs] == ["plan 25 %", "plan 50 %", "plan 75 %"]
  assert "infeasible" in specs[0]["error"]  # 87 of 350: below every plan (the least is 90)
  for s in specs[1:]:
    assert "error" not in s and s["predicted_bytes"] <= s["budget_bytes"], s
    assert sum(n for n, _ in s["runs"]) == 2
  # at 75 % (262 bytes) everything fits: the plan keeps every projection (fastest), on the
  # side that keeps less at the same cost
  assert specs[2]["invact"]
  assert specs[2]["runs"] == [[2, list(frontier.tags(frontier.STACKS["dry-llama"]))]]
  assert abs(specs[2]["predicted_step_ms"] - 4.0) < 1e-9
  missing = frontier.plan_specs([r for r in rs if r["configuration"] != "default"], "dry-llama",
                                dtype="float32", repeats=1)
  assert all("missing" in s["error"] for s in missing)


def test_a_plan_of_runs_keeps_per_run_and_leaves_the_gradient():
  s = frontier.STACKS["dry-llama"]
  loss, args = frontier.build(s, "none", False, np.float32)
  plan, _ = frontier.build(s, "plan", True, np.float32, runs=[[1, ["out_proj"]], [1, []]])
  for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(plan))(*args)),
                  jax.tree.leaves(jax.jit(jax.grad(loss))(*args))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  none, _ = frontier.build(s, "plan", True, np.float32, runs=[[1, []], [1, []]])

  def kept(f):
    return sum(r.bytes for r in memory.residuals(f, *args) if not r.is_argument)
  # the first layer keeps its attention output projection, [batch, seq, d] float32, and no more
  assert kept(plan) - kept(none) == s.batch * s.seq * s.d * 4
  with np.testing.assert_raises_regex(ValueError, "argument `runs`: 3 layers"):
    frontier.build(s, "plan", True, np.float32, runs=[[3, []]])


def test_layers_that_fit_stay_within_the_limit():
  name = "dry-llama"
  limit = 6_000_000
  n = frontier.layers_that_fit(name, "float32", limit_bytes=limit, most=64)
  assert n > 2

  def need(layers):
    loss, args = frontier.build(frontier.STACKS[name].__class__(
        **{**frontier.STACKS[name].__dict__, "layers": layers}), "none", False, np.float32)
    params = sum(a.nbytes for a in jax.tree.leaves(args[0]))
    return memory.compiled(jax.value_and_grad(loss), *args).temp + 2 * params
  assert need(n) <= 0.85 * limit < need(n + 1), (n, need(n), need(n + 1))
  assert frontier.layers_that_fit(name, "float32") == frontier.STACKS[name].layers  # CPU: no limit


def test_rows_plan_at_three_budgets_from_the_measured_policies(monkeypatch):
  real = frontier.measure
  synthetic = {(r["configuration"], r["invact"]): r for r in _synthetic(scale=1e4)}
  monkeypatch.setattr(frontier.measurement, "measure", lambda spec: real(spec) if "runs" in spec else dict(
      synthetic[("default" if spec["policy"] == "none" else spec["policy"], spec["invact"])]))
  rs = frontier.rows(["dry-llama"], dtype="float32", repeats=1, in_process=True,
                     torch_configurations=(), policies=["none", *frontier.planning.PLAN_POLICIES])
  plans = [r for r in rs if r["configuration"].startswith("plan")]
  assert len(plans) == 3
  for r in plans:
    if "error" not in r:  # measured by the real step (compiled temp on a CPU)
      assert r["activation_bytes"] > 0 and "prediction_error" in r and r["runs"], r
  assert any("error" not in r for r in plans)


def test_headline_rows_name_the_fastest_within_each_budget(tmp_path):
  rows = _synthetic(scale=2**30 / 100) + [
      {"model": "dry-llama", "framework": "torch", "invact": False, "configuration": "liger",
       "activation_bytes": 150 * 2**30 // 100, "step_ms": 5.0}]
  data = {"device": "GPU X", "date": "2026-11-25", "versions": {"jax": "0.11.2"}, "rows": rows}
  lines = frontier.headline_rows(data, "bench/frontier_gpu-x_2026-11-25.json")
  assert len(lines) == 4 and all(line.count("|") == 6 for line in lines)
  # 10 % and 25 % of 3.5 GiB are below the least either side keeps (full: 1.00 / 0.90 GiB)
  assert "fastest within 10% of JAX default's activations | none fits | none fits |" in lines[0]
  assert "fastest within 25% of JAX default's activations | none fits | none fits |" in lines[1]
  # 50 % (1.75 GiB): JAX-only save_dot_except_mlp (1.40 GiB, 12 ms); invact minimal (1.80) does
  # not fit, its save_dot_except_mlp (1.26 GiB) does
  assert "save_dot_except_mlp: 12.0 ms, 1.40 GiB | save_dot_except_mlp: 12.0 ms, 1.26 GiB (1.00×)" in lines[2]
  assert "PyTorch + Liger's (1.50 GiB, 5.0 ms)" in lines[3] and "GPU X, JAX 0.11.2, 2026-11-25" in lines[3]
  assert "(1.00×; 2.40× Liger's)" in lines[3], lines[3]  # the invact row against Liger's step too
  # without JAX default's row (out of memory on the device) only Liger's budget is left
  no_default = [r for r in rows if (r["configuration"], r["invact"]) != ("default", False)]
  assert frontier.headline_rows({**data, "rows": no_default},
                                "bench/frontier_gpu-x_2026-11-25.json") == lines[3:]


def test_a_deadline_leaves_error_rows_that_the_front_and_table_skip(monkeypatch):
  """Plans not run for lack of time are rows with an error (on the H100 they had none, and the
  Pareto front raised KeyError on them, losing the whole section's JSON)."""
  import time  # pylint: disable=import-outside-toplevel
  synthetic = {(r["configuration"], r["invact"]): r for r in _synthetic(scale=1e4)}
  policies = ["none", *frontier.planning.PLAN_POLICIES]
  now = [0.0]
  monkeypatch.setattr(time, "time", lambda: now[0])

  def measure(spec):  # the clock passes the deadline with the last policy's row
    if (spec["policy"], spec["invact"]) == (policies[-1], True):
      now[0] = 100.0
    return dict(synthetic[("default" if spec["policy"] == "none" else spec["policy"],
                           spec["invact"])])
  monkeypatch.setattr(frontier.measurement, "measure", measure)
  rs = frontier.rows(["dry-llama"], dtype="float32", repeats=1, in_process=True,
                     torch_configurations=(), policies=policies, deadline=50.0)
  assert len(rs) == 2 * len(policies) + 3
  plans = [r for r in rs if r["configuration"].startswith("plan")]
  errors = [r.get("error") for r in plans]  # 25 %: below what any plan keeps (its own error)
  assert "infeasible" in errors[0] and errors[1:] == ["out of time"] * 2, errors
  front = frontier.pareto(rs)
  assert not any(r["pareto"] for r in plans) and any(r["pareto"] for r in front)
  assert "out of time" in frontier.markdown(front)


def test_newest_per_model_never_mixes_a_models_rows_across_runs(tmp_path):
  import json  # pylint: disable=import-outside-toplevel

  def run(name, rows, dry=False):
    p = tmp_path / f"frontier_{name}.json"
    p.write_text(json.dumps({"device": "X", "date": name[-10:], "dry": dry, "rows": rows}))
    return p

  def row(model, ms, **kw):
    return {"model": model, "framework": "jax", "configuration": "default", "invact": False,
            "activation_bytes": 1, "step_ms": ms, **kw}
  old = run("gpu-x_2026-11-25", [row("llama", 1.0), row("gpt2-medium", 2.0)])
  new = run("gpu-x_2026-11-26", [row("llama-7b", 3.0), row("llama", 4.0, error="oom")])
  dry = run("gpu-x_2026-11-27", [row("dry-llama", 5.0)], dry=True)
  other = run("gpu-y_2026-11-20", [row("llama", 6.0)])
  got = frontier.newest_per_model([old, new, dry, other])
  # the newest run's llama failed: llama comes from the newest run that measured it, and
  # only from it (the failed row is not carried along)
  assert [(p, sorted({r["model"] for r in d["rows"]})) for p, d in got] == [
      (new, ["llama-7b"]), (old, ["gpt2-medium", "llama"]), (other, ["llama"])], got
  assert [r["step_ms"] for r in got[1][1]["rows"]] == [1.0, 2.0]


def test_offloading_rows_make_offloading_a_planner_choice_and_a_run():
  """Where ``minimal_offloaded`` was measured (a GPU), its step over ``minimal``'s is the
  transfers' cost per layer, shared by tensor size; the plans may offload; a run that does
  moves its tags to host memory and back."""
  rs = _synthetic() + [
      {"model": "dry-llama", "framework": "jax", "invact": invact,
       "configuration": "minimal_offloaded", "activation_bytes": 110, "step_ms": 4.4,
       "layers": 2} for invact in (False, True)]
  p = frontier.profile_from_rows(rs, "dry-llama", False)
  assert abs(sum(p.tag_offload_cost) - 0.2) < 1e-9  # (4.4 - 4.0) / 2 layers
  cost = dict(zip(p.tags, p.tag_offload_cost))
  assert cost["mlpwi_0"] > cost["query_proj"] > 0
  assert frontier.profile_from_rows(_synthetic(), "dry-llama", False).tag_offload_cost == ()
  # 150 bytes (43 % of default's 350): the invact side keeps its projections and offloads the
  # MLP's (cheaper to move than to recompute; keeping everything would be 174)
  (spec,) = frontier.plan_specs(rs, "dry-llama", dtype="float32", repeats=1, budgets=(0.43,))
  assert spec["invact"] and spec["runs"] == [[2, ["query_proj", "key_proj", "value_proj",
                                                   "out_proj"], ["mlpwi_0", "mlpwi_1", "mlpwo"]]]
  offloading = [spec]
  assert "offload" in frontier.report.plan_note({**offloading[0], "predicted_bytes": 1})
  s = frontier.STACKS["dry-llama"]
  loss, args = frontier.build(s, "plan", False, np.float32,
                              runs=[[2, ["query_proj"], ["mlpwi_0", "mlpwi_1"]]])
  text = str(jax.make_jaxpr(jax.grad(loss))(*args))
  assert "MemorySpace.Host" in text and "MemorySpace.Device" in text


# ------------------------------------------------------------------ language models
def test_a_language_model_runs_from_tokens_to_the_loss_whatever_the_policy_and_head():
  """Every policy, with and without invact (its head, norms and activations converted),
  leaves the loss and the gradients as the plain program's (float32: the head's chunked
  log-sum-exp within its rounding)."""
  s = frontier.STACKS["dry-llama3"]
  ref = None
  for policy in ("none", "full"):  # dots_no_batch: the dry report's rows
    for invact in (False, True):
      loss, args = frontier.build(s, policy, invact, np.float32)
      value, grads = jax.jit(jax.value_and_grad(loss))(*args)
      if invact:
        report = loss.last_report
        # the scanned layer's two norms (one body for every layer) and the final one; under
        # full remat the layer's norms only where that lowers its compiled temp (JAX 0.10:
        # it does, the backward rules reading their residuals apart; JAX 0.12: it does not),
        # else left alone, said with the two figures
        under_remat = [w for w, _, y in report.left_alone if "inside jax.checkpoint" in y]
        layer_norms = 2 - under_remat.count("rms_norm")
        assert layer_norms in ((2,) if policy == "none" else (0, 2)), report
        assert report.replaced.get("linear_cross_entropy") == 1 and report.replaced.get(
            "rms_norm") == 1 + layer_norms, report
        assert any("folded in" in f for f in report.forms), report.forms
      if ref is None:
        ref = (value, grads)
        continue
      np.testing.assert_allclose(value, ref[0], rtol=2e-6)
      for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
  assert args[1].shape == (s.batch, s.seq + 1)   # tokens: inputs and their next tokens
  params = args[0]
  assert params["layers"]["wk"].shape == (s.layers, s.d, s.kv_width) and s.kv_width < s.d
  assert params["embed"].dtype == np.float32 and "head" not in params  # tied


def test_unrolled_layers_give_the_scanned_stacks_loss_and_gradients():
  """A row's layers unrolled, each with its own parameters: the scanned stack's loss and
  gradients (float32, the same rounding as above), its parameters the same values as a list,
  and no scan over the layers (the only scan left is the head's, under invert)."""
  s = frontier.STACKS["dry-llama3"]
  for invact in (False, True):
    scanned, args = frontier.build(s, "none", invact, np.float32)
    unrolled, uargs = frontier.build(s, "none", invact, np.float32, unrolled=True)
    assert isinstance(uargs[0]["layers"], list) and len(uargs[0]["layers"]) == s.layers
    restacked = jax.tree.map(lambda *a: np.stack(a), *uargs[0]["layers"])
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(args[0]["layers"])):
      np.testing.assert_array_equal(a, b)
    value, grads = jax.jit(jax.value_and_grad(scanned))(*args)
    uvalue, ugrads = jax.jit(jax.value_and_grad(unrolled))(*uargs)
    np.testing.assert_allclose(uvalue, value, rtol=2e-6)
    ugrads["layers"] = jax.tree.map(lambda *a: np.stack(a), *ugrads["layers"])
    for a, b in zip(jax.tree.leaves(ugrads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)
    scans = [str(jax.make_jaxpr(f)(*a)).count(" scan[") for f, a in ((scanned, args),
                                                                    (unrolled, uargs))]
    assert scans == ([2, 1] if invact else [1, 0]), scans
  spec = {"stack": "dry-llama3", "policy": "none", "invact": True, "dtype": "float32",
          "unrolled": True}
  assert frontier.model_stack.row_key(spec)["configuration"] == "default unrolled"


def test_the_tokamax_head_or_its_error():
  s = frontier.STACKS["dry-llama3"]
  if frontier.model_stack.tokamax_loss() is None:
    row = frontier.child_row({"stack": "dry-llama3", "policy": "full", "invact": False,
                          "dtype": "float32", "repeats": 1, "head": "tokamax"})
    assert "tokamax" in row["error"] and row["head"] == "tokamax", row
    return
  # (tokamax 0.0.17's chunked_xla is wrong below 2048 vocabulary entries: 7.97 against 7.49
  # at 64 tokens x 64 x 1024; the dry model has 2048)
  plain, args = frontier.build(s, "full", False, np.float32)
  tok, _ = frontier.build(s, "full", False, np.float32, head="tokamax")
  np.testing.assert_allclose(jax.jit(tok)(*args), jax.jit(plain)(*args), rtol=1e-5)


def test_language_model_rows_follow_the_order_and_carry_an_earlier_runs_rows():
  """The decisive rows first (LM_ORDER), plans with their predictions, torch rows where torch
  is importable; a second run carries the first's rows over instead of measuring them."""
  policies = ["none", "full", "dots_no_batch"]
  first = frontier.rows(["dry-llama3"], dtype="float32", policies=policies, repeats=1,
                        in_process=True, torch_configurations=(), date="2026-11-26")
  keys = [(r["configuration"], r["invact"], r["head"]) for r in first]
  jax_rows = [k for k in keys if "plan" not in k[0]]
  expected = [(("default" if p == "none" else p) + (" unrolled" if u else ""), i, h)
              for p, i, h, u in (x for x in frontier.LM_ORDER if isinstance(x, frontier.JaxRow))
              if p in policies]
  assert jax_rows == expected, jax_rows
  plans = [r for r in first if "plan" in r["configuration"]]
  assert [r["configuration"] for r in plans] == [
      "program plan 10 %", "program plan 25 %", "program plan 50 %", "plan 25 %", "plan 50 %",
      "plan 75 %", "program plan 75 %"]
  for r in plans:
    if "error" not in r:
      assert r["predicted_bytes"] <= r["budget_bytes"] and r["predicted_step_ms"] > 0, r
      assert r["activation_bytes"] > 0 and "prediction_error" in r and r["date"] == "2026-11-26"
  # invact_jax.plan's rows: planned in the row's process on the model as written; on CPU the
  # activation bytes are the compiled temp, which the plan checked against its budget
  program = {r["configuration"]: r for r in plans if r["configuration"].startswith("program")}
  for name in ("program plan 10 %", "program plan 25 %"):
    assert program[name]["error"].startswith("InfeasibleBudget: memory budget"), program[name]
  for name in ("program plan 50 %", "program plan 75 %"):
    r = program[name]
    assert r["invact"] and r["plan_program"] in ("as written", "inverted"), r
    assert r["activation_bytes"] == r["plan_compiled_bytes"] <= r["budget_bytes"], r
    assert abs(r["prediction_error"]) <= 0.10 and r["planning_s"] > 0, r
    assert frontier.report.plan_note(r).startswith("invact_jax.plan of ")
  declared = frontier.Row.__annotations__.keys()
  assert all(set(r) <= declared for r in first), [set(r) - declared for r in first]
  measured = [r for r in first if "error" not in r]
  second = frontier.rows(["dry-llama3"], dtype="float32", policies=policies, repeats=1,
                         in_process=True, torch_configurations=(), date="2026-11-27", done=first)
  infeasible = [program["program plan 10 %"], program["program plan 25 %"]]
  for r in measured + infeasible:  # (the planner's "infeasible" is its answer again)
    assert any(o is r for o in second), r   # carried, not measured again
  assert all(r.get("date") != "2026-11-27" for r in second if "error" not in r)
  # rows of another batch are not carried (a later run's fit may differ): nothing is left to
  # carry, and the deadline has passed
  other = [{**r, "batch": r["batch"] + 1} for r in measured]
  third = frontier.rows(["dry-llama3"], dtype="float32", policies=policies, repeats=1,
                        in_process=True, torch_configurations=(), done=other, deadline=0.0)
  assert not any(o is r for o in third for r in other), third
  # an invact row measured with other head tiles (an earlier default) is measured again
  assert all(r["head_tiles"]["platform"] == "cpu" for r in measured if r["invact"])
  stale = [{**r, "head_tiles": None} if r["invact"] else r for r in measured]
  fourth = frontier.rows(["dry-llama3"], dtype="float32", policies=policies, repeats=1,
                         in_process=True, torch_configurations=(), done=stale, deadline=0.0)
  assert fourth and all(not r["invact"] and any(r is o for o in stale) for r in fourth), fourth


def test_the_fit_runs_apart_from_the_rows(monkeypatch):
  """A fitted stack's batch comes from :func:`frontier.child_row` (a child process on a GPU,
  so that compiling for the fit holds no device memory while the rows run), or from the
  earlier run a run continues (the one batch its measured rows share: the fit is not
  repeated); a fit that fails leaves one error row and no rows at a guessed size."""
  s = frontier.STACKS["dry-llama3"]
  assert frontier.child_row({"fit": "dry-llama3", "dtype": "float32", "field": "batch"}) == {
      "fit": s.batch}  # CPU: no limit, the stack's own
  seen = []
  real = frontier.layers_that_fit
  monkeypatch.setattr(frontier.model_stack, "FIT", {"dry-llama3": "batch"})
  monkeypatch.setattr(frontier.measurement, "layers_that_fit",
                      lambda *a, **k: seen.append((a, k)) or real(*a, **k))
  done = [{"model": "dry-llama3", "framework": "jax", "invact": False, "configuration": c,
           "head": "plain", "layers": s.layers, "batch": s.batch, "activation_bytes": 1,
           "step_ms": 1.0} for c in ("default", "dots_no_batch")]
  said = []
  rs = frontier.rows(["dry-llama3"], dtype="float32", policies=["none", "dots_no_batch"],
                     in_process=True, torch_configurations=(), done=done, deadline=0.0,
                     progress=said.append)
  assert seen == [] and rs[0] == done[0]  # (then the deadline: invert's row is not carried)
  assert said[0] == f"frontier dry-llama3: the batch that fits, {s.batch}, carried over", said
  # rows of two batches (or none measured) say nothing about today's fit: fitted again
  mixed = [done[0], {**done[1], "batch": s.batch + 1}]
  for earlier in (mixed, [{**done[0], "error": "out of memory"}]):
    seen.clear()
    frontier.rows(["dry-llama3"], dtype="float32", policies=["none"], in_process=True,
                  torch_configurations=(), done=earlier, deadline=0.0)
    assert seen == [(("dry-llama3", "float32"), {"field": "batch"})]
  monkeypatch.setattr(frontier.measurement, "layers_that_fit", lambda *a, **k: 1 / 0)
  (row,) = frontier.rows(["dry-llama3"], dtype="float32", policies=["none"], in_process=True,
                         torch_configurations=(), done=mixed, deadline=0.0)
  assert row["error"].startswith("the batch that fits: ZeroDivisionError"), row


def test_a_jax_row_process_takes_the_allocator_pool_at_start(monkeypatch):
  """Each JAX row's child preallocates (one allocator region: the regions that compiling
  took are not left behind for the step's temp to miss), whatever the parent's setting."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  calls = []
  monkeypatch.setattr(child, "run_child",
                      lambda module, spec, timeout_s, env=None: calls.append(
                          (module, spec, env)) or {"error": "not run"})
  rs = frontier.rows(["dry-llama3"], dtype="float32", policies=["none"], in_process=False,
                     torch_configurations=(), plans=False)
  assert [r["configuration"] for r in rs] == ["default", "default", "default unrolled"]
  assert len(calls) == 3 and all(m == "models.benchmarks.frontier" for m, _, _ in calls)
  assert all(env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" for _, _, env in calls), calls


def test_plans_are_calibrated_from_shapes_before_the_presets_are_measured():
  """A language model's early rows (default, full, dots_no_batch per side): each tag's bytes
  exactly from its shape, the recompute time shared by multiply-adds, the keep-everything
  step as the fixed cost."""
  s = frontier.STACKS["dry-llama3"]
  rows = [{"model": "dry-llama3", "framework": "jax", "invact": i, "configuration": c,
           "head": "invact" if i else "plain", "dtype": "bfloat16", "layers": s.layers,
           "batch": s.batch, "activation_bytes": b, "step_ms": t}
          for i in (False, True) for c, b, t in (("default", 10**6, 10.0), ("full", 10**5, 20.0),
                                                 ("dots_no_batch", 5 * 10**5, 12.0))]
  p = frontier.profile_from_rows(rows, "dry-llama3", True)
  sizes = dict(zip(p.tags, p.tag_bytes))
  assert sizes["query_proj"] == s.tokens * s.d * 2 and sizes["key_proj"] == s.tokens * s.kv_width * 2
  assert sizes["mlpwi_0"] == s.tokens * s.ff * 2
  assert p.full_cost == (20.0 - 12.0) / s.layers and abs(sum(p.tag_gain) - p.full_cost) < 1e-9
  assert p.fixed_cost == 12.0 and p.base_bytes == 10**5
  (spec,) = frontier.plan_specs(rows, "dry-llama3", dtype="bfloat16", repeats=1, budgets=(0.5,))
  assert spec["predicted_bytes"] <= 5 * 10**5 and 12.0 <= spec["predicted_step_ms"] <= 20.0, spec


def test_the_largest_batch_that_fits():
  n = frontier.layers_that_fit("dry-llama3", "float32", limit_bytes=40_000_000, field="batch",
                               most=64)
  s = frontier.STACKS["dry-llama3"]

  def need(batch):
    loss, args = frontier.build(dataclasses.replace(s, batch=batch), "none", False, np.float32)
    params = sum(a.nbytes for a in jax.tree.leaves(args[0]))
    return memory.compiled(jax.value_and_grad(loss), *args).temp + 2 * params
  assert n >= 1 and need(n) <= 0.85 * 40_000_000 < need(n + 1), (n, need(n), need(n + 1))


def test_a_row_asked_for_its_profile_says_where_its_step_goes():
  """``python -m models.benchmarks.frontier SPEC`` with ``profile``: the row and its step's
  largest XLA operations (what a GPU session reads beside a missed target)."""
  spec = {"stack": "dry-llama3", "policy": "none", "invact": True, "dtype": "float32",
          "repeats": 1, "profile": 4}
  row = child.run_child("models.benchmarks.frontier", spec, 300.0)
  assert row["configuration"] == "default" and row["step_ms"] > 0, row
  assert 1 <= len(row["profile"]) <= 4 and all(r["ms"] >= 0 for r in row["profile"]), row
  assert "profile" not in frontier.measure({**spec, "profile": 0})


def test_a_row_isolated_from_its_compile_loads_every_executable_from_the_cache():
  """On a device the allocator's peak never resets, so a row's process must not autotune: its
  step is compiled (and planned) by a first child, and the measuring child compiles nothing."""
  import math  # pylint: disable=import-outside-toplevel
  from models.benchmarks.frontier import running  # pylint: disable=import-outside-toplevel
  spec = {"stack": "dry-llama3", "policy": "full", "invact": True, "dtype": "float32",
          "repeats": 1, "head": "plain", "layers": 2, "batch": 2}
  row = running._Rows("float32", 1, False, math.inf, "", lambda _: None, isolated=True).one(spec)  # pylint: disable=protected-access
  assert row["compile_cache"]["misses"] == 0 and row["compile_cache"]["hits"] > 0, row
  direct = frontier.measure(spec)  # (in this process, compiled here)
  assert row["activation_bytes"] == direct["activation_bytes"] == direct["compiled_temp_bytes"]
  assert row["configuration"] == "full" and row["invact"] and row["step_ms"] > 0


def test_rows_known_to_report_their_compiles_peak_are_bounds_and_measured_again(monkeypatch):
  peak = {"date": "2026-11-29", "model": "llama3-1b", "configuration": "full", "invact": True,
          "head": "invact", "batch": 3, "framework": "jax", "activation_bytes": 8408260508,
          "step_ms": 527.9, "layers": 16, "memory": "device peak"}
  other = {**peak, "date": "2026-11-30"}  # measured again (isolated): a measurement
  isolated = {**peak, "compile_cache": {"hits": 35, "misses": 0}}  # (the same day)
  assert frontier.report.compile_peak(peak) and not frontier.report.compile_peak(other)
  assert not frontier.report.compile_peak(isolated)
  assert "| ≤ 8,018.7 |" in frontier.report.markdown([peak])
  assert "| 8,018.7 |" in frontier.report.markdown([other])
  # an earlier run's row so marked is measured again, not carried over
  s = frontier.STACKS["dry-llama3"]
  done = [{"model": "dry-llama3", "framework": "jax", "invact": False, "configuration": "default",
           "head": "plain", "layers": s.layers, "batch": s.batch, "activation_bytes": 1,
           "step_ms": 1.0, "date": "2026-11-29"}]

  def run():
    return frontier.rows(["dry-llama3"], dtype="float32", policies=["none"], in_process=True,
                         torch_configurations=(), done=done, deadline=0.0)
  assert run()[0] is done[0]
  monkeypatch.setattr(frontier.report, "COMPILE_PEAKS", frozenset(
      {("2026-11-29", "dry-llama3", "default", False, "plain", s.batch)}))
  assert not any(r is done[0] for r in run())
  # where that measurement fails (the deadline), the bound is kept, not an error row
  monkeypatch.setattr(frontier.running._Rows, "one",  # pylint: disable=protected-access
                      lambda self, spec: {**model_stack.row_key(spec), "error": "timed out after 6 s"})
  rows = frontier.rows(["dry-llama3"], dtype="float32", policies=["none"], in_process=True,
                       torch_configurations=(), done=done, deadline=time.time() + 600, plans=False)
  assert [r for r in rows if frontier.running.same_row(r, done[0])] == [done[0]]


def test_a_program_plan_leaves_room_for_what_the_device_peak_holds_beyond_compiled_temp():
  from models.benchmarks.frontier import planning  # pylint: disable=import-outside-toplevel
  default = {"model": "m", "framework": "jax", "configuration": "default", "invact": False,
             "activation_bytes": 1000, "compiled_temp_bytes": 900}
  spec = planning.program_plan_spec([default], "m", 25, dtype="bfloat16", repeats=1,
                                    fields={"layers": 2, "batch": 1})
  assert spec["budget_bytes"] == 250 and spec["program_budget"] == 150
  del default["compiled_temp_bytes"]  # (a row before 2026-11-29, or a CPU's: no room)
  spec = planning.program_plan_spec([default], "m", 25, dtype="bfloat16", repeats=1,
                                    fields={"layers": 2, "batch": 1})
  assert spec["budget_bytes"] == spec["program_budget"] == 250


def test_a_plan_measured_before_its_programs_default_row_gets_its_predicted_step_after():
  from models.benchmarks.frontier import planning  # pylint: disable=import-outside-toplevel
  plan = {"model": "m", "framework": "jax", "configuration": "program plan 10 %", "invact": True,
          "plan_program": "inverted", "predicted_bytes": 100, "activation_bytes": 102,
          "plan_step_flops": 120.0, "plan_recompute_flops": 20.0, "step_ms": 13.0}
  assert "predicted_step_ms" not in planning.program_plan_prediction(plan, [plan])
  inverted = {"model": "m", "framework": "jax", "configuration": "default", "invact": True,
              "activation_bytes": 300, "step_ms": 10.0}
  out = planning.with_predictions([plan, inverted])
  assert out[0]["predicted_step_ms"] == 12.0 and abs(out[0]["prediction_error"] - 0.02) < 1e-12
