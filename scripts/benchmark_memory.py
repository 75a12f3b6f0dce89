#!/usr/bin/env python3
"""Memory comparison: residual bytes, compiled temp bytes, device peak and step time.

  python scripts/benchmark_memory.py                           # ViT-B/16, BERT-base, GPT-2, Llama
  python scripts/benchmark_memory.py --models vit-b16 --dtypes bfloat16 --batches 8 --time 3

Prints a markdown table, writes JSON and a bar chart PNG (default: bench/memory.*).
Compiled figures are XLA's static analysis with layers under ``lax.scan`` (``--unrolled``
for unrolled layers, which XLA:CPU fuses and reorders, so those can mislead on CPU).
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models import options  # noqa: E402
from models.benchmarks import model_memory  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--models", default="vit-b16,bert-base,gpt2,llama-small")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--batches", default="8")
  p.add_argument("--seq-len", type=cli.positive_int, default=512, help="text models")
  p.add_argument("--activations", default="preset",
                 help="comma list of registry activations to sweep (e.g. gelu_tanh,gelu_erf,silu) or "
                      "'preset'")
  p.add_argument("--configurations", default="standard,checkpointed,inverted,inverted-all",
                 help=f"comma list of {', '.join(options.CONFIGURATIONS)}")
  p.add_argument("--dropout", type=float, default=None,
                 help="override the presets' dropout rate (e.g. 0.1)")
  p.add_argument("--unrolled", action="store_true", help="unrolled layers instead of lax.scan")
  p.add_argument("--time", type=cli.nonnegative_int, default=0,
                 help="timed steps per row (0: no timing)")
  p.add_argument("--out", type=cli.output_file, default=ROOT / "bench" / "memory",
                 help="path prefix of the .json, .md and .png written")
  args = p.parse_args(argv)
  return model_memory.run(args)


if __name__ == "__main__":
  cli.finish(main)
