"""Pallas kernels vs the XLA path: masks bit-exact, outputs within 1 ulp, CUDA lowering.

``KernelTest`` runs compiled kernels on a GPU (skipped without one); ``KernelInterpretTest``
reruns every case in Pallas interpret mode on any platform (as JAX's own Pallas tests do).
"""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized
from jax import export

from invact_jax import _activations as A
from invact_jax import _bitpack
from pallas_kernels import elementwise

SPECS = {s.name: s for s in (A.GELU_TANH, A.GELU_ERF, A.SILU, A.MISH, A.SIGMOID, A.TANH,
                             A.SOFTPLUS, A.RELU, A._elu_spec(1.0), A._leaky_relu_spec(0.01))}
SPECS["elu_negative_alpha"] = A._elu_spec(-0.5)            # keeps a bit
SPECS["leaky_relu_negative_slope"] = A._leaky_relu_spec(-0.2)  # keeps a bit
SHAPES = ((), (3, 13), (257, 24))
DTYPES = ("float32", "bfloat16", "float16")


def _np(dt):
  return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


def _ulp_diff(a, b, dt):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
  ulp = np.spacing(np.maximum(np.abs(a64), np.abs(b64)).astype(_np(dt))).astype(np.float64)
  return np.where(same, 0.0, np.abs(a64 - b64) / ulp)


class KernelTest(parameterized.TestCase):
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and jax.default_backend() != "gpu":
      self.skipTest("compiled kernels need a GPU; KernelInterpretTest covers CPU")

  @parameterized.product(name=tuple(SPECS), dtype=DTYPES, shape=SHAPES, block_rows=(None, 2))
  def test_forward_and_backward_match_xla(self, name, dtype, shape, block_rows):
    spec = SPECS[name]
    x = np.random.default_rng(0).normal(0, 3, size=shape).astype(_np(dtype))
    x = jnp.asarray(x)
    # y: the same tile math run by XLA (the kernel computes 16-bit inputs in float32 and
    # GELU-erf with its own erfc; see test_kernel_math_accuracy for those vs float64);
    # mask: the XLA path's, bit for bit.
    y_ref = jax.jit(functools.partial(spec.kernel_forward, **spec.kwargs))(x)
    _, m_ref = jax.jit(spec.forward_and_mask)(x)
    from pallas_kernels import activations as kernels
    y, m = jax.jit(lambda x: kernels.forward(spec, x, block_rows=block_rows,
                                             interpret=self.INTERPRET))(x)
    self.assertEqual(y.dtype, y_ref.dtype)
    self.assertLessEqual(float(np.max(_ulp_diff(y, y_ref, dtype), initial=0)), 1.0)
    if m_ref is None:
      self.assertIsNone(m)
    else:
      np.testing.assert_array_equal(np.asarray(m), np.asarray(m_ref))
    dy = jnp.asarray(np.random.default_rng(1).normal(size=shape).astype(_np(dtype)))
    # Reference: the jitted XLA backward, i.e. what implementation="xla" runs.
    def xla_bwd(y, m, dy):
      g = spec.derivative(y, None if m is None else _bitpack.unpack_bits(m, shape))
      return (dy.astype(g.dtype) * g).astype(dy.dtype)
    y_res = jax.jit(spec.forward_and_mask)(x)[0]  # the XLA path's residual
    dx_ref = jax.jit(xla_bwd)(y_res, m_ref, dy)
    dx = jax.jit(lambda y, m, dy: kernels.backward(
        spec, y, m, dy, block_rows=block_rows, interpret=self.INTERPRET))(y_res, m_ref, dy)
    self.assertLessEqual(float(np.max(_ulp_diff(dx, dx_ref, dtype), initial=0)), 1.0)

  def test_public_api_with_pallas_implementation(self):
    import invact_jax
    x = jnp.linspace(-4, 4, 96).reshape(4, 24)
    for f in (invact_jax.gelu, invact_jax.silu, invact_jax.mish, invact_jax.tanh):
      g_k = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, implementation="pallas")))))(x)
      g_x = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, implementation="xla")))))(x)
      np.testing.assert_allclose(g_k, g_x, rtol=0, atol=1e-6)
    with self.assertRaisesRegex(NotImplementedError, "higher-order"):
      jax.grad(lambda x: jax.grad(
          lambda x: invact_jax.gelu(x, implementation="pallas").sum())(x).sum())(x)


def test_kernel_math_accuracy():
  """Kernel forward math (float32 compute, in-kernel erfc) vs float64, where it differs from XLA."""
  from invact_jax import accuracy
  x = np.linspace(-12, 12, 200001).astype(np.float32)
  for name in ("gelu_tanh", "gelu_erf", "silu", "mish", "sigmoid", "softplus"):
    spec = SPECS[name]
    y = np.asarray(jax.jit(spec.kernel_forward)(jnp.asarray(x)), np.float64)
    true = accuracy.forward64(name, x.astype(np.float64))
    # No less accurate than jax.nn's own float32 forward (whose formulas cancel in tails),
    # up to 2 ulp.
    y_nn = np.asarray(jax.jit(spec.forward)(jnp.asarray(x)), np.float64)
    tol = np.abs(y_nn - true) + 2 * np.spacing(np.abs(true).astype(np.float32)).astype(np.float64)
    if name == "gelu_erf":  # the in-kernel erfc's documented fractional error (Press et al.)
      tol = tol + 1.2e-7 * np.abs(true)
    err = np.abs(y - true) - tol
    assert err.max() <= 0, (name, float(x[np.argmax(err)]), float(err.max()))


class KernelInterpretTest(KernelTest):
  INTERPRET = True


def _export_cuda(fn, *avals):
  return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernels_lower_for_cuda_from_any_platform(name, dtype):
  """Unsupported primitives in kernel bodies fail here (CI, no GPU), not on a user's GPU."""
  spec = SPECS[name]
  x = jax.ShapeDtypeStruct((4096, 768), jnp.dtype(dtype))
  m = jax.ShapeDtypeStruct((4096, 96), jnp.uint8)
  from pallas_kernels import activations as kernels
  try:
    fwd = _export_cuda(lambda x: kernels.forward(spec, x), x)
    if spec.bit is None:
      bwd = _export_cuda(lambda y, dy: kernels.backward(spec, y, None, dy), x, x)
    else:
      bwd = _export_cuda(lambda y, m, dy: kernels.backward(spec, y, m, dy), x, m, x)
  except RuntimeError as e:  # JAX 0.11+ without a GPU may need an abstract device
    if "device" in str(e).lower() and jax.__version_info__ >= (0, 11):
      pytest.skip(f"CUDA lowering needs a (abstract) GPU device on JAX {jax.__version__}: {e}")
    raise
  for exp in (fwd, bwd):
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
