#!/usr/bin/env python3
"""invact_jax.plan on programs it was not written for: plans at four budgets beside JAX's and
MaxText's fixed remat policies (models/benchmarks/plan_program.py says what each column is).

  python scripts/plan_program.py --out bench/plan_program_cpu.json
  python scripts/plan_program.py --programs llama --layers 32   # the planning time
  python scripts/plan_program.py --device h100   # compiled for an H100, without one
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import plan_program  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--programs", type=cli.comma_list(tuple(plan_program.PROGRAMS)),
                 default=list(plan_program.PROGRAMS), help="comma list of programs")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--layers", type=cli.positive_int, default=None,
                 help="layers of every program (default: each program's)")
  p.add_argument("--out", type=cli.output_file, default=None, help="JSON output file")
  p.add_argument("--device", default=None,
                 help="compile for this target (h100, h200, v5e, ...; default: this machine)")
  args = p.parse_args(argv)
  if args.device is not None:
    from invact_jax import targets  # pylint: disable=import-outside-toplevel
    try:
      targets.resolve(args.device)
    except (ValueError, TypeError, RuntimeError) as e:
      p.error(str(e))
  return plan_program.run(args.programs, args.dtype, args.layers, args.out, args.device)


if __name__ == "__main__":
  cli.finish(main)
