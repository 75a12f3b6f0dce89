#!/usr/bin/env python3
"""Block size x warps sweep of the compiled Pallas activation kernels on one GPU.

Times the forward (x -> y, packed bits) and backward (y, bits, dy -> dx) of each activation
at 2^26 elements for every ``--block-rows`` x ``--warps`` pair, and a device copy (``-x``)
as the bandwidth reference; prints one line per configuration and rewrites ``--out`` (JSON)
after each, so a run cut short keeps what it measured.

Timing: median over ``--repeats`` calls, each timed on the host around
``jax.block_until_ready``, so every figure includes one dispatch (~tens of microseconds on
an H100): compare configurations with each other, and take bandwidth figures from
``scripts/gpu_report.py`` (interleaved, ten calls per timing).  This is what chose
``pallas_kernels.elementwise.block_rows_for``'s default.

  python scripts/kernel_blocks.py --out bench/kernel_blocks.json
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import kernel_blocks  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--activations", default="gelu_tanh,gelu_erf,mish")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--block-rows", default="128,256,1024,2048", help="rows of 8 elements")
  p.add_argument("--warps", default="4,8")
  p.add_argument("--elements", type=int, default=1 << 26)
  p.add_argument("--repeats", type=int, default=40)
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "kernel_blocks.json")
  args = p.parse_args(argv)
  return kernel_blocks.run(args)


if __name__ == "__main__":
  cli.finish(main)
