"""Dropout keeping the packed mask or only the key: same masks and gradients as the usual way."""
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import invact_jax
from invact_jax import memory


class DropoutTest(parameterized.TestCase):

  @parameterized.parameters("regenerate", "bits")
  def test_same_mask_and_gradient_as_reference(self, mode):
    x = jax.random.normal(jax.random.key(0), (4, 5, 24))
    key = jax.random.key(1)
    w = jnp.cos(jnp.arange(24.0))
    y = invact_jax.dropout(x, 0.1, key, mode=mode)
    np.testing.assert_array_equal(y, invact_jax.dropout_reference(x, 0.1, key))
    g = jax.grad(lambda x: jnp.sum(invact_jax.dropout(x, 0.1, key, mode=mode) * w))(x)
    g_ref = jax.grad(lambda x: jnp.sum(invact_jax.dropout_reference(x, 0.1, key) * w))(x)
    np.testing.assert_array_equal(g, g_ref)
    g_jit = jax.jit(jax.grad(lambda x, k: jnp.sum(invact_jax.dropout(x, 0.1, k, mode=mode) * w)))(
        x, key)
    np.testing.assert_array_equal(g_jit, g_ref)

  def test_residuals(self):
    x = jnp.ones((4, 64))
    key = jax.random.key(1)

    def kept(fn):
      return [(r.shape, r.dtype) for r in memory.residuals(lambda x: jnp.sum(fn(x) * 2.0), x)
              if not r.is_argument and r.bytes]
    self.assertEqual(kept(lambda x: invact_jax.dropout(x, 0.1, key, mode="bits")),
                     [((4, 8), "uint8")])
    regen = kept(lambda x: invact_jax.dropout(x, 0.1, key, mode="regenerate"))
    self.assertFalse([r for r in regen if r[0] == (4, 64) or r[0] == (4, 8)], regen)
    self.assertIn(((4, 64), "bool"), kept(lambda x: invact_jax.dropout_reference(x, 0.1, key)))

  def test_identity_and_errors(self):
    x = jnp.ones(3)
    self.assertIs(invact_jax.dropout(x, 0.1, None), x)
    with self.assertRaisesRegex(ValueError, "argument `rate`"):
      invact_jax.dropout(x, 1.0, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "argument `mode`"):
      invact_jax.dropout(x, 0.1, jax.random.key(0), mode="store")
    with self.assertRaisesRegex(TypeError, "invact_jax.dropout: argument `rate`.*traced"):
      jax.jit(lambda r: invact_jax.dropout(x, r, jax.random.key(0)))(0.1)
    with self.assertRaisesRegex(TypeError, "argument `key`"):
      invact_jax.dropout(x, 0.1, 7)

  def test_vmap_and_scan(self):
    x = jax.random.normal(jax.random.key(0), (3, 16))
    keys = jax.random.split(jax.random.key(1), 3)
    f = lambda x, k: invact_jax.dropout(x, 0.25, k, mode="bits")  # noqa: E731
    np.testing.assert_array_equal(jax.vmap(f)(x, keys),
                                  jnp.stack([invact_jax.dropout_reference(a, 0.25, k)
                                             for a, k in zip(x, keys)]))
