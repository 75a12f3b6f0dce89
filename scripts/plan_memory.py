#!/usr/bin/env python3
"""Memory-budget planner: frontier of recompute cost vs memory, against fixed remat policies.

  python scripts/plan_memory.py                               # ViT-B/16 and GPT-2, bf16, batch 8
  python scripts/plan_memory.py --replot bench/plan_memory_gpt2.json   # redraw, no compiling

Every option: ``--help``; what it does: :mod:`models.experiments.plan_memory`.
"""
import sys

from models.experiments.plan_memory import main

if __name__ == "__main__":
  sys.exit(main())
