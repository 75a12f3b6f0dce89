"""Public softmax that keeps only its output for the backward.

In attention ``p`` is the input of the P @ V matmul, which keeps it anyway, so the softmax
adds no residual of its own; ``dtype=`` lets float32 logits produce bfloat16 probabilities
in one op (the cast then costs no second copy).
"""
from __future__ import annotations

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.softmax import base

__all__ = ["softmax", "softmax_reference"]

#: How this op can run: XLA only (no kernels).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {"xla": _implementation.XLA}


def softmax(x, axis: int = -1, *, dtype=None, implementation=None):
  """Softmax keeping only its output for the backward (in ``dtype``, default ``x.dtype``).

  Computed in float32 (float64 for float64 inputs); fully masked rows (all -inf) give NaN
  as ``jax.nn.softmax`` does.

  Args:
    x: floating-point array.
    axis: the axis to normalize over (a Python or NumPy integer).
    dtype: output dtype, also the dtype the probabilities are kept in.
    implementation: None / "xla" (softmax has no kernels).

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> invact_jax.softmax(jnp.array([0.0, 0.0])).tolist()
    [0.5, 0.5]
  """
  x = _common.float_array("softmax", "x", x)
  out = _common.float_dtype("softmax", "dtype", x.dtype if dtype is None else dtype)
  ax = _common.static_axis("softmax", "axis", axis, max(x.ndim, 1))
  _implementation.resolve(implementation, op="softmax", implementations=IMPLEMENTATIONS,
                         options=())
  return base.softmax(ax if x.ndim else -1, out, x.dtype, x)


def softmax_reference(x, axis: int = -1, *, dtype=None):
  """``jax.nn.softmax`` in float32, cast to ``dtype``: the baseline (keeps f32 + cast)."""
  x = _common.float_array("softmax_reference", "x", x)
  return base.reference(x, axis, x.dtype if dtype is None else _common.float_dtype(
      "softmax_reference", "dtype", dtype))
