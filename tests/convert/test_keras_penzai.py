"""invact_jax.invert on Keras 3 layers (JAX backend, through ``stateless_call``) and penzai
layers and models, unmodified, at random init: every norm and softmax converted,
the forward bit-identical, gradients as close to float64 as the original's, fewer residuals."""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from tests import jit
from tests.convert.test_program import assert_at_float32_floor

os.environ.setdefault("KERAS_BACKEND", "jax")


def _x(shape=(2, 5, 16), seed=0):
  return 1.0 + 2.0 * jax.random.normal(jax.random.key(seed), shape)


def _kept(fn, *args) -> int:
  return sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize
             for r in memory.residuals(fn, *args) if len(r.shape) > 1)


def _keras_layers():
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend")
  return {
      "LayerNormalization": (keras.layers.LayerNormalization(epsilon=1e-5), "layer_norm"),
      "LayerNormalization(center=False)": (keras.layers.LayerNormalization(center=False),
                                           "layer_norm"),
      "LayerNormalization(no affine)": (keras.layers.LayerNormalization(center=False,
                                                                          scale=False),
                                        "layer_norm"),
      "LayerNormalization(axis=1)": (keras.layers.LayerNormalization(axis=1), "layer_norm"),
      "RMSNormalization": (keras.layers.RMSNormalization(), "rms_norm"),
      "Softmax": (keras.layers.Softmax(), "softmax"),
      "Softmax(axis=1)": (keras.layers.Softmax(axis=1), "softmax"),
  }


@pytest.mark.parametrize("name", ["LayerNormalization", "LayerNormalization(center=False)",
                                  "LayerNormalization(no affine)", "LayerNormalization(axis=1)",
                                  "RMSNormalization", "Softmax", "Softmax(axis=1)"])
def test_keras_layers(name):
  layer, public = _keras_layers()[name]
  x = _x()
  layer.build(x.shape)
  weights = [w.value for w in layer.trainable_weights]

  def f(weights, x):
    return layer.stateless_call(weights, [], x)[0]

  def loss(weights, x):
    return jnp.sum(jnp.sin(3 * f(weights, x)))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(weights, x)
  assert inv.last_report.replaced == {public: 1}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  np.testing.assert_array_equal(np.asarray(jit(invact_jax.invert(f))(weights, x)),
                                np.asarray(jit(f)(weights, x)))
  assert_at_float32_floor(loss, (weights, x), g, argnums=(0, 1))
  limit = 1.0 if public == "softmax" else 0.6
  assert _kept(invact_jax.invert(f), weights, x) <= limit * _kept(f, weights, x)


def _penzai():
  pytest.importorskip("penzai")
  from penzai import pz  # pylint: disable=import-outside-toplevel
  return pz


def _keras_losses():
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend")
  v = 40
  y = jax.random.randint(jax.random.key(3), (2, 5), 0, v)
  weights = (jnp.arange(10).reshape(2, 5) % 4 != 0).astype(jnp.float32)
  sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  dense = keras.losses.CategoricalCrossentropy(from_logits=True)
  return {
      # the loss objects' reduction ("sum_over_batch_size", a division guarded against zero)
      "SparseCategoricalCrossentropy(sample_weight)": lambda z: sparse(y, z, sample_weight=weights),
      "CategoricalCrossentropy": lambda z: dense(keras.ops.one_hot(y, v), z),
      "categorical_crossentropy(label_smoothing)": lambda z: keras.ops.mean(
          keras.losses.categorical_crossentropy(keras.ops.one_hot(y, v), z, from_logits=True,
                                                label_smoothing=0.1)),
      "sparse_categorical_crossentropy(masked)": lambda z: keras.ops.sum(
          keras.losses.sparse_categorical_crossentropy(y, z, from_logits=True) * weights)
      / keras.ops.sum(weights),
  }


@pytest.mark.parametrize("name", ["SparseCategoricalCrossentropy(sample_weight)",
                                  "CategoricalCrossentropy",
                                  "categorical_crossentropy(label_smoothing)",
                                  "sparse_categorical_crossentropy(masked)"])
def test_keras_losses_on_a_head_are_the_lm_head(name):
  """Keras's cross-entropies (the one-hot made before the logits' matmul, the labels copied,
  the smoothing's ``s / V`` computed) on ``x @ w``: found, its reduction folded in, the loss as
  the original's up to the chunked log-sum-exp's order, the gradients at float32's floor."""
  loss = _keras_losses()[name]
  x = _x((2, 5, 16))
  w = jax.random.normal(jax.random.key(4), (16, 40)) / 4
  f = lambda x, w: loss(x @ w)  # noqa: E731
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  (form,) = inv.last_report.forms
  assert "folded in" in form, form
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w)), rtol=2e-6)
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


def test_penzai_standardize_and_softmax_layers():
  pz = _penzai()
  x = _x((2, 5, 16))

  def f(x):
    v = pz.nx.wrap(x).tag("batch", "seq", "embedding")
    v = pz.nn.RMSStandardize(across=("embedding",), epsilon=1e-6)(v)
    v = pz.nn.Standardize(across=("embedding",), epsilon=1e-6)(v)
    v = pz.nn.Softmax(("seq",))(v)
    return jnp.sum(jnp.sin(3 * v.unwrap("batch", "seq", "embedding")))
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv))(x)
  assert inv.last_report.replaced == {"rms_norm": 1, "layer_norm": 1, "softmax": 1}, \
      inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  assert_at_float32_floor(f, (x,), g)


def _penzai_llama():
  pz = _penzai()
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=import-outside-toplevel
  cfg = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=32, projection_dim=8,
      mlp_hidden_dim=64, num_decoder_blocks=2, vocab_size=50, mlp_variant="swiglu",
      tie_embedder_and_logits=False)
  model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
  unbound, params = pz.unbind_params(model, freeze=True)
  tokens = pz.nx.wrap(jnp.arange(16).reshape(2, 8) % 50).tag("batch", "seq")
  positions = pz.nx.wrap(jnp.tile(jnp.arange(8)[None], (2, 1))).tag("batch", "seq")

  def loss(values):
    bound = pz.bind_variables(unbound, [pz.ParameterValue(value=v, label=p.label)
                                        for p, v in zip(params, values)])
    logits = bound(tokens, token_positions=positions).unwrap("batch", "seq", "vocabulary")
    return jnp.mean(jnp.sin(logits))
  return loss, [p.value for p in params]


def test_penzai_llama():
  """Every RMSNorm of penzai's Llama (its embedding axis moved to the front by named-axis
  transposes) and every softmax: converted, none left alone."""
  loss, values = _penzai_llama()
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(values)
  assert inv.last_report.replaced == {"rms_norm": 5, "silu": 2, "softmax": 2}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  assert_at_float32_floor(loss, (values,), g)
  assert _kept(inv, values) <= _kept(loss, values)


@pytest.mark.parametrize("name", ["penzai_llama_stacked", "penzai_gemma2", "penzai_gpt_neox",
                                  "keras_gemma", "keras_vit"])
def test_penzai_and_keras_hub_models(name):
  """penzai's layer-stacked Llama (the norms' epsilon a scan constant), Gemma 2 (post norms,
  tanh soft caps) and GPT-NeoX (two norms of one input), and keras-hub backbones where
  keras-hub is installed (it is a benchmark dependency): every norm, softmax and activation
  converted, none left alone, the forward bit-identical, at most 60 % of the bytes kept."""
  from models import third_party  # pylint: disable=import-outside-toplevel
  pytest.importorskip(third_party.requirement(name))
  loss, params = third_party.build(name, "test")
  inv = invact_jax.invert(loss)
  assert float(jit(inv)(params)) == float(jit(loss)(params))
  assert inv.last_report.replaced == third_party.expected(name, 2), inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  kept = lambda f: sum(r.bytes for r in memory.residuals(f, params) if not r.is_argument)  # noqa: E731
  assert kept(inv) <= 0.6 * kept(loss), (kept(inv), kept(loss))
