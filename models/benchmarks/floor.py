"""Kept bytes per layer against the floor: hand-written layers, the project's
models and third-party models.

The floor (:func:`invact_jax.floor_audit`) is the least a layer's backward must keep
without recomputing a matmul.  Figures per layer and token are in units of ``d`` elements of
the compute dtype (``d`` = the hidden width): the compiled temp of the gradient of a scanned
stack of 6 layers minus that of 2, divided by 4 layers and by the tokens (what each layer
adds), and the same difference of the kept bytes (``saved_residuals``) and of the floor.

* Hand-written layers, the way users write them (:data:`models.reference_layers.HAND_LAYERS`): Llama (RMSNorm with
  float32 statistics, SwiGLU, rotary, causal), GPT-2 (pre-LN, GELU-tanh, biases) and BERT
  (post-LN, GELU-erf); attention is a flash-style ``custom_vjp`` keeping q, k, v, o and a
  row log-sum-exp (:func:`models.reference_layers.flash_attention`), as cuDNN's does.  Unconverted and through
  :func:`invact_jax.invert`.
* The project's models (``models/``) in their configurations; the floor is the standard
  configuration's program's (materialized attention probabilities counted).
* Third-party models (:mod:`models.third_party`), unscanned: kept / floor of the
  whole gradient, unconverted and through ``invert``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import sys
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from tqdm import tqdm

import invact_jax
from invact_jax import memory
from models import options
from models import benchmarks
from models import reference_layers
from models import third_party

__all__ = ["SIZES", "Stack", "hand_stack", "model_stack", "per_layer", "third_party_ratio"]

#: (hidden d, heads, sequence T, batch): "issue" is the size the floor figures are quoted at; "test" runs in seconds.
SIZES = {"issue": (256, 4, 128, 2), "test": (64, 4, 16, 2)}


@dataclasses.dataclass(frozen=True)
class Stack:
  """A loss over a stack of layers: ``loss(*args)``; ``tokens`` per step, width ``d``,
  activations in ``dtype``."""
  loss: Callable
  args: tuple
  tokens: int
  d: int
  dtype: Any


def hand_stack(kind: str, depth: int, dtype, size: str = "issue") -> Stack:
  """``depth`` hand-written layers under ``lax.scan`` (parameters stacked), the loss the mean
  square of the output: ``loss(params, x)``."""
  d, heads, t, b = SIZES[size]
  layer, mult = reference_layers.HAND_LAYERS[kind]
  ps = [reference_layers.init_layer(kind, d, int(mult * d), dtype, jax.random.key(i)) for i in range(depth)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ps)
  x = jax.random.normal(jax.random.key(99), (b, t, d), dtype)

  def loss(params, x):
    h, _ = jax.lax.scan(lambda h, p: (layer(p, h, heads), None), x, params)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return Stack(loss, (stacked, x), b * t, d, jnp.dtype(dtype))


def model_stack(model: str, configuration: str, depth: int, dtype, size: str = "issue") -> Stack:
  """The same for a project model (``models.presets.MODELS``) at the size's
  width, heads and tokens, layers scanned."""
  from models import presets  # pylint: disable=import-outside-toplevel
  from models import vit  # pylint: disable=import-outside-toplevel
  d, heads, t, b = SIZES[size]
  mult = 2.75 if "llama" in model else 4.0
  overrides = dict(dtype=jnp.dtype(dtype).name, scan_layers=True, depth=depth, hidden=d,
                   heads=heads, mlp_dim=int(mult * d), remat="none",
                   **options.configuration(configuration))
  cfg = presets.model_config(model, **overrides)
  if isinstance(cfg, vit.ViTConfig):  # about t patches
    side = cfg.patch_size * max(1, round(math.sqrt(t)))
    cfg = cfg.replace(image_size=side)
    tokens = b * ((side // cfg.patch_size) ** 2 + 1)
  else:
    tokens = b * t
  loss, params, x, y = presets.loss_and_inputs(cfg, b, t, jax.random.key(0))
  return Stack(loss, (params, x, y), tokens, d, jnp.dtype(dtype))


def per_layer(build: Callable[[int], Stack], transform=None, floor_build=None, *,
              compiled: bool = True) -> dict:
  """``{"temp", "kept", "floor"}`` per layer and token in ``d`` units (see module doc).

  Args:
    build: ``depth -> Stack``.
    transform: applied to the loss (``invact_jax.invert``), or None.
    floor_build: the program the floor is computed from (default ``build``).
    compiled: also compile the gradient for its temp (else ``temp`` is None).
  """
  figures = {}
  for depth in (2, 6):
    st = build(depth)
    fn = transform(st.loss) if transform else st.loss
    floats = tuple(i for i, a in enumerate(st.args) if any(
        jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(a)))
    temp = memory.compiled(jax.grad(fn, argnums=floats), *st.args).temp if compiled else 0
    kept = invact_jax.floor_audit(fn, *st.args).kept_bytes
    ref = st if floor_build is None else floor_build(depth)
    figures[depth] = (temp, kept, invact_jax.floor_audit(ref.loss, *ref.args).floor_bytes)
  unit = 4 * st.tokens * st.d * jnp.dtype(st.dtype).itemsize
  out = {k: (figures[6][i] - figures[2][i]) / unit
         for i, k in enumerate(("temp", "kept", "floor"))}
  if not compiled:
    out["temp"] = None
  return out


def third_party_ratio(name: str, size: str = "test", dtype=jnp.float32) -> dict[str, Any]:
  """kept / floor of a third-party model's whole gradient, unconverted and through invert."""
  from models import third_party  # pylint: disable=import-outside-toplevel
  loss, params = third_party.build(name, size, dtype)
  base = invact_jax.floor_audit(loss, params)
  inv = invact_jax.floor_audit(invact_jax.invert(loss), params)
  return {"model": name, "floor_bytes": base.floor_bytes, "default": base.ratio,
          "invert": inv.ratio, "invert_excess_bytes": inv.excess_bytes}




PROJECT_MODELS = ("vit-b16", "bert-base", "gpt2", "llama-small")


CONFIGURATIONS = ("standard", "inverted", "inverted-all")


def layer_rows(size: str, dtypes, models) -> list[dict]:
  jobs = []
  for dt in dtypes:
    for kind in reference_layers.HAND_LAYERS:
      build = functools.partial(lambda depth, k, d: hand_stack(k, depth, d, size),
                                k=kind, d=dt)
      jobs.append(({"layer": kind, "source": "hand-written", "dtype": dt,
                    "configuration": "JAX default"}, build, None, None))
      jobs.append(({"layer": kind, "source": "hand-written", "dtype": dt,
                    "configuration": "invact_jax.invert"}, build, invact_jax.invert, None))
    for model in models:
      base = functools.partial(lambda depth, m, d: model_stack(m, "standard", depth, d,
                                                                     size), m=model, d=dt)
      for conf in CONFIGURATIONS:
        build = functools.partial(lambda depth, m, c, d: model_stack(m, c, depth, d, size),
                                  m=model, c=conf, d=dt)
        jobs.append(({"layer": model, "source": "models/", "dtype": dt, "configuration": conf},
                     build, None, base))
  rows = []
  for meta, build, transform, floor_build in tqdm(jobs, desc="layers", file=sys.stderr):
    fig = per_layer(build, transform, floor_build)
    rows.append({**meta, **fig, "ratio": fig["temp"] / fig["floor"]})
  return rows


def third_party_rows(size: str, dtypes, names) -> list[dict]:
  rows = []
  for dt in dtypes:
    for name in tqdm(names, desc=f"third-party {dt}", file=sys.stderr):
      rows.append({**third_party_ratio(name, size, jnp.dtype(dt)), "dtype": dt})
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



def run(a: argparse.Namespace) -> int:
  """``scripts/floor_audit.py``'s job for its parsed command line ``a``; the exit code."""
  warnings.filterwarnings("ignore", message=".*Transformers v5.*")
  names = third_party.installed(a.third_party)
  layers = layer_rows(a.size, a.dtypes, a.models)
  models = third_party_rows("test", a.dtypes, names)
  meta = {"jax": jax.__version__, "host": benchmarks.host(), "device": jax.devices()[0].device_kind,
          "size": dict(zip(("d", "heads", "T", "batch"), SIZES[a.size])),
          "date": datetime.date.today().isoformat()}
  print(f"JAX {meta['jax']}, {meta['device']}, {meta['size']}, {meta['date']}")
  print(tables(layers, models))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "layers": layers, "third_party": models}, f, indent=1)
  return 0
