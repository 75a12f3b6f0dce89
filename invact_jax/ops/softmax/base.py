"""The XLA implementation of the output-saving softmax: ``dx = p * (dp - sum(p * dp))``
computed from the probabilities ``p`` alone, kept in the output dtype.
"""
from __future__ import annotations

import functools

import jax

from invact_jax.ops import _common

# Captured at import: the attribute conversion patches jax.nn.softmax while it runs.
NN_SOFTMAX = jax.nn.softmax


def reference(x, axis, dtype):
  """``jax.nn.softmax`` in the compute dtype, cast to ``dtype`` (keeps f32 + the cast)."""
  return NN_SOFTMAX(x.astype(_common.compute_dtype(x.dtype)), axis=axis).astype(dtype)


def forward(x, axis, dtype, where=None):
  """``jax.nn.softmax`` itself where ``dtype`` is ``x``'s (bit for bit), else computed in
  the compute dtype and cast."""
  if jax.numpy.dtype(dtype) == x.dtype:
    return NN_SOFTMAX(x, axis=axis, where=where)
  return NN_SOFTMAX(x.astype(_common.compute_dtype(x.dtype)), axis=axis,
                    where=where).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def softmax(axis, dtype, x_dtype, x, where=None):
  """Probabilities keeping only themselves for the backward (masked-out ones are 0: their
  gradient is 0 from ``p``)."""
  del x_dtype
  return forward(x, axis, dtype, where)


def _fwd(axis, dtype, x_dtype, x, where=None):
  del x_dtype
  p = forward(x, axis, dtype, where)
  return p, p


def backward(axis: int, x_dtype, p, dp):
  """dx from the kept probabilities ``p`` (also the backward of the softmaxes
  :func:`invact_jax.invert` finds in other code)."""
  c = _common.compute_dtype(p.dtype if p.dtype == jax.numpy.float64 else x_dtype)
  pf, dpf = p.astype(c), dp.astype(c)
  dx = pf * (dpf - jax.numpy.sum(pf * dpf, axis=axis, keepdims=True))
  return dx.astype(x_dtype)


def _bwd(axis, dtype, x_dtype, p, dp):
  del dtype
  p = _common.read_apart(p)
  return backward(axis, x_dtype, p, dp), None


softmax.defvjp(_fwd, _bwd)
