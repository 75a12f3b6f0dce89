#!/usr/bin/env python3
"""The frontier's memory predicted on any machine: every llama3-1b and llama3-8b JAX row
compiled for the device without it (models/benchmarks/frontier_deviceless.py says what each
row is).

  python scripts/frontier_deviceless.py --device h100        # bench/frontier_deviceless_h100_<date>.json
  python scripts/frontier_deviceless.py --device h200 --stacks llama3-1b
  python scripts/frontier_deviceless.py --device h100x8 --fsdp   # llama3-8b, FSDP over 8 H100s
  python scripts/frontier_deviceless.py --docs               # docs/deviceless.md's tables
"""
import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import frontier, frontier_deviceless  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--device", default="h100",
                 help="the target: h100, h200, h100x8, a GpuTargetConfigProto file (default: h100)")
  p.add_argument("--stacks", type=cli.comma_list(tuple(frontier.STACKS)),
                 default=list(frontier_deviceless.STACKS), help="comma list of models")
  p.add_argument("--no-plans", action="store_true", help="leave out invact_jax.plan's rows")
  p.add_argument("--fsdp", action="store_true",
                 help="the scale-out simulation instead: llama3-8b, 32 layers, FSDP over the "
                      "target's devices, one 4096-token sequence per device")
  p.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench")
  p.add_argument("--docs", action="store_true",
                 help="regenerate docs/deviceless.md's tables from the committed JSONs and exit")
  args = p.parse_args(argv)
  if args.docs:
    return frontier_deviceless.write_docs(ROOT / "bench", ROOT / "docs" / "deviceless.md")
  # tokamax logs a warning per compile that its autotuning cache has no entry for the CPU
  logging.getLogger("absl").setLevel(logging.ERROR)
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  try:
    targets.resolve(args.device)
  except (ValueError, TypeError, RuntimeError) as e:
    p.error(str(e))
  progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
  if args.fsdp:
    path = frontier_deviceless.run_fsdp(args.out_dir, args.device, progress=progress)
  else:
    path = frontier_deviceless.run(args.out_dir, args.device, stacks=args.stacks,
                                   plans=not args.no_plans, progress=progress)
  print(path)
  return 0


if __name__ == "__main__":
  cli.finish(main)
