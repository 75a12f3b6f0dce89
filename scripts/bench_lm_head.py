"""The LM head benchmark: plain head, invact_jax.linear_cross_entropy (both gradient modes),
invert() of the plain code and tokamax (where installed), memory and time side by side in one
process, the steps timed interleaved.

  python scripts/bench_lm_head.py --json bench/lm_head_cpu_2026-11-25.json
  python scripts/bench_lm_head.py --tokens 256 --vocab 4096 --repeats 2     # seconds
  python scripts/bench_lm_head.py --tokens 8192 --d 4096 --vocab 128256 --dtypes bfloat16  # GPU
  python scripts/bench_lm_head.py ... --tiles 128x2048 512x128256 backward:1024x1024  # a sweep
  python scripts/bench_lm_head.py ... --profile 8   # where each head's time goes
  python scripts/bench_lm_head.py ... --device h100  # the temp columns for an H100, on any machine
  python scripts/bench_lm_head.py ... --skip-below 1e-6 1e-4  # the fused head's gradient filter
  python scripts/bench_lm_head.py ... --heads plain "invact_jax" --pallas-blocks 64x4 128x8

Where torch is importable, PyTorch's plain head and Liger-Kernel's fused linear cross-entropy
(on a CUDA GPU with liger-kernel) run on the same head, each in its own process.

See models/benchmarks/lm_head.py.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import lm_head  # noqa: E402


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = cli.parser(__doc__)
  p.add_argument("--tokens", type=cli.positive_int, default=2048)
  p.add_argument("--d", type=cli.positive_int, default=256)
  p.add_argument("--vocab", type=cli.positive_int, default=32768)
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=lm_head.DTYPES,
                 help="bfloat16/float32: bfloat16 hidden states, float32 master weight")
  p.add_argument("--repeats", type=cli.positive_int, default=7)
  p.add_argument("--tiles", nargs="+", type=lm_head.parse_tile, default=[],
                 metavar="[backward:]TOKENSxVOCAB",
                 help="also invact_jax with these tiles: gradients in the forward (TOKENS per "
                      "chunk, VOCAB per weight-gradient update) or, after backward:, the "
                      "recomputing backward's tiles")
  p.add_argument("--profile", type=cli.positive_int, default=0, metavar="K",
                 help="also each JAX head's K largest XLA operations per step (jax.profiler)")
  p.add_argument("--skip-below", nargs="+", type=cli.positive_float, default=[], metavar="T",
                 help="also the fused Pallas head dropping backward tiles whose gradient "
                      "entries are all below T (its gradient error; interpret mode without a "
                      "GPU)")
  p.add_argument("--heads", nargs="+", choices=lm_head.HEADS, default=None,
                 help="only these heads (default: every one that runs here)")
  p.add_argument("--pallas-blocks", nargs="+", type=lm_head.parse_block, default=[],
                 metavar="ROWSxWARPS",
                 help="also the fused Pallas head at these token blocks and warps (a sweep)")
  p.add_argument("--device", default=None,
                 help="predict the memory columns for this device without it (h100, h200, a "
                      "GpuTargetConfigProto file; docs/deviceless.md): compile only, no timing")
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  if a.device:
    from invact_jax import targets  # pylint: disable=import-outside-toplevel
    try:
      targets.resolve(a.device)
    except (ValueError, TypeError, RuntimeError) as e:
      p.error(str(e))
  return lm_head.run(a, argv)


if __name__ == "__main__":
  cli.finish(main)
