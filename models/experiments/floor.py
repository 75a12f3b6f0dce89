"""Kept bytes per layer against the floor: hand-written layers, the project's
models and third-party models.

The floor (:func:`invact_jax.memory.floor_audit`) is the least a layer's backward must keep
without recomputing a matmul.  Figures per layer and token are in units of ``d`` elements of
the compute dtype (``d`` = the hidden width): the compiled temp of the gradient of a scanned
stack of 6 layers minus that of 2, divided by 4 layers and by the tokens (what each layer
adds), and the same difference of the kept bytes (``saved_residuals``) and of the floor.

* Hand-written layers, the way users write them (:data:`HAND_LAYERS`): Llama (RMSNorm with
  float32 statistics, SwiGLU, rotary, causal), GPT-2 (pre-LN, GELU-tanh, biases) and BERT
  (post-LN, GELU-erf); attention is a flash-style ``custom_vjp`` keeping q, k, v, o and a
  row log-sum-exp (:func:`flash_attention`), as cuDNN's does.  Unconverted and through
  :func:`invact_jax.invert`.
* The project's models (``models/``) in their configurations; the floor is the standard
  configuration's program's (materialized attention probabilities counted).
* Third-party models (:mod:`models.experiments.third_party`), unscanned: kept / floor of the
  whole gradient, unconverted and through ``invert``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

import invact_jax
from invact_jax import memory
from models import options

__all__ = ["flash_attention", "rms_norm", "layer_norm", "rope", "init_layer", "HAND_LAYERS",
           "SIZES", "Stack", "hand_stack", "model_stack", "per_layer", "third_party_ratio"]

#: (hidden d, heads, sequence T, batch): "issue" is the size the floor figures are quoted at; "test" runs in seconds.
SIZES = {"issue": (256, 4, 128, 2), "test": (64, 4, 16, 2)}


# ------------------------------------------------------------------------ attention
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q, k, v, causal: bool):
  """Attention over [batch, seq, heads, head_dim] keeping q, k, v, o and the float32 row
  log-sum-exp for the backward (the probabilities are recomputed), as cuDNN's does."""
  return _flash_fwd(q, k, v, causal)[0]


def _logits(q, k, causal: bool):
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(q.shape[-1])
  if causal:
    n = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e30)
  return s


def _flash_fwd(q, k, v, causal):
  s = _logits(q, k, causal)
  lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)
  o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse).astype(v.dtype), v)
  return o, (q, k, v, o, lse)


def _flash_bwd(causal, res, do):
  q, k, v, o, lse = res
  p = jnp.exp(_logits(q, k, causal) - lse)
  dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), do)
  dp = jnp.einsum("bqhd,bkhd->bhqk", do, v, preferred_element_type=jnp.float32)
  delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
  ds = (p * (dp - delta[..., None]) / math.sqrt(q.shape[-1])).astype(q.dtype)
  return (jnp.einsum("bhqk,bkhd->bqhd", ds, k), jnp.einsum("bhqk,bqhd->bkhd", ds, q), dv)


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------- hand-written layers
def rms_norm(x, w, eps=1e-6):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w * xf.astype(x.dtype)


def layer_norm(x, g, b, eps=1e-5):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * g + b


def rope(x):
  _, t, _, d = x.shape
  inv = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention(p, x, heads: int, causal: bool, rotary: bool = False):
  b, t, d = x.shape

  def proj(name):
    y = x @ p["w" + name]
    if "b" + name in p:
      y = y + p["b" + name]
    return y.reshape(b, t, heads, d // heads)
  q, k, v = proj("q"), proj("k"), proj("v")
  if rotary:
    q, k = rope(q), rope(k)
  o = flash_attention(q, k, v, causal).reshape(b, t, d) @ p["wo"]
  return o + p["bo"] if "bo" in p else o


def llama_layer(p, x, heads: int):
  x = x + _attention(p, rms_norm(x, p["n1"]), heads, True, rotary=True)
  h = rms_norm(x, p["n2"])
  return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]


def gpt2_layer(p, x, heads: int):
  x = x + _attention(p, layer_norm(x, p["g1"], p["b1"]), heads, True)
  h = layer_norm(x, p["g2"], p["b2"])
  return x + jax.nn.gelu(h @ p["w1"] + p["c1"], approximate=True) @ p["w2"] + p["c2"]


def bert_layer(p, x, heads: int):
  x = layer_norm(x + _attention(p, x, heads, False), p["g1"], p["b1"])
  h = jax.nn.gelu(x @ p["w1"] + p["c1"], approximate=False)
  return layer_norm(x + h @ p["w2"] + p["c2"], p["g2"], p["b2"])


#: name -> (layer function, MLP width as a multiple of d)
HAND_LAYERS: dict[str, tuple[Callable, float]] = {
    "llama": (llama_layer, 2.75), "gpt2": (gpt2_layer, 4.0), "bert": (bert_layer, 4.0)}


def init_layer(kind: str, d: int, ff: int, dtype, key, kv: int | None = None) -> dict:
  """One layer's parameters; ``kv``: the key/value projections' width (grouped-query
  attention; default ``d``)."""
  kv = d if kv is None else kv
  shapes = {"wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d)}
  if kind == "llama":
    shapes.update(n1=(d,), n2=(d,), wg=(d, ff), wu=(d, ff), wd=(ff, d))
  else:
    shapes.update(bq=(d,), bk=(d,), bv=(d,), bo=(d,), g1=(d,), b1=(d,), g2=(d,), b2=(d,),
                  w1=(d, ff), c1=(ff,), w2=(ff, d), c2=(d,))
  out = {}
  for (name, shape), k in zip(sorted(shapes.items()), jax.random.split(key, len(shapes))):
    if len(shape) == 1:
      v = jnp.ones(shape) if name[0] in "gn" else 0.1 * jax.random.normal(k, shape)
    else:
      v = jax.random.normal(k, shape) / math.sqrt(shape[0])
    out[name] = v.astype(dtype)
  return out


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
  layer, mult = HAND_LAYERS[kind]
  ps = [init_layer(kind, d, int(mult * d), dtype, jax.random.key(i)) for i in range(depth)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ps)
  x = jax.random.normal(jax.random.key(99), (b, t, d), dtype)

  def loss(params, x):
    h, _ = jax.lax.scan(lambda h, p: (layer(p, h, heads), None), x, params)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return Stack(loss, (stacked, x), b * t, d, jnp.dtype(dtype))


def model_stack(model: str, configuration: str, depth: int, dtype, size: str = "issue") -> Stack:
  """The same for a project model (``models.experiments.model_memory.MODELS``) at the size's
  width, heads and tokens, layers scanned."""
  from models.experiments import model_memory  # pylint: disable=import-outside-toplevel
  from models import vit  # pylint: disable=import-outside-toplevel
  d, heads, t, b = SIZES[size]
  mult = 2.75 if "llama" in model else 4.0
  overrides = dict(dtype=jnp.dtype(dtype).name, scan_layers=True, depth=depth, hidden=d,
                   heads=heads, mlp_dim=int(mult * d), remat="none",
                   **options.configuration(configuration))
  cfg = model_memory.model_config(model, **overrides)
  if isinstance(cfg, vit.ViTConfig):  # about t patches
    side = cfg.patch_size * max(1, round(math.sqrt(t)))
    cfg = cfg.replace(image_size=side)
    tokens = b * ((side // cfg.patch_size) ** 2 + 1)
  else:
    tokens = b * t
  loss, params, x, y = model_memory.loss_and_inputs(cfg, b, t, jax.random.key(0))
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
    kept = memory.floor_audit(fn, *st.args).kept_bytes
    ref = st if floor_build is None else floor_build(depth)
    figures[depth] = (temp, kept, memory.floor_audit(ref.loss, *ref.args).floor_bytes)
  unit = 4 * st.tokens * st.d * jnp.dtype(st.dtype).itemsize
  out = {k: (figures[6][i] - figures[2][i]) / unit
         for i, k in enumerate(("temp", "kept", "floor"))}
  if not compiled:
    out["temp"] = None
  return out


def third_party_ratio(name: str, size: str = "test", dtype=jnp.float32) -> dict[str, Any]:
  """kept / floor of a third-party model's whole gradient, unconverted and through invert."""
  from models.experiments import third_party  # pylint: disable=import-outside-toplevel
  loss, params = third_party.build(name, size, dtype)
  base = memory.floor_audit(loss, params)
  inv = memory.floor_audit(invact_jax.invert(loss), params)
  return {"model": name, "floor_bytes": base.floor_bytes, "default": base.ratio,
          "invert": inv.ratio, "invert_excess_bytes": inv.excess_bytes}
