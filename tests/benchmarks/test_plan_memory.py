"""``scripts/plan_memory.py`` and ``scripts/plan_run_shapes.py``: the tables, the plot, saved
profiles, the device-peak check, bad arguments."""
import json
import os
import pathlib
import types

import pytest

from invact_jax import memory
from models import planning, presets
from tests import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL_VIT = dict(image_size=16, patch_size=4, channels=3, num_classes=5, hidden=32, depth=2,
                 heads=4, mlp_dim=64)

def test_plan_memory_script_redraws_table_and_png(tmp_path, capsys):
  """--replot and --profiles on a committed run (bench/plan_memory_vit_ti_small.json)."""
  script = load_script("plan_memory")
  committed = json.loads((ROOT / "bench" / "plan_memory_vit_ti_small.json").read_text())
  fr = committed["results"]["vit-ti16"]
  saved = tmp_path / "frontier.json"
  saved.write_text(json.dumps({"meta": {}, "results": {"tiny-vit": fr}}))
  assert script.main(["--replot", str(saved)]) == 0
  out = capsys.readouterr().out
  assert out.count("| tiny-vit |") == len(fr["plans"])
  assert saved.with_suffix(".png").stat().st_size > 10_000
  assert script.main(["--replot", str(tmp_path / "missing.json")]) == 2
  assert "--replot: no such file" in capsys.readouterr().err
  # Beside a JSON in a directory this user cannot write (a read-only checkout): one line.
  real_access = os.access
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(os, "access", lambda p, m: False if pathlib.Path(p) == tmp_path
               else real_access(p, m))
    assert script.main(["--replot", str(saved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replot: cannot write" in err[0] and "not writable" in err[0]
    assert script.main(["--models", "gpt2", "--out", str(tmp_path / "p")]) == 2
    assert "--out: cannot write" in capsys.readouterr().err
  assert script.main(["--models", "resnet"]) == 2
  assert "unknown model" in capsys.readouterr().err
  assert script.main(["--points", "1"]) == 2
  # --profiles: from a JSON of the same models and settings, else a one-line error.
  prof = fr["profiles"][0]
  meta = {"dtype": "bfloat16", "batch": 8, "seq_len": 512, "overrides": {}}
  saved.write_text(json.dumps({"meta": meta, "results": {"vit-b16": {"profiles": [prof]}}}))
  for argv, message in [(["--batch", "4"], "was profiled with batch=8, this run has 4"),
                        (["--models", "gpt2"], "has no profile of model 'gpt2'"),
                        ([], "configurations ['standard', 'inverted-norms']")]:
    assert script.main(["--profiles", str(saved)] + argv) == 2
    assert message in capsys.readouterr().err
  saved.write_text(json.dumps({"meta": meta, "results": {"vit-b16": {"profiles": [
      {**prof, "configuration": c, "unknown_field": 1} for c in ("standard", "inverted",
                                                                 "inverted-norms")]}}}))
  assert script.main(["--profiles", str(saved)]) == 2
  assert "holds a profile this version cannot read" in capsys.readouterr().err
  assert script.main(["--profiles", str(tmp_path / "missing.json")]) == 2
  assert "--profiles: no such file" in capsys.readouterr().err


def test_device_peak_check(monkeypatch, capsys):
  """GPU-side verification: allocator peak per plan, one child process per row."""
  cfg = presets.model_config("vit-b16", **SMALL_VIT)
  if not memory.reports_peak():
    with pytest.raises(RuntimeError, match="memory_stats"):
      planning.device_peak(cfg, 2, "inverted", (("query",),))
  else:  # a GPU: the device's temporaries track the compiled figure
    got = planning.device_peak(cfg, 2, "inverted", (("query",),))
    temp = planning.measure(cfg, 2, "inverted", (("query",),)).compiled_temp_bytes
    assert abs((got["peak_increase"] - got["output_bytes"]) / temp - 1) <= 0.10, (got, temp)
  from models.benchmarks import child
  from models.benchmarks import plan_memory
  # Child: one row in, the allocator's figures out.
  monkeypatch.setattr(planning, "device_peak", lambda *a, **k: {
      "peak_bytes_in_use": 900, "peak_increase": 700, "output_bytes": 200})
  row = {"model": "gpt2", "dtype": "float32", "batch": 2, "seq_len": 8,
         "configuration": "inverted", "keep": [["query"]], "overrides": {"depth": 2}}
  child_row = plan_memory.device_peak_row(row)
  assert child_row["peak_increase"] == 700
  # Parent: runs the child, records the device temp and the prediction's error against it.
  calls = []
  def fake_child(module, spec, timeout_s):
    assert module == "models.benchmarks.plan_memory"
    calls.append(spec)
    return child_row
  monkeypatch.setattr(child, "run_child", fake_child)
  args = types.SimpleNamespace(dtype="float32", batch=2, seq_len=8)
  plan_row = {"budget": 1000, "configuration": "inverted", "keep": [["query"], []],
              "predicted_bytes": 550}
  fixed_row = {"policy": "full", "configuration": "inverted", "keep": [], "predicted_bytes": 450}
  plan_memory._add_device_peak(plan_row, "gpt2", args, {"depth": 2})  # pylint: disable=protected-access
  plan_memory._add_device_peak(fixed_row, "gpt2", args, {})  # pylint: disable=protected-access
  assert calls[0]["keep"] == [["query"], []] and calls[1]["keep"] == [[]]
  assert calls[0]["overrides"] == {"depth": 2}
  assert plan_row["device_temp_bytes"] == 500
  assert plan_row["device_prediction_error"] == pytest.approx(0.1)
  assert fixed_row["device_prediction_error"] == pytest.approx(-0.1)
  monkeypatch.setattr(child, "run_child", lambda *a: {"error": "RuntimeError: CUDA out of memory"})
  with pytest.raises(RuntimeError, match="CUDA out of memory"):
    plan_memory._add_device_peak(dict(plan_row), "gpt2", args, {})  # pylint: disable=protected-access
  # No allocator statistics on this device: a clear error, before any compiling.
  if not memory.reports_peak():
    assert load_script("plan_memory").main(["--device-peak", "--models", "gpt2"]) == 2
    assert "--device-peak needs a device" in capsys.readouterr().err


def test_plan_run_shapes_script_covers_both_orders_and_lone_layers(capsys):
  script = load_script("plan_run_shapes")
  from models.benchmarks import plan_memory
  shapes = plan_memory.shapes(6)
  assert all(sum(n for _, n in runs) == 6 for runs in shapes.values())
  assert {"Ex4+Cx2", "Cx2+Ex4", "Bx4+Cx2", "Cx2+Bx4"} <= set(shapes)  # runs of >= 2, both orders
  assert {"Ex5+A", "A+Ex5", "Bx5+C", "C+Bx5"} <= set(shapes)          # a lone layer last, first
  assert script.main(["--depth", "3"]) == 2
  assert "--depth must be at least 4" in capsys.readouterr().err
  assert script.main(["--models", "resnet"]) == 2
  assert "unknown model 'resnet'" in capsys.readouterr().err


def test_plan_memory_rejects_bad_head_modes_in_one_line(capsys):
  script = load_script("plan_memory")
  assert script.main(["--head-modes", "standard,fused", "--models", "gpt2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --head-modes:"), err

