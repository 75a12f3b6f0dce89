"""models.benchmarks.step_profile: a language model's step profiled per kernel, its JSON, the
frontier seeded with its rows, and docs/profile.md generated from the committed JSON."""
import gzip
import json
import pathlib
import subprocess
import sys

import pytest

from models.benchmarks import step_profile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _event(op, kernel, ts, dur):
  return {"ph": "X", "pid": 2, "tid": 1, "ts": ts, "dur": dur, "name": kernel,
          "args": {"hlo_op": op, "hlo_module": "jit_lm_loss"}}


def _data(tmp_path):
  raw = tmp_path / "profile_gpu-x_2026-11-29"
  raw.mkdir()
  trace = {"traceEvents": [{"ph": "M", "pid": 2, "name": "process_name",
                            "args": {"name": "/device:GPU:0"}}]
           + [_event("command_buffer_1", "nvjet_gemm", 10 * i, 5) for i in range(2)]
           + [_event("command_buffer_1", "wrapped_convert_1", 100, 300)]}
  with gzip.open(raw / "trace_jax-default-invact.json.gz", "wt") as f:
    json.dump(trace, f)
  rows = [{"model": "m", "framework": "jax", "configuration": "default", "invact": True,
           "step_ms": 20.0, "activation_bytes": 2**30, "raw": "jax-default-invact",
           "profile": [{"op": "command_buffer_1", "ms": 99.0, "calls": 1.0}]},
          {"model": "m", "framework": "torch", "configuration": "liger", "invact": False,
           "step_ms": 18.0, "activation_bytes": 2**31, "raw": "torch-liger", "torch": "2.11",
           "profile": [{"kernel": "nvjet_gemm", "ms": 4.0, "calls": 4.0, "head": False},
                       {"kernel": "liger_cross_entropy_kernel", "ms": 1.0, "calls": 2.0,
                        "head": True}]}]
  data = {"environment": {"device": "GPU X", "date": "2026-11-29", "driver": "1",
                          "versions": {"jax": "0.11.2"}},
          "model": "m", "layers": 2, "batch": 1, "rows": rows}
  path = tmp_path / "profile_gpu-x_2026-11-29.json"
  path.write_text(json.dumps(data))
  return path


def test_jax_rows_are_recomputed_from_their_traces_and_tabled_by_kind(tmp_path):
  path = _data(tmp_path)
  assert step_profile.from_traces(path) == 1  # the torch row has no JAX trace
  data = json.loads(path.read_text())
  jax_row = data["rows"][0]
  assert [(k["kernel"], k["ms"], k["calls"]) for k in jax_row["profile"]] == [
      ("wrapped_convert_1", 0.3, 1.0), ("nvjet_gemm", 0.01, 2.0)]
  text = step_profile.markdown(data, "bench/p.json")
  assert "| ms per step | invert, default | PyTorch + Liger |" in text
  assert "| matmuls, in the layers | 0.0 | 4.0 |" in text  # 2 calls of 2 layers: in them
  assert "| matmuls, outside them (head, embedding, loss) | 0.0 | 0.0 |" in text
  assert "| copies and casts, outside them (head, embedding, loss) | 0.3 | 0.0 |" in text
  assert "| elementwise and norms, outside them (head, embedding, loss) | 0.0 | 1.0 |" in text
  assert "GPU X" in text and "torch 2.11" in text and "`bench/p.json`" in text
  page = f"intro\n<!-- profile: {path.relative_to(tmp_path)} -->\nold\n<!-- end -->\ntail\n"
  out = step_profile.render_docs(page, tmp_path)
  assert out.startswith("intro\n<!-- profile: ") and out.endswith("<!-- end -->\ntail\n")
  assert "old" not in out and step_profile.render_docs(out, tmp_path) == out


def test_the_frontier_is_seeded_with_the_rows_and_the_batch_comes_from_the_prediction(tmp_path):
  """The profiled rows go into the day's frontier JSON, replacing rows of the same key; a new
  day's file starts from the device's newest one (nothing measured earlier is lost)."""
  row = {"model": "m", "framework": "jax", "configuration": "default", "invact": True,
         "head": "invact", "batch": 3}
  rows = [{**row, "step_ms": 2.0, "profile": [1], "raw": "x"},
          {"model": "m", "framework": "torch", "error": "no GPU"}]
  path = step_profile.seed_frontier(tmp_path, "NVIDIA H200", "2026-11-29", {"jax": "0.11.2"}, rows)
  assert path.name == "frontier_nvidia-h200_2026-11-29.json"
  seeded = json.loads(path.read_text())
  assert seeded["rows"] == [{**row, "step_ms": 2.0}] and not seeded["dry"]
  other = {**row, "configuration": "full", "step_ms": 5.0}
  seeded["rows"].append(other)
  path.write_text(json.dumps(seeded))
  again = [{**row, "step_ms": 1.0}]
  later = step_profile.seed_frontier(tmp_path, "NVIDIA H200", "2026-12-01", {}, again)
  assert json.loads(later.read_text())["rows"] == [other, {**row, "step_ms": 1.0}]
  assert json.loads(path.read_text())["rows"] == [{**row, "step_ms": 2.0}, other]  # untouched
  step_profile.seed_frontier(tmp_path, "NVIDIA H200", "2026-12-01", {}, [{**row, "step_ms": 0.5}])
  assert json.loads(later.read_text())["rows"] == [other, {**row, "step_ms": 0.5}]
  assert step_profile.batch_predicted(tmp_path, "NVIDIA H200", "m") is None
  (tmp_path / "frontier_deviceless_h200_2026-11-28.json").write_text(json.dumps({
      "device_kind": "NVIDIA H200", "rows": [
          {"model": "m", "batch": 3}, {"model": "m", "batch": 3}, {"model": "n", "batch": 1}]}))
  (tmp_path / "frontier_deviceless_h100_2026-11-29.json").write_text(json.dumps({
      "device_kind": "NVIDIA H100 80GB HBM3", "rows": [{"model": "m", "batch": 2}]}))
  assert step_profile.batch_predicted(tmp_path, "NVIDIA H200", "m") == 3
  assert step_profile.batch_predicted(tmp_path, "NVIDIA H100 80GB HBM3", "m") == 2
  assert step_profile.batch_predicted(ROOT / "bench", "NVIDIA H200", "llama3-1b") == 3


def test_docs_profile_is_generated_from_the_committed_json():
  page = (ROOT / "docs" / "profile.md").read_text()
  assert "<!-- profile: bench/" in page
  assert page == step_profile.render_docs(page, ROOT), "python scripts/profile_step.py --docs"


@pytest.mark.parametrize("args, message", [
    (["--stack", "vit-l16"], "--stack: a language model"),
    (["--from-traces", "no/such.json"], "--from-traces: no such file")])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_step.py"), *args],
                       capture_output=True, text=True, check=False, timeout=120)
  assert out.returncode == 2 and message in out.stderr and len(out.stderr.splitlines()) == 1, out


def test_rows_past_the_deadline_are_keyed_as_the_frontiers(tmp_path):
  """Each profiled row (:data:`step_profile.ROWS`) carries the frontier's key for its kind, the
  unrolled one included, so that it replaces the frontier's row of the same key."""
  rows = step_profile.rows("dry-llama3", {"layers": 2, "batch": 2}, tmp_path, deadline=0.0)
  assert [(r["framework"], r["configuration"], r["invact"], r["error"]) for r in rows] == [
      ("jax", "default", True, "out of time"), ("jax", "default unrolled", True, "out of time"),
      ("jax", "dots_no_batch", False, "out of time"), ("torch", "liger", False, "out of time")]
  assert all(r["model"] == "dry-llama3" for r in rows)
