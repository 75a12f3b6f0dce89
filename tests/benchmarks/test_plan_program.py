"""``scripts/plan_program.py``: its tables in docs/planner.md come from the committed JSONs,
and bad arguments are one line."""
import json
import pathlib

import pytest

from models.benchmarks import plan_program
from tests import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["plan_program_cpu_2026-11-29_jax0.10.json",
                                  "plan_program_cpu_32_layers_2026-11-29_jax0.10.json"])
def test_the_docs_tables_are_the_committed_rows(name):
  rows = json.loads((ROOT / "bench" / name).read_text())["rows"]
  page = (ROOT / "docs" / "planner.md").read_text()
  assert plan_program.table(rows) in page
  for r in rows:  # what the page claims of every row
    assert r["compiled_bytes"] <= r["budget"]
    assert abs(r["prediction_error"]) <= 0.047
    full = r["fixed"]["full"]["recompute_flops"]
    assert r["recompute_flops"] <= r["best_fixed_recompute_flops"] + 0.01 * full
    assert r["recompute_error"] is None or abs(r["recompute_error"]) <= 0.041, r
    if r["fraction"] == min(x["fraction"] for x in rows) and r["best_fixed"] != "none":
      assert r["recompute_flops"] <= 0.95 * r["best_fixed_recompute_flops"], r
  if "32_layers" in name:  # planning a 32-layer program: at most two compiles' time
    assert max(r["plan_seconds"] / r["compile_seconds"] for r in rows) <= 2.0


def test_bad_arguments_are_one_line(capsys):
  script = load_script("plan_program")
  with pytest.raises(SystemExit) as e:
    script.main(["--programs", "resnet"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "resnet" in err[0]
  with pytest.raises(ValueError, match="--layers: penzai-llama-stacked has the 8 layers"):
    plan_program.rows("penzai-llama-stacked", layers=4)
