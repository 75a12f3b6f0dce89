#!/usr/bin/env python3
"""Memory-budget planner: frontier of recompute cost vs memory, against fixed remat policies.

  python scripts/plan_memory.py                               # ViT-B/16 and GPT-2, bf16, batch 8
  python scripts/plan_memory.py --models vit-b16 --points 5 --batch 4
  python scripts/plan_memory.py --replot bench/plan_memory_gpt2.json   # redraw, no compiling
  python scripts/plan_memory.py --models gpt2 --profiles bench/plan_memory_gpt2.json  # re-plan

For each model: profiles each configuration (standard / inverted activations; see
models/planning.py), then solves the integer program (invact_jax.planner, HiGHS) at budgets
from the minimum feasible to the unconstrained peak, compiles every plan and every fixed
policy (full, save_qkv_proj, save_dot_except_mlp, minimal, nothing) with layers scanned, and
prints a table with predicted vs compiled bytes and measured recompute FLOPs.  Writes JSON and
a PNG of the frontier (default bench/plan_memory.*; the README's runs are
bench/plan_memory_vit.* and bench/plan_memory_gpt2.*).  CPU figures are XLA's compiled
temp_size_in_bytes.
"""
import sys

from models import cli
from models.benchmarks import plan_memory


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  cli.add_arguments(p, plan_memory.Options)
  return plan_memory.run(cli.from_args(plan_memory.Options, p.parse_args(argv)))


if __name__ == "__main__":
  sys.exit(main())
