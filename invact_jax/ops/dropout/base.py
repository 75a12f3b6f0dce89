"""The XLA implementation of dropout that keeps the packed mask or only the key.

``mode="regenerate"`` keeps only the PRNG key and redraws the mask in the backward (0 bytes
per element, one more RNG pass); ``mode="bits"`` keeps the mask packed 8 per byte
(:mod:`invact_jax.bitpack`).  ``jnp.where`` on a boolean mask, the usual way, keeps 1 byte
per element.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from invact_jax import bitpack


def keep_mask(key, rate, shape):
  return jax.random.bernoulli(key, 1.0 - rate, shape)


def scale_kept(x, keep, rate):
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def dropout(rate: float, mode: str, x, key):
  del mode
  return scale_kept(x, keep_mask(key, rate, x.shape), rate)


def _fwd(rate, mode, x, key):
  keep = keep_mask(key, rate, x.shape)
  y = scale_kept(x, keep, rate)
  if mode == "bits":
    return y, (bitpack.pack_bits(keep), None)
  return y, (None, key)


def _bwd(rate, mode, res, dy):
  packed, key = res
  keep = bitpack.unpack_bits(packed, dy.shape) if mode == "bits" else keep_mask(key, rate, dy.shape)
  return scale_kept(dy, keep, rate), None


dropout.defvjp(_fwd, _bwd)
