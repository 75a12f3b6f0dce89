"""Inverted activations: forward identity with jax.nn, gradients at the storage floor."""
import functools
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import invact_jax
from invact_jax import accuracy
from tests.activation_cases import CASES, DTYPES, NONMONOTONE

SHAPES = ((), (0,), (7,), (3, 13), (2, 3, 16))


def _np_dtype(name):
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@functools.lru_cache(maxsize=None)
def _audit(name, dtype):
  return accuracy.audit(name, dtype)


def _bits(a):
  """Raw bytes of an array (any shape, incl. 0-d), for bit-exact comparisons."""
  return np.asarray(a).reshape(-1).view(np.uint8)


def _inputs(shape, dtype, seed=0):
  x = np.random.default_rng(seed).normal(0.0, 3.0, size=shape)
  return jnp.asarray(x.astype(_np_dtype(dtype)))


class ForwardTest(parameterized.TestCase):

  @parameterized.product(name=tuple(CASES), dtype=DTYPES, shape=SHAPES, jit=(False, True))
  def test_forward_bit_identical_to_jax_nn(self, name, dtype, shape, jit):
    ours, ref = CASES[name]
    x = _inputs(shape, dtype)
    wrap = jax.jit if jit else (lambda f: f)
    y, y_ref = wrap(ours)(x), wrap(ref)(x)
    self.assertEqual(y.dtype, y_ref.dtype)
    self.assertEqual(y.shape, y_ref.shape)
    np.testing.assert_array_equal(_bits(y), _bits(y_ref))

  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_forward_bit_identical_inside_grad(self, name, dtype):
    # The forward inside value_and_grad (the custom_vjp fwd rule) is jax.nn's too.
    ours, ref = CASES[name]
    x = _inputs((4, 40), dtype, seed=1)
    y, _ = jax.jit(jax.value_and_grad(lambda x: ours(x).astype(jnp.float32).sum()))(x)
    y_ref = jax.jit(lambda x: ref(x).astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


class AccuracyTest(parameterized.TestCase):
  """The issue's target: max |f'_approx(y, bit) - f'(x)| <= 1.2 x storage floor."""

  @parameterized.product(name=tuple(accuracy.NONMONOTONE + accuracy.MONOTONE), dtype=DTYPES)
  def test_error_within_floor(self, name, dtype):
    row = _audit(name, dtype)
    print(f"{name} {dtype}: floor {row.floor:.3e} error {row.error:.3e} ratio {row.ratio:.3f}")
    self.assertEqual(row.nonfinite, 0)
    self.assertLessEqual(row.error, 1.2 * row.floor)

  def test_floor_detects_a_bad_inverse(self):
    # The audit must be able to fail: a slightly wrong derivative breaks the bound.
    row = accuracy.audit("silu", "float32",
                         approx=lambda y, x: accuracy.derivative64("silu", x.astype(np.float64)) + 1e-3)
    self.assertGreater(row.error, 1.2 * row.floor)


class GradientTest(parameterized.TestCase):

  @parameterized.product(name=tuple(CASES), dtype=DTYPES, shape=SHAPES[1:], jit=(False, True))
  def test_grad_vs_float64_and_jax_nn(self, name, dtype, shape, jit):
    ours, ref = CASES[name]
    audit_name = name
    x = _inputs(shape, dtype, seed=2)
    wrap = jax.jit if jit else (lambda f: f)
    dy = jnp.ones(shape, x.dtype)
    g = wrap(lambda x: jax.vjp(ours, x)[1](dy)[0])(x)
    g_ref = wrap(lambda x: jax.vjp(ref, x)[1](dy)[0])(x)
    chex.assert_equal_shape([g, x])
    self.assertEqual(g.dtype, x.dtype)
    x64 = np.asarray(x, np.float64)
    true = accuracy.derivative64(audit_name, x64)
    g64, gref64 = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    # Tolerance: the measured floor (1.2x) plus rounding dx to the input dtype.
    half_ulp = 0.5 * np.spacing(np.abs(true).astype(_np_dtype(dtype))).astype(np.float64)
    tol = 1.2 * _audit(audit_name, dtype).floor + half_ulp
    if name == "leaky_relu":  # kink convention at -0.0 (see invact_jax.leaky_relu)
      keep = x64 != 0
      g64, gref64, true, tol = g64[keep], gref64[keep], true[keep], tol[keep]
    np.testing.assert_array_less(np.abs(g64 - true), tol + 1e-30)
    # Against jax.nn's own gradient: within our bound plus jax.nn's own error.
    np.testing.assert_array_less(np.abs(g64 - gref64), tol + np.abs(gref64 - true) + 1e-30)

  @parameterized.parameters(*CASES)
  def test_transformations(self, name):
    ours, ref = CASES[name]
    x = _inputs((5, 8, 24), "float32", seed=3)
    loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x))))
    g_ref = jax.grad(loss(ref))(x)
    tol = 1.2 * _audit(name, "float32").floor + 1e-6
    variants = {
        "grad": jax.grad(loss(ours)),
        "jit_grad": jax.jit(jax.grad(loss(ours))),
        "value_and_grad": lambda x: jax.value_and_grad(loss(ours))(x)[1],
        "vmap": jax.vmap(jax.grad(loss(ours))),
        "grad_of_vmap": jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(ours)(x)))),
        "checkpoint": jax.grad(jax.checkpoint(loss(ours))),
        "remat_policy": jax.grad(jax.checkpoint(
            loss(ours), policy=jax.checkpoint_policies.nothing_saveable)),
        "scan": jax.grad(lambda x: jax.lax.scan(
            lambda c, xi: (c + jnp.sum(jnp.sin(ours(xi))), None), 0.0, x)[0]),
    }
    for vname, fn in variants.items():
      with self.subTest(vname):
        chex.assert_trees_all_close(fn(x), g_ref, atol=tol, rtol=0)

  @parameterized.parameters(*NONMONOTONE)
  def test_branch_point_and_minimum(self, name):
    # Inputs at and around x_min, including those whose output rounds to y_min.
    ours, _ = CASES[name]
    audit_name = name
    x_min, _ = accuracy.branch_point64(audit_name)
    for dtype in DTYPES:
      dt = _np_dtype(dtype)
      x = (x_min + np.linspace(-0.05, 0.05, 1001)).astype(dt)
      g = jax.grad(lambda x: ours(x).astype(jnp.float32).sum())(jnp.asarray(x))
      true = accuracy.derivative64(audit_name, x.astype(np.float64))
      half_ulp = 0.5 * np.spacing(np.abs(true).astype(dt)).astype(np.float64)
      tol = 1.2 * _audit(audit_name, dtype).floor + half_ulp
      err = np.abs(np.asarray(g, np.float64) - true)
      self.assertTrue(np.all(np.isfinite(np.asarray(g, np.float64))))
      np.testing.assert_array_less(err, tol)


  @parameterized.parameters(*NONMONOTONE)
  def test_jit_equals_eager_at_the_minimum(self, name):
    # XLA must not fold (y - y_min_hi) - y_min_lo into one constant: near x_min that
    # loses y_min_lo and costs up to ~3e-5 of gradient accuracy (float32).
    from invact_jax import _activations
    spec = _activations.spec_for_audit(name)
    x = (accuracy.branch_point64(name)[0] + np.linspace(-2e-3, 2e-3, 4001)).astype(np.float32)
    y, m = spec.forward_and_mask(jnp.asarray(x))
    f = lambda y, m: _activations.derivative_from_packed(spec, y, m)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(y, m)), np.asarray(f(y, m)), rtol=0, atol=2e-7)


class SpecialValuesTest(parameterized.TestCase):

  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_nan_and_inf(self, name, dtype):
    ours, ref = CASES[name]
    x = jnp.asarray(np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 1.0]).astype(_np_dtype(dtype)))
    np.testing.assert_array_equal(_bits(ours(x)), _bits(ref(x)))
    g = np.asarray(jax.grad(lambda x: ours(x).astype(jnp.float32).sum())(x), np.float64)
    g_ref = np.asarray(jax.grad(lambda x: ref(x).astype(jnp.float32).sum())(x), np.float64)
    # NaN input: the same gradient as jax.nn (NaN, or relu's 0 / leaky_relu's slope).
    np.testing.assert_array_equal(g[:1], g_ref[:1])
    # Where the true derivative is finite (its limit at +-inf), ours is that value.
    true = accuracy.derivative64(name, np.asarray(x, np.float64))
    np.testing.assert_allclose(g[1:], true[1:].astype(_np_dtype(dtype)).astype(np.float64),
                               atol=1.2 * _audit(name, dtype).floor + 1e-7)


class InputValidationTest(parameterized.TestCase):

  @parameterized.product(name=tuple(CASES),
                         bad=(np.arange(3), np.array([True, False]), np.ones(2, np.complex64),
                              np.ones(2, np.uint8), 3, True))
  def test_rejects_non_float(self, name, bad):
    ours, _ = CASES[name]
    with self.assertRaisesRegex(TypeError, r"argument `x`.*float16, bfloat16, float32 or float64"):
      ours(bad)

  def test_python_float_accepted(self):
    self.assertEqual(float(invact_jax.gelu(1.0)), float(jax.nn.gelu(1.0)))

  def test_bad_implementation(self):
    with self.assertRaisesRegex(ValueError, "argument `implementation`"):
      invact_jax.gelu(jnp.ones(3), implementation="cuda")

  def test_triton_backend_is_a_clear_error(self):
    # On every platform (a GPU with jax-triton installed included): no ImportError, no
    # silent fallback, a RuntimeError that names the choice and says why.
    with self.assertRaisesRegex(RuntimeError, "implementation='triton' cannot run here: .*"
                                "not written yet"):
      invact_jax.silu(jnp.ones(3), implementation="triton")
    self.assertFalse(invact_jax.available("triton")[0])

  def test_implementation_options(self):
    x = jnp.linspace(-3, 3, 64 * 40).reshape(40, 64)
    for block_rows in (1, 4, 256):
      impl = invact_jax.Implementation(name="pallas", block_rows=block_rows)
      w = jnp.cos(3.0 * x)  # dy, independent of y
      g = jax.grad(lambda x: jnp.vdot(invact_jax.gelu(x, implementation=impl), w))(x)
      g_ref = jax.grad(lambda x: jnp.vdot(invact_jax.gelu(x, implementation="xla"), w))(x)
      np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-6)
    with self.assertRaisesRegex(ValueError, "argument `block_rows` must be a positive power"):
      invact_jax.Implementation(name="pallas", block_rows=3)
    with self.assertRaisesRegex(ValueError, "argument `name`"):
      invact_jax.Implementation(name="cuda")

  def test_traced_parameter_rejected(self):
    with self.assertRaisesRegex(TypeError, "argument `alpha` must be a concrete scalar"):
      jax.jit(lambda a: invact_jax.elu(jnp.ones(3), a))(1.0)
    with self.assertRaisesRegex(TypeError, "argument `negative_slope`"):
      jax.jit(lambda a: invact_jax.leaky_relu(jnp.ones(3), a))(0.1)

  @parameterized.parameters(-0.5, 0.0, 0.3)
  def test_leaky_relu_any_slope(self, slope):
    x = jnp.linspace(-3, 3, 25)
    g = jax.grad(lambda x: invact_jax.leaky_relu(x, slope).sum())(x)
    g_ref = jax.grad(lambda x: jax.nn.leaky_relu(x, slope).sum())(x)
    np.testing.assert_allclose(g[x != 0], g_ref[x != 0])

  @parameterized.parameters(-0.5, 0.0, 2.0)
  def test_elu_any_alpha(self, alpha):
    x = jnp.linspace(-3, 3, 25)
    g = jax.grad(lambda x: invact_jax.elu(x, alpha).sum())(x)
    g_ref = jax.grad(lambda x: jax.nn.elu(x, alpha).sum())(x)
    np.testing.assert_allclose(g, g_ref, atol=1e-6)


class HigherOrderTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_forward_mode_is_a_clear_error(self, name):
    ours, _ = CASES[name]
    with self.assertRaisesRegex(TypeError, "forward-mode|jvp"):
      jax.jvp(ours, (jnp.ones(3),), (jnp.ones(3),))

  @parameterized.parameters(*(n for n in CASES if n not in ("relu", "leaky_relu")))
  def test_second_derivative_is_a_clear_error(self, name):
    ours, _ = CASES[name]
    grad_sum = lambda x: jax.grad(lambda x: ours(x).sum())(x).sum()
    with self.assertRaisesRegex(NotImplementedError, "higher-order derivatives are not supported"):
      jax.grad(grad_sum)(jnp.ones(3))
    with self.assertRaisesRegex(NotImplementedError, "higher-order"):
      jax.hessian(lambda x: ours(x).sum())(jnp.ones(3))

  @parameterized.parameters("relu", "leaky_relu")
  def test_piecewise_linear_second_derivative_is_exact(self, name):
    # f' is piecewise constant in y, so no tangent reaches the guard: f'' = 0, as jax.nn.
    ours, ref = CASES[name]
    x = jnp.linspace(-2.0, 2.0, 9) + 0.1
    h = jax.hessian(lambda x: ours(x).sum())(x)
    chex.assert_trees_all_close(h, jax.hessian(lambda x: ref(x).sum())(x))


def test_float64_under_x64():
  # Separate process: x64 is a global switch.
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      jax.config.update("jax_enable_x64", True)
      import invact_jax
      from invact_jax import accuracy
      x = jnp.linspace(-8.0, 8.0, 4001, dtype=jnp.float64)
      for name, f, ref in [("gelu_erf", lambda x: invact_jax.gelu(x, approximate=False),
                            lambda x: jax.nn.gelu(x, approximate=False)),
                           ("silu", invact_jax.silu, jax.nn.silu),
                           ("softplus", invact_jax.softplus, jax.nn.softplus)]:
        assert f(x).dtype == jnp.float64
        assert np.array_equal(np.asarray(f(x)), np.asarray(ref(x)))
        g = jax.grad(lambda x: f(x).sum())(x)
        assert g.dtype == jnp.float64
        err = np.max(np.abs(np.asarray(g) - accuracy.derivative64(name, np.asarray(x))))
        print(name, err)
        assert err < 2e-6, (name, err)   # the fit's tolerance (see README: float64)
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
