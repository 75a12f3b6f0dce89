#!/usr/bin/env python3
"""Compiled memory of per-layer plans by run shape: the evidence behind the planner's runs.

  python scripts/plan_run_shapes.py --models vit-ti16 --depth 6 --image-size 32 --patch-size 8 \
      --dtype float32 --seq-len 512
  python scripts/plan_run_shapes.py --models gpt2 --depth 6 --seq-len 128 --dtype bfloat16

(bench/plan_run_shapes_{vit_ti,gpt2}.json: JAX 0.10.2; bench/plan_run_shapes_vit_ti_jax012.json:
the first command under JAX 0.12.)

Compiles the training step (configuration ``inverted``, layers scanned, batch 8) under plans made of
three sets, E = nothing, A = {mlp_out} (0 bytes), B = {attn_out, mlp_pre, mlp_out} and
C = B + {key, value}: one set everywhere, runs of two or more layers in both orders, and one
lone layer (first or last).  Prints one JSON row per plan: XLA's compiled temp bytes and their
difference to keeping nothing.  With runs of two or more layers the rows follow
``invact_jax.planner``'s phase model (e.g. C x2 then E x4 is E x6 plus two layers of C, and
C x6 minus E x4 then C x2 is four); lone layers do not (README "Memory-budget planner").
Writes ``--out`` (JSON) when given.
"""
import pathlib
import sys

from models import cli
from models.benchmarks import plan_memory


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--models", default="vit-ti16")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--depth", type=int, default=6)
  p.add_argument("--image-size", type=int, default=None)
  p.add_argument("--patch-size", type=int, default=None)
  p.add_argument("--seq-len", type=int, default=128, help="text models")
  p.add_argument("--out", type=pathlib.Path, default=None)
  args = p.parse_args(argv)
  return plan_memory.run_shapes(args)


if __name__ == "__main__":
  sys.exit(main())
