"""Pallas norm kernels: the shared base compiled on a GPU (skipped without one) and in
interpret mode anywhere; kernel-level checks against the XLA math; CUDA lowering from CPU."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

from invact_jax.ops.norms import base as norm_base
from pallas_kernels import norms as kernels
from tests.ops.activations.test_pallas import export_cuda
from tests.ops.norms import base


def _ulps(a, b, dt):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.maximum(np.max(np.abs(b64)), 1e-30)
  return np.max(np.abs(a64 - b64)) / (scale * float(ml_dtypes.finfo(base.np_dtype(dt)).eps))


class PallasNormTest(base.NormTestBase):
  IMPLEMENTATION = "pallas"
  INTERPRET = False
  KERNELS = kernels  # the kernel module (test_triton: pallas_kernels.triton_norms)

  @parameterized.product(dtype=base.DTYPES, rms=(False, True), n=(200, 768, 5000),
                         affine=(True, False))
  def test_kernels_match_xla_math(self, dtype, rms, n, affine):
    self.skip_interpreted_float16(dtype)
    rng = np.random.default_rng(n)
    x = jnp.asarray((rng.normal(size=(5, n)) * 2 + 1).astype(base.np_dtype(dtype)))
    s = jnp.asarray(rng.normal(size=n).astype(np.float32)) if affine else None
    b = jnp.asarray(rng.normal(size=n).astype(np.float32)) if affine and not rms else None
    out = jnp.dtype(base.np_dtype(dtype))
    z, xhat, rstd = jax.jit(lambda x: self.KERNELS.forward(
        x, s, b, rms=rms, eps=1e-6, out_dtype=out, interpret=self.INTERPRET))(x)
    xh_ref, rstd_ref = norm_base.normalize(x, rms, 1e-6)
    z_ref = norm_base.affine(xh_ref, s, b, out)
    # Same math, different summation order: a few float32 ulps before the final rounding
    # (16-bit outputs: at most one rounding flip).  Units: ulps of the largest element.
    bound = 8 if dtype == "float32" else 1.01
    self.assertLessEqual(_ulps(rstd, rstd_ref[:, 0], "float32"), 8)
    self.assertLessEqual(_ulps(xhat, xh_ref.astype(out), dtype), bound)
    self.assertLessEqual(_ulps(z, z_ref, dtype), bound)
    dz = jnp.asarray(rng.normal(size=(5, n)).astype(base.np_dtype(dtype)))
    dx = jax.jit(lambda xh, r, dz: self.KERNELS.backward_dx(
        xh, r, dz, s, rms=rms, dx_dtype=out, interpret=self.INTERPRET))(xhat, rstd, dz)
    g = dz.astype(jnp.float32) * (1.0 if s is None else s)
    dx_ref = norm_base.dx_from_xhat(xhat.astype(jnp.float32), rstd[:, None], g, rms).astype(out)
    self.assertLessEqual(_ulps(dx, dx_ref, dtype), 1.01 if dtype != "float32" else 16)


class PallasNormInterpretTest(PallasNormTest):
  INTERPRET = True


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_kernels_lower_for_cuda_from_any_platform(rms, dtype):
  x = jax.ShapeDtypeStruct((4096, 768), jnp.dtype(dtype))
  r = jax.ShapeDtypeStruct((4096,), jnp.float32)
  p = jax.ShapeDtypeStruct((768,), jnp.float32)
  fwd = export_cuda(lambda x, s, b: kernels.forward(x, s, None if rms else b, rms=rms, eps=1e-6,
                                                    out_dtype=x.dtype), x, p, p)
  bwd = export_cuda(lambda xh, r, dz, s: kernels.backward_dx(xh, r, dz, s, rms=rms,
                                                             dx_dtype=xh.dtype), x, r, x, p)
  for exp in (fwd, bwd):
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
