"""Transformer layers written by hand the way users write them, as references for the floor
figures (:mod:`models.benchmarks.floor`) and the frontier's stacks
(:mod:`models.benchmarks.frontier`): Llama (RMSNorm with float32 statistics, SwiGLU, rotary,
causal, grouped-query attention where the key/value projections are narrower), GPT-2 (pre-LN,
GELU-tanh, biases; :func:`vit_layer` the same block without the causal mask) and BERT (post-LN,
GELU-erf).  Attention is a flash-style ``custom_vjp`` keeping q, k, v, o and a row
log-sum-exp (:func:`flash_attention`), as cuDNN's does; a layer takes another
(``attention=``, e.g. :func:`fastest_attention`).  With ``named=True`` a layer tags its
projections with MaxText's ``checkpoint_name`` s (:data:`TAGS`), for the remat policies that
save by name.  Parameters are plain dicts (:func:`init_layer`)."""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["flash_attention", "attention", "fastest_attention", "rms_norm", "layer_norm", "rope",
           "llama_layer", "gpt2_layer", "vit_layer", "bert_layer", "HAND_LAYERS", "TAGS",
           "init_layer"]


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
  """The flash attention's backward: the probabilities recomputed from q, k and the row
  log-sum-exp, then dq, dk, dv."""
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


def attention(q, k, v, causal: bool):
  """:func:`flash_attention` over [batch, seq, heads, head_dim], the key/value heads repeated
  where there are fewer of them (grouped-query attention)."""
  if k.shape[2] != q.shape[2]:
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
  return flash_attention(q, k, v, causal)


def fastest_attention(q, k, v, causal: bool):
  """cuDNN's flash attention where the program compiles for a GPU
  (:func:`invact_jax.targets.platform`, a deviceless target included) in 16 bits (grouped-query
  natively); elsewhere :func:`attention` (the same residuals)."""
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  if targets.platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return attention(q, k, v, causal)


#: The ``checkpoint_name`` s a layer tags with ``named=True`` (MaxText's), per kind.
TAGS = {"llama": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1",
                  "mlpwo"),
        "gpt2": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo")}


def _namer(named: bool) -> Callable:
  return checkpoint_name if named else (lambda x, name: x)


def _attention(p, x, heads: int, causal: bool, rotary: bool = False, *, named: bool = False,
               attend: Callable = attention):
  """Multi-head attention of ``x`` [batch, seq, d] through ``attend`` (grouped-query where
  the key/value projections are narrower), biases where ``p`` has them, projections tagged
  with MaxText's names where ``named``."""
  b, t, d = x.shape
  dh, name = d // heads, _namer(named)

  def proj(w, tag):
    y = x @ p["w" + w]
    if "b" + w in p:
      y = y + p["b" + w]
    y = name(y, tag)
    return y.reshape(b, t, y.shape[-1] // dh, dh)
  q, k, v = proj("q", "query_proj"), proj("k", "key_proj"), proj("v", "value_proj")
  if rotary:
    q, k = rope(q), rope(k)
  o = attend(q, k, v, causal).reshape(b, t, d) @ p["wo"]
  return name(o + p["bo"] if "bo" in p else o, "out_proj")


def llama_layer(p, x, heads: int, *, named: bool = False, attention: Callable = attention):  # pylint: disable=redefined-outer-name
  """A pre-norm Llama layer: RMSNorm, rotary causal attention, RMSNorm, SwiGLU MLP."""
  name = _namer(named)
  x = x + _attention(p, rms_norm(x, p["n1"]), heads, True, rotary=True, named=named,
                     attend=attention)
  h = rms_norm(x, p["n2"])
  g, u = name(h @ p["wg"], "mlpwi_0"), name(h @ p["wu"], "mlpwi_1")
  return x + name((jax.nn.silu(g) * u) @ p["wd"], "mlpwo")


def gpt2_layer(p, x, heads: int, *, causal: bool = True, named: bool = False,
               attention: Callable = attention):  # pylint: disable=redefined-outer-name
  """A pre-LN GPT-2 layer: LayerNorm, causal attention, LayerNorm, GELU-tanh MLP, biases."""
  name = _namer(named)
  x = x + _attention(p, layer_norm(x, p["g1"], p["b1"]), heads, causal, named=named,
                     attend=attention)
  h = layer_norm(x, p["g2"], p["b2"])
  a = jax.nn.gelu(name(h @ p["w1"], "mlpwi") + p["c1"], approximate=True)
  return x + name(a @ p["w2"], "mlpwo") + p["c2"]


def vit_layer(p, x, heads: int, *, named: bool = False, attention: Callable = attention):  # pylint: disable=redefined-outer-name
  """A ViT encoder layer: :func:`gpt2_layer` without the causal mask (pre-LN, GELU-tanh)."""
  return gpt2_layer(p, x, heads, causal=False, named=named, attention=attention)


def bert_layer(p, x, heads: int):
  """A post-LN BERT layer: attention, LayerNorm, GELU-erf MLP, LayerNorm."""
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
