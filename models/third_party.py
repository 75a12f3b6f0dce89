"""Third-party models for the program-level conversion: unmodified, and converted by hand.

``build(name, size, dtype)`` gives ``(loss, params)`` for a model written by somebody else:
transformers' Flax BERT, GPT-2, ViT and Llama (random init from a config, no download), an
Equinox transformer block (``eqx.nn.MultiheadAttention`` + ``eqx.nn.MLP`` with
``jax.nn.gelu`` stored in a field + ``eqx.nn.LayerNorm``), a Flax NNX block, keras-hub's
Gemma, Llama, BERT, GPT-2 and ViT backbones (Keras 3, JAX backend, through
``stateless_call``) and penzai's Llama (plain and layer-stacked), Gemma, Gemma 2 and
GPT-NeoX.  ``loss`` is ``params -> scalar`` on a fixed batch, so
``jax.grad(invact_jax.invert(loss))`` is what a user writes.  ``hand_converted(name)`` (for
:data:`MODELS`) is a context manager under which ``build`` makes the model with its
activations and norms replaced in its source by invact_jax's (transformers' ``ACT2FN``
entries and its RMSNorm class; Equinox's fields; Flax's norms via ``invact_jax.inverted``):
the reference the automatic conversion must match.

transformers (< 5, the last line with Flax models), Equinox, Keras 3 and penzai are test-only
dependencies; keras-hub is a benchmark-only one (``pip install --no-deps keras-hub
kagglehub``: its TensorFlow requirement serves tokenizers, not the backbones).
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import invact_jax
from invact_jax import memory

__all__ = ["MODELS", "KERAS_HUB", "PENZAI", "ALL_MODELS", "SIZES", "build", "hand_converted",
           "expected", "compare", "requirement", "installed"]

#: Models with a hand conversion (the reference ``invert`` is compared with).
MODELS = ("bert", "gpt2", "vit", "llama", "equinox", "nnx")
KERAS_HUB = ("keras_gemma", "keras_llama", "keras_bert", "keras_gpt2", "keras_vit")
PENZAI = ("penzai_llama", "penzai_llama_stacked", "penzai_gemma", "penzai_gemma2",
          "penzai_gpt_neox")
ALL_MODELS = MODELS + KERAS_HUB + PENZAI
# (hidden, layers, heads, sequence, batch): "test" runs in seconds on a CPU; "table" is the
# README's (BERT-base width, short sequence).
# "zoo": width 128, 2 layers, at 512 tokens (the conversion zoo's figures); "plan": 8 layers
# of width 256 at 512 tokens (scripts/plan_program.py).
SIZES = {"test": (64, 2, 4, 16, 2), "zoo": (128, 2, 4, 128, 4),
         "table": (768, 2, 12, 128, 8), "plan": (256, 8, 4, 256, 2)}

def installed(names) -> list[str]:
  """The models of ``names`` whose package is installed; a line on stderr for each other."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  out = []
  for m in names:
    if importlib.util.find_spec(requirement(m)) is None:
      print(f"skipped {m}: package {requirement(m)!r} is not installed", file=sys.stderr)
    else:
      out.append(m)
  return out


def _normal(key, shape, dtype):
  """Normal inputs with the same values in every dtype (bfloat16-representable), so a model
  built in another precision (the reference gradient) sees the same batch."""
  return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(dtype)


def requirement(name: str) -> str:
  """The package model ``name`` needs."""
  if name in KERAS_HUB:
    return "keras_hub"
  if name in PENZAI:
    return "penzai"
  return {"equinox": "equinox", "nnx": "flax"}.get(name, "transformers")


def expected(name: str, layers: int) -> dict[str, int]:
  """What model ``name`` has, per converted kind: the conversion report must list all of it."""
  return {
      # keras-hub: 2 norms per layer + the final one; one softmax and one activation per
      # layer; BERT's embedding norm and pooler tanh
      "keras_gemma": {"rms_norm": 2 * layers + 1, "softmax": layers, "gelu": layers},
      "keras_llama": {"rms_norm": 2 * layers + 1, "softmax": layers, "silu": layers},
      "keras_bert": {"layer_norm": 2 * layers + 1, "softmax": layers, "gelu": layers,
                     "tanh": 1},
      "keras_gpt2": {"layer_norm": 2 * layers + 1, "softmax": layers, "gelu": layers},
      "keras_vit": {"layer_norm": 2 * layers + 1, "softmax": layers, "gelu": layers},
      # penzai (a stacked model's scan body is converted once): Gemma 2 adds post-attention
      # and post-MLP norms and tanh soft caps (attention logits per layer, final logits)
      "penzai_llama": {"rms_norm": 2 * layers + 1, "softmax": layers, "silu": layers},
      "penzai_llama_stacked": {"rms_norm": 3, "softmax": 1, "silu": 1},
      "penzai_gemma": {"rms_norm": 2 * layers + 1, "softmax": layers, "gelu": layers},
      "penzai_gemma2": {"rms_norm": 4 * layers + 1, "softmax": layers, "gelu": layers,
                        "tanh": layers + 1},
      "penzai_gpt_neox": {"layer_norm": 2 * layers + 1, "softmax": layers, "gelu": layers},
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
  """A Hugging Face Flax model (``bert``, ``gpt2``, ``vit``, ``llama``) of ``size`` =
  (hidden, layers, heads, seq, batch): ``(loss(params), params)``."""
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
    inputs = {"pixel_values": _normal(key, (batch, 3, side, side), dtype)}
  else:
    inputs = {"input_ids": jax.random.randint(key, (batch, seq), 0, 1000, jnp.int32)}
  params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating)
                        else p, model.params)

  def loss(params):
    out = model(**inputs, params=params, train=False).last_hidden_state
    return jnp.mean(out.astype(jnp.float32) ** 2)
  return loss, params


def _equinox(size, dtype):
  """An Equinox pre-LN transformer of ``size``: ``(loss(params), params)``."""
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
  x = _normal(jax.random.key(1), (batch, seq, hidden), dtype)

  def loss(params):
    model = eqx.combine(params, static)

    def one(h):
      for b in model:
        h = b(h)
      return h
    return jnp.mean(jax.vmap(one)(x).astype(jnp.float32) ** 2)
  return loss, params


def _nnx(size, dtype):
  """A Flax NNX pre-LN transformer of ``size`` whose activation is captured at construction
  (attribute swapping cannot reach it): ``(loss(params), params)``."""
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
  x = _normal(jax.random.key(1), (batch, seq, hidden), dtype)

  def loss(params):
    model = nnx.merge(graphdef, params)
    h = x
    for b in model:
      h = b(h)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return loss, params


def _keras_hub(name: str, size, dtype):
  """A keras-hub backbone (``keras_*``) of ``size`` on Keras's JAX backend:
  ``(loss(trainable), trainable)``."""
  import os  # pylint: disable=import-outside-toplevel
  os.environ.setdefault("KERAS_BACKEND", "jax")
  import keras  # pylint: disable=import-outside-toplevel
  if keras.backend.backend() != "jax":
    raise RuntimeError(f"model {name!r} needs Keras's JAX backend (KERAS_BACKEND=jax before "
                       f"Keras is imported), got {keras.backend.backend()!r}")
  import keras_hub  # pylint: disable=import-outside-toplevel
  hidden, layers, heads, seq, batch = size
  keras.utils.set_random_seed(0)
  km, dt, vocab = keras_hub.models, jnp.dtype(dtype).name, 256
  if name == "keras_gemma":
    model = km.GemmaBackbone(vocabulary_size=vocab, num_layers=layers, num_query_heads=heads,
                             num_key_value_heads=1, hidden_dim=hidden,
                             intermediate_dim=2 * hidden, head_dim=hidden // heads, dtype=dt)
  elif name == "keras_llama":
    model = km.LlamaBackbone(vocabulary_size=vocab, num_layers=layers, num_query_heads=heads,
                             hidden_dim=hidden, intermediate_dim=2 * hidden,
                             num_key_value_heads=max(1, heads // 2), dtype=dt)
  elif name == "keras_bert":
    model = km.BertBackbone(vocabulary_size=vocab, num_layers=layers, num_heads=heads,
                            hidden_dim=hidden, intermediate_dim=4 * hidden, dropout=0.0,
                            max_sequence_length=seq, dtype=dt)
  elif name == "keras_gpt2":
    model = km.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=heads,
                            hidden_dim=hidden, intermediate_dim=4 * hidden, dropout=0.0,
                            max_sequence_length=seq, dtype=dt)
  else:
    side = 8 * max(1, round((seq - 1) ** 0.5))  # patches of 8: about seq tokens
    model = km.ViTBackbone(image_shape=(side, side, 3), patch_size=8, num_layers=layers,
                           num_heads=heads, hidden_dim=hidden, mlp_dim=4 * hidden, dtype=dt)
  trainable = [v.value for v in model.trainable_variables]
  fixed = [v.value for v in model.non_trainable_variables]
  key = jax.random.key(1)
  if name == "keras_vit":
    inputs = _normal(key, (batch, side, side, 3), dtype)
  else:
    ids = jax.random.randint(key, (batch, seq), 0, vocab, jnp.int32)
    inputs = {"token_ids": ids, "padding_mask": jnp.ones_like(ids)}
    if name == "keras_bert":
      inputs["segment_ids"] = jnp.zeros_like(ids)

  def loss(trainable):
    out, _ = model.stateless_call(trainable, fixed, inputs)
    out = out["sequence_output"] if isinstance(out, dict) else out
    return jnp.mean(out.astype(jnp.float32) ** 2)
  return loss, trainable


def _penzai(name: str, size, dtype):
  """A penzai transformer (``penzai_*``: GPT-NeoX or Llama-like) of ``size``:
  ``(loss(params), params)``."""
  from penzai import pz  # pylint: disable=import-outside-toplevel
  from penzai.models.transformer.variants import gpt_neox  # pylint: disable=import-outside-toplevel
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel
  hidden, layers, heads, seq, batch = size
  vocab = 256
  common = dict(embedding_dim=hidden, mlp_hidden_dim=2 * hidden, num_decoder_blocks=layers,
                vocab_size=vocab, parameter_dtype=dtype, activation_dtype=dtype)
  if name in ("penzai_llama", "penzai_llama_stacked"):
    cfg = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=max(1, heads // 2), query_head_multiplier=min(2, heads),
        projection_dim=hidden // heads, mlp_variant="swiglu", tie_embedder_and_logits=False,
        use_layer_stack=name == "penzai_llama_stacked", **common)
    model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
  elif name in ("penzai_gemma", "penzai_gemma2"):
    two = name == "penzai_gemma2"
    cfg = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=1, query_head_multiplier=heads, projection_dim=hidden // heads,
        mlp_variant="geglu_approx", tie_embedder_and_logits=True, use_post_attn_norm=two,
        use_post_ffw_norm=two, final_logit_softcap=30.0 if two else None,
        attn_logits_soft_cap=50.0 if two else None, **common)
    model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
  else:
    cfg = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=heads, projection_dim=hidden // heads, activation_fn="gelu_exact",
        rope_subset_size=max(2, hidden // heads // 4), rope_wavelength=10000.0,
        layernorm_epsilon=1e-5, **common)
    model = gpt_neox.build_gpt_neox_transformer(cfg, init_base_rng=jax.random.key(0))
  unbound, params = pz.unbind_params(model, freeze=True)
  tokens = pz.nx.wrap(jnp.arange(batch * seq).reshape(batch, seq) % vocab).tag("batch", "seq")
  positions = pz.nx.wrap(jnp.tile(jnp.arange(seq)[None], (batch, 1))).tag("batch", "seq")

  def loss(values):
    bound = pz.bind_variables(unbound, [pz.ParameterValue(value=v, label=p.label)
                                        for p, v in zip(params, values)])
    logits = bound(tokens, token_positions=positions).unwrap("batch", "seq", "vocabulary")
    return jnp.mean(jnp.sin(logits.astype(jnp.float32)))
  return loss, [p.value for p in params]


def _reference_grad(name: str, size: str, dtype, params):
  """The gradient in a wider precision at the same parameter values: the model built in
  float64 (x64) for a float32 one, built in float32 for a bfloat16 one."""
  wide = jnp.float64 if jnp.dtype(dtype) == jnp.float32 else jnp.float32

  def grad():
    loss, fresh = build(name, size, wide)  # the same structure (a class made per build too)
    values = [np.asarray(a, wide) if jnp.issubdtype(a.dtype, jnp.floating) else a
              for a in jax.tree.leaves(params)]
    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(
        jax.tree.unflatten(jax.tree.structure(fresh), values)))
  if wide == jnp.float64:
    with jax.enable_x64(True):  # its layers compute in float64
      return grad()
  return grad()


def compare(name: str, size: str = "test", dtype=jnp.float32, *,
            unfused: bool = False, reference: bool = False,
            fallback: str | None = None, timed: int = 0) -> dict[str, Any]:
  """The conversion of ``name`` measured: forward equality, gradient rel L2 vs the unconverted
  model (of ``invert`` and of the hand conversion), compiled temp of the gradient and the
  bytes autodiff keeps (unconverted, by hand where there is a hand conversion, by ``invert``;
  with ``unfused``, also by ``invert(floor=False)``), the report; with ``reference``, each
  gradient's rel L2 distance to a wider-precision one (:func:`_reference_grad`);
  ``fallback``: :func:`invact_jax.invert`'s; with ``timed`` = n, the seconds from the loss to
  its compiled gradient (trace, lower, compile), unconverted and through a new ``invert``
  (its conversion and, with ``fallback``, its measurements included), the median of n tries
  of each, interleaved, without JAX's persistent compilation cache."""
  loss, params = build(name, size, dtype)
  inv = invact_jax.invert(loss, fallback=fallback)

  def grad_and_temp(f, p):  # one compilation for both (the tests' time is compilation)
    c = jax.jit(jax.grad(f)).lower(p).compile()
    return c(p), int(c.memory_analysis().temp_size_in_bytes)

  def kept(f, p) -> int:
    return sum(r.bytes for r in memory.residuals(f, p) if not r.is_argument)

  def sq(tree):
    return sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in jax.tree.leaves(tree))

  def rel(g):  # leaf by leaf (the hand-built Equinox blocks are another class)
    diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
            for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g), strict=True)]
    return (sq(diff) / sq(g0)) ** 0.5
  g0, t0 = grad_and_temp(loss, params)
  g1, t1 = grad_and_temp(inv, params)
  same = bool(jax.jit(loss)(params) == jax.jit(inv)(params))
  row = {"model": name, "size": size, "dtype": jnp.dtype(dtype).name, "fallback": fallback,
         "forward_identical": same, "grad_rel_l2": rel(g1),
         "temp_unconverted": t0, "temp_invert": t1,
         "kept_unconverted": kept(loss, params), "kept_invert": kept(inv, params)}
  if unfused:
    row["temp_invert_unfused"] = grad_and_temp(invact_jax.invert(loss, floor=False), params)[1]
  if reference:
    g_ref = _reference_grad(name, size, dtype, params)

    def err(g):
      diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
              for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True)]
      return (sq(diff) / sq(g_ref)) ** 0.5
    row["grad_error_unconverted"], row["grad_error_invert"] = err(g0), err(g1)
  if name in MODELS:
    with hand_converted(name):
      hand_loss, hand_params = build(name, size, dtype)  # the same seeds: the same values
      gh, row["temp_hand"] = grad_and_temp(hand_loss, hand_params)
      row["kept_hand"] = kept(hand_loss, hand_params)
    row["grad_rel_l2_hand"] = rel(gh)
  if timed:
    row["compile_s_unconverted"], row["compile_s_invert"] = compile_seconds(
        loss, lambda: invact_jax.invert(loss, fallback=fallback), (params,), timed)
  row["converted"] = inv.last_report.replaced
  row["left_alone"] = [list(x) for x in inv.last_report.left_alone]
  row["recomputed"] = [list(x) for x in inv.last_report.recomputed]
  return row


def compile_seconds(loss: Callable, converted: Callable[[], Callable], args: tuple,
                    tries: int) -> tuple[float, float]:
  """Median seconds from ``loss`` (and from a new ``converted()``) to the compiled gradient
  with respect to its first argument at ``args``, ``tries`` of each, interleaved; JAX's
  persistent cache and ``invert``'s remat-check figures (a first conversion's work) off
  meanwhile."""
  from invact_jax import convert  # pylint: disable=import-outside-toplevel

  def seconds(f) -> float:
    convert.forget_measurements()
    t = time.perf_counter()
    jax.jit(jax.grad(f)).lower(*args).compile()
    return time.perf_counter() - t
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    pairs = [(seconds(loss), seconds(converted())) for _ in range(tries)]
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
  return tuple(float(np.median(t)) for t in zip(*pairs))


def build(name: str, size: str = "test", dtype=jnp.float32) -> tuple[Callable, Any]:
  """``(loss, params)`` of third-party model ``name`` (one of :data:`ALL_MODELS`)."""
  if name not in ALL_MODELS:
    raise ValueError(f"argument `name`: unknown model {name!r}; choose from {ALL_MODELS}")
  if size not in SIZES:
    raise ValueError(f"argument `size`: unknown size {size!r}; choose from {tuple(SIZES)}")
  if name == "equinox":
    return _equinox(SIZES[size], dtype)
  if name == "nnx":
    return _nnx(SIZES[size], dtype)
  if name in KERAS_HUB:
    return _keras_hub(name, SIZES[size], dtype)
  if name in PENZAI:
    return _penzai(name, SIZES[size], dtype)
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
