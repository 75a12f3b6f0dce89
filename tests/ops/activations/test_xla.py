"""The XLA implementation (the default): the shared base, plus what only it promises."""
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import parameterized

import invact_jax
import tests
from invact_jax import accuracy
from invact_jax.ops.activations import base, registry
from tests.ops.activations import base as test_base
from tests.ops.activations.cases import CASES, NONMONOTONE


class XlaActivationTest(test_base.ActivationTestBase):
  IMPLEMENTATION = "xla"

  @parameterized.parameters(*(n for n, a in registry.ACTIVATIONS.items() if a.piecewise_linear))
  def test_piecewise_linear_gradient_is_jax_nn_s_on_every_16_bit_value(self, name):
    # f' is piecewise constant: from y (and the bit) it is exact, so the gradient equals
    # jax.nn's bit for bit on every bfloat16 and float16 input, the ends (relu6's 0 and 6,
    # hard_sigmoid's x + 3 rounded to 0 or 6, hard_tanh's +-1) and NaN included.
    case = CASES[name]
    for dtype in ("bfloat16", "float16"):
      dt = test_base.np_dtype(dtype)
      x = jnp.asarray(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dt))
      grad = lambda f: jax.jit(jax.grad(lambda x: f(x).astype(jnp.float32).sum()))(x)  # noqa: E731
      g, g_ref = np.asarray(grad(case.fn()), np.float32), np.asarray(grad(case.reference()), np.float32)
      if name == "leaky_relu":  # the kink convention at -0.0 (see invact_jax.leaky_relu), which
        # XLA:CPU's flushed negative subnormals reach too (jax.nn's x >= 0 then holds)
        x32 = np.asarray(x, np.float32)
        keep = ~(np.signbit(x32) & (np.abs(x32) < float(ml_dtypes.finfo(dt).tiny)))
        g, g_ref = g[keep], g_ref[keep]
      np.testing.assert_array_equal(g, g_ref, err_msg=f"{name} {dtype}")

  @parameterized.parameters(*CASES)
  def test_forward_bit_identical_inside_grad(self, name):
    # The forward inside value_and_grad (the custom_vjp fwd rule) is jax.nn's too; every
    # dtype in one program per function.
    case = CASES[name]
    xs = [test_base.inputs((4, 40), dtype, seed=1) for dtype in test_base.DTYPES]
    def loss(xs):
      ys = [case.fn()(x) for x in xs]
      return sum(y.astype(jnp.float32).sum() for y in ys), ys
    # (two compilations compared to the last ulp: at XLA's default code generation, where the
    # claim is made; tests.DEFAULT_COMPILE — squareplus's cancellation for x < 0 shows -O0's
    # elemental code 1-2 ulp apart between the two programs)
    (_, ys), _ = tests.jit(jax.value_and_grad(loss, has_aux=True))(xs)
    y_refs = test_base.jit_each(case.reference(), jit=tests.jit)(xs)
    for dtype, y, y_ref in zip(test_base.DTYPES, ys, y_refs):
      with self.subTest(dtype=dtype):
        np.testing.assert_array_equal(test_base.raw_bits(y), test_base.raw_bits(y_ref))

  @parameterized.parameters(*NONMONOTONE)
  def test_jit_equals_eager_at_the_minimum(self, name):
    # XLA must not fold the two-float y_min into one constant: near x_min that loses its
    # low part and costs up to ~3e-5 of gradient accuracy (float32).
    op = CASES[name].op
    x = (accuracy.branch_point64(name)[0] + np.linspace(-2e-3, 2e-3, 4001)).astype(np.float32)
    y, m = base.XLA.forward(op, jnp.asarray(x))
    f = lambda y, m: base.derivative_from_packed(op, y, m)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(f)(y, m)), np.asarray(f(y, m)), rtol=0, atol=2e-7)


class InputValidationTest(parameterized.TestCase):

  @parameterized.product(name=tuple(CASES),
                         bad=(np.arange(3), np.array([True, False]), np.ones(2, np.complex64),
                              np.ones(2, np.uint8), 3, True))
  def test_rejects_non_float(self, name, bad):
    with self.assertRaisesRegex(TypeError, r"argument `x`.*float16, bfloat16, float32 or float64"):
      CASES[name].fn()(bad)

  def test_python_float_accepted(self):
    self.assertEqual(float(invact_jax.gelu(1.0)), float(jax.nn.gelu(1.0)))

  def test_bad_implementation(self):
    with self.assertRaisesRegex(ValueError, "argument `implementation`"):
      invact_jax.gelu(jnp.ones(3), implementation="cuda")

  def test_triton_is_a_clear_error(self):
    # Softmax has no Triton kernels (activations and norms do): asking says what the
    # op has.
    with self.assertRaisesRegex(ValueError, "implementation='triton' is not available for this op"):
      invact_jax.softmax(jnp.ones((2, 3)), implementation="triton")
    if jax.default_backend() != "gpu":  # activations: a platform error that says what to use
      self.assertFalse(invact_jax.available("triton")[0])
      with self.assertRaisesRegex(RuntimeError, "need a CUDA GPU .*use implementation='xla'"):
        invact_jax.silu(jnp.ones(3), implementation="triton")

  def test_implementation_options(self):
    x = jnp.linspace(-3, 3, 64 * 40).reshape(40, 64)
    w = jnp.cos(3.0 * x)  # dy, independent of y
    g_ref = tests.jit(jax.grad(lambda x: jnp.vdot(invact_jax.gelu(x, implementation="xla"), w)))(x)
    xd = np.asarray(x, np.float64)   # tanh GELU's derivative in float64
    t = np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd**3))
    true = (0.5 * (1 + t) + 0.5 * xd * (1 - t**2) * np.sqrt(2 / np.pi)
            * (1 + 3 * 0.044715 * xd**2)) * np.asarray(w, np.float64)
    own_error = float(np.max(np.abs(np.asarray(g_ref, np.float64) - true)))
    grads = []
    for block_rows in (1, 4, 256):
      impl = invact_jax.Implementation(name="pallas", block_rows=block_rows)
      grads.append(tests.jit(jax.grad(
          lambda x: jnp.vdot(invact_jax.gelu(x, implementation=impl), w)))(x))
      if jax.default_backend() == "gpu" or jax.__version_info__ < (0, 12):
        # The tiling never changes a result: one kernel body for every element.
        np.testing.assert_array_equal(grads[-1], grads[0])
      else:
        # JAX 0.12's interpret mode compiles the body per block shape, and XLA:CPU rounds
        # the inverse's steps differently per shape: up to 1.3e-6 apart here, 0.13 of the
        # backward's own error against float64 (9.5e-6, near GELU's minimum; 2026-11-25).
        # The tiling stays well inside that error.
        apart = float(jnp.max(jnp.abs(grads[-1] - grads[0])))
        assert apart <= 0.25 * own_error, (apart, own_error)
    if jax.default_backend() != "gpu":  # interpret mode: XLA's math, so XLA's gradient
      np.testing.assert_allclose(grads[0], g_ref, rtol=0, atol=1e-6)
    with self.assertRaisesRegex(ValueError, "argument `block_rows` must be a positive power"):
      invact_jax.Implementation(name="pallas", block_rows=3)
    with self.assertRaisesRegex(ValueError, "argument `name`"):
      invact_jax.Implementation(name="cuda")
    with self.assertRaisesRegex(ValueError, "no kernel options"):
      invact_jax.Implementation(name="xla", block_rows=4)

  def test_bad_parameters_name_the_argument(self):
    with self.assertRaisesRegex(TypeError, "argument `alpha` must be a concrete number"):
      jax.jit(lambda a: invact_jax.elu(jnp.ones(3), a))(1.0)
    with self.assertRaisesRegex(TypeError, "argument `negative_slope`"):
      jax.jit(lambda a: invact_jax.leaky_relu(jnp.ones(3), a))(0.1)
    with self.assertRaisesRegex(TypeError, "invact_jax.elu: argument `alpha` must be a real number"):
      invact_jax.elu(jnp.ones(3), "a")
    with self.assertRaisesRegex(TypeError, "argument `alpha`.*shape"):
      invact_jax.elu(jnp.ones(3), np.ones(2))
    self.assertEqual(float(invact_jax.elu(jnp.float32(-1.0), np.float32(0.5))),
                     float(jax.nn.elu(jnp.float32(-1.0), 0.5)))

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

  def test_celu_any_alpha_and_zero_named(self):
    x = jnp.linspace(-3, 3, 25)
    for alpha in (-0.5, 0.3, 2.0):
      g = jax.grad(lambda x: invact_jax.celu(x, alpha).sum())(x)
      g_ref = jax.grad(lambda x: jax.nn.celu(x, alpha).sum())(x)
      np.testing.assert_allclose(g, g_ref, rtol=2e-6, atol=1e-7)
    with self.assertRaisesRegex(ValueError, "invact_jax.celu: argument `alpha` must be nonzero"):
      invact_jax.celu(x, 0.0)

  def test_public_names_mirror_jax_nn(self):
    import inspect
    for name in registry.PUBLIC:
      ours = inspect.signature(getattr(invact_jax, name))
      ref = inspect.signature(getattr(jax.nn, name))
      self.assertEqual(list(ours.parameters)[:len(ref.parameters)], list(ref.parameters), name)
      self.assertIn("implementation", ours.parameters)
      self.assertTrue(callable(getattr(invact_jax, f"{name}_reference")))


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
