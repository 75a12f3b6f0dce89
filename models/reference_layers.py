"""Transformer layers written by hand the way users write them, as references for the floor
figures (:mod:`models.benchmarks.floor`) and the frontier's stacks
(:mod:`models.benchmarks.frontier`): Llama (RMSNorm with float32 statistics, SwiGLU, rotary,
causal), GPT-2 (pre-LN, GELU-tanh, biases) and BERT (post-LN, GELU-erf).  Attention is a
flash-style ``custom_vjp`` keeping q, k, v, o and a row log-sum-exp (:func:`flash_attention`),
as cuDNN's does.  Parameters are plain dicts (:func:`init_layer`)."""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["flash_attention", "rms_norm", "layer_norm", "rope", "llama_layer", "gpt2_layer",
           "bert_layer", "HAND_LAYERS", "init_layer"]


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
