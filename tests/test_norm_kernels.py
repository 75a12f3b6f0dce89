"""Pallas norm kernels (pallas_kernels.norms) vs the XLA path; CUDA lowering; sharding.

``NormKernelTest`` runs compiled on a GPU (skipped without one); ``NormKernelInterpretTest``
reruns every case in Pallas interpret mode.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import invact_jax
from invact_jax import _norms
from pallas_kernels import norms as kernels
from tests.test_pallas_kernels import DTYPES, _export_cuda, _np


def _ulps(a, b, dt):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.maximum(np.max(np.abs(b64)), 1e-30)
  return np.max(np.abs(a64 - b64)) / (scale * float(ml_dtypes.finfo(_np(dt)).eps))


class NormKernelTest(parameterized.TestCase):
  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and jax.default_backend() != "gpu":
      self.skipTest("compiled kernels need a GPU; NormKernelInterpretTest covers CPU")

  @parameterized.product(dtype=DTYPES, rms=(False, True), n=(200, 768, 5000),
                         affine=(True, False))
  def test_forward_and_dx_match_xla(self, dtype, rms, n, affine):
    rng = np.random.default_rng(n)
    x = jnp.asarray((rng.normal(size=(5, n)) * 2 + 1).astype(_np(dtype)))
    s = jnp.asarray(rng.normal(size=n).astype(np.float32)) if affine else None
    b = jnp.asarray(rng.normal(size=n).astype(np.float32)) if affine and not rms else None
    out = jnp.dtype(_np(dtype))
    z, xhat, rstd = jax.jit(lambda x: kernels.forward(
        x, s, b, rms=rms, eps=1e-6, out_dtype=out, interpret=self.INTERPRET))(x)
    xh_ref, rstd_ref = _norms._normalize(x, rms, 1e-6)  # pylint: disable=protected-access
    z_ref = _norms._affine(xh_ref, s, b, out)  # pylint: disable=protected-access
    # Same math, different summation order: a few float32 ulps before the final rounding
    # (16-bit outputs: at most one rounding flip).  Units: ulps of the largest element.
    bound = 8 if dtype == "float32" else 1.01
    self.assertLessEqual(_ulps(rstd, rstd_ref[:, 0], "float32"), 8)
    self.assertLessEqual(_ulps(xhat, xh_ref.astype(out), dtype), bound)
    self.assertLessEqual(_ulps(z, z_ref, dtype), bound)
    dz = jnp.asarray(rng.normal(size=(5, n)).astype(_np(dtype)))
    dx = jax.jit(lambda xh, r, dz: kernels.backward_dx(
        xh, r, dz, s, rms=rms, dx_dtype=out, interpret=self.INTERPRET))(xhat, rstd, dz)
    g = dz.astype(jnp.float32) * (1.0 if s is None else s)
    dx_ref = _norms._dx(xhat.astype(jnp.float32), rstd[:, None], g, rms).astype(out)  # pylint: disable=protected-access
    self.assertLessEqual(_ulps(dx, dx_ref, dtype), 1.01 if dtype != "float32" else 16)

  @parameterized.parameters(False, True)
  def test_public_api_gradients_match_xla(self, rms):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 96)) * 3, jnp.float32)
    s = jnp.asarray(rng.normal(size=96), jnp.float32).at[5].set(0.0)
    b = jnp.asarray(rng.normal(size=96), jnp.float32)
    w = jnp.cos(jnp.arange(96.0))

    def loss(impl):
      def f(x, s, b):
        y = (invact_jax.rms_norm(x, s, implementation=impl) if rms
             else invact_jax.layer_norm(x, s, b, implementation=impl))
        return jnp.sum(y * w)
      return f
    gk = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1, 2)))(x, s, b)
    gx = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(x, s, b)
    for a, c in zip(gk, gx):
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)


class NormKernelInterpretTest(NormKernelTest):
  INTERPRET = True


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_kernels_lower_for_cuda_from_any_platform(rms, dtype):
  x = jax.ShapeDtypeStruct((4096, 768), jnp.dtype(dtype))
  r = jax.ShapeDtypeStruct((4096,), jnp.float32)
  p = jax.ShapeDtypeStruct((768,), jnp.float32)
  fwd = _export_cuda(lambda x, s, b: kernels.forward(x, s, None if rms else b, rms=rms, eps=1e-6,
                                                     out_dtype=x.dtype), x, p, p)
  bwd = _export_cuda(lambda xh, r, dz, s: kernels.backward_dx(xh, r, dz, s, rms=rms,
                                                              dx_dtype=xh.dtype), x, r, x, p)
  for exp in (fwd, bwd):
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_sharded_norm_kernels_run_per_shard():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  sh = NamedSharding(mesh, P("data", "model", None))
  x = jax.random.normal(jax.random.key(0), (8, 4, 200))
  s, b = jnp.linspace(0.5, 1.5, 200), jnp.zeros(200)
  fn = lambda x: jax.vjp(lambda x: invact_jax.layer_norm(  # noqa: E731
      x, s, b, implementation="pallas"), x)[1](jnp.cos(x))[0]
  step = jax.jit(fn, in_shardings=sh, out_shardings=sh)
  hlo = step.lower(jax.device_put(x, sh)).compile().as_text()
  assert not [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
              if c in hlo]
  np.testing.assert_allclose(step(jax.device_put(x, sh)), jax.jit(fn)(x), rtol=1e-6, atol=1e-6)
