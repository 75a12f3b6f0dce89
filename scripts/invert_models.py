"""The program-level conversion (``invact_jax.invert``) on third-party models: a table.

For each model (transformers' Flax BERT, GPT-2, ViT, Llama; an Equinox block; a Flax NNX
block; see models/experiments/third_party.py): is the converted forward bit-identical, the
gradient's relative L2 distance to the unconverted one, and the compiled temp memory of the
gradient unconverted / converted by hand / converted by ``invert``.

  python scripts/invert_models.py                     # the README's table (size "table")
  python scripts/invert_models.py --size test --models bert llama --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import jax
import jax.numpy as jnp
from tqdm import tqdm

from models.experiments import third_party


def _pct(a: int, b: int) -> str:
  return f"{100.0 * (a / b - 1):+.1f} %"


def table(rows) -> str:
  head = ("| model | forward | grad rel L2 (hand) | temp unconverted | by hand | `invert` | "
          "invert / hand | converted | left alone |")
  lines = [head, "|" + "---|" * 9]
  for r in rows:
    left = len(r["left_alone"])
    lines.append(
        f"| {r['model']} | {'identical' if r['forward_identical'] else 'DIFFERS'} | "
        f"{r['grad_rel_l2']:.1e} ({r['grad_rel_l2_hand']:.1e}) | "
        f"{r['temp_unconverted'] / 2**20:.1f} MiB | "
        f"{_pct(r['temp_hand'], r['temp_unconverted'])} | "
        f"{_pct(r['temp_invert'], r['temp_unconverted'])} | "
        f"{r['temp_invert'] / r['temp_hand']:.3f} | "
        + ", ".join(f"{k} x{v}" for k, v in sorted(r["converted"].items()))
        + f" | {left} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=list(third_party.MODELS),
                 choices=third_party.MODELS)
  p.add_argument("--size", default="table", choices=tuple(third_party.SIZES))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--json", help="also write the rows here")
  a = p.parse_args(argv)
  warnings.filterwarnings("ignore", message=".*Transformers v5.*")
  rows = [third_party.compare(m, a.size, jnp.dtype(a.dtype))
          for m in tqdm(a.models, desc="models", file=sys.stderr)]
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "size": third_party.SIZES[a.size], "dtype": a.dtype}
  print(f"JAX {meta['jax']}, {meta['device']}, (hidden, layers, heads, sequence, batch) = "
        f"{meta['size']}, {a.dtype}")
  print(table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
