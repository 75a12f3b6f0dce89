"""``scripts/plan_memory.py``: the project's models planned by ``invact_jax.plan`` (the one
planner path) beside JAX's policies and MaxText's presets over the models' names; its JSON,
table and plot, the redraw, and bad arguments."""
import json
import os
import pathlib

import pytest

from tests import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_VIT = ["--models", "vit-ti16", "--depth", "4", "--image-size", "16", "--patch-size", "4",
            "--dtype", "float32", "--batch", "4", "--points", "3", "--no-convert"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("plan_memory") / "tiny_jax0.10"  # a prefix, dots and all
  assert load_script("plan_memory").main(TINY_VIT + ["--out", str(out)]) == 0
  return out, json.loads(_beside(out, ".json").read_text())


def _beside(prefix: pathlib.Path, ext: str) -> pathlib.Path:
  return prefix.with_name(prefix.name + ext)


def test_plans_of_a_project_model_fit_and_recompute_no_more_than_any_policy_that_fits(tiny_run):
  out, saved = tiny_run
  rows = saved["results"]["vit-ti16"]
  assert len(rows) == 3 and saved["meta"]["convert"] is False
  fixed = rows[0]["fixed"]
  assert set(fixed) == {"none", "full", "dots", "dots_no_batch", "save_qkv_proj",
                        "save_dot_except_mlp", "minimal"}
  # The budgets span full remat's compiled temp to no remat's; presets keep what they name.
  assert rows[0]["budget"] == fixed["full"]["compiled_bytes"]
  assert rows[-1]["budget"] == fixed["none"]["compiled_bytes"]
  assert (fixed["full"]["compiled_bytes"] < fixed["save_qkv_proj"]["compiled_bytes"]
          < fixed["minimal"]["compiled_bytes"])
  # Candidates: the model's own names (readable), and matmuls it leaves unnamed (the
  # attention scores) named automatically.
  by = {t["name"]: t["named_by"] for t in rows[0]["tensors"]}
  assert all(by.get(n) == "program" for n in ("query", "key", "value", "attn_out", "mlp_pre"))
  assert all(w == "program" or n.startswith("matmul_") for n, w in by.items()), by
  # (convert=True, the script's default, plans invert() of the model too: its choice is
  # tests/planner/test_api.py's; here the project's models' own path, at CI cost.)
  assert all(r["configuration"] == "as written" for r in rows)
  # no recompute where it fits: the program as written, or its layer without remat
  assert rows[-1]["as_written"] or rows[-1]["policy"] == "none", rows[-1]
  assert rows[-1]["recompute_flops"] <= 1e-6 * fixed["full"]["recompute_flops"]
  for r in rows:
    assert r["compiled_bytes"] <= r["budget"], r
    assert abs(r["prediction_error"]) <= 0.10, r
    if r["best_fixed_recompute_flops"] is not None:
      assert r["recompute_flops"] <= r["best_fixed_recompute_flops"] * 1.001 + 1e6, r
  # The table, the markdown and the plot.
  md = _beside(out, ".md").read_text()
  assert md.count("| vit-ti16 | 4 |") == 3
  assert _beside(out, ".png").stat().st_size > 10_000


def test_replot_redraws_without_compiling_and_bad_arguments_are_one_line(tiny_run, tmp_path,
                                                                         capsys):
  script = load_script("plan_memory")
  out, saved = tiny_run
  copy = tmp_path / "copy.json"
  copy.write_text(json.dumps(saved))
  capsys.readouterr()
  assert script.main(["--replot", str(copy)]) == 0
  assert capsys.readouterr().out.count("| vit-ti16 |") == 3
  assert copy.with_suffix(".png").stat().st_size > 10_000
  for argv, message in [(["--replot", str(tmp_path / "missing.json")], "--replot: no such file"),
                        (["--models", "resnet"], "unknown model 'resnet'"),
                        (["--points", "1"], "--points must be at least 2")]:
    assert script.main(argv + ["--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
  copy.write_text("{}")
  assert script.main(["--replot", str(copy)]) == 2
  assert "is not a complete JSON written by this script" in capsys.readouterr().err
  # Beside a JSON in a directory this user cannot write (a read-only checkout): one line.
  real_access = os.access
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(os, "access", lambda p, m: False if pathlib.Path(p) == tmp_path
               else real_access(p, m))
    copy.write_text(json.dumps(saved))
    assert script.main(["--replot", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replot: cannot write" in err[0], err
    assert script.main(["--models", "gpt2", "--out", str(tmp_path / "p")]) == 2
    assert "--out: cannot write" in capsys.readouterr().err


def test_the_docs_table_is_the_committed_run():
  from models.benchmarks import plan_program  # pylint: disable=import-outside-toplevel
  saved = json.loads((ROOT / "bench" / "plan_memory_cpu_2026-11-29_jax0.10.json").read_text())
  rows = [r for rs in saved["results"].values() for r in rs]
  assert plan_program.table(rows) in (ROOT / "docs" / "planner.md").read_text()
  for r in rows:  # what the page claims of every row
    assert r["compiled_bytes"] <= r["budget"] and abs(r["prediction_error"]) <= 0.10
    assert r["recompute_flops"] <= r["best_fixed_recompute_flops"] * 1.001 + 1e6
