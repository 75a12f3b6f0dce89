"""The program-level conversion (``invact_jax.invert``) on third-party models: a table.

For each model (transformers' Flax BERT, GPT-2, ViT, Llama; an Equinox block; a Flax NNX
block; keras-hub's Gemma, Llama, BERT, GPT-2 and ViT; penzai's Llama, stacked Llama, Gemma,
Gemma 2 and GPT-NeoX; see models/experiments/third_party.py): is the converted forward
bit-identical, the gradient's relative L2 distance to the unconverted one, the bytes
autodiff keeps and the compiled temp memory of the gradient, unconverted / by ``invert`` /
converted by hand (where the model has a hand conversion), and what was converted.
Models whose package is not installed are skipped with a line saying so (keras-hub:
``pip install --no-deps keras-hub kagglehub``).

  python scripts/invert_models.py                     # the README's table (size "table")
  python scripts/invert_models.py --size zoo --models keras_vit penzai_gemma2 --json out.json
  python scripts/invert_models.py --size zoo --fallback temp   # temp never above the original
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from models.experiments import third_party  # noqa: E402


def _pct(a: int, b: int) -> str:
  return f"{100.0 * (a / b - 1):+.1f} %"


def _listed(counts: dict) -> str:
  """``gelu x2, layer_norm x5`` for ``{name: count}``; ``0`` for none."""
  return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "0"


def table(rows) -> str:
  """Markdown table of :func:`third_party.compare` rows."""
  head = ("| model | forward | grad error vs wider: unconverted / `invert` | kept vs "
          "unconverted | temp unconverted | `invert` | by hand | converted | recomputed | "
          "left alone |")
  lines = [head, "|" + "---|" * 10]
  for r in rows:
    hand = _pct(r["temp_hand"], r["temp_unconverted"]) if "temp_hand" in r else "—"
    lines.append(
        f"| {r['model']} | {'identical' if r['forward_identical'] else 'DIFFERS'} | "
        f"{r['grad_error_unconverted']:.1e} / {r['grad_error_invert']:.1e} | "
        f"{100 * r['kept_invert'] / r['kept_unconverted']:.0f} % | "
        f"{r['temp_unconverted'] / 2**20:.2f} MiB | "
        f"{_pct(r['temp_invert'], r['temp_unconverted'])} | {hand} | "
        + _listed(r["converted"]) + " | "
        + _listed(collections.Counter(e[0] for e in r.get("recomputed", [])))
        + f" | {len(r['left_alone'])} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--models", nargs="+", default=list(third_party.ALL_MODELS),
                 choices=third_party.ALL_MODELS)
  p.add_argument("--size", default="table", choices=tuple(third_party.SIZES))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--fallback", choices=("temp",),
                 help="invert's fallback: leave alone the sites that raise the compiled temp")
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  warnings.filterwarnings("ignore", message=".*Transformers v5.*")
  models = third_party.installed(a.models)
  rows = [third_party.compare(m, a.size, jnp.dtype(a.dtype), reference=True,
                                 fallback=a.fallback)
          for m in tqdm(models, desc="models", file=sys.stderr)]
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "size": third_party.SIZES[a.size], "dtype": a.dtype, "fallback": a.fallback,
          "date": datetime.date.today().isoformat()}
  print(f"JAX {meta['jax']}, {meta['device']}, (hidden, layers, heads, sequence, batch) = "
        f"{meta['size']}, {a.dtype}, {meta['date']}")
  print(table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
