"""Softmax that keeps only its output, and dropout that keeps a bit mask or nothing.

* :func:`softmax`: ``p = softmax(x)`` with backward ``dx = p * (dp - sum(p * dp))`` from
  ``p`` alone, kept in the output dtype.  In attention, ``p`` is the input of the P @ V
  matmul, which keeps it anyway, so the softmax adds no residual of its own; ``dtype=``
  lets float32 logits produce bfloat16 probabilities in one op (the cast then costs no
  second copy).
* :func:`dropout`: ``mode="regenerate"`` keeps only the PRNG key and redraws the mask in
  the backward (0 bytes per element, one more RNG pass); ``mode="bits"`` keeps the mask
  packed 8 per byte (the layout of :mod:`invact_jax._bitpack`).  ``jnp.where`` on a
  boolean mask, the usual way, keeps 1 byte per element.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from invact_jax import _bitpack

__all__ = ["softmax", "softmax_reference", "dropout", "dropout_reference"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")
# Captured at import: invact_jax.inverted() patches jax.nn.softmax while it runs.
_NN_SOFTMAX = jax.nn.softmax


def _float_dtype(fn, arg, dtype):
  d = jnp.dtype(dtype)
  if d.name not in _FLOATS:
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be floating point, got {d}")
  return d


def _compute(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _softmax(axis, dtype, x):
  return _NN_SOFTMAX(x.astype(_compute(x.dtype)), axis=axis).astype(dtype)


def _softmax_fwd(axis, dtype, x):
  p = _softmax(axis, dtype, x)
  return p, (p, jnp.zeros((0,), x.dtype))


def _softmax_bwd(axis, dtype, res, dp):
  del dtype
  p, x_like = res
  c = _compute(p.dtype if p.dtype == jnp.float64 else x_like.dtype)
  pf, dpf = p.astype(c), dp.astype(c)
  dx = pf * (dpf - jnp.sum(pf * dpf, axis=axis, keepdims=True))
  return (dx.astype(x_like.dtype),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(x, axis: int = -1, *, dtype=None):
  """Softmax keeping only its output for the backward (in ``dtype``, default ``x.dtype``).

  Computed in float32 (float64 for float64 inputs); fully masked rows (all -inf) give NaN
  as ``jax.nn.softmax`` does.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> invact_jax.softmax(jnp.array([0.0, 0.0])).tolist()
    [0.5, 0.5]
  """
  if not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  _float_dtype("softmax", "x", x.dtype)
  out = _float_dtype("softmax", "dtype", x.dtype if dtype is None else dtype)
  if not isinstance(axis, int):
    raise TypeError(f"invact_jax.softmax: argument `axis` must be an int, got {axis!r}")
  return _softmax(axis, out, x)


def softmax_reference(x, axis: int = -1, *, dtype=None):
  """``jax.nn.softmax`` in float32, cast to ``dtype``: the baseline (keeps f32 + cast)."""
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  return _NN_SOFTMAX(x.astype(_compute(x.dtype)), axis=axis).astype(out)


# -------------------------------------------------------------------------------- dropout
def _keep_mask(key, rate, shape):
  return jax.random.bernoulli(key, 1.0 - rate, shape)


def _apply(x, keep, rate):
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dropout(rate, mode, x, key):
  del mode
  return _apply(x, _keep_mask(key, rate, x.shape), rate)


def _dropout_fwd(rate, mode, x, key):
  keep = _keep_mask(key, rate, x.shape)
  y = _apply(x, keep, rate)
  if mode == "bits":
    return y, (_bitpack.pack_bits(keep), None)
  return y, (None, key)


def _dropout_bwd(rate, mode, res, dy):
  packed, key = res
  if mode == "bits":
    keep = _bitpack.unpack_bits(packed, dy.shape)
  else:
    keep = _keep_mask(key, rate, dy.shape)
  return _apply(dy, keep, rate), None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x, rate: float, key, *, mode: str = "regenerate"):
  """Inverted-scaling dropout (keep with prob. ``1 - rate``, scale by ``1/(1 - rate)``).

  Same mask as :func:`dropout_reference` for the same key.  ``mode="regenerate"`` keeps
  nothing but the key; ``"bits"`` keeps the mask packed 8 per byte.  ``key=None`` or
  ``rate=0`` is the identity.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> y = invact_jax.dropout(jnp.ones(8), 0.5, jax.random.key(0))
    >>> bool(jnp.all((y == 0) | (y == 2)))
    True
  """
  if mode not in ("regenerate", "bits"):
    raise ValueError(f"invact_jax.dropout: argument `mode` must be 'regenerate' or 'bits', "
                     f"got {mode!r}")
  rate = float(rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"invact_jax.dropout: argument `rate` must be in [0, 1), got {rate}")
  if not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  _float_dtype("dropout", "x", x.dtype)
  if key is None or rate == 0.0:
    return x
  return _dropout(rate, mode, x, key)


def dropout_reference(x, rate: float, key):
  """``jnp.where(bernoulli(key), x / (1 - rate), 0)`` with JAX's autodiff (keeps a bool mask)."""
  if key is None or rate == 0.0:
    return x
  return _apply(x, _keep_mask(key, rate, x.shape), rate)
