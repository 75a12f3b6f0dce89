"""Inverted activations: keep the output (plus one bit where f is not monotone).

Per activation, by name:
  * ``<op>_reference`` — ``jax.nn``'s function with JAX's own autodiff (oracle, baseline);
  * ``<op>_grad_from_output(y, bit)`` — the math of the backward: f'(f^-1(y)) from the
    stored output (and branch bit), plain jnp, usable in XLA and in kernel bodies;
  * ``<op>`` — the public drop-in, a ``jax.custom_vjp`` whose residuals are ``y`` and,
    for GELU/SiLU/Mish, the branch mask packed 8 per byte (``_inverted_fwd`` /
    ``_inverted_bwd``), with ``implementation=`` dispatch.

The forward output is ``jax.nn``'s, bit for bit.  Backward math runs in float32 for
16- and 32-bit inputs (float64 for float64) and is cast back to the input dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax import _bitpack
from invact_jax import _dispatch
from invact_jax import _inverse_fits
from invact_jax import _piecewise

__all__ = [
    "gelu", "silu", "swish", "sigmoid", "tanh", "softplus", "elu", "leaky_relu", "relu", "mish",
    "gelu_reference", "silu_reference", "sigmoid_reference", "tanh_reference",
    "softplus_reference", "elu_reference", "leaky_relu_reference", "relu_reference",
    "mish_reference",
]

ACCEPTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)

# jax.nn's functions, captured at import: ``invact_jax.inverted()`` swaps the module
# attributes, and the forward/reference must keep calling the originals.
_NN = {name: getattr(jax.nn, name) for name in (
    "gelu", "silu", "mish", "sigmoid", "softplus", "elu", "leaky_relu", "relu")}


# ----------------------------------------------------------------------------- references
def gelu_reference(x, approximate: bool = True):
  """``jax.nn.gelu`` (JAX autodiff keeps x and several intermediates)."""
  return _NN["gelu"](x, approximate=approximate)


def silu_reference(x):
  return _NN["silu"](x)


def mish_reference(x):
  return _NN["mish"](x)


def sigmoid_reference(x):
  return _NN["sigmoid"](x)


def tanh_reference(x):
  return jnp.tanh(x)


def softplus_reference(x):
  return _NN["softplus"](x)


def elu_reference(x, alpha=1.0):
  return _NN["elu"](x, alpha)


def leaky_relu_reference(x, negative_slope=1e-2):
  return _NN["leaky_relu"](x, negative_slope)


def relu_reference(x):
  return _NN["relu"](x)


# ------------------------------------------------------------- backward math, from output
# ``y`` is in the compute dtype (float32/float64); ``bit`` is bool or None.
def gelu_tanh_grad_from_output(y, bit):
  """GELU (tanh form): bit = x < x_min ~ -0.7525."""
  return _piecewise.evaluate(_piecewise.FIT["gelu_tanh"], y, bit)


def gelu_erf_grad_from_output(y, bit):
  """GELU (erf form): bit = x < x_min ~ -0.7518."""
  return _piecewise.evaluate(_piecewise.FIT["gelu_erf"], y, bit)


def silu_grad_from_output(y, bit):
  """SiLU: bit = x < x_min ~ -1.2785."""
  return _piecewise.evaluate(_piecewise.FIT["silu"], y, bit)


def mish_grad_from_output(y, bit):
  """Mish: bit = x < x_min ~ -1.1924."""
  return _piecewise.evaluate(_piecewise.FIT["mish"], y, bit)


def sigmoid_grad_from_output(y, bit):
  del bit
  return y * (1.0 - y)


def tanh_grad_from_output(y, bit):
  del bit
  return (1.0 - y) * (1.0 + y)  # 1 - y^2 without cancellation near |y| = 1


_EXPM1_TAYLOR = tuple((-1.0) ** k / math.factorial(k + 1) for k in range(14))


def softplus_grad_from_output(y, bit):
  """sigmoid(x) = 1 - exp(-y) = -expm1(-y).

  XLA:CPU's float32 expm1 errs by up to 5 ulp; a Taylor series y * P(y) below
  y = 0.5 (truncation < 1e-12) and 1 - exp(-y) above (no cancellation there) keep
  it near 1 ulp.
  """
  del bit
  p = jnp.full_like(y, _EXPM1_TAYLOR[-1])
  for c in reversed(_EXPM1_TAYLOR[:-1]):
    p = p * y + c
  return jnp.where(y < 0.5, y * p, 1.0 - jnp.exp(-y))


def relu_grad_from_output(y, bit):
  del bit
  return jnp.where(y > 0, jnp.ones_like(y), jnp.zeros_like(y))  # jax.nn.relu: f'(0) = 0


def elu_grad_from_output(y, bit, *, alpha):
  # x > 0: 1;  x <= 0: alpha * exp(x) = y + alpha.  bit (= x > 0) only when alpha < 0.
  pos = (y > 0) if bit is None else bit
  return jnp.where(pos, jnp.ones_like(y), y + jnp.asarray(alpha, y.dtype))


def leaky_relu_grad_from_output(y, bit, *, negative_slope):
  # bit (= x >= 0) only when negative_slope <= 0; otherwise the sign bit of y is x's
  # (a tiny negative x whose slope * x underflows gives y = -0.0, still negative).  At
  # the kink x = -0.0 this returns the left slope (jax.nn: 1); both are subgradients.
  pos = ~(jnp.signbit(y) | jnp.isnan(y)) if bit is None else bit  # NaN: slope, as jax.nn
  return jnp.where(pos, jnp.ones_like(y), jnp.full_like(y, negative_slope))


# ------------------------------------------------------------------------------ specs
@dataclasses.dataclass(frozen=True)
class ActivationSpec:
  """What the generic custom_vjp and the kernels need to know about one activation.

  Attributes:
    name: public name (``gelu_tanh``/``gelu_erf`` for the two GELU forms).
    forward: ``forward(x, **params) -> y``, the ``jax.nn`` function itself.
    grad_from_output: ``(y, bit, **params) -> f'(x)`` in the compute dtype.
    bit: ``(x_f32, **params) -> bool`` branch mask, or None for monotone activations.
      ``x`` is already upcast, so the comparison is exact for every input dtype.
    params: static keyword parameters (alpha, negative_slope) as a sorted tuple.
  """
  name: str
  forward: Callable[..., Any]
  grad_from_output: Callable[..., Any]
  bit: Callable[..., Any] | None = None
  params: tuple[tuple[str, float], ...] = ()
  kernel_math: Callable[..., Any] | None = None  # forward for kernel bodies (default: forward)

  @property
  def kernel_forward(self):
    """Forward on a kernel tile; 16-bit inputs are computed in float32 and rounded once
    (Triton lacks several bf16/f16 elementwise lowerings; XLA GPU fuses the same way)."""
    f = self.forward if self.kernel_math is None else self.kernel_math

    def on_tile(x, **kw):
      if x.dtype in (jnp.bfloat16, jnp.float16):
        return f(x.astype(jnp.float32), **kw).astype(x.dtype)
      return f(x, **kw)
    return on_tile

  @property
  def kwargs(self) -> dict[str, float]:
    return dict(self.params)

  def compute_dtype(self, dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32

  def forward_and_mask(self, x):
    """XLA forward: ``(y, packed_mask or None)``."""
    y = self.forward(x, **self.kwargs)
    if self.bit is None:
      return y, None
    bits = self.bit(x.astype(self.compute_dtype(x.dtype)), **self.kwargs)
    return y, _bitpack.pack_bits(bits)

  def derivative(self, y, bits):
    """f'(x) in the compute dtype from the stored output and unpacked bits."""
    yc = y.astype(self.compute_dtype(y.dtype))
    return self.grad_from_output(yc, bits, **self.kwargs)


def _below(threshold):
  def bit(x):
    return x < jnp.asarray(threshold, x.dtype)
  return bit


def _branch_bit(name):
  fit = _piecewise.FIT[name]
  # Compare in float32 against the float32-rounded x_min (float64: the float64 value).
  def bit(x):
    t = fit.x_min if x.dtype == jnp.float64 else fit.x_min32
    return x < jnp.asarray(t, x.dtype)
  return bit


def erfc_f32(z, scale: float = 1.0):
  """erfc(scale * z) in float32 from arithmetic and exp only (Pallas Triton has no erfc).

  erfc(a) = exp(-a^2) * erfcx(a), a = |scale * z|, with erfcx a piecewise Chebyshev fit
  (relative error < 1e-9; ``_inverse_fits.ERFCX``, generated by ``scripts/fit_inverse.py``)
  and erfc(-a) = 2 - erfc(a).  The exponent is taken from z itself: with a 12-bit z_hi,
  a^2 = s2 z_hi^2 + s2 (|z| - z_hi)(|z| + z_hi), the first term exact (``scale`` must have an
  exact float32 square s2, e.g. sqrt(1/2) for GELU).  So neither the rounding of a^2 nor
  that of scale * z (which erfc amplifies 2 a^2-fold; it only enters the well-conditioned
  erfcx here) costs accuracy in the tail: <= 3.5 ulp measured on [-2, 9], where XLA's own
  erfc reaches 65 ulp (tests/test_pallas_kernels.py).
  """
  s2 = float(np.float32(scale * scale))
  if abs(s2 - scale * scale) > 1e-15 * s2:
    raise ValueError(f"erfc_f32: `scale`**2 must be exact in float32, got scale={scale}")
  z = z.astype(jnp.float32)
  az = jnp.abs(z)
  a = az if scale == 1.0 else jnp.abs(z * np.float32(scale))
  pieces = _piecewise.ERFCX
  erfcx = _piecewise.chebyshev_pieces(a, _piecewise.piece_index(a, pieces), pieces)
  z_hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(az, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32)
  # exp(-d) by its Taylor series (|d| < 2 a^2 2^-12 <= 0.06 where erfc(a) is a normal
  # float32; degree 7 leaves < 1e-13): a second exp would be merged with the first by
  # XLA's simplifier (exp(u) exp(v) -> exp(u + v)), losing the split.
  d = (az - z_hi) * (az + z_hi) * s2
  e_d = 1.0 + d * (-1.0 + d * (1 / 2 + d * (-1 / 6 + d * (1 / 24 + d * (
      -1 / 120 + d * (1 / 720 - d / 5040))))))
  erfc_a = jnp.exp(-(z_hi * z_hi * s2)) * e_d * erfcx
  erfc_a = jnp.where(a > pieces[-1].hi, 0.0, erfc_a)  # underflows float32 there
  return jnp.where(z >= 0, erfc_a, 2.0 - erfc_a)


def _gelu_erf_kernel_math(x):
  xf = x.astype(jnp.float32)
  return (0.5 * xf * erfc_f32(-xf, scale=float(np.sqrt(0.5)))).astype(x.dtype)


GELU_TANH = ActivationSpec("gelu_tanh", lambda x: _NN["gelu"](x, approximate=True),
                           gelu_tanh_grad_from_output, _branch_bit("gelu_tanh"))
GELU_ERF = ActivationSpec("gelu_erf", lambda x: _NN["gelu"](x, approximate=False),
                          gelu_erf_grad_from_output, _branch_bit("gelu_erf"),
                          kernel_math=_gelu_erf_kernel_math)
SILU = ActivationSpec("silu", _NN["silu"], silu_grad_from_output, _branch_bit("silu"))
MISH = ActivationSpec("mish", _NN["mish"], mish_grad_from_output, _branch_bit("mish"))
SIGMOID = ActivationSpec("sigmoid", _NN["sigmoid"], sigmoid_grad_from_output)
TANH = ActivationSpec("tanh", jnp.tanh, tanh_grad_from_output)
SOFTPLUS = ActivationSpec("softplus", _NN["softplus"], softplus_grad_from_output)
RELU = ActivationSpec("relu", _NN["relu"], relu_grad_from_output)


def _elu_spec(alpha: float) -> ActivationSpec:
  bit = (lambda x, alpha: x > 0) if alpha < 0 else None
  return ActivationSpec("elu", lambda x, alpha: _NN["elu"](x, alpha), elu_grad_from_output,
                        bit, (("alpha", alpha),))


def _leaky_relu_spec(negative_slope: float) -> ActivationSpec:
  bit = (lambda x, negative_slope: x >= 0) if negative_slope <= 0 else None
  return ActivationSpec("leaky_relu", lambda x, negative_slope: _NN["leaky_relu"](x, negative_slope),
                        leaky_relu_grad_from_output, bit, (("negative_slope", negative_slope),))


_AUDIT_SPECS = {s.name: s for s in (GELU_TANH, GELU_ERF, SILU, MISH, SIGMOID, TANH, SOFTPLUS, RELU)}


def spec_for_audit(name: str) -> ActivationSpec:
  """The spec behind ``name`` with default parameters (used by ``accuracy``)."""
  if name == "elu":
    return _elu_spec(1.0)
  if name == "leaky_relu":
    return _leaky_relu_spec(0.01)
  return _AUDIT_SPECS[name]


def derivative_from_packed(spec: ActivationSpec, y, packed):
  """f'(x) in the compute dtype from ``y`` and the packed mask (XLA path)."""
  bits = None if packed is None else _bitpack.unpack_bits(packed, y.shape)
  return spec.derivative(y, bits)


# ---------------------------------------------------------------------- the custom_vjp
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(name, g):
  return g


@_first_order_only.defjvp
def _first_order_only_jvp(name, primals, tangents):
  del primals, tangents
  raise NotImplementedError(_dispatch.first_order_message(name))


@dataclasses.dataclass(frozen=True)
class _Bound:
  spec: ActivationSpec
  backend: _dispatch.Backend


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _inverted(op: _Bound, x):
  return op.spec.forward(x, **op.spec.kwargs)


def _inverted_fwd(op: _Bound, x):
  y, packed = op.backend.forward(op.spec, x)
  return y, (y, packed)


def _inverted_bwd(op: _Bound, res, dy):
  y, packed = res
  dx = op.backend.backward(op.spec, y, packed, dy,
                           guard=functools.partial(_first_order_only, op.spec.name))
  return (dx,)


_inverted.defvjp(_inverted_fwd, _inverted_bwd)


def _check_x(fn_name: str, x):
  if isinstance(x, (bool, int, complex)) and not isinstance(x, float):
    raise TypeError(f"invact_jax.{fn_name}: argument `x` must be a floating-point array "
                    f"(float16, bfloat16, float32 or float64), got Python {type(x).__name__}")
  if not hasattr(x, "dtype"):
    x = jnp.asarray(x)
  dtype = jnp.dtype(x.dtype)
  if dtype not in [jnp.dtype(d) for d in ACCEPTED_DTYPES]:
    raise TypeError(f"invact_jax.{fn_name}: argument `x` must be a floating-point array "
                    f"(float16, bfloat16, float32 or float64), got dtype {dtype}")
  return jnp.asarray(x)


def _static_scalar(fn_name: str, arg: str, value) -> float:
  try:
    return float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(f"invact_jax.{fn_name}: argument `{arg}` must be a concrete scalar (a Python "
                    f"or NumPy number), got {type(value).__name__}; the backward pass is "
                    "specialised on it at trace time") from e


def _apply(fn_name: str, spec: ActivationSpec, x, implementation):
  x = _check_x(fn_name, x)
  backend = _dispatch.resolve(implementation)
  return _inverted(_Bound(spec, backend), x)


# ------------------------------------------------------------------- public functions
def gelu(x, approximate: bool = True, *, implementation: str | None = None):
  """GELU that keeps only its output and a 1-bit branch mask for the backward.

  Drop-in for :func:`jax.nn.gelu`: same signature and bit-identical outputs.  The
  backward recomputes f'(x) from y and the bit (x < x_min), to within 1.2x the
  error that storing y in its dtype makes unavoidable.

  Args:
    x: floating-point array (float16, bfloat16, float32, or float64).
    approximate: tanh form (True, Flax's ``nn.gelu`` default) or erf form (False).
    implementation: None (fastest available), "xla", "pallas", "triton", or an
      :class:`invact_jax.Implementation` with kernel options (block size).

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x = jnp.linspace(-3.0, 3.0, 7)
    >>> bool(jnp.all(invact_jax.gelu(x) == jax.nn.gelu(x)))
    True
    >>> g = jax.grad(lambda x: invact_jax.gelu(x).sum())(x)
    >>> bool(jnp.allclose(g, jax.grad(lambda x: jax.nn.gelu(x).sum())(x), atol=1e-5))
    True
  """
  return _apply("gelu", GELU_TANH if approximate else GELU_ERF, x, implementation)


def silu(x, *, implementation: str | None = None):
  """SiLU/swish, x * sigmoid(x), keeping y and a 1-bit mask (x < -1.2785).

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> invact_jax.silu(jnp.array([0.0, 1.0])).tolist()
    [0.0, 0.7310585975646973]
  """
  return _apply("silu", SILU, x, implementation)


swish = silu


def mish(x, *, implementation: str | None = None):
  """Mish, x * tanh(softplus(x)), keeping y and a 1-bit mask (x < -1.1924)."""
  return _apply("mish", MISH, x, implementation)


def sigmoid(x, *, implementation: str | None = None):
  """Sigmoid keeping only y (f' = y (1 - y))."""
  return _apply("sigmoid", SIGMOID, x, implementation)


def tanh(x, *, implementation: str | None = None):
  """tanh keeping only y (f' = (1 - y)(1 + y))."""
  return _apply("tanh", TANH, x, implementation)


def softplus(x, *, implementation: str | None = None):
  """Softplus keeping only y (f' = 1 - exp(-y))."""
  return _apply("softplus", SOFTPLUS, x, implementation)


def relu(x, *, implementation: str | None = None):
  """ReLU keeping only y (f' = [y > 0], so f'(0) = 0 as in jax.nn.relu)."""
  return _apply("relu", RELU, x, implementation)


def elu(x, alpha=1.0, *, implementation: str | None = None):
  """ELU keeping only y (f' = 1 for y > 0, else y + alpha); a bit only if alpha < 0.

  ``alpha`` must be a concrete scalar.
  """
  return _apply("elu", _elu_spec(_static_scalar("elu", "alpha", alpha)), x, implementation)


def leaky_relu(x, negative_slope=1e-2, *, implementation: str | None = None):
  """Leaky ReLU keeping only y; a bit only if negative_slope <= 0.

  ``negative_slope`` must be a concrete scalar.
  """
  slope = _static_scalar("leaky_relu", "negative_slope", negative_slope)
  return _apply("leaky_relu", _leaky_relu_spec(slope), x, implementation)
