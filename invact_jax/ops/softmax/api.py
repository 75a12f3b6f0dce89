"""Public softmax that keeps only its output for the backward.

In attention ``p`` is the input of the P @ V matmul, which keeps it anyway, so the softmax
adds no residual of its own; ``dtype=`` lets float32 logits produce bfloat16 probabilities
in one op (the cast then costs no second copy).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.softmax import base

__all__ = ["softmax", "softmax_reference"]

#: How this op can run: XLA only (no kernels).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {"xla": _implementation.XLA}


def softmax(x: ArrayLike, axis: int | tuple[int, ...] = -1, where: ArrayLike | None = None, *,
            dtype: DTypeLike | None = None,
            implementation: _implementation.ImplementationLike = None) -> jax.Array:
  """Softmax keeping only its output for the backward, ``jax.nn.softmax``'s signature.

  Without ``dtype`` (or with ``x``'s) the forward is ``jax.nn.softmax`` itself, bit for bit,
  in ``x``'s dtype; with another ``dtype`` it is computed in float32 (float64 for float64
  inputs) and cast, so that float32 logits give, say, bfloat16 probabilities in one op.
  Fully masked rows (all -inf) give NaN as ``jax.nn.softmax`` does.

  Args:
    x: floating-point array.
    axis: the axis, or a tuple of axes, to normalize over (Python or NumPy integers).
    where: elements to include (a boolean array broadcastable to ``x``); the others get
      probability 0 and no gradient, as in ``jax.nn.softmax``.
    dtype: output dtype, also the dtype the probabilities are kept in.
    implementation: None / "xla" (softmax has no kernels).

  Returns:
    The probabilities, ``x``'s shape, in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> invact_jax.softmax(jnp.array([0.0, 0.0])).tolist()
    [0.5, 0.5]
  """
  x = _common.float_array("softmax", "x", x)
  out = _common.float_dtype("softmax", "dtype", x.dtype if dtype is None else dtype)
  axes = axis if isinstance(axis, tuple) else (axis,)
  if not axes:
    raise ValueError("invact_jax.softmax: argument `axis` must name at least one axis")
  ax = tuple(_common.static_axis("softmax", "axis", a, max(x.ndim, 1)) for a in axes)
  if len(set(ax)) != len(ax):
    raise ValueError(f"invact_jax.softmax: argument `axis` repeats an axis: {axis!r}")
  _implementation.resolve(implementation, op="softmax", implementations=IMPLEMENTATIONS,
                         options=())
  if where is not None:
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"invact_jax.softmax: argument `where` must be a boolean array, got "
                      f"dtype {where.dtype}")
    try:
      where = jnp.broadcast_to(where, x.shape)
    except ValueError:
      raise ValueError(f"invact_jax.softmax: argument `where` of shape {where.shape} does not "
                       f"broadcast to x's {x.shape}") from None
  ax = (ax if len(ax) > 1 else ax[0]) if x.ndim else -1
  return base.softmax(ax, out, x.dtype, x, where)


def softmax_reference(x: ArrayLike, axis: int = -1, *, dtype: DTypeLike | None = None
                      ) -> jax.Array:
  """``jax.nn.softmax`` in float32, cast to ``dtype``: the baseline (keeps f32 + cast).

  Args:
    x: floating-point array.
    axis: the axis to normalize over.
    dtype: output dtype (default: ``x.dtype``).

  Returns:
    The probabilities, differentiated by JAX.
  """
  x = _common.float_array("softmax_reference", "x", x)
  return base.reference(x, axis, x.dtype if dtype is None else _common.float_dtype(
      "softmax_reference", "dtype", dtype))
