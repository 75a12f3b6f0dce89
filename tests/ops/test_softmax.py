"""Softmax keeping only its output: gradients at the storage floor, residuals, errors."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import parameterized

import invact_jax
from invact_jax import memory

DTYPES = ("float32", "bfloat16", "float16")


def _np(dt):
  return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


class SoftmaxTest(parameterized.TestCase):

  @parameterized.product(dtype=DTYPES, axis=(-1, 1, np.int64(0)))
  def test_gradient_vs_float64_at_the_storage_floor(self, dtype, axis):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(4, 3, 16)) * 4).astype(np.float32)
    w = rng.normal(size=x.shape)
    p, vjp = jax.vjp(lambda x: invact_jax.softmax(x, axis=axis, dtype=_np(dtype)), jnp.asarray(x))
    self.assertEqual(p.dtype, jnp.dtype(_np(dtype)))
    dp = w.astype(_np(dtype))
    (dx,) = vjp(jnp.asarray(dp))
    ax = int(axis)
    x64, dp64 = x.astype(np.float64), dp.astype(np.float64)
    p64 = np.exp(x64 - x64.max(ax, keepdims=True))
    p64 /= p64.sum(ax, keepdims=True)
    grad = lambda p: p * (dp64 - (p * dp64).sum(ax, keepdims=True))  # noqa: E731
    want = grad(p64)
    floor = np.max(np.abs(grad(p64.astype(_np(dtype)).astype(np.float64)) - want))
    err = np.max(np.abs(np.asarray(dx, np.float64) - want))
    # jax.nn's own gradient on this device: XLA:GPU's float32 exp errs by ~2 ulp, so its p
    # (and ours, the same forward) is further from float64 than rounding alone (H100: our
    # error 1.005x the bound below); ours must then be no worse than jax.nn's.
    _, vjp_nn = jax.vjp(lambda x: jax.nn.softmax(x, axis=ax).astype(_np(dtype)), jnp.asarray(x))
    err_nn = np.max(np.abs(np.asarray(vjp_nn(jnp.asarray(dp))[0], np.float64) - want))
    bound = 1.5 * floor + 4 * np.finfo(np.float32).eps * np.max(np.abs(want))
    self.assertLessEqual(err, max(bound, 1.25 * err_nn))

  def test_keeps_only_the_output(self):
    x = jnp.ones((2, 8, 8))
    kept = [r for r in memory.residuals(
        lambda x: jnp.sum(jnp.einsum("bqk,bkd->bqd", invact_jax.softmax(x, dtype=jnp.bfloat16),
                                     jnp.ones((2, 8, 4), jnp.bfloat16)).astype(jnp.float32)), x)
            if not r.is_argument and r.bytes]
    # The bf16 probabilities (kept by the matmul too: one buffer) and nothing in float32.
    self.assertTrue(all(r.dtype == "bfloat16" for r in kept if r.shape == (2, 8, 8)), kept)
    self.assertFalse([r for r in kept if r.shape == (2, 8, 8) and r.dtype == "float32"])

  def test_masked_rows_and_errors(self):
    x = jnp.array([[0.0, -jnp.inf], [-jnp.inf, -jnp.inf]])
    np.testing.assert_array_equal(np.isnan(invact_jax.softmax(x)), np.isnan(jax.nn.softmax(x)))
    with self.assertRaisesRegex(TypeError, "argument `x`"):
      invact_jax.softmax(jnp.ones(3, jnp.int32))
    with self.assertRaisesRegex(TypeError, "argument `dtype`"):
      invact_jax.softmax(jnp.ones(3), dtype=jnp.int8)
    with self.assertRaisesRegex(TypeError, "argument `axis` must be an integer"):
      invact_jax.softmax(jnp.ones(3), axis=1.5)
    with self.assertRaisesRegex(ValueError, "argument `axis` repeats"):
      invact_jax.softmax(jnp.ones((2, 3)), axis=(1, -1))
    with self.assertRaisesRegex(TypeError, "argument `where` must be a boolean"):
      invact_jax.softmax(jnp.ones(3), where=jnp.ones(3))
    with self.assertRaisesRegex(ValueError, "argument `where` of shape"):
      invact_jax.softmax(jnp.ones((2, 3)), where=jnp.ones((4,), bool))
    with self.assertRaisesRegex(ValueError, "argument `axis` = 2 is out of range"):
      invact_jax.softmax(jnp.ones(3), axis=2)

  def test_transforms(self):
    x = jax.random.normal(jax.random.key(0), (3, 4, 8))
    f = lambda x: jnp.sum(jnp.sin(invact_jax.softmax(x)))  # noqa: E731
    fr = lambda x: jnp.sum(jnp.sin(invact_jax.softmax_reference(x)))  # noqa: E731
    g = jax.grad(fr)(x)
    for fn in (jax.grad(f), jax.jit(jax.grad(f)), jax.vmap(jax.grad(f)), jax.grad(jax.checkpoint(f))):
      np.testing.assert_allclose(fn(x), g, rtol=1e-5, atol=1e-6)


  @parameterized.product(dtype=DTYPES)
  def test_forward_is_jax_nn_softmax_bit_for_bit(self, dtype):
    x = jax.random.normal(jax.random.key(0), (4, 3, 16)).astype(_np(dtype)) * 3
    for kw in ({}, {"axis": 1}, {"axis": (0, 2)}):
      np.testing.assert_array_equal(np.asarray(invact_jax.softmax(x, **kw), np.float32),
                                    np.asarray(jax.nn.softmax(x, **kw), np.float32))

  @parameterized.product(axis=(-1, (0, 2)))
  def test_where_and_tuple_axes_match_jax_nn(self, axis):
    x = jax.random.normal(jax.random.key(1), (4, 3, 16))
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (4, 1, 16))
    w = jax.random.normal(jax.random.key(3), x.shape)
    ours = lambda x: jnp.sum(w * invact_jax.softmax(x, axis=axis, where=mask))  # noqa: E731
    theirs = lambda x: jnp.sum(w * jax.nn.softmax(x, axis=axis, where=mask))  # noqa: E731
    np.testing.assert_array_equal(invact_jax.softmax(x, axis=axis, where=mask),
                                  jax.nn.softmax(x, axis=axis, where=mask))
    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(theirs)(x), rtol=1e-5, atol=1e-6)
