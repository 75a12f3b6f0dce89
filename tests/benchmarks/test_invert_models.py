"""scripts/invert_models.py's table (models/benchmarks/invert_models.py)."""
from models.benchmarks import invert_models


def test_the_table_shows_the_compile_times_where_the_rows_have_them():
  row = {"model": "m", "forward_identical": True, "grad_error_unconverted": 1e-7,
         "grad_error_invert": 1e-7, "kept_invert": 1, "kept_unconverted": 2,
         "temp_unconverted": 2**20, "temp_invert": 2**19, "converted": {"gelu": 1},
         "left_alone": [], "recomputed": [["gelu", "here"]]}
  plain = invert_models.table([row]).splitlines()
  assert plain[0].endswith("| left alone |") and plain[1].count("---") == 10
  assert plain[2] == ("| m | identical | 1.0e-07 / 1.0e-07 | 50 % | 1.00 MiB | -50.0 % | — | "
                      "gelu x1 | gelu x1 | 0 |")
  timed = invert_models.table([{**row, "compile_s_unconverted": 2.0,
                                "compile_s_invert": 2.5}]).splitlines()
  assert timed[0].endswith("| compile unconverted | `invert` |")
  assert timed[1].count("---") == 12 and timed[2] == plain[2] + " 2.00 s | 1.25× |"


def test_under_remat_rows_time_the_conversion_with_its_check_and_tabulate():
  """``--under-remat``: the project's model with its layers under full remat, converted (the
  body's norms, softmax and activation, after the remat check's two compiles), both temps
  and both times; the table shows them."""
  rows = invert_models.remat_rows(
      ["gpt2"], "full", "float32", 1, batch=2, seq_len=32,
      overrides=dict(vocab=128, max_len=32, hidden=32, depth=2, heads=4, mlp_dim=64))
  (r,) = rows
  assert (r["model"], r["policy"], r["layers"]) == ("gpt2", "full", 2)
  assert r["converted"] and r["temp_invert"] < r["temp_unconverted"]
  assert r["compile_s_unconverted"] > 0 and r["compile_s_invert"] > 0
  line = invert_models.remat_table(rows).splitlines()[2]
  assert line.startswith("| gpt2 | full | ") and line.endswith("× |")
