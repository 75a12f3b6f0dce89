"""Bit packing: numpy's little-endian packbits layout along the last axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from invact_jax import pack_bits, packed_shape, unpack_bits


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (8,), (9,), (3, 13), (2, 3, 16), (4, 0)])
def test_matches_numpy_packbits_and_roundtrips(shape):
  bits = np.random.default_rng(0).random(shape) < 0.5
  packed = jax.jit(pack_bits)(jnp.asarray(bits))
  assert packed.dtype == jnp.uint8
  assert packed.shape == packed_shape(shape)
  expect = np.packbits(bits.reshape(1) if bits.ndim == 0 else bits, axis=-1, bitorder="little")
  np.testing.assert_array_equal(np.asarray(packed), expect)
  np.testing.assert_array_equal(np.asarray(jax.jit(unpack_bits, static_argnums=1)(packed, shape)), bits)


def test_packed_size_is_ceil_n_over_8():
  assert packed_shape((5, 3072)) == (5, 384)
  assert packed_shape((5, 3073)) == (5, 385)


def test_unpack_rejects_mismatched_shape():
  with pytest.raises(ValueError, match="does not match"):
    unpack_bits(jnp.zeros((2, 3), jnp.uint8), (2, 32))
