#!/usr/bin/env python3
"""Training parity, shown statistically: K seeds x {standard, inverted, inverted-all} x
{float32, bfloat16} on the digits ViT and a byte-level GPT on the Python standard library.

  python scripts/parity.py                    # the full study (K = 5), resumable
  python scripts/parity.py --quick            # 2 seeds, a few steps: a test of the script

Writes <out>.json ({"runs": [...], "summary": [...], "gradients": [...], "meta": {...}}),
<out>.md (the tables) and <out>.png (training loss, mean over seeds with a min-max band).
Run directories live under --workdir; a second call reads finished runs back and continues
an interrupted one from its last checkpoint.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  # a signal from here on, the imports below included: one line saying how to continue
  cli.stop_on_signals("; run the same command again to continue the study")

from models.benchmarks import parity  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = cli.parser(__doc__)
  p.add_argument("--seeds", type=int, default=None, help="seeds per cell (K; default 5, --quick: 2)")
  p.add_argument("--tasks", type=cli.comma_list(tuple(parity.TASKS)), default=list(parity.TASKS))
  p.add_argument("--dtypes", type=cli.comma_list(parity.DTYPES), default=list(parity.DTYPES))
  p.add_argument("--configurations", type=cli.comma_list(parity.CONFIGURATIONS),
                 default=list(parity.CONFIGURATIONS))
  p.add_argument("--quick", action="store_true",
                 help="2 seeds, 8 steps, 64 held-out examples (tests the script)")
  p.add_argument("--no-gradients", action="store_true",
                 help="skip the gradient-at-initialisation comparison")
  p.add_argument("--out", type=cli.output_prefix, default=None,
                 help="output prefix (default: bench/parity, or runs/parity-quick/parity)")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="run directories (default: runs/parity, or runs/parity-quick)")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  if args.seeds is None:
    args.seeds = 2 if args.quick else 5
  if args.seeds < 1:
    p.error(f"--seeds must be at least 1, got {args.seeds}")
  if "standard" not in args.configurations:
    p.error("--configurations must include standard (the baseline of every paired difference)")
  name = "parity-quick" if args.quick else "parity"
  args.workdir = args.workdir or ROOT / "runs" / name
  args.out = args.out or (ROOT / "runs" / name / "parity" if args.quick else ROOT / "bench" / "parity")
  return parity.run(args, argv)


if __name__ == "__main__":
  cli.finish(main)
