"""Packing of boolean masks, 8 elements per uint8, along the last axis.

Layout (shared by every backend, so residuals are interchangeable): bit ``k`` of
byte ``j`` of a row holds element ``8 * j + k`` of that row — NumPy's
``packbits(..., axis=-1, bitorder="little")``.  A row of ``n`` elements packs into
``ceil(n / 8)`` bytes.  Packing never crosses the last axis, so an array sharded
along any axis (the last one included, in multiples of 8) packs shard-locally.
A 0-d mask is treated as a row of one element.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

__all__ = ["packed_shape", "pack_bits", "unpack_bits"]

_SHIFTS = np.arange(8, dtype=np.uint8)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of the packed mask for an array of ``shape``.

  Args:
    shape: the boolean array's shape.

  Returns:
    ``shape`` with its last axis ``ceil(n / 8)``.
  """
  if len(shape) == 0:
    return (1,)
  return (*shape[:-1], math.ceil(shape[-1] / 8))


def pack_bits(bits: jnp.ndarray) -> jnp.ndarray:
  """Packs a boolean array along its last axis into uint8 (see module doc).

  Args:
    bits: boolean array [..., n].

  Returns:
    uint8 array [..., ceil(n / 8)]: bit ``k`` of byte ``j`` holds element ``8j + k``.
  """
  if bits.ndim == 0:
    bits = bits.reshape(1)
  n = bits.shape[-1]
  pad = (-n) % 8
  if pad:
    bits = jnp.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, pad)])
  grouped = bits.reshape(*bits.shape[:-1], (n + pad) // 8, 8).astype(jnp.uint8)
  return jnp.sum(grouped << _SHIFTS, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
  """Inverse of :func:`pack_bits` for an original array of ``shape``.

  Args:
    packed: uint8 array from :func:`pack_bits`.
    shape: the original boolean array's shape.

  Returns:
    The boolean array of ``shape``.
  """
  if packed.shape != packed_shape(tuple(shape)):
    raise ValueError(f"packed mask of shape {packed.shape} does not match an array of shape "
                     f"{tuple(shape)} (expected {packed_shape(tuple(shape))})")
  bits = ((packed[..., None] >> _SHIFTS) & 1).astype(bool)
  bits = bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
  if len(shape) == 0:
    return bits[..., 0].reshape(())
  return bits[..., : shape[-1]]
