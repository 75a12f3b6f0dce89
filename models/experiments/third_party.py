"""Third-party models for the program-level conversion: unmodified, and converted by hand.

``build(name, size, dtype)`` gives ``(loss, params)`` for a model written by somebody else:
transformers' Flax BERT, GPT-2, ViT and Llama (random init from a config, no download), an
Equinox transformer block (``eqx.nn.MultiheadAttention`` + ``eqx.nn.MLP`` with
``jax.nn.gelu`` stored in a field + ``eqx.nn.LayerNorm``) and a Flax NNX block.  ``loss`` is
``params -> scalar`` on a fixed batch, so ``jax.grad(invact_jax.invert(loss))`` is what a user
writes.  ``hand_converted(name)`` is a context manager under which ``build`` makes the model
with its activations and norms replaced in its source by invact_jax's (transformers'
``ACT2FN`` entries and its RMSNorm class; Equinox's fields; Flax's norms via
``invact_jax.inverted``): the reference the automatic conversion must match.

transformers (< 5, the last line with Flax models) and Equinox are test-only dependencies.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import invact_jax

__all__ = ["MODELS", "SIZES", "build", "hand_converted", "expected", "compare"]

MODELS = ("bert", "gpt2", "vit", "llama", "equinox", "nnx")
# (hidden, layers, heads, sequence, batch): "test" runs in seconds on a CPU; "table" is the
# README's (BERT-base width, short sequence).
SIZES = {"test": (64, 2, 4, 16, 2), "table": (768, 2, 12, 128, 8)}

def expected(name: str, layers: int) -> dict[str, int]:
  """What model ``name`` has, per converted kind: the conversion report must list all of it."""
  return {
      # embeddings LN + 2 per layer; GELU (erf) per layer; softmax per layer; pooler tanh
      "bert": {"layer_norm": 1 + 2 * layers, "gelu": layers, "softmax": layers, "tanh": 1},
      "gpt2": {"layer_norm": 2 * layers + 1, "gelu": layers, "softmax": layers},
      "vit": {"layer_norm": 2 * layers + 1, "gelu": layers, "softmax": layers, "tanh": 1},
      "llama": {"rms_norm": 2 * layers + 1, "silu": layers, "softmax": layers},
      "equinox": {"layer_norm": 2 * layers, "gelu": layers, "softmax": layers},
      # NNX's attention calls jax.nn.dot_product_attention, whose softmax (behind
      # transposes) is found by its algebra.
      "nnx": {"layer_norm": 2 * layers, "gelu": layers, "softmax": layers},
  }[name]


def _transformers(name: str, size, dtype):
  import transformers as tf  # pylint: disable=import-outside-toplevel
  hidden, layers, heads, seq, batch = size
  common = dict(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden,
                intermediate_size=4 * hidden)
  if name == "bert":
    model = tf.FlaxBertModel(tf.BertConfig(vocab_size=1000, max_position_embeddings=seq,
                                           **common), dtype=dtype, seed=0)
  elif name == "vit":
    model = tf.FlaxViTModel(tf.ViTConfig(image_size=4 * int(seq ** 0.5), patch_size=4, **common),
                            dtype=dtype, seed=0)
  elif name == "llama":
    # transformers' Flax rotary table keeps max_position_embeddings columns of sin|cos:
    # it must be at least 2 * head_dim.
    model = tf.FlaxLlamaModel(tf.LlamaConfig(vocab_size=1000, num_key_value_heads=heads,
                                             max_position_embeddings=max(seq, 256), **common),
                              dtype=dtype, seed=0)
  else:
    model = tf.FlaxGPT2Model(tf.GPT2Config(vocab_size=1000, n_embd=hidden, n_layer=layers,
                                           n_head=heads, n_positions=seq), dtype=dtype, seed=0)
  key = jax.random.key(1)
  if name == "vit":
    side = 4 * int(seq ** 0.5)
    inputs = {"pixel_values": jax.random.normal(key, (batch, 3, side, side), dtype)}
  else:
    inputs = {"input_ids": jax.random.randint(key, (batch, seq), 0, 1000)}
  params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating)
                        else p, model.params)

  def loss(params):
    out = model(**inputs, params=params, train=False).last_hidden_state
    return jnp.mean(out.astype(jnp.float32) ** 2)
  return loss, params


def _equinox(size, dtype):
  import equinox as eqx  # pylint: disable=import-outside-toplevel
  hidden, layers, heads, seq, batch = size

  class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.norm1 = eqx.nn.LayerNorm(hidden, dtype=dtype)
      self.attn = eqx.nn.MultiheadAttention(heads, hidden, dtype=dtype, key=k1)
      self.norm2 = eqx.nn.LayerNorm(hidden, dtype=dtype)
      self.mlp = eqx.nn.MLP(hidden, hidden, 4 * hidden, 1, activation=jax.nn.gelu, dtype=dtype,
                            key=k2)

    def __call__(self, x):  # x: [seq, hidden]
      h = jax.vmap(self.norm1)(x)
      x = x + self.attn(h, h, h)
      return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

  blocks = [Block(k) for k in jax.random.split(jax.random.key(0), layers)]
  params, static = eqx.partition(blocks, eqx.is_inexact_array)
  x = jax.random.normal(jax.random.key(1), (batch, seq, hidden), dtype)

  def loss(params):
    model = eqx.combine(params, static)

    def one(h):
      for b in model:
        h = b(h)
      return h
    return jnp.mean(jax.vmap(one)(x).astype(jnp.float32) ** 2)
  return loss, params


def _nnx(size, dtype):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  hidden, layers, heads, seq, batch = size

  class Block(nnx.Module):
    def __init__(self, rngs, act=jax.nn.gelu):
      self.act = act  # captured at construction: attribute swapping cannot reach it
      self.norm1 = nnx.LayerNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(heads, hidden, decode=False, dtype=dtype,
                                         param_dtype=dtype, rngs=rngs)
      self.norm2 = nnx.LayerNorm(hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
      self.up = nnx.Linear(hidden, 4 * hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
      self.down = nnx.Linear(4 * hidden, hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(self.norm1(x))
      return x + self.down(self.act(self.up(self.norm2(x))))

  rngs = nnx.Rngs(0)
  blocks = nnx.List([Block(rngs) for _ in range(layers)]) if hasattr(nnx, "List") else [
      Block(rngs) for _ in range(layers)]
  graphdef, params = nnx.split(blocks)
  x = jax.random.normal(jax.random.key(1), (batch, seq, hidden), dtype)

  def loss(params):
    model = nnx.merge(graphdef, params)
    h = x
    for b in model:
      h = b(h)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return loss, params


def compare(name: str, size: str = "test", dtype=jnp.float32) -> dict[str, Any]:
  """The conversion of ``name`` measured: forward equality, gradient rel L2 vs the unconverted
  model (of ``invert`` and of the hand conversion), compiled temp of the gradient (unconverted,
  by hand, by ``invert``), the report."""
  loss, params = build(name, size, dtype)
  inv = invact_jax.invert(loss)

  def grad_and_temp(f, p):  # one compilation for both (the tests' time is compilation)
    c = jax.jit(jax.grad(f)).lower(p).compile()
    return c(p), int(c.memory_analysis().temp_size_in_bytes)

  def sq(tree):
    return sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in jax.tree.leaves(tree))

  def rel(g):  # leaf by leaf (the hand-built Equinox blocks are another class)
    diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g), strict=True)]
    return (sq(diff) / sq(g0)) ** 0.5
  g0, t0 = grad_and_temp(loss, params)
  g1, t1 = grad_and_temp(inv, params)
  same = bool(jax.jit(loss)(params) == jax.jit(inv)(params))
  row = {"model": name, "size": size, "dtype": jnp.dtype(dtype).name,
         "forward_identical": same, "grad_rel_l2": rel(g1),
         "temp_unconverted": t0, "temp_invert": t1}
  with hand_converted(name):
    hand_loss, hand_params = build(name, size, dtype)  # the same seeds: the same values
    gh, row["temp_hand"] = grad_and_temp(hand_loss, hand_params)
  row["grad_rel_l2_hand"] = rel(gh)
  row["converted"] = inv.last_report.replaced
  row["left_alone"] = [list(x) for x in inv.last_report.left_alone]
  return row


def build(name: str, size: str = "test", dtype=jnp.float32) -> tuple[Callable, Any]:
  """``(loss, params)`` of third-party model ``name`` (one of :data:`MODELS`)."""
  if name not in MODELS:
    raise ValueError(f"argument `name`: unknown model {name!r}; choose from {MODELS}")
  if size not in SIZES:
    raise ValueError(f"argument `size`: unknown size {size!r}; choose from {tuple(SIZES)}")
  if name == "equinox":
    return _equinox(SIZES[size], dtype)
  if name == "nnx":
    return _nnx(SIZES[size], dtype)
  return _transformers(name, SIZES[size], dtype)


# ------------------------------------------------------------------- hand conversion
def _llama_rms_call(self, hidden_states):
  """transformers' FlaxLlamaRMSNorm.__call__ with invact_jax's rms_norm (same epsilon, dtype)."""
  out = jnp.result_type(self.weight, self.dtype)
  return invact_jax.rms_norm(hidden_states, self.weight, epsilon=self.epsilon, dtype=out)


def _eqx_layer_norm_call(self, x, state=None, *, key=None):
  """equinox.nn.LayerNorm.__call__ (per row) with invact_jax's layer_norm."""
  del key
  out = invact_jax.layer_norm(x, self.weight, self.bias, epsilon=self.eps)
  return out if state is None else (out, state)


@contextlib.contextmanager
def _patched(obj, attr, value):
  saved = getattr(obj, attr)
  setattr(obj, attr, value)
  try:
    yield
  finally:
    setattr(obj, attr, saved)


@contextlib.contextmanager
def hand_converted(name: str):
  """While active, ``build(name)`` and its loss run the model converted in its source."""
  with contextlib.ExitStack() as stack:
    if name in ("bert", "gpt2", "vit", "llama"):
      from transformers import modeling_flax_utils as mfu  # pylint: disable=import-outside-toplevel
      from transformers.models.llama import modeling_flax_llama as fl  # pylint: disable=import-outside-toplevel
      acts = {"gelu": functools.partial(invact_jax.gelu, approximate=False),
              "gelu_new": functools.partial(invact_jax.gelu, approximate=True),
              "gelu_pytorch_tanh": functools.partial(invact_jax.gelu, approximate=True),
              "silu": invact_jax.silu, "swish": invact_jax.silu, "relu": invact_jax.relu,
              "tanh": invact_jax.tanh}
      saved = dict(mfu.ACT2FN)
      mfu.ACT2FN.update(acts)
      stack.callback(mfu.ACT2FN.update, saved)
      stack.enter_context(_patched(fl.FlaxLlamaRMSNorm, "__call__", _llama_rms_call))
      # The pooler's tanh is nn.tanh called by attribute: the attribute swap reaches it.
    if name == "equinox":
      import equinox as eqx  # pylint: disable=import-outside-toplevel
      stack.enter_context(_patched(eqx.nn.LayerNorm, "__call__", _eqx_layer_norm_call))
      stack.enter_context(_patched(jax.nn, "gelu", invact_jax.gelu))
    if name == "nnx":
      stack.enter_context(_patched(jax.nn, "gelu", invact_jax.gelu))
    stack.enter_context(invact_jax.inverted(warn=False))
    yield
