#!/usr/bin/env python3
"""The memory-budget planner's frontier on the project's models, by invact_jax.plan.

Plans at budgets from full remat's compiled temp to no remat's, beside JAX's policies and
MaxText's presets:

  python scripts/plan_memory.py                                # ViT-B/16 and GPT-2, bf16, batch 8
  python scripts/plan_memory.py --models gpt2 --seq-len 256 --points 5
  python scripts/plan_memory.py --replot bench/plan_memory.json   # redraw, no compiling

Per model (layers scanned, its blocks' tensors named): the compiled temp and recompute FLOPs
of JAX's fixed policies and of MaxText-style presets over the models' names, then
invact_jax.plan (with invact_jax.invert of the model as an operator variant, --no-convert:
without) at each budget, compiled.  Writes JSON, a markdown table and a PNG (default
bench/plan_memory.*); models/benchmarks/plan_memory.py and plan_program.py say what each
column is.  CPU figures are XLA's compiled temp_size_in_bytes.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import plan_memory  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  cli.add_arguments(p, plan_memory.Options)
  return plan_memory.run(cli.from_args(plan_memory.Options, p.parse_args(argv)))


if __name__ == "__main__":
  cli.finish(main)
