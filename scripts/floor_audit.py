"""Kept bytes per layer against the floor: a table and a JSON.

Per layer and token, in units of d elements of the compute dtype: compiled temp of the
gradient of a scanned stack (6 layers minus 2), the bytes autodiff keeps, and the floor
(invact_jax.memory.floor_audit), for hand-written Llama / GPT-2 / BERT layers unconverted and
through invact_jax.invert, and for the project's models in their configurations; then kept /
floor of third-party models' whole gradients (those whose package is installed).  See
models/experiments/floor.py.

  python scripts/floor_audit.py --json bench/floor_cpu_2026-11-25.json
  python scripts/floor_audit.py --size test --dtypes float32      # seconds
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

import invact_jax  # noqa: E402
from models.experiments import floor  # noqa: E402
from models.experiments import third_party  # noqa: E402

PROJECT_MODELS = ("vit-b16", "bert-base", "gpt2", "llama-small")
CONFIGURATIONS = ("standard", "inverted", "inverted-all")


def layer_rows(size: str, dtypes, models) -> list[dict]:
  jobs = []
  for dt in dtypes:
    for kind in floor.HAND_LAYERS:
      build = functools.partial(lambda depth, k, d: floor.hand_stack(k, depth, d, size),
                                k=kind, d=dt)
      jobs.append(({"layer": kind, "source": "hand-written", "dtype": dt,
                    "configuration": "JAX default"}, build, None, None))
      jobs.append(({"layer": kind, "source": "hand-written", "dtype": dt,
                    "configuration": "invact_jax.invert"}, build, invact_jax.invert, None))
    for model in models:
      base = functools.partial(lambda depth, m, d: floor.model_stack(m, "standard", depth, d,
                                                                     size), m=model, d=dt)
      for conf in CONFIGURATIONS:
        build = functools.partial(lambda depth, m, c, d: floor.model_stack(m, c, depth, d, size),
                                  m=model, c=conf, d=dt)
        jobs.append(({"layer": model, "source": "models/", "dtype": dt, "configuration": conf},
                     build, None, base))
  rows = []
  for meta, build, transform, floor_build in tqdm(jobs, desc="layers", file=sys.stderr):
    fig = floor.per_layer(build, transform, floor_build)
    rows.append({**meta, **fig, "ratio": fig["temp"] / fig["floor"]})
  return rows


def third_party_rows(size: str, dtypes, names) -> list[dict]:
  rows = []
  for dt in dtypes:
    for name in tqdm(names, desc=f"third-party {dt}", file=sys.stderr):
      rows.append({**floor.third_party_ratio(name, size, jnp.dtype(dt)), "dtype": dt})
  return rows


def tables(layers, models) -> str:
  out = ["| layer | source | dtype | configuration | compiled temp (d) | kept (d) | floor (d) "
         "| temp / floor |", "|---|---|---|---|---:|---:|---:|---:|"]
  for r in layers:
    out.append(f"| {r['layer']} | {r['source']} | {r['dtype']} | {r['configuration']} | "
               f"{r['temp']:.2f} | {r['kept']:.2f} | {r['floor']:.2f} | {r['ratio']:.2f} |")
  out += ["", "| third-party model | dtype | floor MiB | kept / floor, unconverted | "
          "kept / floor, invert |", "|---|---|---:|---:|---:|"]
  for r in models:
    out.append(f"| {r['model']} | {r['dtype']} | {r['floor_bytes'] / 2**20:.2f} | "
               f"{r['default']:.2f} | {r['invert']:.2f} |")
  return "\n".join(out)


def main(argv=None) -> int:
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--size", default="issue", choices=tuple(floor.SIZES),
                 help="layer sizes (d, heads, T, batch); third-party models use 'test' sizes")
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=("float32", "bfloat16"))
  p.add_argument("--models", nargs="*", default=list(PROJECT_MODELS), choices=PROJECT_MODELS)
  p.add_argument("--third-party", nargs="*", default=list(third_party.ALL_MODELS),
                 choices=third_party.ALL_MODELS)
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  warnings.filterwarnings("ignore", message=".*Transformers v5.*")
  names = third_party.installed(a.third_party)
  layers = layer_rows(a.size, a.dtypes, a.models)
  models = third_party_rows("test", a.dtypes, names)
  meta = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
          "size": dict(zip(("d", "heads", "T", "batch"), floor.SIZES[a.size])),
          "date": datetime.date.today().isoformat()}
  print(f"JAX {meta['jax']}, {meta['device']}, {meta['size']}, {meta['date']}")
  print(tables(layers, models))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "layers": layers, "third_party": models}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
