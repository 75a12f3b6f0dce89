"""What ``scripts/invert_models.py`` runs (the script parses the flags).

The program-level conversion (``invact_jax.invert``) on third-party models: a table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
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


#: The project's models :func:`remat_rows` converts (bfloat16 or float32, batch 8, GPT-2 at
#: 256 tokens, ViT-B/16 at 224 px: docs/planner.md's programs).
REMAT_MODELS = ("gpt2", "vit-b16")


def remat_rows(models, policy: str, dtype: str, tries: int, *, batch: int = 8,
               seq_len: int = 256, overrides: dict | None = None) -> list[dict]:
  """``invert`` of the project's ``models`` (configurations changed by ``overrides``) with
  their scanned layers under the ``jax.checkpoint`` ``policy``: the gradient's compiled temp
  and the median seconds (of ``tries``) from the loss to it, as written and through
  ``invert`` (its remat check's two compiles of one layer included), with what it converted
  and left alone."""
  import invact_jax  # pylint: disable=import-outside-toplevel
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  from models.benchmarks import plan_memory  # pylint: disable=import-outside-toplevel
  rows = []
  for model in tqdm(models, desc="models", file=sys.stderr):
    build, args, depth, _ = plan_memory.program(model, dtype=dtype, batch=batch,
                                                seq_len=seq_len, overrides=overrides or {})
    loss = build(policy)
    inv = invact_jax.invert(loss)
    row = {"model": model, "policy": policy, "layers": depth,
           "temp_unconverted": memory.compiled(jax.value_and_grad(loss), *args).temp,
           "temp_invert": memory.compiled(jax.value_and_grad(inv), *args).temp,
           "converted": inv.last_report.replaced,
           "left_alone": [list(x) for x in inv.last_report.left_alone]}
    row["compile_s_unconverted"], row["compile_s_invert"] = third_party.compile_seconds(
        loss, lambda: invact_jax.invert(loss), args, tries)  # pylint: disable=cell-var-from-loop
    rows.append(row)
  return rows


def remat_table(rows) -> str:
  """Markdown table of :func:`remat_rows` rows."""
  lines = ["| model | layers under | temp as written | `invert` | converted | left alone | "
           "compile as written | `invert` |", "|" + "---|" * 8]
  for r in rows:
    lines.append(f"| {r['model']} | {r['policy']} | {r['temp_unconverted'] / 2**20:.2f} MiB | "
                 f"{_pct(r['temp_invert'], r['temp_unconverted'])} | {_listed(r['converted'])} | "
                 f"{len(r['left_alone'])} | {r['compile_s_unconverted']:.2f} s | "
                 f"{r['compile_s_invert'] / r['compile_s_unconverted']:.2f}× |")
  return "\n".join(lines)


def _meta(a: argparse.Namespace, **more) -> dict:
  return {"jax": jax.__version__, "host": benchmarks.host(),
          "device": jax.devices()[0].device_kind, "dtype": a.dtype,
          "compile_tries": a.compile_tries, "date": datetime.date.today().isoformat(), **more}


def run(a: argparse.Namespace) -> int:
  """``scripts/invert_models.py``'s job for its parsed command line ``a``; the exit code."""
  if a.under_remat:
    rows = remat_rows(REMAT_MODELS, a.under_remat, a.dtype, max(a.compile_tries, 1))
    meta = _meta(a, batch=8, seq_len=256)
    head, text = f"({meta['host']}), {a.dtype}, batch 8", remat_table(rows)
  else:
    warnings.filterwarnings("ignore", message=".*Transformers v5.*")
    rows = [third_party.compare(m, a.size, jnp.dtype(a.dtype), reference=True,
                                fallback=a.fallback, timed=a.compile_tries)
            for m in tqdm(third_party.installed(a.models), desc="models", file=sys.stderr)]
    meta = _meta(a, size=third_party.SIZES[a.size], fallback=a.fallback)
    head = f"(hidden, layers, heads, sequence, batch) = {meta['size']}, {a.dtype}"
    text = table(rows)
  print(f"JAX {meta['jax']}, {meta['device']}, {head}, {meta['date']}")
  print(text)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return 0
