"""``scripts/plan_program.py``: its tables in docs/planner.md come from the committed JSONs,
and bad arguments are one line."""
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from invact_jax import planner
from invact_jax.planner import cost_model, layer_loop
from models.benchmarks import frontier, plan_program
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


def _gpt2(layers=4):
  """A GPT-2 written by hand with its own names (``plan_program``'s ``gpt2-hand``), small."""
  shape = frontier.Shape("gpt2", d=64, heads=2, ff=256, layers=layers, seq=64, batch=2,
                         vocab=256)
  return lambda policy: plan_program._hand_gpt2(shape, policy, jnp.float32)  # pylint: disable=protected-access


def test_a_gpt2_with_its_own_names_recomputes_less_than_every_fixed_policy():
  """The issue's GPT-2 (its names on ln1, qkv, attn, attn_out, ln2, fc1, fc2_in; q, k and v
  sliced from qkv): at the tightest of four budgets the plan recomputes at least 5 % less
  than the best of JAX's policies that fits, and no more at the others (it once kept q, k, v
  one by one — each alone spares nothing — and recomputed 1.8x dots_no_batch's)."""
  build = _gpt2()
  loss, args = build("none")
  rows = plan_program.rows_of("gpt2", lambda p: build(p)[0], args, 4, "float32",
                              ["none", "full", "dots", "dots_no_batch"], lambda m: None)
  assert "qkv" in {t["name"] for t in rows[0]["tensors"]}
  for r in rows:
    assert r["compiled_bytes"] <= r["budget"] and r["best_fixed"] is not None
    assert r["recompute_flops"] <= (r["best_fixed_recompute_flops"]
                                    + 0.01 * r["fixed"]["full"]["recompute_flops"]), r
    assert abs(r["recompute_error"]) <= 0.02, r
  assert rows[0]["recompute_flops"] <= 0.95 * rows[0]["best_fixed_recompute_flops"], rows[0]


def test_maxtext_presets_are_weighed_where_the_layer_has_their_names():
  """The frontier's Llama carries MaxText's names: the presets whose names it has are choices
  (those alike there once)."""
  shape = frontier.Shape("llama", d=64, heads=2, ff=128, layers=4, seq=32, batch=2)
  loss, args = frontier.build(shape, "none", False, jnp.float32, named=True)
  closed = jax.make_jaxpr(loss)(*args)
  loop = layer_loop.read_by_the_backward(layer_loop.find_loops(closed)[1][0])  # pylint: disable=protected-access
  choices = cost_model.fixed_choices(loop)  # pylint: disable=protected-access
  presets = {c.label: c.keep for c in choices[4:]}
  assert {"minimal", "save_qkv_proj", "save_out_proj"} <= set(presets)
  assert presets["save_qkv_proj"] == tuple(n for n in planner.MAXTEXT_PRESETS["save_qkv_proj"]
                                           if n in presets["minimal"])
  assert len({frozenset(k) for k in presets.values()}) == len(presets)
