"""The math of the inverted activations' backward pass: f'(x) from the stored output.

Each ``<name>_grad(y, bit, **params)`` takes the output ``y`` already in the compute dtype
(float32, or float64 for float64 data) and the branch bit (bool, or None for monotone
activations) and returns f'(f^-1(y)).  Only arithmetic, comparisons, ``where`` and a few
transcendentals, no gathers: the same code runs in XLA and inside kernel bodies.

Non-monotone activations (GELU, SiLU, Mish) evaluate the generated fits of ``_fits``
(``scripts/fit_inverse.py``): one rational per branch chosen by the storage dtype
(:mod:`.rational`), or piecewise Chebyshev fits for float64 (:mod:`._piecewise`); the rest
have closed forms.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.ops.activations import _fits
from invact_jax.ops.activations import _piecewise
from invact_jax.ops.activations import rational


def fitted_grad(name: str, y, bit, *, storage_dtype=None, approx_ops=None):
  """f'(f^-1(y)) of the non-monotone activation ``name`` from its generated fit.

  ``y`` is in the compute dtype; ``storage_dtype`` (default: y's) is the dtype it was stored
  in, which picks the fit: 16-bit outputs cannot use more accuracy than a cheaper fit gives.
  ``approx_ops`` (sqrt, log, divide; a kernel's approximate instructions) are used for 16-bit
  outputs only.
  """
  if y.dtype == jnp.float64:
    return _piecewise.evaluate(_piecewise.FIT[name], y, bit)
  storage = jnp.dtype(y.dtype if storage_dtype is None else storage_dtype)
  fit = rational.fit_for(name, storage)
  if approx_ops is not None and storage == jnp.dtype(jnp.float16):
    # lg2.approx errs by ~2^-22 absolute, and q = sqrt(-log(y / y_min)) magnifies that near
    # the minimum: float16 outputs (11 bits) then differ from the XLA path by 3 ulp (H100,
    # mish); bfloat16's 8 bits do not see it (<= 1 ulp).  float16 keeps the exact log.
    approx_ops = _ExactLog(approx_ops)
  return rational.evaluate(fit, y, bit, ops=None if fit.exact_min else approx_ops)


class _ExactLog:
  """A kernel's approximate ops with jnp's log instead of the approximate one."""

  def __init__(self, ops):
    self.sqrt, self.divide, self.log = ops.sqrt, ops.divide, jnp.log


def branch_threshold(name: str, dtype) -> float:
  """x_min of ``name`` as compared in ``dtype`` (the bit is ``x < x_min``)."""
  fit = _piecewise.FIT[name]
  return fit.x_min if jnp.dtype(dtype) == jnp.float64 else fit.x_min32


def sigmoid_grad(y, bit):
  del bit
  return y * (1.0 - y)


def tanh_grad(y, bit):
  del bit
  return (1.0 - y) * (1.0 + y)  # 1 - y^2 without cancellation near |y| = 1


_EXPM1_TAYLOR = tuple((-1.0) ** k / math.factorial(k + 1) for k in range(14))


_LN2_HI = 0.693145751953125        # ln 2 with 12 trailing zero bits: n * _LN2_HI is exact
_LN2_LO = 1.428606765330187e-06
_EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(9))


def exp_neg(y):
  """exp(-y) for 0 <= y <= 104 to ~1 ulp on every device: Cody-Waite reduction, -y = n ln2 + r with
  |r| <= ln2/2, a degree-8 Taylor polynomial (truncation < 1e-9), and ldexp.  XLA:GPU's
  float32 exp errs by ~2 ulp, which alone takes softplus's gradient to 1.4x its floor."""
  t = -y
  n = jnp.floor(t * (1.0 / math.log(2.0)) + 0.5)  # (Pallas-Triton has no round)
  r = (t - n * _LN2_HI) - n * _LN2_LO
  p = jnp.full_like(y, _EXP_TAYLOR[-1])
  for c in reversed(_EXP_TAYLOR[:-1]):
    p = p * r + c
  return jnp.ldexp(p, n.astype(jnp.int32))


def softplus_grad(y, bit):
  """sigmoid(x) = 1 - exp(-y) = -expm1(-y).

  XLA:CPU's float32 expm1 errs by up to 5 ulp; a Taylor series y * P(y) below y = 0.5
  (truncation < 1e-12) and 1 - exp(-y) above (no cancellation there), with the device-
  independent :func:`exp_neg`, keep it near 1 ulp.
  """
  del bit
  p = jnp.full_like(y, _EXPM1_TAYLOR[-1])
  for c in reversed(_EXPM1_TAYLOR[:-1]):
    p = p * y + c
  # The branch not taken stays finite; above 104, exp(-y) < 2^-150 rounds to 0.  NaN is
  # passed explicitly: compiled Triton kernels lower clip's min/max to minnumf/maxnumf,
  # which drop a NaN operand.
  big = jnp.clip(y, 0.5, 104.0)
  return jnp.where(jnp.isnan(y), y, jnp.where(y < 0.5, y * p, 1.0 - exp_neg(big)))


def relu_grad(y, bit):
  del bit
  return jnp.where(y > 0, jnp.ones_like(y), jnp.zeros_like(y))  # jax.nn.relu: f'(0) = 0


def hard_silu_grad(y, bit):
  # y = x (x + 3) / 6 on (-3, 3): f' = (2x + 3) / 6 = +-sqrt(2 (y + 3/8) / 3), the sign the
  # bit's (x < -3/2, the minimum y = -3/8); y + 3/8 is exact near the minimum (Sterbenz) and
  # clamped at 0 where rounding put y an ulp below it.  Beyond: f' = 1 for y >= 3 (x >= 3,
  # jax.nn: 1 at x = 3), 0 for x <= -3 (y = 0, or NaN at x = -inf: the limit).
  d = y + jnp.asarray(0.375, y.dtype)
  d = jnp.where(d < 0, jnp.zeros_like(d), d)  # a select: Triton's max would drop a NaN y
  r = jnp.sqrt(d * jnp.asarray(2 / 3, y.dtype))
  left = jnp.where(y < 0, -r, jnp.zeros_like(y))
  right = jnp.where(y >= 3, jnp.ones_like(y), r)
  return jnp.where(bit, left, right)


def relu6_grad(y, bit):
  del bit  # jax.nn.relu6: f'(0) = f'(6) = 0, and y in (0, 6) exactly where x is
  return jnp.where((y > 0) & (y < 6), jnp.ones_like(y), jnp.zeros_like(y))


def hard_sigmoid_grad(y, bit):
  # y = relu6(x + 3) / 6 lies in (0, 1) exactly where relu6's input does in (0, 6), in
  # every float dtype (the rounding of r / 6 for r in (0, 6) never reaches 0 or 1; tests).
  del bit
  return jnp.where((y > 0) & (y < 1), jnp.full_like(y, 1.0 / 6.0), jnp.zeros_like(y))


def _exact_square(v):
  """``(p, e)`` with ``p + e == v * v`` exactly: Dekker's product on a Veltkamp split (no
  FMA needed, and exact with one)."""
  c = v * (2.0 ** ((jnp.finfo(v.dtype).nmant + 2) // 2) + 1.0)
  h1 = c - (c - v)
  h2 = v - h1
  p = v * v
  return p, ((h1 * h1 - p) + 2.0 * h1 * h2) + h2 * h2


def soft_sign_grad(y, bit):
  """f' = (1 - |y|)^2, since y = x / (1 + |x|) makes 1 - |y| = 1 / (1 + |x|).

  1 - |y| is taken as hi + lo exactly (Fast2Sum: |y| <= 1) and hi^2 as p + e exactly
  (:func:`_exact_square`), so only the last sum rounds, with or without FMA contraction:
  rounding 1 - |y| and its square put float32 at 1.46x its floor, and hi^2 + 2 hi lo
  without FMA (LLVM at -O0, the Triton kernels) at 1.22x.
  """
  del bit
  a = jnp.abs(y)
  hi = 1.0 - a
  lo = (1.0 - hi) - a
  p, e = _exact_square(hi)
  return p + (e + 2.0 * hi * lo)


def squareplus_grad(y, bit, *, b):
  # y = (x + sqrt(x^2 + b)) / 2 > 0 solves y^2 - x y - b/4 = 0, so x = y - b / (4 y) and
  # f' = (1 + x / sqrt(x^2 + b)) / 2 = y / (2 y - x) = 1 / (1 + b / (4 y^2)): no overflow
  # for large y (f' -> 1) nor cancellation for small (f' -> 4 y^2 / b).  1.198x its float32
  # floor on the audit grid (t / (t + b) with t = 4 y^2: 1.28x; y / (y + c / y): 1.31x;
  # y^2 taken exactly and the quotient corrected: 1.190x, not worth its eleven operations).
  del bit
  return 1.0 / (1.0 + (jnp.asarray(b, y.dtype) / 4.0) / y / y)


def sparse_plus_grad(y, bit):
  # f' = 0 for x <= -1 (y = 0), (x + 1) / 2 = sqrt(y) for -1 < x < 1 (y = (x + 1)^2 / 4),
  # 1 for x >= 1 (y = x >= 1).  A select keeps NaN where min would lower to Triton's minnumf.
  del bit
  r = jnp.sqrt(y)
  return jnp.where(r > 1, jnp.ones_like(r), r)


def sparse_sigmoid_bit(x):
  # jax.nn: 0.5 * clip(x + 1, 0, 2) with x + 1 rounded in x's own dtype; where the sum is 0
  # or 2, max's or min's tie gives f' = 1/4, and y = 0 or 1 as beyond the ends (f' = 0).
  # In bfloat16 that is x = 1 - 2^-8, 1 and 1 + 2^-7, not only x = +-1.  The sum is taken
  # wide (exact for 16-bit x near the ends) and rounded once to x's dtype.
  wide = jnp.promote_types(x.dtype, jnp.float32)
  s = (x.astype(wide) + 1).astype(x.dtype).astype(wide)
  return (s == 0) | (s == 2)


def sparse_sigmoid_grad(y, bit):
  # y is the rounded x + 1 halved (exactly), so 0 < y < 1 where 0 < x + 1 < 2: f' = 1/2;
  # the bit marks the ties (f' = 1/4).  Selects keep f' = 0 for NaN, as jax.nn.
  inner = jnp.where((y > 0) & (y < 1), jnp.full_like(y, 0.5), jnp.zeros_like(y))
  return jnp.where(bit, jnp.full_like(y, 0.25), inner)


def hard_tanh_grad(y, bit):
  # The bit (= -1 <= x <= 1, or NaN) is the whole derivative: y = 1 comes from x = 1
  # (jax.nn: f' = 1) as from x > 1 (f' = 0), so the output alone cannot tell.
  return jnp.where(bit, jnp.ones_like(y), jnp.zeros_like(y))


def celu_grad(y, bit, *, alpha):
  # x > 0 exactly where y > 0 (any alpha != 0): f' = 1; else exp(x / alpha) = y / alpha + 1.
  del bit
  a = jnp.asarray(alpha, y.dtype)
  return jnp.where(y > 0, jnp.ones_like(y), y / a + 1)


#: jax.nn.selu's constants.
SELU_SCALE, SELU_ALPHA = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717


def selu_grad(y, bit):
  # scale for x > 0 (exactly where y > 0); else scale * alpha * exp(x) = y + scale * alpha,
  # the constant rounded as jax.nn.selu's y at x = -inf is (so that f'(-inf) = 0 exactly).
  del bit
  scale = jnp.asarray(SELU_SCALE, y.dtype)
  return jnp.where(y > 0, jnp.broadcast_to(scale, y.shape),
                   y + scale * jnp.asarray(SELU_ALPHA, y.dtype))


def elu_grad(y, bit, *, alpha):
  # x > 0: 1;  x <= 0: alpha * exp(x) = y + alpha.  bit (= x > 0) only when alpha < 0.
  pos = (y > 0) if bit is None else bit
  return jnp.where(pos, jnp.ones_like(y), y + jnp.asarray(alpha, y.dtype))


def leaky_relu_grad(y, bit, *, negative_slope):
  # bit (= x >= 0) only when negative_slope <= 0; otherwise the sign bit of y is x's
  # (a tiny negative x whose slope * x underflows gives y = -0.0, still negative).  At
  # the kink x = -0.0 this returns the left slope (jax.nn: 1); both are subgradients.
  pos = ~(jnp.signbit(y) | jnp.isnan(y)) if bit is None else bit  # NaN: slope, as jax.nn
  return jnp.where(pos, jnp.ones_like(y), jnp.full_like(y, negative_slope))


# ------------------------------------------------------------- kernel-body forward math
def erfc_f32(z, scale: float = 1.0):
  """erfc(scale * z) in float32 from arithmetic and exp only (Triton has no erf lowering).

  erfc(a) = exp(-a^2) * erfcx(a), a = |scale * z|, with erfcx one minimax rational
  (``_fits.ERFCX``, generated by ``scripts/fit_inverse.py``, which checks this very float32
  evaluation: relative error < 3e-7) and erfc(-a) = 2 - erfc(a).  The exponent is taken
  from z itself: with a 12-bit z_hi, a^2 = s2 z_hi^2 + s2 (|z| - z_hi)(|z| + z_hi), the first
  term exact (``scale`` must have an exact float32 square s2, e.g. sqrt(1/2) for GELU).  So
  neither the rounding of a^2 nor that of scale * z (which erfc amplifies 2 a^2-fold; it only
  enters the well-conditioned erfcx here) costs accuracy in the tail, where XLA's own erfc
  reaches 65 ulp (tests).
  """
  s2 = float(np.float32(scale * scale))
  if abs(s2 - scale * scale) > 1e-15 * s2:
    raise ValueError(f"erfc_f32: argument `scale`**2 must be exact in float32, got scale={scale}")
  z = z.astype(jnp.float32)
  az = jnp.abs(z)
  a = az if scale == 1.0 else jnp.abs(z * np.float32(scale))
  fit = _fits.ERFCX
  d_c = a + np.float32(fit["c"])
  u = (a * np.float32(2.0 / fit["t_end"]) - d_c) / d_c  # 2 a / ((a + c) t_end) - 1
  erfcx = rational.horner(u, fit["p"]) / (rational.horner(u, fit["q"]) * d_c)
  z_hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(az, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32)
  # exp(-d) by its Taylor series (|d| < 2 a^2 2^-12 <= 0.06 where erfc(a) is a normal
  # float32; degree 7 leaves < 1e-13): a second exp would be merged with the first by
  # XLA's simplifier (exp(u) exp(v) -> exp(u + v)), losing the split.
  d = (az - z_hi) * (az + z_hi) * s2
  e_d = 1.0 + d * (-1.0 + d * (1 / 2 + d * (-1 / 6 + d * (1 / 24 + d * (
      -1 / 120 + d * (1 / 720 - d / 5040))))))
  erfc_a = jnp.exp(-(z_hi * z_hi * s2)) * e_d * erfcx
  erfc_a = jnp.where(a > np.float32(fit["a_end"]), 0.0, erfc_a)  # underflows float32 there
  return jnp.where(z >= 0, erfc_a, 2.0 - erfc_a)


def relu_kernel_forward(x):
  """ReLU on a kernel tile: jax.nn.relu's max(x, 0) lowers to Triton's maxnumf, which turns
  NaN into 0; this select keeps NaN (and gives the same value everywhere else)."""
  return jnp.where(x < 0, jnp.zeros_like(x), x)


def _clip_keeping_nan(x, hi):
  """``clip(x, 0, hi)`` on a kernel tile: selects that keep NaN, where min/max lower to
  Triton's minnumf/maxnumf (which drop it)."""
  return jnp.where(x < 0, jnp.zeros_like(x), jnp.where(x > hi, jnp.full_like(x, hi), x))


def relu6_kernel_forward(x):
  """relu6 on a kernel tile (:func:`_clip_keeping_nan`)."""
  return _clip_keeping_nan(x, 6)


def hard_sigmoid_kernel_forward(x):
  """hard_sigmoid on a kernel tile, with :func:`relu6_kernel_forward`."""
  return relu6_kernel_forward(x + 3) / 6


def sparse_sigmoid_kernel_forward(x):
  """sparse_sigmoid on a kernel tile: 0.5 * clip(x + 1, 0, 2) (:func:`_clip_keeping_nan`)."""
  return 0.5 * _clip_keeping_nan(x + 1, 2)


def hard_silu_kernel_forward(x):
  """hard_silu on a kernel tile, with :func:`relu6_kernel_forward`."""
  return x * hard_sigmoid_kernel_forward(x)


def celu_kernel_forward(x, alpha=1.0):
  """celu on a kernel tile: selects that keep NaN in place of jax.nn's max/min."""
  zero = jnp.zeros_like(x)
  return jnp.where(x > 0, x, zero) + alpha * jnp.expm1(jnp.where(x < 0, x, zero) / alpha)


def gelu_erf_kernel_forward(x):
  """GELU (erf form) on a kernel tile, with :func:`erfc_f32` (no erf lowering in Triton)."""
  xf = x.astype(jnp.float32)
  return (0.5 * xf * erfc_f32(-xf, scale=float(np.sqrt(0.5)))).astype(x.dtype)
