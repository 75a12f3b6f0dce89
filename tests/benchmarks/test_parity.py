"""scripts/parity.py: the byte-level text data, the paired statistics, and a --quick
study end to end (outputs, pairing by seed, resume of an interrupted run, no recomputation)."""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from models.training import data as data_lib
from models.benchmarks import parity
from models import training
from tests import load_script


def test_text_windows_split_by_file_and_targets_shift_by_one(tmp_path):
  files = []
  for i in range(10):
    f = tmp_path / f"m{i}.py"
    f.write_bytes(bytes([65 + i]) * 50)  # file i is 50 copies of one letter
    files.append(f)
  d = data_lib.load_text(seq_len=8, files=files, heldout_every=5)
  assert d.modality == "text" and d.num_classes == 256 and d.seq_len == 8
  held_out = {ord("C"), ord("H")}  # files 2 and 7 (i % 5 == 2)
  assert set(np.unique(d.x_test)) - {10} == held_out  # 10: the newline between files
  assert not held_out & set(np.unique(d.x_train))
  np.testing.assert_array_equal(d.x_train[:, 1:], d.y_train[:, :-1])
  np.testing.assert_array_equal(d.x_train[1:, 0], d.y_train[:-1, -1])  # windows are contiguous
  stdlib = data_lib.load_text(seq_len=64)
  assert stdlib.x_train.shape[0] > 10_000 and stdlib.x_test.shape == (512, 64)
  with pytest.raises(data_lib.DataError, match="seq_len"):
    data_lib.load_text(seq_len=1)
  with pytest.raises(data_lib.DataError, match="at least 10 files"):
    data_lib.load_text(files=files[:3])


def test_paired_difference_and_its_confidence_interval():
  tasks = {"digits": parity.TASKS["digits"]}
  base = [0.95, 0.96, 0.97, 0.94, 0.96]
  other = [0.955, 0.962, 0.965, 0.946, 0.958]
  runs = [{"task": "digits", "dtype": "float32", "configuration": c, "seed": s,
           "metric": "test_accuracy", "value": v}
          for c, vals in (("standard", base), ("inverted", other)) for s, v in enumerate(vals)]
  runs.append({**runs[0], "metric": "test_loss", "value": 9.0})  # another metric: ignored
  rows = {r["configuration"]: r for r in parity.summarize(runs, tasks)}
  d = (np.array(other) - np.array(base)) * 100
  hw = stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
  r = rows["inverted"]
  assert r["diff_mean"] == pytest.approx(d.mean()) and r["diff_ci95_half_width"] == pytest.approx(hw)
  assert abs(d.mean()) + hw <= 1.0 and r["equivalent"] is True
  assert rows["standard"]["mean"] == pytest.approx(np.mean(base)) and "diff_mean" not in rows["standard"]
  # Standard in bfloat16 pairs with standard in float32 (the control for a change of rounding).
  bf16 = [dict(r, dtype="bfloat16", value=r["value"] + 0.01) for r in runs
          if r["configuration"] == "standard" and r["metric"] == "test_accuracy"]
  control = [r for r in parity.summarize(runs + bf16, tasks) if r["dtype"] == "bfloat16"]
  assert len(control) == 1 and control[0]["against"] == "standard (float32)"
  assert control[0]["diff_mean"] == pytest.approx(1.0) and control[0]["diff_ci95_half_width"] < 1e-9
  # A 2-point drop on every seed is not equivalent; the table says so.
  worse = [dict(r, value=r["value"] - 0.02) if r["configuration"] == "inverted" else r for r in runs]
  rows = {r["configuration"]: r for r in parity.summarize(worse, tasks)}
  assert rows["inverted"]["equivalent"] is False
  assert "**no**" in parity.table(list(rows.values()), tasks)


def test_quick_study_end_to_end_resumes_and_never_recomputes(tmp_path):
  script = load_script("parity")
  work, out = tmp_path / "runs", tmp_path / "out" / "parity"
  # One task (the digits job runs through the same code; tests/training/test_training.py
  # covers its training), one dtype, two configurations: the script's paths at CI cost.
  argv = ["--quick", "--tasks", "text", "--dtypes", "bfloat16",
          "--configurations", "standard,inverted-all",
          "--workdir", str(work), "--out", str(out), "--no-progress"]
  # An interrupted run: text, inverted-all, seed 1 stopped at its checkpoint half-way.
  text = parity.quick(parity.TASKS["text"])
  assert text.load(1).x_test.shape == (parity.QUICK_HELDOUT, 64)
  cut = parity.run_dir(work, "text", "bfloat16", "inverted-all", 1)
  cfg = dataclasses.replace(text.config, dtype="bfloat16", seed=1, configuration="inverted-all")
  training.train(cfg, text.load(1), cut, progress=False, stop_after=parity.QUICK_STEPS // 2)
  assert script.main(argv) == 0
  report = json.loads(out.with_suffix(".json").read_text())
  runs = report["runs"]
  assert len(runs) == 2 * 2 * 2  # configurations x seeds x metrics
  assert set(runs[0]) == {"task", "dtype", "configuration", "seed", "metric", "value",
                          "higher_is_better", "steps", "wall_s"}
  assert all(r["steps"] == parity.QUICK_STEPS and math.isfinite(r["value"]) for r in runs)
  assert json.loads((cut / "parity_run.json").read_text())["resumed"] is True
  diffs = [r for r in report["summary"] if r["configuration"] == "inverted-all"]
  assert len(diffs) == 1 and all(r["paired_seeds"] == 2 and r["diff_ci95_half_width"] is not None
                                 for r in diffs)
  # Gradients at init: inverted-all vs standard in bf16 is within bf16's own rounding noise
  # (standard bf16 vs standard f32), measured at rel. L2 1.0e-2 vs 1.2e-2.
  grads = {(g["configuration"], g["compared_dtype"]): g for g in report["gradients"]}
  ours, noise = grads[("inverted-all", "bfloat16")], grads[("standard", "float32")]
  assert ours["rel_l2"] < noise["rel_l2"] and ours["cosine"] > 0.999
  assert report["meta"]["seeds"] == 2 and report["meta"]["quick"] is True
  assert out.with_suffix(".png").stat().st_size > 10_000
  assert "paired diff [95 % CI]" in out.with_suffix(".md").read_text()
  # A second call recomputes nothing.
  stamps = {p: p.stat().st_mtime_ns for p in work.rglob("parity_run.json")}
  assert len(stamps) == 4
  assert script.main(argv + ["--no-gradients"]) == 0
  assert {p: p.stat().st_mtime_ns for p in work.rglob("parity_run.json")} == stamps
  # A run directory written with other options is refused, naming it.
  saved = json.loads((cut / "parity_run.json").read_text())
  saved["config"]["lr"] = 1.0
  (cut / "parity_run.json").write_text(json.dumps(saved))
  assert script.main(argv + ["--no-gradients"]) == 2


def test_study_compiles_once_per_cell_through_a_cache_in_the_workdir(tmp_path):
  """Every seed of a cell compiles the same steps: scripts/parity.py keeps JAX's persistent
  compilation cache in the workdir, unless the user set one (as the suite does)."""
  code = ("import sys, pathlib, jax; "
          "from models.benchmarks import parity; parity.compilation_cache(pathlib.Path(sys.argv[1])); "
          "print(jax.config.jax_compilation_cache_dir)")
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  for extra, want in (({}, str(tmp_path / "xla_cache")), ({"JAX_COMPILATION_CACHE_DIR": "/x"}, "/x")):
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**env, **extra},
                         cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want, out.stderr[-2000:]
