"""The LM head benchmark: plain head, invact_jax.linear_cross_entropy (both gradient modes),
invert() of the plain code and tokamax (where installed), memory and time side by side in one
process, the steps timed interleaved.

  python scripts/bench_lm_head.py --json bench/lm_head_cpu_2026-11-25.json
  python scripts/bench_lm_head.py --tokens 256 --vocab 4096 --repeats 2     # seconds
  python scripts/bench_lm_head.py --tokens 8192 --d 4096 --vocab 128256 --dtypes bfloat16  # GPU
  python scripts/bench_lm_head.py ... --tiles 128x2048 512x128256 backward:1024x1024  # a sweep

Where torch is importable, PyTorch's plain head and Liger-Kernel's fused linear cross-entropy
(on a CUDA GPU with liger-kernel) run on the same head, each in its own process.

See models/experiments/lm_head.py.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

# PyTorch's rows (where torch is importable) run in child processes on the same device.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # pylint: disable=wrong-import-position

from models.experiments import cli  # pylint: disable=wrong-import-position
from models.experiments import lm_head  # pylint: disable=wrong-import-position


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--tokens", type=cli.positive_int, default=2048)
  p.add_argument("--d", type=cli.positive_int, default=256)
  p.add_argument("--vocab", type=cli.positive_int, default=32768)
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=("float32", "bfloat16"))
  p.add_argument("--repeats", type=cli.positive_int, default=7)
  p.add_argument("--tiles", nargs="+", type=lm_head.parse_tile, default=[],
                 metavar="[backward:]TOKENSxVOCAB",
                 help="also invact_jax with these tiles: gradients in the forward (TOKENS per "
                      "chunk, VOCAB per weight-gradient update) or, after backward:, the "
                      "recomputing backward's tiles")
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  why = lm_head.too_large(a.tokens, a.d, a.vocab)
  if why:
    print(f"error: --tokens/--d/--vocab: {why}", file=sys.stderr)
    return 2
  rows = lm_head.rows(a.tokens, a.d, a.vocab, a.dtypes, a.repeats, tiles=a.tiles)
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
