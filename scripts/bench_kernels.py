#!/usr/bin/env python3
"""Kernel timing: forward, backward, fwd+bwd times and GB/s, jax.nn vs invact_jax backends.

  python scripts/bench_kernels.py                                  # 2^20..2^28, f32 + bf16
  python scripts/bench_kernels.py --min-log2 20 --max-log2 22 --implementations xla
  python scripts/bench_kernels.py --cost     # HLO ops of fwd+bwd and time vs jax.nn
  python scripts/bench_kernels.py --cost-split --activations silu --dtypes bfloat16
                                             # where that time goes (each pass; backward parts)

On a GPU this compares the XLA path, the Pallas kernels and jax.nn against the device copy
bandwidth; without one, Pallas runs in interpret mode (correctness only, its timings mean
nothing) and is left out unless named.  Prints a markdown table and writes JSON
(default bench/kernels.json) with the device, JAX version and date.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import op_speed  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--activations", default="gelu_tanh,gelu_erf,silu")
  p.add_argument("--min-log2", type=int, default=20)
  p.add_argument("--max-log2", type=int, default=28)
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--implementations", default=None,
                 help="comma list of xla,pallas (default: xla, plus pallas on a GPU)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--inner", type=int, default=None,
                 help="calls per timed round (default 10 on a GPU, 1 elsewhere)")
  report = p.add_mutually_exclusive_group()
  report.add_argument("--cost", action="store_true",
                      help="instead: per activation x dtype, HLO ops of the fused forward+backward "
                      "and its time vs jax.nn (interleaved medians, --elements); writes "
                      "bench/activation_cost.{json,md}")
  report.add_argument("--cost-split", action="store_true",
                      help="instead: per non-monotone activation x dtype, the time of each pass alone "
                      "and of the backward with its bit unpacking, log, square roots or division "
                      "replaced by free stand-ins; writes bench/activation_cost_split.{json,md}")
  p.add_argument("--elements", type=int, default=1 << 23,
                 help="--cost, --cost-split: elements per call")
  p.add_argument("--out", type=pathlib.Path, default=None,
                 help="JSON path (default bench/kernels.json, bench/activation_cost.json or "
                 "bench/activation_cost_split.json)")
  args = p.parse_args(argv)
  return op_speed.benchmark(args)


if __name__ == "__main__":
  cli.finish(main)
