"""Public inverted activations: drop-ins for ``jax.nn`` that keep only their output.

Each ``<op>(x, ..., *, implementation=None)`` is a ``jax.custom_vjp`` keeping y (and, for a
non-monotone op, one branch bit per element packed 8 per byte); its forward is bit-identical
to ``jax.nn``'s on the XLA path.  Each ``<op>_reference`` is ``jax.nn``'s own function with
JAX autodiff, the baseline.  Signatures mirror ``jax.nn``; every function here is a thin
wrapper over its entry in :mod:`.registry` (the math) and runs on one of
:data:`IMPLEMENTATIONS` (see :mod:`invact_jax.ops._implementation`).
"""
from __future__ import annotations


import jax

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.activations import base
from invact_jax.ops.activations import pallas
from invact_jax.ops.activations import registry
from invact_jax.ops.activations import triton
from invact_jax.ops.activations.reference import gelu_reference as gelu_reference
from invact_jax.ops.activations.reference import silu_reference as silu_reference
from invact_jax.ops.activations.reference import swish_reference as swish_reference
from invact_jax.ops.activations.reference import mish_reference as mish_reference
from invact_jax.ops.activations.reference import sigmoid_reference as sigmoid_reference
from invact_jax.ops.activations.reference import tanh_reference as tanh_reference
from invact_jax.ops.activations.reference import softplus_reference as softplus_reference
from invact_jax.ops.activations.reference import selu_reference as selu_reference
from invact_jax.ops.activations.reference import celu_reference as celu_reference
from invact_jax.ops.activations.reference import elu_reference as elu_reference
from invact_jax.ops.activations.reference import hard_tanh_reference as hard_tanh_reference
from invact_jax.ops.activations.reference import leaky_relu_reference as leaky_relu_reference
from invact_jax.ops.activations.reference import hard_silu_reference as hard_silu_reference
from invact_jax.ops.activations.reference import hard_swish_reference as hard_swish_reference
from invact_jax.ops.activations.reference import hard_sigmoid_reference as hard_sigmoid_reference
from invact_jax.ops.activations.reference import relu6_reference as relu6_reference
from invact_jax.ops.activations.reference import relu_reference as relu_reference
from invact_jax.ops.activations.reference import soft_sign_reference as soft_sign_reference
from invact_jax.ops.activations.reference import squareplus_reference as squareplus_reference
from invact_jax.ops.activations.reference import sparse_plus_reference as sparse_plus_reference
from invact_jax.ops.activations.reference import sparse_sigmoid_reference as sparse_sigmoid_reference

__all__ = ["gelu", "silu", "swish", "mish", "sigmoid", "tanh", "softplus", "selu", "celu", "elu",
           "hard_tanh", "leaky_relu", "hard_silu", "hard_swish", "hard_sigmoid", "relu6", "relu",
           "gelu_reference",
           "silu_reference", "swish_reference", "mish_reference", "sigmoid_reference",
           "tanh_reference", "softplus_reference", "selu_reference", "celu_reference",
           "elu_reference", "hard_tanh_reference", "leaky_relu_reference", "hard_silu_reference",
           "hard_swish_reference",
           "hard_sigmoid_reference", "relu6_reference", "relu_reference",
           "soft_sign", "squareplus", "sparse_plus", "sparse_sigmoid",
           "soft_sign_reference", "squareplus_reference", "sparse_plus_reference",
           "sparse_sigmoid_reference"]

#: How the activations can run: name -> implementation (kernel options set by ``resolve``).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {
    "xla": base.XLA, "pallas": pallas.PallasActivation(), "triton": triton.TritonActivation()}

Array = jax.Array
ImplementationLike = _implementation.ImplementationLike


def resolve(implementation: ImplementationLike, *, op: str = "gelu"
            ) -> _implementation.ImplementationBase:
  """The activation implementation that ``implementation=`` names, with its kernel options.

  For benchmarks and kernel tools that call an implementation's ``forward``/``backward``
  or :func:`base.apply` directly.

  Args:
    implementation: None, "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.
    op: the public op it is for (for messages).

  Returns:
    An instance of ``IMPLEMENTATIONS``' class for that name.
  """
  return _implementation.resolve(implementation, op=op, implementations=IMPLEMENTATIONS)


def _run(public: str, x, implementation, selector: dict | None = None, **params) -> Array:
  """``invact_jax.<public>``: check the arguments, pick the entry and the implementation."""
  x = _common.float_array(public, "x", x)
  entry, bound = registry.entry(public, selector or {}, params)
  impl = _implementation.resolve(implementation, op=public, implementations={
      k: IMPLEMENTATIONS[k] for k in entry.implementations})
  return base.apply(base.Op(entry, bound), impl, x)


# ------------------------------------------------------------------- the public ops
def gelu(x: Array, approximate: bool = True, *,
         implementation: ImplementationLike = None) -> Array:
  """GELU keeping only its output and a 1-bit branch mask for the backward.

  Drop-in for ``jax.nn.gelu``: bit-identical outputs on the XLA path.  The backward computes
  f'(x) from y and the bit ``x < x_min`` (x_min ~ -0.75, where GELU turns).

  Args:
    x: floating-point array (float16, bfloat16, float32 or float64).
    approximate: True for the tanh form (Flax's default), False for the erf form.
    implementation: None (XLA), "xla", "pallas", "triton", or an
      :class:`invact_jax.Implementation` with kernel options.

  Returns:
    ``jax.nn.gelu(x, approximate)``.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x = jnp.linspace(-3.0, 3.0, 7)
    >>> bool(jnp.all(invact_jax.gelu(x) == jax.nn.gelu(x)))
    True
    >>> g = jax.grad(lambda x: invact_jax.gelu(x, approximate=False).sum())(x)
    >>> g_ref = jax.grad(lambda x: jax.nn.gelu(x, approximate=False).sum())(x)
    >>> bool(jnp.allclose(g, g_ref, atol=1e-5))
    True
  """
  return _run("gelu", x, implementation, {"approximate": approximate})


def silu(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """SiLU (swish), ``x * sigmoid(x)``, keeping its output and a 1-bit branch mask.

  Drop-in for ``jax.nn.silu`` (bit-identical on the XLA path); the bit is
  ``x < x_min ~ -1.2785``.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.silu(x)``.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x = jnp.linspace(-3.0, 3.0, 7)
    >>> g = jax.grad(lambda x: invact_jax.silu(x).sum())(x)
    >>> bool(jnp.allclose(g, jax.grad(lambda x: jax.nn.silu(x).sum())(x), atol=1e-5))
    True
  """
  return _run("silu", x, implementation)


def swish(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Alias of :func:`silu` (as ``jax.nn.swish`` is of ``jax.nn.silu``).

  Args:
    x: floating-point array.
    implementation: as for :func:`silu`.

  Returns:
    ``jax.nn.swish(x)``.
  """
  return _run("swish", x, implementation)


def mish(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Mish, ``x * tanh(softplus(x))``, keeping its output and a 1-bit branch mask.

  Drop-in for ``jax.nn.mish`` (bit-identical on the XLA path); the bit is
  ``x < x_min ~ -1.1924``.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.mish(x)``.
  """
  return _run("mish", x, implementation)


def sigmoid(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Sigmoid keeping only its output: f' = y (1 - y).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.sigmoid(x)``.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> float(jax.grad(lambda x: invact_jax.sigmoid(x))(0.0))
    0.25
  """
  return _run("sigmoid", x, implementation)


def tanh(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """tanh keeping only its output: f' = (1 - y)(1 + y).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.tanh(x)``.
  """
  return _run("tanh", x, implementation)


def softplus(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Softplus keeping only its output: f' = 1 - exp(-y).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.softplus(x)``.
  """
  return _run("softplus", x, implementation)


def selu(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """SELU keeping only its output: f' = scale for x > 0, else y + scale * alpha.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.selu(x)``.
  """
  return _run("selu", x, implementation)


def celu(x: Array, alpha: float = 1.0, *, implementation: ImplementationLike = None) -> Array:
  """CELU keeping only its output: f' = 1 for x > 0, else y / alpha + 1.

  Args:
    x: floating-point array.
    alpha: as in ``jax.nn.celu``; a static nonzero number (the backward is specialised on it).
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.celu(x, alpha)``.
  """
  if float(_common.static_scalar("celu", "alpha", alpha)) == 0.0:
    raise ValueError("invact_jax.celu: argument `alpha` must be nonzero, got 0.0")
  return _run("celu", x, implementation, alpha=alpha)


def elu(x: Array, alpha: float = 1.0, *, implementation: ImplementationLike = None) -> Array:
  """ELU keeping only its output: f' = 1 for x > 0, else y + alpha (a bit if alpha < 0).

  Args:
    x: floating-point array.
    alpha: as in ``jax.nn.elu``; a static number (the backward is specialised on it).
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.elu(x, alpha)``.
  """
  return _run("elu", x, implementation, alpha=alpha)


def hard_tanh(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Hard tanh keeping its output and one bit per element (-1 <= x <= 1).

  The bit is the derivative: ``jax.nn.hard_tanh``'s is 1 at x = +-1, where y = +-1 also
  comes from |x| > 1 (f' = 0), so the output alone cannot tell.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.hard_tanh(x)``.
  """
  return _run("hard_tanh", x, implementation)


def leaky_relu(x: Array, negative_slope: float = 1e-2, *,
               implementation: ImplementationLike = None) -> Array:
  """Leaky ReLU keeping only its output (a bit only if ``negative_slope <= 0``).

  Args:
    x: floating-point array.
    negative_slope: as in ``jax.nn.leaky_relu``; a static number.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.leaky_relu(x, negative_slope)``.
  """
  return _run("leaky_relu", x, implementation, negative_slope=negative_slope)


def hard_silu(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Hard SiLU ``x * hard_sigmoid(x)`` keeping its output and a 1-bit branch mask.

  f' = +-sqrt(2 (y + 3/8) / 3) on (-3, 3), the sign from the bit (x < -3/2), 1 above, 0 below.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.hard_silu(x)``.
  """
  return _run("hard_silu", x, implementation)


def hard_swish(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Alias of :func:`hard_silu` (as ``jax.nn.hard_swish`` is of ``jax.nn.hard_silu``).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.hard_swish(x)``.
  """
  return _run("hard_swish", x, implementation)


def hard_sigmoid(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Hard sigmoid ``relu6(x + 3) / 6`` keeping only its output: f' = 1/6 for 0 < y < 1.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.hard_sigmoid(x)``.
  """
  return _run("hard_sigmoid", x, implementation)


def relu6(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """ReLU6 keeping only its output: f' = [0 < y < 6] (0 at 0 and 6, as ``jax.nn.relu6``).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.relu6(x)``.
  """
  return _run("relu6", x, implementation)


def relu(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """ReLU keeping only its output: f' = [y > 0] (f'(0) = 0, as ``jax.nn.relu``).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.relu(x)``.
  """
  return _run("relu", x, implementation)


def soft_sign(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Soft sign, ``x / (1 + |x|)``, keeping only its output: f' = (1 - |y|)^2.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.soft_sign(x)``.
  """
  return _run("soft_sign", x, implementation)


def squareplus(x: Array, b: float = 4.0, *,
               implementation: ImplementationLike = None) -> Array:
  """Squareplus, ``(x + sqrt(x^2 + b)) / 2``, keeping only its output:
  f' = 1 / (1 + b / (4 y^2)).

  Args:
    x: floating-point array.
    b: as in ``jax.nn.squareplus``; a static positive number (the backward is specialised on
      it).
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.squareplus(x, b)``.
  """
  if not float(_common.static_scalar("squareplus", "b", b)) > 0.0:
    raise ValueError(f"invact_jax.squareplus: argument `b` must be positive, got {b!r}")
  return _run("squareplus", x, implementation, b=b)


def sparse_plus(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Sparse plus (0 below -1, ``(x + 1)^2 / 4`` between, x above 1) keeping only its output:
  f' = min(sqrt(y), 1).

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.sparse_plus(x)``.
  """
  return _run("sparse_plus", x, implementation)


def sparse_sigmoid(x: Array, *, implementation: ImplementationLike = None) -> Array:
  """Sparse sigmoid (0 below -1, ``(x + 1) / 2`` between, 1 above 1) keeping only its output
  and a bit: f' = 1/2 for 0 < y < 1, and ``jax.nn``'s 1/4 where ``x + 1`` rounds to 0 or 2.

  Args:
    x: floating-point array.
    implementation: None (XLA), "xla", "pallas", "triton" or an :class:`invact_jax.Implementation`.

  Returns:
    ``jax.nn.sparse_sigmoid(x)``.
  """
  return _run("sparse_sigmoid", x, implementation)


#: public name -> (the op, its reference); a test checks its names against :data:`registry.PUBLIC`.
OPS = {
    "gelu": (gelu, gelu_reference),
    "silu": (silu, silu_reference),
    "swish": (swish, swish_reference),
    "mish": (mish, mish_reference),
    "sigmoid": (sigmoid, sigmoid_reference),
    "tanh": (tanh, tanh_reference),
    "softplus": (softplus, softplus_reference),
    "selu": (selu, selu_reference),
    "celu": (celu, celu_reference),
    "elu": (elu, elu_reference),
    "hard_tanh": (hard_tanh, hard_tanh_reference),
    "leaky_relu": (leaky_relu, leaky_relu_reference),
    "hard_silu": (hard_silu, hard_silu_reference),
    "hard_swish": (hard_swish, hard_swish_reference),
    "hard_sigmoid": (hard_sigmoid, hard_sigmoid_reference),
    "relu6": (relu6, relu6_reference),
    "relu": (relu, relu_reference),
    "soft_sign": (soft_sign, soft_sign_reference),
    "squareplus": (squareplus, squareplus_reference),
    "sparse_plus": (sparse_plus, sparse_plus_reference),
    "sparse_sigmoid": (sparse_sigmoid, sparse_sigmoid_reference),
}
