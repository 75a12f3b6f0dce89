"""invact_jax.invert finds norms and softmaxes by their algebra: hand-written
variants of every way the statistics, the radical and the affine are written, over any axes,
under vmap and scan, folded as Keras folds them; and says why it leaves a candidate alone."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from tests import jit
from tests.convert.test_program import assert_at_float32_floor

D = 32
EPS = 1e-5


def _x(shape=(4, 6, D), dtype=jnp.float32, seed=0):
  return (1.5 + 2.0 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _params(seed=7):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return 1 + 0.1 * jax.random.normal(k1, (D,)), 0.1 * jax.random.normal(k2, (D,))


def _mean(v, axis=-1):
  return jnp.mean(v, axis=axis, keepdims=True)


# LayerNorm written every way (x, scale g, bias b)
def ln_rsqrt(x, g, b):
  m = _mean(x)
  return (x - m) * jax.lax.rsqrt(_mean((x - m) ** 2) + EPS) * g + b


def ln_pow_div_sqrt(x, g, b):
  m = _mean(x)
  return b + g * ((x - m) / jnp.sqrt(_mean(jnp.power(x - m, 2)) + EPS))


def ln_fast_variance_clipped(x, g, b):
  m = _mean(x)
  var = jnp.maximum(_mean(x * x) - m * m, 0.0)
  return (x - m) * (g * jax.lax.rsqrt(var + EPS)) + b


def ln_keras_folded(x, g, b):
  m = _mean(x)
  r = jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + EPS)
  return x * (r * g) + (b - m * r * g)


def ln_reciprocal_sqrt_f32_stats(x, g, b):
  xf = x.astype(jnp.float32)
  m = _mean(xf)
  r = jnp.reciprocal(jnp.sqrt(jnp.var(xf, axis=-1, keepdims=True) + EPS))
  return ((xf - m) * r * g + b).astype(x.dtype)


def ln_pow_minus_half(x, g, b):
  m = _mean(x)
  return g * (x - m) * jnp.power(jnp.mean(jnp.square(x - m), -1, keepdims=True) + EPS, -0.5) + b


# RMSNorm written every way (x, scale g)
def rms_rsqrt(x, g, _):
  return x * jax.lax.rsqrt(_mean(x * x) + EPS) * g


def rms_gemma(x, w, _):
  xf = x.astype(jnp.float32)
  return (xf * jnp.reciprocal(jnp.sqrt(_mean(jnp.power(xf, 2)) + EPS)) * (1 + w)).astype(x.dtype)


def rms_divide(x, g, _):
  return g * (x / jnp.sqrt(_mean(jnp.square(x)) + EPS))


def rms_input_dtype_stats(x, g, _):
  return (x * jax.lax.rsqrt(_mean(x * x) + jnp.asarray(EPS, x.dtype)) * g.astype(x.dtype))


def l2_normalize(x, g, _):
  """x / ||x||: an RMSNorm up to sqrt(n) (a sum of squares, no epsilon)."""
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True) * g


def l2_normalize_f32_stats(x, g, _):
  xf = x.astype(jnp.float32)
  return (xf / jnp.sqrt(jnp.sum(xf * xf, -1, keepdims=True) + EPS) * g).astype(x.dtype)


def ln_scaled_variance(x, g, b):
  """A statistic up to a constant factor: (x - m) * rsqrt(3 var + eps)."""
  m = _mean(x)
  return (x - m) * jax.lax.rsqrt(3.0 * _mean(jnp.square(x - m)) + EPS) * g + b


def standardize_last(x, _, __):
  return jax.nn.standardize(x, axis=-1, epsilon=EPS)


def standardize_axis1(x, _, __):
  return jax.nn.standardize(x, axis=1, epsilon=EPS)


def standardize_two_axes(x, _, __):
  return jax.nn.standardize(x, axis=(1, 2), epsilon=EPS)


def ln_vmapped_rows(x, g, b):
  def row(v):
    m = jnp.mean(v)
    return (v - m) * jax.lax.rsqrt(jnp.var(v) + EPS) * g + b
  return jax.vmap(jax.vmap(row))(x)


def ln_std_plus_eps(x, g, b):
  """The annotated Transformer's LayerNorm: ``g * (x - mean) / (std + eps) + b``."""
  return g * (x - _mean(x)) / (jnp.std(x, -1, keepdims=True) + EPS) + b


def ln_unbiased_std_plus_eps(x, g, b):
  """With the unbiased standard deviation (``ddof=1``, torch's default) and a larger eps."""
  return (x - _mean(x)) / (jnp.std(x, -1, keepdims=True, ddof=1) + 1e-2) * g + b


def rms_plus_eps(x, g, _):
  """An RMSNorm dividing by the root mean square plus eps."""
  return x / (jnp.sqrt(_mean(x * x)) + 1e-2) * g


def rms_floored_variance(x, g, _):
  """``x * rsqrt(max(mean(x^2), eps))``: the variance kept from falling below eps."""
  return x * jax.lax.rsqrt(jnp.maximum(_mean(x * x), 1e-2)) * g


def ln_floored_variance(x, g, b):
  return (x - _mean(x)) * jax.lax.rsqrt(jnp.maximum(jnp.var(x, -1, keepdims=True), 1e-2)) * g + b


def l2_normalize_floored(x, g, _):
  """torch's ``F.normalize``: ``x / max(||x||, eps)``."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 0.5) * g


NORMS = {
    "rms_floored_variance": (rms_floored_variance, "rms_norm"),
    "ln_floored_variance": (ln_floored_variance, "layer_norm"),
    "l2_normalize_floored": (l2_normalize_floored, "rms_norm"),
    "ln_std_plus_eps": (ln_std_plus_eps, "layer_norm"),
    "ln_unbiased_std_plus_eps": (ln_unbiased_std_plus_eps, "layer_norm"),
    "rms_plus_eps": (rms_plus_eps, "rms_norm"),
    "ln_rsqrt": (ln_rsqrt, "layer_norm"),
    "ln_pow_div_sqrt": (ln_pow_div_sqrt, "layer_norm"),
    "ln_fast_variance_clipped": (ln_fast_variance_clipped, "layer_norm"),
    "ln_keras_folded": (ln_keras_folded, "layer_norm"),
    "ln_reciprocal_sqrt_f32_stats": (ln_reciprocal_sqrt_f32_stats, "layer_norm"),
    "ln_pow_minus_half": (ln_pow_minus_half, "layer_norm"),
    "rms_rsqrt": (rms_rsqrt, "rms_norm"),
    "rms_gemma": (rms_gemma, "rms_norm"),
    "rms_divide": (rms_divide, "rms_norm"),
    "rms_input_dtype_stats": (rms_input_dtype_stats, "rms_norm"),
    "l2_normalize": (l2_normalize, "rms_norm"),
    "l2_normalize_f32_stats": (l2_normalize_f32_stats, "rms_norm"),
    "ln_scaled_variance": (ln_scaled_variance, "layer_norm"),
    "standardize_last": (standardize_last, "layer_norm"),
    "standardize_axis1": (standardize_axis1, "layer_norm"),
    "standardize_two_axes": (standardize_two_axes, "layer_norm"),
    "ln_vmapped_rows": (ln_vmapped_rows, "layer_norm"),
}


def _loss(norm):
  def loss(x, g, b):
    z = norm(x, g, b).astype(jnp.float32)
    return jnp.sum(jnp.sin(3 * z) * jnp.cos(jnp.arange(z.shape[-1], dtype=jnp.float32)))
  return loss


def kept_bytes(fn, *args) -> int:
  """Bytes autodiff keeps for ``fn``'s backward, inputs included (a norm that keeps its input
  holds it as much as one that keeps a copy), parameter vectors excluded."""
  return sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize
             for r in memory.residuals(fn, *args) if r.shape != (D,))


# bfloat16 inputs where the dtype changes the program (statistics upcast or not, a final cast)
_BF16 = ("ln_rsqrt", "ln_keras_folded", "ln_reciprocal_sqrt_f32_stats", "rms_gemma",
         "rms_input_dtype_stats", "standardize_last", "l2_normalize_f32_stats",
         "ln_std_plus_eps")


@pytest.mark.parametrize("name, dtype", [(n, "float32") for n in sorted(NORMS)]
                         + [(n, "bfloat16") for n in _BF16])
def test_norm_written_any_way_is_converted(name, dtype):
  norm, public = NORMS[name]
  x, (g, b) = _x(dtype=jnp.dtype(dtype)), _params()
  inv = invact_jax.invert(norm)
  z = jit(inv)(x, g, b)
  assert inv.last_report.replaced == {public: 1}, inv.last_report
  np.testing.assert_array_equal(np.asarray(z), np.asarray(jit(norm)(x, g, b)))  # bit-identical
  loss = _loss(norm)
  inv_loss = invact_jax.invert(loss)
  grads = jax.jit(jax.grad(inv_loss, argnums=(0, 1, 2)))(x, g, b)
  assert inv_loss.last_report.replaced == {public: 1}
  assert_at_float32_floor(loss, (x, g, b), grads, argnums=(0, 1, 2),
                          hand_loss=None if dtype == "float32" else loss)
  assert kept_bytes(inv, x, g, b) <= 0.6 * kept_bytes(norm, x, g, b), (
      memory.residuals(inv, x, g, b), memory.residuals(norm, x, g, b))


@pytest.mark.parametrize("name", ["rms_floored_variance", "ln_floored_variance",
                                  "l2_normalize_floored"])
def test_a_floored_statistic_below_and_above_its_floor(name):
  """Rows whose statistic lies below the floor (a constant scale there: no projection term)
  and above it: the forward is the original's bit for bit and the gradient at the float32
  floor."""
  norm, public = NORMS[name]
  x, (g, b) = _x(), _params()
  x = x.at[0, :2].multiply(1e-3)  # below any of the floors
  inv = invact_jax.invert(norm)
  np.testing.assert_array_equal(np.asarray(jit(inv)(x, g, b)), np.asarray(jit(norm)(x, g, b)))
  loss = _loss(norm)
  inv_loss = invact_jax.invert(loss)
  grads = jax.jit(jax.grad(inv_loss, argnums=(0, 1, 2)))(x, g, b)
  assert inv_loss.last_report.replaced == {public: 1}, inv_loss.last_report
  assert_at_float32_floor(loss, (x, g, b), grads, argnums=(0, 1, 2))


def test_under_scan_and_vmap():
  g, b = _params()

  def stack(x):
    def layer(h, _):
      return jnp.tanh(ln_keras_folded(h, g, b)), None
    return jnp.sum(jax.lax.scan(layer, x, None, length=3)[0])
  inv = invact_jax.invert(jax.vmap(stack))
  x = _x((2, 4, 6, D))
  out = jax.jit(inv)(x)
  assert inv.last_report.replaced.get("layer_norm") == 1  # the scan body, converted once
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(jax.vmap(stack))(x)))
  gi = jax.grad(lambda x: jnp.sum(inv(x)))(x)
  gr = jax.grad(lambda x: jnp.sum(jax.vmap(stack)(x)))(x)
  np.testing.assert_allclose(np.asarray(gi), np.asarray(gr), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("fn, why", [
    # x scaled by its centred variance but not centred itself (Keras's old rms_scaling)
    (lambda x, g, b: x * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS) * g,
     "its statistics are not a LayerNorm's or an RMSNorm's"),
    # the mean behind a stop_gradient: JAX's own gradient is not the norm's
    (lambda x, g, b: (x - jax.lax.stop_gradient(_mean(x))) * jax.lax.rsqrt(
        jnp.var(x, -1, keepdims=True) + EPS) * g + b,
     "its statistics are not a LayerNorm's or an RMSNorm's"),
])
def test_what_is_not_a_norm_is_left_alone_with_its_reason(fn, why):
  x, (g, b) = _x(), _params()
  inv = invact_jax.invert(_loss(fn))
  jax.grad(inv)(x, g, b)
  assert "layer_norm" not in inv.last_report.replaced
  assert "rms_norm" not in inv.last_report.replaced
  assert any(why in y for _, _, y in inv.last_report.left_alone), inv.last_report.left_alone


def test_escaping_statistics_are_reported():
  x, (g, b) = _x(), _params()

  def loss(x):
    m = _mean(x)
    r = jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + EPS)
    return jnp.sum(jnp.sin((x - m) * r * g + b)) + jnp.sum(r)  # the statistic used again
  inv = invact_jax.invert(loss)
  jax.grad(inv)(x)
  assert "layer_norm" not in inv.last_report.replaced
  assert any("escape" in y for _, _, y in inv.last_report.left_alone), inv.last_report.left_alone


SOFTMAXES = {
    "axis_minus_2": lambda q, k, v: jax.nn.softmax(q, axis=-2) * v,
    "axis_1": lambda q, k, v: jax.nn.softmax(q, axis=1) * v,
    "masked": lambda q, k, v: jax.nn.softmax(jnp.where(k > 0, q, -1e9), axis=-1) * v,
    # unshifted, its exponentials written twice (one computation, as XLA merges them)
    "exp_written_twice": lambda q, k, v: jnp.exp(q) / jnp.sum(jnp.exp(q), -1, keepdims=True) * v,
    # ... and shifted, the shift written twice too (the exponentials of values computed alike)
    "shifted_written_twice": lambda q, k, v: jnp.exp(q - q.max(-1, keepdims=True)) / jnp.sum(
        jnp.exp(q - q.max(-1, keepdims=True)), -1, keepdims=True) * v,
    # jax.nn.softmax(where=): the masked entries 0, and their gradient
    "where": lambda q, k, v: jax.nn.softmax(q, axis=-1, where=k > 0) * v,
    "where_axis_1": lambda q, k, v: jax.nn.softmax(q, axis=1, where=k > -0.5) * v,
    # ... under a mask of fewer dimensions, spread by each where (a causal [T, T] mask, a
    # per-key padding mask passed in)
    "where_causal": lambda q, k, v: jax.nn.softmax(
        q, axis=-1, where=jnp.tril(jnp.ones((4, 16), bool), 8)) * v,
    "where_padding": lambda q, k, v: jax.nn.softmax(q, axis=-1, where=k[:, :1, :1, :] > 0) * v,
    "dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla"),
    "dot_product_attention_causal": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", is_causal=True),
}


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmax_over_any_axis_and_behind_transposes(name):
  f = SOFTMAXES[name]
  q, k, v = (_x((2, 8, 4, 16), seed=s) for s in range(3))

  def loss(q, k, v):
    return jnp.sum(jnp.sin(f(q, k, v)))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv, argnums=(0, 1, 2)))(q, k, v)
  assert inv.last_report.replaced == {"softmax": 1}, inv.last_report
  fz = invact_jax.invert(f)
  np.testing.assert_array_equal(np.asarray(jit(fz)(q, k, v)), np.asarray(jit(f)(q, k, v)))
  assert_at_float32_floor(loss, (q, k, v), g, argnums=(0, 1, 2))
  assert kept_bytes(inv, q, k, v) <= kept_bytes(loss, q, k, v)


def test_a_softmax_summed_in_float32_is_found_in_bfloat16():
  """jax.nn.softmax of a bfloat16 array sums in float32 and casts the sum back."""
  q = _x((2, 8, 4, 16), jnp.bfloat16)

  def loss(q):
    return jnp.sum(jnp.sin(jax.nn.softmax(q, axis=-1).astype(jnp.float32)))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(q)
  assert inv.last_report.replaced == {"softmax": 1}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  np.testing.assert_array_equal(np.asarray(jit(inv)(q)), np.asarray(jit(loss)(q)))
  assert_at_float32_floor(loss, (q,), g, hand_loss=loss)
  assert kept_bytes(inv, q) < kept_bytes(loss, q)


def test_a_masked_softmax_in_bfloat16_and_a_mask_on_the_sum_alone():
  """jax.nn.softmax(where=) of bfloat16 (the sum in float32) is found; exponentials summed
  under a mask but not masked themselves (their masked entries not 0) are no softmax: left
  as written."""
  q, k = _x((2, 8, 4, 16), jnp.bfloat16), _x((2, 8, 4, 16), seed=1)

  def loss(q, k):
    return jnp.sum(jnp.sin(jax.nn.softmax(q, axis=-1, where=k > 0).astype(jnp.float32)))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(q, k)
  assert inv.last_report.replaced == {"softmax": 1}, inv.last_report
  np.testing.assert_array_equal(np.asarray(jit(inv)(q, k)), np.asarray(jit(loss)(q, k)))
  assert_at_float32_floor(lambda q: loss(q, k), (q,), g, hand_loss=lambda q: loss(q, k))

  def sum_masked(q, k):
    e = jnp.exp(q - jax.lax.stop_gradient(jnp.max(q, -1, keepdims=True)))
    return jnp.sum(jnp.sin(e / jnp.sum(jnp.where(k > 0, e, 0.0), -1, keepdims=True)))
  q32 = q.astype(jnp.float32)
  inv = invact_jax.invert(sum_masked)
  g = jax.jit(jax.grad(inv))(q32, k)
  assert "softmax" not in inv.last_report.replaced, inv.last_report
  np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.jit(jax.grad(sum_masked))(q32, k)))


def test_two_norms_of_one_input_are_both_found():
  """GPT-NeoX's parallel block normalizes the same x twice (attention and MLP branches)."""
  (g1, b1), (g2, b2) = _params(7), _params(8)

  def loss(x):
    return jnp.sum(jnp.sin(ln_rsqrt(x, g1, b1)) * jnp.cos(ln_keras_folded(x, g2, b2)))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(_x())
  assert inv.last_report.replaced == {"layer_norm": 2}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  assert_at_float32_floor(loss, (_x(),), g)


def test_an_epsilon_passed_into_a_scan_is_a_constant():
  """Stacked layers (penzai's layer stack): the norm's epsilon is a constant of the enclosing
  program that the scan body receives as an input."""
  g, _ = _params()
  eps = jnp.float32(1e-6)

  def loss(x):
    def layer(h, _):
      hf = h * jax.lax.rsqrt(_mean(h * h) + eps)  # eps: a closed-over array, a scan constant
      return jnp.tanh(hf * g), None
    return jnp.sum(jax.lax.scan(layer, x, None, length=2)[0])
  inv = invact_jax.invert(loss)
  g_inv = jax.jit(jax.grad(inv))(_x())
  assert inv.last_report.replaced == {"rms_norm": 1, "tanh": 1}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  assert_at_float32_floor(loss, (_x(),), g_inv)
