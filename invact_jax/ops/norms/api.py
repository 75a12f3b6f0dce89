"""Public output-saving norms: LayerNorm / RMSNorm and the fused norm -> dense unit.

Forward matches ``flax.nnx.LayerNorm``/``RMSNorm`` (statistics in float32, two-pass
variance); the backward keeps only ``xhat`` (output dtype) and float32 ``rstd`` per row.
``implementation=`` as for every invact_jax op: None/"xla", "pallas" or "triton" (row kernels).
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.norms import base
from invact_jax.ops.norms import pallas
from invact_jax.ops.norms import triton

__all__ = ["layer_norm", "rms_norm", "layer_norm_reference", "rms_norm_reference",
           "layer_norm_dense", "rms_norm_dense", "norm_dense_reference"]

#: How the norms can run: name -> implementation (kernel options set by ``resolve``).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {
    "xla": base.XLA, "pallas": pallas.PallasNorm(), "triton": triton.TritonNorm()}
_OPTIONS = ("interpret",)

Array = jax.Array
ImplementationLike = _implementation.ImplementationLike


def _check(fn: str, x, scale, bias, dtype, epsilon):
  """``x`` as a floating array, after one line naming the first of ``scale``, ``bias``, ``dtype``
  or ``epsilon`` not of its kind or shape."""
  x = _common.float_array(fn, "x", x)
  if x.ndim < 1:
    raise ValueError(f"invact_jax.{fn}: argument `x` must have at least 1 dimension, got a scalar")
  n = x.shape[-1]
  for arg, v in (("scale", scale), ("bias", bias)):
    if v is not None:
      if not hasattr(v, "shape"):
        raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be an array of shape ({n},) or "
                        f"None, got {type(v).__name__}")
      if tuple(v.shape) != (n,):
        raise ValueError(f"invact_jax.{fn}: argument `{arg}` must have shape ({n},) (the last "
                         f"axis of x), got {tuple(v.shape)}")
      _common.float_array(fn, arg, v)
  out = _common.float_dtype(fn, "dtype", x.dtype if dtype is None else dtype)
  eps = _common.static_scalar(fn, "epsilon", epsilon)
  if not eps >= 0 or math.isinf(eps):
    raise ValueError(f"invact_jax.{fn}: argument `epsilon` must be finite and >= 0, got {eps}")
  return x, out, eps


def _implementation_of(fn, implementation):
  return _implementation.resolve(implementation, op=fn, implementations=IMPLEMENTATIONS,
                                 options=_OPTIONS)


def layer_norm(x: ArrayLike, scale: ArrayLike | None = None, bias: ArrayLike | None = None, *,
               epsilon: float = 1e-6, dtype: DTypeLike | None = None,
               implementation: ImplementationLike = None) -> Array:
  """LayerNorm over the last axis that keeps only ``xhat`` (output dtype) and float32 ``rstd``.

  Forward matches ``flax.nnx.LayerNorm`` to rounding; gradients are exact for every
  ``scale`` (no division by it).

  Args:
    x: floating-point array [..., n].
    scale, bias: [n] arrays or None.
    epsilon: added to the variance (a static number).
    dtype: output dtype (default: ``x.dtype``); also the dtype ``xhat`` is kept in.
    implementation: None / "xla", "pallas" (row kernels; interpret mode without a GPU),
      "triton" (raw Triton row kernels; a CUDA GPU), or an :class:`invact_jax.Implementation`.

  Returns:
    ``(x - mean) * rstd * scale + bias`` over the last axis, in ``dtype``.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x = jnp.arange(12.0).reshape(3, 4)
    >>> y = invact_jax.layer_norm(x, jnp.ones(4), jnp.zeros(4))
    >>> bool(jnp.allclose(y, invact_jax.layer_norm_reference(x, jnp.ones(4), jnp.zeros(4))))
    True
  """
  x, out, eps = _check("layer_norm", x, scale, bias, dtype, epsilon)
  return base.norm(_implementation_of("layer_norm", implementation), False, eps, out, x.dtype, x, scale, bias)


def rms_norm(x: ArrayLike, scale: ArrayLike | None = None, *, epsilon: float = 1e-6,
             dtype: DTypeLike | None = None, implementation: ImplementationLike = None) -> Array:
  """RMSNorm over the last axis keeping only ``xhat`` and float32 ``rstd`` (see layer_norm).

  Args:
    x: floating-point array [..., n].
    scale: [n] array or None.
    epsilon: added to the mean square (a static number).
    dtype: output dtype (default: ``x.dtype``); also the dtype ``xhat`` is kept in.
    implementation: as for :func:`layer_norm`.

  Returns:
    ``x * rstd * scale`` over the last axis, in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> y = invact_jax.rms_norm(jnp.array([[3.0, 4.0]]), epsilon=0.0)
    >>> [round(float(v), 4) for v in y[0]]
    [0.8485, 1.1314]
  """
  x, out, eps = _check("rms_norm", x, scale, None, dtype, epsilon)
  return base.norm(_implementation_of("rms_norm", implementation), True, eps, out, x.dtype, x, scale, None)


def layer_norm_reference(x: ArrayLike, scale: ArrayLike | None = None,
                         bias: ArrayLike | None = None, *, epsilon: float = 1e-6,
                         dtype: DTypeLike | None = None) -> Array:
  """Plain-jnp LayerNorm with JAX's own autodiff (Flax's formulation): the baseline.

  Args:
    x, scale, bias, epsilon, dtype: as for :func:`layer_norm`.

  Returns:
    What :func:`layer_norm` returns, differentiated by JAX (it keeps ``x``).
  """
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  xhat, _ = base.normalize(x, False, epsilon)
  return base.affine(xhat, scale, bias, out)


def rms_norm_reference(x: ArrayLike, scale: ArrayLike | None = None, *, epsilon: float = 1e-6,
                       dtype: DTypeLike | None = None) -> Array:
  """Plain-jnp RMSNorm with JAX's own autodiff: the baseline.

  Args:
    x, scale, epsilon, dtype: as for :func:`rms_norm`.

  Returns:
    What :func:`rms_norm` returns, differentiated by JAX (it keeps ``x``).
  """
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  xhat, _ = base.normalize(x, True, epsilon)
  return base.affine(xhat, scale, None, out)


def _check_dense(fn, x, kernels, biases):
  """``(kernels, biases)`` as tuples, after one line naming the first kernel or bias of the wrong
  rank, width or count."""
  kernels = tuple(kernels)
  biases = (None,) * len(kernels) if biases is None else tuple(biases)
  if not kernels:
    raise ValueError(f"invact_jax.{fn}: argument `kernels` must hold at least one [n, m] array")
  if len(biases) != len(kernels):
    raise ValueError(f"invact_jax.{fn}: argument `biases` must have one entry per kernel "
                     f"({len(kernels)}), got {len(biases)}")
  for i, (k, b) in enumerate(zip(kernels, biases)):
    if getattr(k, "ndim", None) != 2 or k.shape[0] != x.shape[-1]:
      raise ValueError(f"invact_jax.{fn}: argument `kernels[{i}]` must have shape "
                       f"({x.shape[-1]}, m), got {tuple(getattr(k, 'shape', ()))}")
    if b is not None and tuple(b.shape) != (k.shape[1],):
      raise ValueError(f"invact_jax.{fn}: argument `biases[{i}]` must have shape "
                       f"({k.shape[1]},), got {tuple(b.shape)}")
  return kernels, biases


def layer_norm_dense(x: ArrayLike, scale: ArrayLike | None, bias: ArrayLike | None,
                     kernels: Sequence[ArrayLike], biases: Sequence[ArrayLike | None] | None = None,
                     *, epsilon: float = 1e-6, dtype: DTypeLike | None = None,
                     implementation: ImplementationLike = None) -> tuple[Array, ...]:
  """``tuple(LN(x) @ W_i + b_i)`` keeping only ``xhat`` + ``rstd`` for the backward.

  The affine output is recomputed in the backward for the weight gradients, so norm and
  matmul(s) together keep one [..., n] tensor (in ``dtype``) plus a float32 per row.
  ``implementation`` chooses how the norm part runs (the matmuls are XLA's).

  Args:
    x: floating-point array [..., n].
    scale, bias: [n] arrays or None.
    kernels: [n, m_i] weights.
    biases: [m_i] biases or None, one per kernel (default: none).
    epsilon, dtype, implementation: as for :func:`layer_norm`.

  Returns:
    One [..., m_i] array per kernel, in ``dtype``.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> x, w = jnp.ones((2, 8)), jnp.ones((8, 3))
    >>> (y,) = invact_jax.layer_norm_dense(x, jnp.ones(8), jnp.zeros(8), [w])
    >>> y.shape
    (2, 3)
  """
  x, out, eps = _check("layer_norm_dense", x, scale, bias, dtype, epsilon)
  kernels, biases = _check_dense("layer_norm_dense", x, kernels, biases)
  return base.norm_dense(_implementation_of("layer_norm_dense", implementation), False, eps, out, x.dtype,
                         x, scale, bias, kernels, biases)


def rms_norm_dense(x: ArrayLike, scale: ArrayLike | None, kernels: Sequence[ArrayLike],
                   biases: Sequence[ArrayLike | None] | None = None, *, epsilon: float = 1e-6,
                   dtype: DTypeLike | None = None,
                   implementation: ImplementationLike = None) -> tuple[Array, ...]:
  """``tuple(RMSNorm(x) @ W_i + b_i)`` keeping only ``xhat`` + ``rstd`` (see layer_norm_dense).

  Args:
    x, scale, kernels, biases, epsilon, dtype, implementation: as for :func:`layer_norm_dense`
      (no norm bias).

  Returns:
    One [..., m_i] array per kernel, in ``dtype``.
  """
  x, out, eps = _check("rms_norm_dense", x, scale, None, dtype, epsilon)
  kernels, biases = _check_dense("rms_norm_dense", x, kernels, biases)
  return base.norm_dense(_implementation_of("rms_norm_dense", implementation), True, eps, out, x.dtype,
                         x, scale, None, kernels, biases)


def norm_dense_reference(x: ArrayLike, scale: ArrayLike | None, bias: ArrayLike | None,
                         kernels: Sequence[ArrayLike],
                         biases: Sequence[ArrayLike | None] | None = None, *, rms: bool = False,
                         epsilon: float = 1e-6, dtype: DTypeLike | None = None
                         ) -> tuple[Array, ...]:
  """The unfused baseline of :func:`layer_norm_dense` / :func:`rms_norm_dense`.

  Args:
    x, scale, bias, kernels, biases, epsilon, dtype: as for :func:`layer_norm_dense`.
    rms: RMSNorm (``bias`` ignored) instead of LayerNorm.

  Returns:
    One [..., m_i] array per kernel, differentiated by JAX.
  """
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  biases = (None,) * len(kernels) if biases is None else biases
  xhat, _ = base.normalize(x, rms, epsilon)
  z = base.affine(xhat, scale, None if rms else bias, out)
  return tuple(base.dense(z, k, b, out) for k, b in zip(kernels, biases))
