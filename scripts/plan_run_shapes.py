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
from __future__ import annotations

import datetime
import json
import pathlib
import sys

SETS = {"E": (), "A": ("mlp_out",), "B": ("attn_out", "mlp_pre", "mlp_out"),
        "C": ("key", "value", "attn_out", "mlp_pre", "mlp_out")}


def shapes(depth: int) -> dict[str, list[tuple[str, int]]]:
  """Plan name -> runs [(set name, layers)] in forward order."""
  out = {f"{s}x{depth}": [(s, depth)] for s in "EBC"}
  for lone, rest in (("A", "E"), ("C", "E"), ("C", "B")):
    out[f"{rest}x{depth - 1}+{lone}"] = [(rest, depth - 1), (lone, 1)]
    out[f"{lone}+{rest}x{depth - 1}"] = [(lone, 1), (rest, depth - 1)]
  for rest, two in (("B", "C"), ("E", "C")):
    out[f"{rest}x{depth - 2}+{two}x2"] = [(rest, depth - 2), (two, 2)]
    out[f"{two}x2+{rest}x{depth - 2}"] = [(two, 2), (rest, depth - 2)]
  return out


def main(argv=None) -> int:
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--models", default="vit-ti16")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--depth", type=int, default=6)
  p.add_argument("--image-size", type=int, default=None)
  p.add_argument("--patch-size", type=int, default=None)
  p.add_argument("--seq-len", type=int, default=128, help="text models")
  p.add_argument("--out", type=pathlib.Path, default=None)
  args = p.parse_args(argv)
  if args.depth < 4:
    print("error: --depth must be at least 4 (two runs of two layers)", file=sys.stderr)
    return 2
  import jax  # pylint: disable=import-outside-toplevel
  from models.experiments import model_memory  # pylint: disable=import-outside-toplevel
  from models.experiments import plan_profiles  # pylint: disable=import-outside-toplevel
  if args.models not in model_memory.MODELS:
    print(f"error: unknown model {args.models!r}; choose from {sorted(model_memory.MODELS)}",
          file=sys.stderr)
    return 2
  extra = {k: v for k, v in (("image_size", args.image_size), ("patch_size", args.patch_size))
           if v is not None}
  cfg = model_memory.model_config(args.models, dtype=args.dtype, depth=args.depth, **extra)
  rows = []
  for name, runs in shapes(args.depth).items():
    keep = [SETS[s] for s, n in runs for _ in range(n)]
    temp = plan_profiles.compiled_temp(cfg, 8, "inverted", keep, seq_len=args.seq_len)
    nothing = rows[0]["compiled_temp_bytes"] if rows else temp  # the first plan keeps nothing
    rows.append({"plan": name, "runs": runs, "compiled_temp_bytes": temp,
                 "over_keep_nothing": temp - nothing})
    print(json.dumps(rows[-1]), flush=True)
  out = {"meta": {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
                  "platform": jax.default_backend(), "command": " ".join(sys.argv)},
         "rows": rows}
  if args.out:
    args.out.write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
