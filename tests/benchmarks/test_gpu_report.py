"""scripts/gpu_report.py --dry-run on CPU: every section's code path runs, the JSON and the
markdown carry every figure, and the README block regenerates from it."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from models.benchmarks import gpu_report
from tests import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_report")
  done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_report.py"), "--dry-run",
                         "--sections", "kernels,models,frontier", "--out-dir", str(out)],
                        capture_output=True, text=True, check=False, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  path = next(out.glob("gpu_*.json"))
  return json.loads(path.read_text()), path


def test_dry_run_fills_every_section(dry_report):
  report, path = dry_report
  env = report["environment"]
  assert env["platform"] == "cpu" and env["versions"]["jax"]
  impls = {(r["implementation"], r["pass"]) for r in report["kernels"]}
  assert {("copy", "fwd"), ("jax.nn", "fwd+bwd"), ("xla", "bwd")} <= impls
  assert all(r["gbps"] > 0 and r["fraction_of_copy"] > 0 for r in report["kernels"])
  assert "tests" not in report  # the GPU tests run as `pytest -m gpu` (make gpu-test)
  (group,) = report["models"]
  assert set(group["peaks"]) == {"standard", "inverted-all"}
  assert group["peaks"]["inverted-all"]["compiled_temp_bytes"] < \
      group["peaks"]["standard"]["compiled_temp_bytes"]
  assert set(group["step_time_s"]) == {"standard", "inverted-all"}
  fr = report["frontier"]
  assert {r["model"] for r in fr["rows"]} == {"dry-llama3"}
  rows = [r for r in fr["rows"] if r["framework"] == "jax" and r["head"] != "tokamax"
          and not r["configuration"].startswith("plan")]
  assert {(r["configuration"], r["invact"]) for r in rows} == {
      (c, i) for c in ("default", "full") for i in (False, True)} | {("default unrolled", True)}
  assert all(r["activation_bytes"] > 0 and r["step_ms"] > 0 for r in rows), rows
  by = {(r["configuration"], r["invact"]): r["activation_bytes"] for r in rows}
  assert by[("default", True)] < by[("default", False)]   # invact keeps less
  assert by[("full", False)] < by[("default", False)]     # and so does full remat
  assert any(r["pareto"] for r in fr["rows"])
  saved = json.loads(pathlib.Path(fr["json"]).read_text())
  assert saved["rows"] == fr["rows"] and saved["device"] == env["device"]
  md = path.with_suffix(".md").read_text()
  for heading in ("**Kernels**", "**Models**", "**Frontier**"):
    assert heading in md


def _fake_children(monkeypatch, fits_up_to):
  calls = []
  monkeypatch.setattr(gpu_report, "_run_child",
                      lambda spec, t: calls.append(spec["batch"]) or {"fits": spec["batch"] <= fits_up_to})
  return calls


def test_max_batch_steps_from_a_prediction_then_bisects(monkeypatch):
  calls = _fake_children(monkeypatch, 437)
  r = gpu_report.max_batch(model="m", dtype="bfloat16", configurations=("c",), start=424,
                           max_probes=3, deadline=1e12, grow=1.08, progress=lambda m: None)["c"]
  assert calls == [424, 456, 440] and (r["largest_fitting"], r["smallest_failing"]) == (424, 440)
  calls = _fake_children(monkeypatch, 300)  # the prediction was too high: step down
  r = gpu_report.max_batch(model="m", dtype="bfloat16", configurations=("c",), start=424,
                           max_probes=6, deadline=1e12, grow=1.08, progress=lambda m: None)["c"]
  # Steps down grow (/1.08, /1.17, /1.36): bracketed by the fourth probe.
  assert calls[:4] == [424, 392, 336, 240] and r["largest_fitting"] <= 300 < r["smallest_failing"]
  calls = _fake_children(monkeypatch, 100)  # no prediction: double, then bisect to ~6 %
  r = gpu_report.max_batch(model="m", dtype="bfloat16", configurations=("c",), start=8,
                           max_probes=12, deadline=1e12, progress=lambda m: None)["c"]
  assert calls[:5] == [8, 16, 32, 64, 128]
  assert r["largest_fitting"] <= 100 < r["smallest_failing"]
  assert r["smallest_failing"] - r["largest_fitting"] <= max(8, r["largest_fitting"] // 16)


def test_resume_keeps_measured_figures():
  # A report cut short resumes: measured peaks are not measured again.
  calls = []
  old = gpu_report._run_child  # pylint: disable=protected-access
  gpu_report._run_child = lambda spec, t: calls.append(spec) or {"peak_bytes_in_use": 1}
  try:
    spec = {"model": "vit-b16", "dtype": "bfloat16", "batch": 8, "seq_len": 0}
    prev = [{**spec, "peaks": {"standard": {"peak_bytes_in_use": 5}, "inverted": {"error": "x"}},
             "step_time_s": {"standard": 0.1, "inverted": 0.1}}]
    (g,) = gpu_report.models(specs=[spec], rounds=1, deadline=1e12, progress=lambda m: None,
                             previous=prev, setups=(("standard", None), ("inverted", None)))
  finally:
    gpu_report._run_child = old  # pylint: disable=protected-access
  assert [c["configuration"] for c in calls] == ["inverted"]
  assert g["peaks"]["standard"] == {"peak_bytes_in_use": 5}


def test_docs_block_is_generated_from_the_committed_report():
  reports = gpu_report.newest_per_section((ROOT / "bench").glob("gpu_*_????-??-??.json"))
  if not reports:
    pytest.skip("no GPU report committed")
  md = "\n".join(gpu_report.markdown(json.loads(p.read_text())) for p in reports)
  readme = (ROOT / "docs" / "gpu-report.md").read_text()
  block = readme.split("<!-- gpu-report:begin -->\n", 1)[1].split("<!-- gpu-report:end -->", 1)[0]
  assert block.strip() == md.strip()


def test_docs_take_each_section_from_the_newest_report_that_has_it(tmp_path):
  def report(name, *sections):
    p = tmp_path / f"gpu_{name}.json"
    p.write_text(json.dumps({s: {"x": 1} for s in sections}))
    return p
  a1 = report("dev-a_2026-11-22", "kernels", "tests", "models")
  a2 = report("dev-a_2026-11-23", "kernels", "models")  # tests: older one still newest
  a3 = report("dev-a_2026-11-25", "frontier")
  b1 = report("dev-b_2026-11-20", "kernels")
  b2 = report("dev-b_2026-11-21", "kernels", "tests")  # covers all of b1
  got = gpu_report.newest_per_section([a1, a2, a3, b1, b2])
  assert got == [a3, a2, a1, b2], got
  # the frontier counts per model: a newer run of other stacks keeps the older one's table
  rows = lambda *ms: {"frontier": {"rows": [{"model": m} for m in ms]}}  # noqa: E731
  c1, c2, c3 = (tmp_path / f"gpu_dev-c_2026-11-2{i}.json" for i in (1, 2, 3))
  c1.write_text(json.dumps(rows("llama", "vit-l16")))
  c2.write_text(json.dumps(rows("llama")))
  c3.write_text(json.dumps(rows("llama-7b")))
  assert gpu_report.newest_per_section([c1, c2, c3]) == [c3, c2, c1]
  assert gpu_report.newest_per_device([a1, a2, a3, b1, b2]) == [a3, b2]


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
  for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "PYTHONUNBUFFERED"):
    monkeypatch.setenv(k, os.environ.get(k, ""))  # (the report sets them for its children)
  script = load_script("gpu_report")
  assert script.main(["--sections", "kernels"]) == 2
  assert "no GPU" in capsys.readouterr().err
  assert script.main(["--dry-run", "--sections", "bogus"]) == 2
  assert "--sections" in capsys.readouterr().err


def test_largest_batch_says_when_no_probe_fitted():
  # A prediction off by more than the probes could correct once read "inverted-all: 0".
  probes = [{"batch": b, "fits": False} for b in (1344, 1240, 1056)]
  assert gpu_report._largest({"largest_fitting": 0, "smallest_failing": 1056, "probes": probes}) \
      == "not found (every probe failed: 1344, 1240, 1056)"
  assert gpu_report._largest({"largest_fitting": 64, "smallest_failing": None,
                              "probes": [{"batch": 64, "fits": True}]}) == ">= 64 (no probe failed: 64)"
  assert gpu_report._largest({"largest_fitting": 1040, "smallest_failing": 1056,
                              "probes": []}) == "1040 (fails at 1056)"


def test_kernel_blocks_needs_a_gpu(tmp_path, capsys):
  assert load_script("kernel_blocks").main(["--out", str(tmp_path / "k.json")]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      "error: needs a GPU (JAX backend 'cpu')"]
  assert not (tmp_path / "k.json").exists()


def test_a_new_configuration_retimes_all_of_them_together():
  # Step times are interleaved in one process, so a configuration added to a report that
  # has the others' times measures all of them again (ratios from one process).
  calls = []
  old = gpu_report._run_child  # pylint: disable=protected-access
  gpu_report._run_child = lambda spec, t: calls.append(spec) or (
      {gpu_report.label(*s): 0.2 for s in spec["setups"]} if spec["kind"] == "times" else
      {"peak_bytes_in_use": 1})
  try:
    spec = {"model": "vit-b16", "dtype": "bfloat16", "batch": 8, "seq_len": 0}
    prev = [{**spec, "peaks": {"standard": {"peak_bytes_in_use": 5}},
             "step_time_s": {"standard": 0.1}}]
    (g,) = gpu_report.models(specs=[spec], rounds=1, deadline=1e12, progress=lambda m: None,
                             previous=prev, setups=(("standard", None), ("inverted", "pallas")))
  finally:
    gpu_report._run_child = old  # pylint: disable=protected-access
  assert [(c["kind"], c.get("configuration"), c.get("implementation")) for c in calls] == [
      ("peak", "inverted", "pallas"), ("times", None, None)]
  assert calls[1]["setups"] == [["standard", None], ["inverted", "pallas"]]
  assert g["step_time_s"] == {"standard": 0.2, "inverted (pallas)": 0.2}


def test_planner_timeout_says_where_it_was(monkeypatch, tmp_path):
  def timeout(cmd, **kw):
    raise subprocess.TimeoutExpired(cmd, kw["timeout"], stderr=b"plan: 3step [00:09, profile "
                                    b"vit-b16 inverted]\rplan: 4step [00:12, profile vit-b16 "
                                    b"inverted-norms]")
  monkeypatch.setattr(gpu_report.subprocess, "run", timeout)
  res = gpu_report.planner(tmp_path, model="vit-b16", batch=8, timeout_s=12)
  assert res["error"] == ("timed out after 12 s at: plan: 4step [00:12, profile vit-b16 "
                          "inverted-norms]")


def test_the_planner_section_runs_plan_memory_in_a_child_with_its_options(monkeypatch, tmp_path):
  from models.benchmarks import plan_memory
  seen = []
  monkeypatch.setattr(plan_memory, "run", lambda options: seen.append(options) or 2)
  row = gpu_report.measure({"kind": "planner", "options": {
      "models": "gpt2", "batch": 2, "points": 3, "out": str(tmp_path / "p"), "seq_len": 8}})
  assert row == {"returncode": 2}
  (opts,) = seen
  assert opts == plan_memory.Options(models="gpt2", batch=2, points=3, seq_len=8,
                                     out=tmp_path / "p")
  # The parent: the child's row says plan_memory's exit code; its results are read back.
  (tmp_path / "gpu_planner.json").write_text(json.dumps({"results": {"gpt2": {"x": 1}}}))
  answers = iter(['{"returncode": 0}', '{"returncode": 2}',
                  '{"error": "ValueError: bad", "kind": "planner"}'])
  monkeypatch.setattr(gpu_report.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
      cmd, 0, stdout="table\n" + next(answers) + "\n", stderr=""))
  ok = gpu_report.planner(tmp_path, model="gpt2", batch=2, timeout_s=60, seq_len=8)
  assert ok["returncode"] == 0 and ok["results"] == {"gpt2": {"x": 1}}
  assert json.loads(ok["command"].split(" ", 2)[2])["options"]["seq_len"] == 8
  assert gpu_report.planner(tmp_path, model="gpt2", batch=2, timeout_s=60)["returncode"] == 2
  bad = gpu_report.planner(tmp_path, model="gpt2", batch=2, timeout_s=60)
  assert bad["returncode"] == 1 and "ValueError: bad" in bad["tail"] and "results" not in bad
