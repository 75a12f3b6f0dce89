"""The activations' references: ``jax.nn``'s own functions with JAX's autodiff (they keep
``x``), the baselines of :mod:`.api`'s inverted ops.  Signatures mirror ``jax.nn``."""
from __future__ import annotations

import jax

from invact_jax.ops.activations import registry

Array = jax.Array


def _reference(public: str, x, selector: dict | None = None, **params) -> Array:
  """``jax.nn``'s function for ``public`` (captured at import), JAX autodiff."""
  entry, _ = registry.entry(public, selector or {}, {})
  return entry.original(x, **(selector or {}), **params)


def gelu_reference(x: Array, approximate: bool = True) -> Array:
  """``jax.nn.gelu`` with JAX's own autodiff (keeps x): the baseline of :func:`gelu`.

  Args:
    x: floating-point array.
    approximate: as for :func:`gelu`.

  Returns:
    ``jax.nn.gelu`` of ``x``, differentiated by JAX.
  """
  return _reference("gelu", x, {"approximate": approximate})


def silu_reference(x: Array) -> Array:
  """``jax.nn.silu`` with JAX's own autodiff: the baseline of :func:`silu`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.silu`` of ``x``, differentiated by JAX.
  """
  return _reference("silu", x)


def swish_reference(x: Array) -> Array:
  """``jax.nn.swish`` with JAX's own autodiff: the baseline of :func:`swish`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.swish`` of ``x``, differentiated by JAX.
  """
  return _reference("swish", x)


def mish_reference(x: Array) -> Array:
  """``jax.nn.mish`` with JAX's own autodiff: the baseline of :func:`mish`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.mish`` of ``x``, differentiated by JAX.
  """
  return _reference("mish", x)


def sigmoid_reference(x: Array) -> Array:
  """``jax.nn.sigmoid`` with JAX's own autodiff: the baseline of :func:`sigmoid`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.sigmoid`` of ``x``, differentiated by JAX.
  """
  return _reference("sigmoid", x)


def tanh_reference(x: Array) -> Array:
  """``jax.nn.tanh`` with JAX's own autodiff: the baseline of :func:`tanh`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.tanh`` of ``x``, differentiated by JAX.
  """
  return _reference("tanh", x)


def softplus_reference(x: Array) -> Array:
  """``jax.nn.softplus`` with JAX's own autodiff: the baseline of :func:`softplus`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.softplus`` of ``x``, differentiated by JAX.
  """
  return _reference("softplus", x)


def selu_reference(x: Array) -> Array:
  """``jax.nn.selu`` with JAX's own autodiff: the baseline of :func:`selu`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.selu`` of ``x``, differentiated by JAX.
  """
  return _reference("selu", x)


def celu_reference(x: Array, alpha: float = 1.0) -> Array:
  """``jax.nn.celu`` with JAX's own autodiff: the baseline of :func:`celu`.

  Args:
    x: floating-point array.
    alpha: as for :func:`celu`.

  Returns:
    ``jax.nn.celu`` of ``x``, differentiated by JAX.
  """
  return _reference("celu", x, alpha=alpha)


def elu_reference(x: Array, alpha: float = 1.0) -> Array:
  """``jax.nn.elu`` with JAX's own autodiff: the baseline of :func:`elu`.

  Args:
    x: floating-point array.
    alpha: as for :func:`elu`.

  Returns:
    ``jax.nn.elu`` of ``x``, differentiated by JAX.
  """
  return _reference("elu", x, alpha=alpha)


def hard_tanh_reference(x: Array) -> Array:
  """``jax.nn.hard_tanh`` with JAX's own autodiff: the baseline of :func:`hard_tanh`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.hard_tanh`` of ``x``, differentiated by JAX.
  """
  return _reference("hard_tanh", x)


def leaky_relu_reference(x: Array, negative_slope: float = 1e-2) -> Array:
  """``jax.nn.leaky_relu`` with JAX's own autodiff: the baseline of :func:`leaky_relu`.

  Args:
    x: floating-point array.
    negative_slope: as for :func:`leaky_relu`.

  Returns:
    ``jax.nn.leaky_relu`` of ``x``, differentiated by JAX.
  """
  return _reference("leaky_relu", x, negative_slope=negative_slope)


def hard_silu_reference(x: Array) -> Array:
  """``jax.nn.hard_silu`` with JAX's own autodiff: the baseline of :func:`hard_silu`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.hard_silu`` of ``x``, differentiated by JAX.
  """
  return _reference("hard_silu", x)


def hard_swish_reference(x: Array) -> Array:
  """``jax.nn.hard_swish`` with JAX's own autodiff: the baseline of :func:`hard_swish`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.hard_swish`` of ``x``, differentiated by JAX.
  """
  return _reference("hard_swish", x)


def hard_sigmoid_reference(x: Array) -> Array:
  """``jax.nn.hard_sigmoid`` with JAX's own autodiff: the baseline of :func:`hard_sigmoid`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.hard_sigmoid`` of ``x``, differentiated by JAX.
  """
  return _reference("hard_sigmoid", x)


def relu6_reference(x: Array) -> Array:
  """``jax.nn.relu6`` with JAX's own autodiff: the baseline of :func:`relu6`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.relu6`` of ``x``, differentiated by JAX.
  """
  return _reference("relu6", x)


def relu_reference(x: Array) -> Array:
  """``jax.nn.relu`` with JAX's own autodiff: the baseline of :func:`relu`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.relu`` of ``x``, differentiated by JAX.
  """
  return _reference("relu", x)


def soft_sign_reference(x: Array) -> Array:
  """``jax.nn.soft_sign`` with JAX's own autodiff: the baseline of :func:`soft_sign`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.soft_sign`` of ``x``, differentiated by JAX.
  """
  return _reference("soft_sign", x)


def squareplus_reference(x: Array, b: float = 4.0) -> Array:
  """``jax.nn.squareplus`` with JAX's own autodiff: the baseline of :func:`squareplus`.

  Args:
    x: floating-point array.
    b: as for :func:`squareplus`.

  Returns:
    ``jax.nn.squareplus`` of ``x``, differentiated by JAX.
  """
  return _reference("squareplus", x, b=b)


def sparse_plus_reference(x: Array) -> Array:
  """``jax.nn.sparse_plus`` with JAX's own autodiff: the baseline of :func:`sparse_plus`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.sparse_plus`` of ``x``, differentiated by JAX.
  """
  return _reference("sparse_plus", x)


def sparse_sigmoid_reference(x: Array) -> Array:
  """``jax.nn.sparse_sigmoid`` with JAX's own autodiff: the baseline of :func:`sparse_sigmoid`.

  Args:
    x: floating-point array.

  Returns:
    ``jax.nn.sparse_sigmoid`` of ``x``, differentiated by JAX.
  """
  return _reference("sparse_sigmoid", x)
