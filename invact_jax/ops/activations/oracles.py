"""Float64 truth for each activation: forward, derivative, and (monotone) f'(f^-1(y)).

Plain NumPy (SciPy's special functions, imported on first use), so the audit
(:mod:`invact_jax.accuracy`) and the fitter (:mod:`.fitting`) compare against values that
are exact to float64 rounding.  The registry attaches these to each activation.
"""
from __future__ import annotations

import numpy as np

_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)
_GELU_TANH_A = 0.044715
_SELU_SCALE, _SELU_ALPHA = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717


def _sp():
  from scipy import special  # pylint: disable=import-outside-toplevel
  return special


def _phi(x):
  return np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


def _softplus(x):
  return np.logaddexp(x, 0.0)


def _clip(x):
  return np.clip(x, -1e6, 1e6)  # f' is constant to float64 precision beyond; avoids inf * 0


# ------------------------------------------------------------------------------ forwards
def gelu_erf_forward(x):
  return x * _sp().ndtr(x)


def gelu_tanh_forward(x):  # 0.5 (1 + tanh(u)) == expit(2u), without cancellation
  # (x * x * x, not x ** 3: NumPy's pow takes ~100x as long, most of a refit's time)
  return x * _sp().expit(2.0 * _SQRT_2_OVER_PI * (x + _GELU_TANH_A * (x * x * x)))


def silu_forward(x):
  return x * _sp().expit(x)


def mish_forward(x):
  return x * np.tanh(_softplus(x))


def sigmoid_forward(x):
  return _sp().expit(x)


def tanh_forward(x):
  return np.tanh(x)


def softplus_forward(x):
  return _softplus(x)


def relu6_forward(x):
  return np.where(np.isnan(x), x, np.clip(x, 0.0, 6.0))


def hard_sigmoid_forward(x):
  return relu6_forward(x + 3.0) / 6.0


def hard_silu_forward(x):
  return x * hard_sigmoid_forward(x)


def hard_tanh_forward(x):
  return np.where(np.isnan(x), x, np.clip(x, -1.0, 1.0))


def celu_forward(x, alpha=1.0):
  return np.maximum(x, 0.0) + alpha * np.expm1(np.minimum(x, 0.0) / alpha)


def selu_forward(x):
  return _SELU_SCALE * elu_forward(x, _SELU_ALPHA)


def elu_forward(x, alpha=1.0):
  return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


def leaky_relu_forward(x, negative_slope=1e-2):
  return np.where(x >= 0, x, negative_slope * x)


def relu_forward(x):
  return np.maximum(x, 0.0)


# --------------------------------------------------------------------------- derivatives
def gelu_erf_derivative(x):
  xf = _clip(x)
  return _sp().ndtr(xf) + xf * _phi(xf)


def gelu_tanh_derivative(x):
  xf = _clip(x)
  u2 = 2.0 * _SQRT_2_OVER_PI * (xf + _GELU_TANH_A * (xf * xf * xf))
  s, sm = _sp().expit(u2), _sp().expit(-u2)
  return s + xf * s * sm * 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_A * xf * xf)


def silu_derivative(x):
  s = _sp().expit(_clip(x))
  return s * (1.0 + _clip(x) * (1.0 - s))


def mish_derivative(x):
  xf = _clip(x)
  t = np.tanh(_softplus(xf))
  return t + xf * (1.0 - t * t) * _sp().expit(xf)


def sigmoid_derivative(x):
  s = _sp().expit(_clip(x))
  return s * (1.0 - s)


def tanh_derivative(x):
  t = np.tanh(_clip(x))
  return 1.0 - t * t


def softplus_derivative(x):
  return _sp().expit(_clip(x))


def relu6_derivative(x):
  return np.where((x > 0) & (x < 6), 1.0, 0.0)


def hard_sigmoid_derivative(x):
  return np.where((x > -3) & (x < 3), 1.0 / 6.0, 0.0)


def hard_silu_derivative(x):
  # jax.nn: hard_sigmoid(x) + x relu6'(x + 3) / 6, relu6' = 0 at 0 and 6.
  return np.where(x >= 3, 1.0, np.where(x > -3, (2.0 * x + 3.0) / 6.0, 0.0))


def hard_tanh_derivative(x):
  return np.where((x >= -1) & (x <= 1), 1.0, 0.0)


def celu_derivative(x, alpha=1.0):
  return np.where(x > 0, 1.0, np.exp(np.minimum(_clip(x), 0.0) / alpha))


def selu_derivative(x):
  return _SELU_SCALE * elu_derivative(x, _SELU_ALPHA)


def elu_derivative(x, alpha=1.0):
  return np.where(x > 0, 1.0, alpha * np.exp(np.minimum(_clip(x), 0.0)))


def leaky_relu_derivative(x, negative_slope=1e-2):
  # At the kink, -0.0 takes the left slope (see invact_jax.leaky_relu).
  return np.where(np.signbit(x), negative_slope, 1.0)


def soft_sign_forward(x):
  return np.where(np.isinf(x), np.sign(x), x / (np.abs(x) + 1.0))  # (its limits at +-inf)


def soft_sign_derivative(x):
  return 1.0 / np.square(1.0 + np.abs(x))


def squareplus_forward(x, b=4.0):
  # (x + s) / 2 = b / (2 (s - x)): no cancellation for negative x
  s = np.sqrt(np.square(x) + b)
  return np.where(x >= 0, (x + s) / 2.0, b / (2.0 * (s - x)))


def squareplus_derivative(x, b=4.0):
  x = _clip(x)
  s = np.sqrt(np.square(x) + b)
  return np.where(x >= 0, 0.5 * (1.0 + x / s), 0.5 * b / (s * (s - x)))


def sparse_plus_forward(x):
  return np.where(x <= -1, 0.0, np.where(x >= 1, x, np.square(x + 1.0) / 4.0))


def sparse_plus_derivative(x):
  return np.where(x <= -1, 0.0, np.where(x >= 1, 1.0, (x + 1.0) / 2.0))


def sparse_sigmoid_forward(x):
  return np.clip(x + 1.0, 0.0, 2.0) / 2.0


def sparse_sigmoid_derivative(x):
  # f' = 1/4 at x = +-1 (jax.nn's: max's and min's ties count half)
  return np.where(np.abs(x) < 1, 0.5, np.where(np.abs(x) == 1, 0.25, 0.0))


def relu_derivative(x):
  return np.where(x > 0, 1.0, 0.0)


# ------------------------------------------- monotone: f'(f^-1(y)) in closed form, from y
def sigmoid_grad_from_output(y, x):
  del x
  return y * (1.0 - y)


def tanh_grad_from_output(y, x):
  del x
  return (1.0 - y) * (1.0 + y)


def softplus_grad_from_output(y, x):
  del x
  return -np.expm1(-y)


def relu6_grad_from_output(y, x):
  del x
  return np.where((y > 0) & (y < 6), 1.0, 0.0)


def hard_sigmoid_grad_from_output(y, x):
  del x
  return np.where((y > 0) & (y < 1), 1.0 / 6.0, 0.0)


def hard_silu_grad_from_output(y, x):
  # The branch is x's (x < -3/2: the left, decreasing one).
  r = np.sqrt(np.maximum(y + 0.375, 0.0) * (2.0 / 3.0))
  return np.where(x < -1.5, np.where(y < 0, -r, 0.0), np.where(y >= 3, 1.0, r))


def hard_tanh_grad_from_output(y, x):
  # The branch is x's: y = +-1 comes from |x| = 1 (f' = 1) as from |x| > 1 (f' = 0).
  del y
  return hard_tanh_derivative(x)


def celu_grad_from_output(y, x, alpha=1.0):
  del x
  return np.where(y > 0, 1.0, y / alpha + 1.0)


def selu_grad_from_output(y, x):
  del x
  return np.where(y > 0, _SELU_SCALE, y + _SELU_SCALE * _SELU_ALPHA)


def elu_grad_from_output(y, x, alpha=1.0):
  # The branch is x's (for alpha < 0 the output does not tell it).
  return np.where(x > 0, 1.0, y + alpha)


def soft_sign_grad_from_output(y, x):
  del x
  return np.square(1.0 - np.abs(y))


def squareplus_grad_from_output(y, x, b=4.0):
  del x
  return 1.0 / (1.0 + (b / 4.0) / np.square(y))


def sparse_plus_grad_from_output(y, x):
  del x
  return np.minimum(np.sqrt(y), 1.0)


def sparse_sigmoid_grad_from_output(y, x, dtype=np.float64):
  # From y and the bit, x + 1 rounded to the storage dtype ``dtype`` as jax.nn rounds it: a
  # sum of 0 or 2 is a tie (1/4), where the true derivative at x's other than +-1 is 1/2 or 0.
  s = (x + 1.0).astype(dtype).astype(np.float64)
  return np.where((s == 0) | (s == 2), 0.25, np.where((y > 0) & (y < 1), 0.5, 0.0))


def leaky_relu_grad_from_output(y, x, negative_slope=1e-2):
  return np.where(np.signbit(x), negative_slope, 1.0)


def relu_grad_from_output(y, x):
  del x
  return np.where(y > 0, 1.0, 0.0)
