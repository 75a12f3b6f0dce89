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
