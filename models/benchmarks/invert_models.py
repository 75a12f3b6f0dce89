"""What ``scripts/invert_models.py`` runs (the script parses the flags).

The program-level conversion (``invact_jax.invert``) on third-party models: a table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
from tqdm import tqdm

from models import benchmarks
from models import third_party



def _pct(a: int, b: int) -> str:
  return f"{100.0 * (a / b - 1):+.1f} %"


def _listed(counts: dict) -> str:
  """``gelu x2, layer_norm x5`` for ``{name: count}``; ``0`` for none."""
  return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "0"


def table(rows) -> str:
  """Markdown table of :func:`third_party.compare` rows."""
  timed = any("compile_s_invert" in r for r in rows)
  head = ("| model | forward | grad error vs wider: unconverted / `invert` | kept vs "
          "unconverted | temp unconverted | `invert` | by hand | converted | recomputed | "
          "left alone |" + (" compile unconverted | `invert` |" if timed else ""))
  lines = [head, "|" + "---|" * (12 if timed else 10)]
  for r in rows:
    hand = _pct(r["temp_hand"], r["temp_unconverted"]) if "temp_hand" in r else "—"
    line = (
        f"| {r['model']} | {'identical' if r['forward_identical'] else 'DIFFERS'} | "
        f"{r['grad_error_unconverted']:.1e} / {r['grad_error_invert']:.1e} | "
        f"{100 * r['kept_invert'] / r['kept_unconverted']:.0f} % | "
        f"{r['temp_unconverted'] / 2**20:.2f} MiB | "
        f"{_pct(r['temp_invert'], r['temp_unconverted'])} | {hand} | "
        + _listed(r["converted"]) + " | "
        + _listed(collections.Counter(e[0] for e in r.get("recomputed", [])))
        + f" | {len(r['left_alone'])} |")
    if timed:
      line += (f" {r['compile_s_unconverted']:.2f} s | "
               f"{r['compile_s_invert'] / r['compile_s_unconverted']:.2f}× |")
    lines.append(line)
  return "\n".join(lines)



def run(a: argparse.Namespace) -> int:
  """``scripts/invert_models.py``'s job for its parsed command line ``a``; the exit code."""
  warnings.filterwarnings("ignore", message=".*Transformers v5.*")
  models = third_party.installed(a.models)
  rows = [third_party.compare(m, a.size, jnp.dtype(a.dtype), reference=True,
                                 fallback=a.fallback, timed=a.compile_tries)
          for m in tqdm(models, desc="models", file=sys.stderr)]
  meta = {"jax": jax.__version__, "host": benchmarks.host(), "device": jax.devices()[0].device_kind,
          "size": third_party.SIZES[a.size], "dtype": a.dtype, "fallback": a.fallback,
          "compile_tries": a.compile_tries,
          "date": datetime.date.today().isoformat()}
  print(f"JAX {meta['jax']}, {meta['device']}, (hidden, layers, heads, sequence, batch) = "
        f"{meta['size']}, {a.dtype}, {meta['date']}")
  print(table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0
