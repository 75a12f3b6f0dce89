"""The LM head benchmark (issue 40): plain head, invact_jax.linear_cross_entropy, invert() of
the plain code and tokamax (where installed), memory and time side by side in one process.

  python scripts/bench_lm_head.py --json bench/lm_head_cpu_2026-11-25.json
  python scripts/bench_lm_head.py --tokens 256 --vocab 4096 --repeats 2     # seconds

See models/experiments/lm_head.py.
"""
from __future__ import annotations

import datetime
import json
import sys

import jax

from models.experiments import cli
from models.experiments import lm_head


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--tokens", type=cli.positive_int, default=2048)
  p.add_argument("--d", type=cli.positive_int, default=256)
  p.add_argument("--vocab", type=cli.positive_int, default=32768)
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=cli.positive_int, default=7)
  p.add_argument("--json", help="also write the rows here")
  a = p.parse_args(argv)
  rows = lm_head.rows(a.tokens, a.d, a.vocab, a.dtypes, a.repeats)
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "tokens": a.tokens, "d": a.d, "vocab": a.vocab, "repeats": a.repeats,
          "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
          "command": "python scripts/bench_lm_head.py " + " ".join(argv or sys.argv[1:])}
  print(f"JAX {meta['jax']}, {meta['device']}, Python {meta['python']}, N={a.tokens} "
        f"d={a.d} V={a.vocab}, median of {a.repeats}, {meta['date']}")
  print(lm_head.table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
