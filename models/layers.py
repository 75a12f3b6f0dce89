"""Shared transformer layers (Flax NNX): attention, MLP, encoder stack, dropout.

Every memory option is a field of :class:`models.options.BlockOptions` read here (the
modes say what each op keeps, ``implementation`` how the invact_jax ops run), so scripts
and benchmarks sweep configs and never edit model code.  ``save_names`` is a memory plan
(``invact_jax.planner``): per layer, the ``checkpoint_name`` tags (``options.TAGS``) to keep,
the rest recomputed; it overrides ``remat``.  Parameters are the Flax modules' in every
mode, so checkpoints are interchangeable.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import invact_jax
from invact_jax import targets
from invact_jax.ops.activations import registry
from models.options import REMAT_POLICIES
from models.options import TAGS  # noqa: F401  (re-exported: the planner's tag list)


def tag(x, name: str, on: bool):
  """``checkpoint_name(x, name)`` when a memory plan is in use (``on``), else x.

  Names are only read by remat policies; without one they are left out, because a named
  copy of a custom_vjp's output can be kept beside the output itself.
  """
  return checkpoint_name(x, name) if on else x


def activation_fn(name: str, mode: str, implementation=None) -> Callable[[jax.Array], jax.Array]:
  """The registry activation ``name`` in memory mode ``mode`` (see ``models.options``)."""
  entry = registry.get(name)
  standard = functools.partial(entry.original, **dict(entry.selector))
  if mode == "standard":
    return standard
  if mode == "checkpointed":
    return jax.checkpoint(standard)
  if mode == "inverted":
    return functools.partial(getattr(invact_jax, entry.public), **dict(entry.selector),
                             implementation=implementation)
  raise ValueError(f"unknown activation_mode {mode!r}")


def dropout(x, rate: float, key, mode: str = "standard") -> jax.Array:
  """Dropout (scaled at training time) with an explicit key; identity when ``key`` is None.

  Every ``mode`` draws the same mask for the same key (see ``dropout_mode``).
  """
  if key is None or rate == 0.0:
    return x
  if mode == "standard":
    return invact_jax.dropout_reference(x, rate, key)
  return invact_jax.dropout(x, rate, key, mode=mode)


def _param(p):
  return None if p is None else p[...]


def apply_norm(norm, x, mode: str, implementation=None):
  """``norm(x)`` for an ``nnx.LayerNorm``/``nnx.RMSNorm`` in memory mode ``mode``.

  ``"fused"`` means ``"inverted"`` here: a norm with no projection to fuse with.
  """
  if mode == "standard":
    return norm(x)
  dtype = norm.dtype or x.dtype
  if isinstance(norm, nnx.RMSNorm):
    return invact_jax.rms_norm(x, _param(norm.scale), epsilon=norm.epsilon, dtype=dtype,
                               implementation=implementation)
  return invact_jax.layer_norm(x, _param(norm.scale), _param(norm.bias), epsilon=norm.epsilon,
                               dtype=dtype, implementation=implementation)


def norm_dense(norm, x, linears, implementation=None):
  """``tuple(linear(norm(x)) for linear in linears)`` as one fused ``invact_jax`` unit."""
  dtype = norm.dtype or x.dtype
  kernels = [_param(lin.kernel) for lin in linears]
  biases = [_param(lin.bias) for lin in linears]
  if isinstance(norm, nnx.RMSNorm):
    return invact_jax.rms_norm_dense(x, _param(norm.scale), kernels, biases,
                                     epsilon=norm.epsilon, dtype=dtype,
                                     implementation=implementation)
  return invact_jax.layer_norm_dense(x, _param(norm.scale), _param(norm.bias), kernels, biases,
                                     epsilon=norm.epsilon, dtype=dtype,
                                     implementation=implementation)


def cudnn_attention_runs(dtype, head_dim: int = 64) -> bool:
  """Whether ``attention="auto"`` takes cuDNN's flash attention: compiling for a GPU
  (:func:`invact_jax.targets.platform`: the local one, or one compiled for without it), a
  16-bit dtype and a head size cuDNN takes (a multiple of 8, at most 128)."""
  return (targets.platform() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim % 8 == 0 and head_dim <= 128)


def dot_product_attention(q, k, v, *, causal: bool, attention: str,
                          softmax_mode: str = "standard", tagged: bool = False):
  """q, k, v: [batch, seq, heads, head_dim] -> [batch, seq, heads, head_dim].

  ``attention``: ``"auto"`` (cuDNN's flash attention through
  ``jax.nn.dot_product_attention`` where it runs and ``softmax_mode`` is ``"standard"``,
  else ``"xla"``), ``"xla"`` (the probabilities materialized; ``softmax_mode`` says what
  their softmax keeps) or ``"dot_product"`` (``jax.nn.dot_product_attention``'s default
  implementation)."""
  if (attention == "auto" and softmax_mode == "standard"
      and cudnn_attention_runs(q.dtype, q.shape[-1])):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  if attention == "dot_product":
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
  if causal:
    n = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((n, n), bool)), logits, jnp.finfo(jnp.float32).min)
  if softmax_mode == "inverted":
    probs = invact_jax.softmax(logits, axis=-1, dtype=v.dtype)
  else:
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  probs = tag(probs, "attn_probs", tagged)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Attention(nnx.Module):
  """Multi-head self-attention with Flax-standard ``nnx.Linear`` projections."""

  def __init__(self, cfg, *, causal: bool = False, rngs: nnx.Rngs):
    d, dt = cfg.hidden, cfg.dtype
    self.heads, self.causal, self.attention = cfg.heads, causal, cfg.attention
    self.softmax_mode, self.implementation = cfg.softmax_mode, cfg.implementation
    self.tagged = cfg.save_names is not None
    self.query = nnx.Linear(d, d, dtype=dt, rngs=rngs)
    self.key = nnx.Linear(d, d, dtype=dt, rngs=rngs)
    self.value = nnx.Linear(d, d, dtype=dt, rngs=rngs)
    self.out = nnx.Linear(d, d, dtype=dt, rngs=rngs)

  def qkv(self, x, norm=None):
    """Projections of x, or of norm(x) fused with the norm when ``norm`` is given."""
    if norm is not None:
      q, k, v = norm_dense(norm, x, (self.query, self.key, self.value), self.implementation)
    else:
      q, k, v = self.query(x), self.key(x), self.value(x)
    on = self.tagged
    return tag(q, "query", on), tag(k, "key", on), tag(v, "value", on)

  def __call__(self, x, norm=None):
    b, n, _ = x.shape
    d = self.out.in_features
    split = lambda t: t.reshape(b, n, self.heads, d // self.heads)
    q, k, v = self.qkv(x, norm)
    o = dot_product_attention(split(q), split(k), split(v), causal=self.causal,
                              attention=self.attention, softmax_mode=self.softmax_mode,
                              tagged=self.tagged)
    o = tag(o.reshape(b, n, d), "attn_context", self.tagged)
    return tag(self.out(o), "attn_out", self.tagged)


class Mlp(nnx.Module):
  """Dense -> activation -> dense (the activation chosen by the config)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(cfg.hidden, cfg.mlp_dim, dtype=cfg.dtype, rngs=rngs)
    self.fc2 = nnx.Linear(cfg.mlp_dim, cfg.hidden, dtype=cfg.dtype, rngs=rngs)
    self.act = activation_fn(cfg.activation, cfg.activation_mode, cfg.implementation)
    self.tagged = cfg.save_names is not None
    self.implementation = cfg.implementation

  def __call__(self, x, norm=None):
    h = self.fc1(x) if norm is None else norm_dense(norm, x, (self.fc1,), self.implementation)[0]
    a = tag(self.act(tag(h, "mlp_pre", self.tagged)), "mlp_act", self.tagged)
    return tag(self.fc2(a), "mlp_out", self.tagged)


def pre_norm_residuals(x, key, cfg, *sublayers):
  """x + dropout(layer(norm(x))) for each (norm, layer), with one dropout key each.

  With ``norm_mode="fused"`` the layer gets the norm and fuses it with its projections.
  """
  keys = [None] * len(sublayers) if key is None else list(jax.random.split(key, len(sublayers)))
  for i, ((norm, layer), k) in enumerate(zip(sublayers, keys)):
    if cfg.norm_mode == "fused":
      h = layer(x, norm=norm)
    else:
      h = layer(tag(apply_norm(norm, x, cfg.norm_mode, cfg.implementation),
                    "norm_attn" if i == 0 else "norm_mlp", cfg.save_names is not None))
    x = x + dropout(h, cfg.dropout, k, cfg.dropout_mode)
  return x


class PreNormBlock(nnx.Module):
  """x + Attn(LN(x)); x + MLP(LN(x)) — ViT and GPT-2 blocks."""

  def __init__(self, cfg, *, causal: bool = False, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.attn = Attention(cfg, causal=causal, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.mlp = Mlp(cfg, rngs=rngs)
    self.cfg = cfg

  def __call__(self, x, key=None):
    return pre_norm_residuals(x, key, self.cfg, (self.ln1, self.attn), (self.ln2, self.mlp))


class Stack(nnx.Module):
  """``depth`` blocks, unrolled or stacked under ``nnx.scan``, each under ``remat``.

  Scanned with a per-layer plan (``save_names`` differing between layers), each contiguous
  run of layers with one plan entry is its own parameter stack and its own ``lax.scan``
  (``blocks[g]``).  Slicing one stack per run instead copies the parameters into every run's
  scan (kept for its backward) and assembles the gradient from per-run pieces: two extra
  parameter-sized buffers, +245 % compiled temp on a ViT-Ti with one layer different.
  """

  def __init__(self, cfg, make_block: Callable[[nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs):
    self.depth = cfg.depth
    self.policy_name = cfg.remat
    self.save_names = cfg.save_names
    self.scan = cfg.scan_layers
    if not cfg.scan_layers:
      self.blocks = nnx.List([make_block(rngs) for _ in range(cfg.depth)])
      return

    def stacked(n):
      @nnx.split_rngs(splits=n)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_stacked(rngs):
        return make_block(rngs)
      return make_stacked(rngs)
    self.blocks = stacked(cfg.depth)
    groups = self._groups()
    if len(groups) > 1:  # initialised as one stack, so a plan does not change the weights
      graphdef, state = nnx.split(self.blocks)
      self.blocks = nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a, s=s, e=e: a[s:e], state))
                              for s, e, _ in groups])

  def _apply_block(self, layer: int = 0):
    """How layer ``layer`` runs: under ``nnx.remat`` with the plan's names for it (a memory
    plan), or the stack's policy, or as it is."""
    apply = lambda block, x, key: block(x, key)
    if self.save_names is not None:
      names = self.save_names[layer if len(self.save_names) > 1 else 0]
      return nnx.remat(apply, policy=jax.checkpoint_policies.save_only_these_names(*names))
    if self.policy_name == "none":
      return apply
    return nnx.remat(apply, policy=REMAT_POLICIES[self.policy_name])

  def _groups(self):
    """Contiguous runs of layers sharing one plan entry: [(start, end, layer index)]."""
    if self.save_names is None or len(self.save_names) == 1:
      return [(0, self.depth, 0)]
    out, start = [], 0
    for i in range(1, self.depth + 1):
      if i == self.depth or self.save_names[i] != self.save_names[start]:
        out.append((start, i, start))
        start = i
    return out

  def __call__(self, x, key=None):
    keys = None if key is None else jax.random.split(key, self.depth)
    if not self.scan:
      for i, block in enumerate(self.blocks):
        x = self._apply_block(i)(block, x, None if keys is None else keys[i])
      return x
    groups = self._groups()
    if len(groups) == 1:
      return self._scan(self.blocks, x, keys, self._apply_block())
    for blocks, (start, end, layer) in zip(self.blocks, groups):
      x = self._scan(blocks, x, None if keys is None else keys[start:end], self._apply_block(layer))
    return x

  @staticmethod
  def _scan(blocks, x, keys, apply):
    """``blocks`` (stacked) applied to ``x`` under ``nnx.scan``, each with its key of ``keys``
    (None: no dropout keys)."""
    if keys is None:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return apply(block, x, None)
      return body(x, blocks)

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
    def body_with_keys(x, block, k):
      return apply(block, x, k)
    return body_with_keys(x, blocks, keys)


def rotary(x, positions, base: float = 10000.0):
  """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half convention)."""
  d = x.shape[-1]
  inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = positions[:, None].astype(jnp.float32) * inv_freq[None, :]  # [seq, d/2]
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RotaryAttention(Attention):
  """Causal attention with rotary embeddings and no biases (Llama)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, dt = cfg.hidden, cfg.dtype
    self.heads, self.causal, self.attention = cfg.heads, True, cfg.attention
    self.softmax_mode, self.implementation = cfg.softmax_mode, cfg.implementation
    self.tagged = cfg.save_names is not None
    self.query = nnx.Linear(d, d, use_bias=False, dtype=dt, rngs=rngs)
    self.key = nnx.Linear(d, d, use_bias=False, dtype=dt, rngs=rngs)
    self.value = nnx.Linear(d, d, use_bias=False, dtype=dt, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=False, dtype=dt, rngs=rngs)

  def __call__(self, x, norm=None):
    b, n, _ = x.shape
    d = self.out.in_features
    split = lambda t: t.reshape(b, n, self.heads, d // self.heads)
    pos = jnp.arange(n)
    q, k, v = self.qkv(x, norm)
    q, k = rotary(split(q), pos), rotary(split(k), pos)
    o = dot_product_attention(q, k, split(v), causal=True, attention=self.attention,
                              softmax_mode=self.softmax_mode, tagged=self.tagged)
    o = tag(o.reshape(b, n, d), "attn_context", self.tagged)
    return tag(self.out(o), "attn_out", self.tagged)


class GluMlp(nnx.Module):
  """SwiGLU: down(act(gate(x)) * up(x)), no biases (Llama)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    kw = dict(use_bias=False, dtype=cfg.dtype, rngs=rngs)
    self.gate = nnx.Linear(cfg.hidden, cfg.mlp_dim, **kw)
    self.up = nnx.Linear(cfg.hidden, cfg.mlp_dim, **kw)
    self.down = nnx.Linear(cfg.mlp_dim, cfg.hidden, **kw)
    self.act = activation_fn(cfg.activation, cfg.activation_mode, cfg.implementation)
    self.tagged = cfg.save_names is not None
    self.implementation = cfg.implementation
    # An inverted activation keeps its output: the product with ``up`` is then recomputed
    # rather than kept (a memory plan decides for itself what the block keeps).
    self.recompute_product = cfg.activation_mode == "inverted" and not self.tagged

  def __call__(self, x, norm=None):
    if norm is None:
      g, u = self.gate(x), self.up(x)
    else:
      g, u = norm_dense(norm, x, (self.gate, self.up), self.implementation)
    g, u = tag(g, "mlp_pre", self.tagged), tag(u, "mlp_pre", self.tagged)
    if self.recompute_product:
      # The activation keeps its output anyway: keep it and ``up`` for the down projection
      # too and recompute their product in the backward (one [tokens, mlp_dim] tensor less).
      return jax.checkpoint(lambda y, u: self.down(y * u), prevent_cse=False)(self.act(g), u)
    a = tag(self.act(g) * u, "mlp_act", self.tagged)
    return tag(self.down(a), "mlp_out", self.tagged)


class PostNormBlock(nnx.Module):
  """LN(x + Attn(x)); LN(x + MLP(x)) — BERT blocks."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.attn = Attention(cfg, rngs=rngs)
    self.ln1 = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.mlp = Mlp(cfg, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.cfg = cfg

  def __call__(self, x, key=None):
    c = self.cfg
    k1, k2 = (None, None) if key is None else tuple(jax.random.split(key))
    mode = c.norm_mode  # "fused" runs as "inverted": these norms feed the next block
    x = apply_norm(self.ln1, x + dropout(self.attn(x), c.dropout, k1, c.dropout_mode), mode,
                   c.implementation)
    return apply_norm(self.ln2, x + dropout(self.mlp(x), c.dropout, k2, c.dropout_mode), mode,
                      c.implementation)


class LlamaBlock(nnx.Module):
  """x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.attn = RotaryAttention(cfg, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.mlp = GluMlp(cfg, rngs=rngs)
    self.cfg = cfg

  def __call__(self, x, key=None):
    return pre_norm_residuals(x, key, self.cfg, (self.attention_norm, self.attn),
                              (self.mlp_norm, self.mlp))
