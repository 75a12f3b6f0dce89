"""What ``scripts/kernel_blocks.py`` runs (the script parses the flags).

Block size x warps sweep of the compiled Pallas activation kernels on one GPU.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _median_seconds(f, *args, repeats: int) -> float:
  """The median wall time of ``f(*args)`` over ``repeats`` calls after one warm-up call."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)



def run(args: argparse.Namespace) -> int:
  """``scripts/kernel_blocks.py``'s job for its parsed command line ``args``; the exit code."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "gpu":
    print(f"error: needs a GPU (JAX backend {jax.default_backend()!r})", file=sys.stderr)
    return 2
  if args.elements % 4096:
    print("error: --elements must be a multiple of 4096", file=sys.stderr)
    return 2
  from invact_jax.ops.activations import base, pallas, registry  # pylint: disable=import-outside-toplevel
  from models.benchmarks import gpu_report  # pylint: disable=import-outside-toplevel
  n = args.elements
  report = {"meta": {**gpu_report.environment(), "elements": n, "repeats": args.repeats,
                     "command": " ".join(sys.argv)}, "rows": []}
  for dt in args.dtypes.split(","):
    dtype = jnp.dtype(dt)
    size = dtype.itemsize
    x = (jax.random.normal(jax.random.key(0), (n // 4096, 4096)) * 2).astype(dtype)
    dy = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
    copy_gbps = 2 * n * size / _median_seconds(jax.jit(lambda x: -x), x, repeats=args.repeats) / 1e9
    for name in args.activations.split(","):
      entry = registry.get(name)
      op = base.Op(entry, entry.params)
      for br in map(int, args.block_rows.split(",")):
        for nw in map(int, args.warps.split(",")):
          kb = pallas.PallasActivation(block_rows=br, num_warps=nw)
          fwd = jax.jit(lambda x, kb=kb, op=op: kb.forward(op, x))
          bwd = jax.jit(lambda y, m, dy, kb=kb, op=op: kb.backward(op, y, m, dy))
          y, m = fwd(x)
          tf = _median_seconds(fwd, x, repeats=args.repeats)
          tb = _median_seconds(bwd, y, m, dy, repeats=args.repeats)
          row = {"activation": name, "dtype": dt, "block_rows": br, "warps": nw,
                 "forward_ms": tf * 1e3, "backward_ms": tb * 1e3,
                 "forward_of_copy": n * (2 * size + 1 / 8) / tf / 1e9 / copy_gbps,
                 "backward_of_copy": n * (3 * size + 1 / 8) / tb / 1e9 / copy_gbps}
          report["rows"].append(row)
          args.out.write_text(json.dumps(report, indent=1))
          print(f"{name:9s} {dt:8s} block_rows {br:5d} warps {nw}  forward {tf * 1e3:6.3f} ms "
                f"{row['forward_of_copy']:5.0%}  backward {tb * 1e3:6.3f} ms "
                f"{row['backward_of_copy']:5.0%}", flush=True)
  return 0
