"""Output-saving LayerNorm/RMSNorm (+ fused norm->dense), softmax and dropout.

Gradients are compared with float64 references.  The tolerance is the measured floor:
the error of the same float64 math fed the *stored* tensor rounded to the dtype (xhat
for the norms, p for softmax), i.e. what keeping the output in that dtype makes
unavoidable, times 1.5 plus a few ulps of the gradient's own rounding.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import invact_jax
from invact_jax import memory

DTYPES = ("float32", "bfloat16", "float16")


def _np(dt):
  return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


def _eps(dt):
  return float(ml_dtypes.finfo(_np(dt)).eps)


def _ln64(x, s, b, rms):
  x = np.asarray(x, np.float64)
  c = x if rms else x - x.mean(-1, keepdims=True)
  rstd = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6)
  xhat = c * rstd
  z = xhat * s + (0.0 if b is None else b)
  return xhat, rstd, z


def _ln_grads64(x, s, b, dz, rms, xhat=None):
  """Analytic float64 gradients; ``xhat`` overrides the exact one (the floor's input)."""
  xh, rstd, _ = _ln64(x, s, b, rms)
  xh = xh if xhat is None else np.asarray(xhat, np.float64)
  g = dz * s
  proj = (g * xh).mean(-1, keepdims=True)
  dx = rstd * (g - xh * proj) if rms else rstd * (g - g.mean(-1, keepdims=True) - xh * proj)
  return dx, (dz * xh).reshape(-1, x.shape[-1]).sum(0), dz.reshape(-1, x.shape[-1]).sum(0)


def _inputs(dt, seed=0, zero_scale=True):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(3, 5, 64)) * 3 + 1).astype(_np(dt))
  s = rng.normal(size=64).astype(np.float32)
  if zero_scale:
    s[[3, 10]] = 0.0        # exact zeros: the known failure of scale-dividing norms
    s[17] = 1e-40           # a float32 denormal
  b = rng.normal(size=64).astype(np.float32)
  dz = rng.normal(size=(3, 5, 64))
  return x, s, b, dz


class NormTest(parameterized.TestCase):

  @parameterized.product(dtype=DTYPES, rms=(False, True))
  def test_gradients_vs_float64_including_zero_scale(self, dtype, rms):
    x, s, b, dz = _inputs(dtype)
    if rms:
      f = lambda x, s, b: invact_jax.rms_norm(x, s)  # noqa: E731
    else:
      f = lambda x, s, b: invact_jax.layer_norm(x, s, b)  # noqa: E731
    z, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(s), jnp.asarray(b))
    self.assertEqual(z.dtype, jnp.dtype(_np(dtype)))
    dx, ds, db = vjp(jnp.asarray(dz.astype(_np(dtype))))
    dz_r = dz.astype(_np(dtype)).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = _ln_grads64(x64, s.astype(np.float64), None if rms else b.astype(np.float64), dz_r, rms)
    xh = _ln64(x64, s, b, rms)[0]
    floor = _ln_grads64(x64, s.astype(np.float64), None if rms else b.astype(np.float64), dz_r,
                        rms, xhat=xh.astype(_np(dtype)))
    for got, want, fl, name in zip((dx, ds, db), exact, floor, ("dx", "dscale", "dbias")):
      if rms and name == "dbias":  # b is not an input of rms_norm
        self.assertFalse(np.any(np.asarray(got)))
        continue
      got = np.asarray(got, np.float64)
      self.assertTrue(np.all(np.isfinite(got)), name)
      floor_err = np.max(np.abs(fl - want))
      tol = 1.5 * floor_err + 8 * _eps(dtype if name == "dx" else "float32") * np.max(np.abs(want))
      self.assertLessEqual(np.max(np.abs(got - want)), tol, name)
    # Zero-scale channels: their dscale is the exact sum of dz * xhat; dx gets nothing from them.
    ds = np.asarray(ds, np.float64)
    np.testing.assert_allclose(ds[[3, 10]], exact[1][[3, 10]],
                               rtol=0, atol=1.5 * np.max(np.abs(floor[1] - exact[1])) + 1e-4)

  @parameterized.parameters(False, True)
  def test_forward_matches_flax(self, rms):
    from flax import nnx
    x, s, b, _ = _inputs("float32", zero_scale=False)
    mod = (nnx.RMSNorm(64, rngs=nnx.Rngs(0)) if rms else nnx.LayerNorm(64, rngs=nnx.Rngs(0)))
    mod.scale.value = jnp.asarray(s)
    if not rms:
      mod.bias.value = jnp.asarray(b)
    ours = invact_jax.rms_norm(x, s) if rms else invact_jax.layer_norm(x, s, b)
    np.testing.assert_allclose(ours, mod(jnp.asarray(x)), rtol=0, atol=3e-6)

  def test_residuals_are_xhat_and_row_statistics(self):
    x, s, b, _ = _inputs("bfloat16")
    x = jnp.asarray(x)
    kept = [r for r in memory.residuals(
        lambda x: jnp.sum(invact_jax.layer_norm(x, s, b).astype(jnp.float32)), x)
            if not r.is_argument and r.bytes]
    self.assertCountEqual([(r.shape, r.dtype) for r in kept],
                          [((3, 5, 64), "bfloat16"), ((3, 5, 1), "float32")])
    ref = [r for r in memory.residuals(
        lambda x: jnp.sum(invact_jax.layer_norm_reference(x, s, b).astype(jnp.float32)), x)
           if not r.is_argument]
    self.assertGreater(sum(r.bytes for r in ref), sum(r.bytes for r in kept))

  @parameterized.product(dtype=("float32", "bfloat16"), rms=(False, True))
  def test_norm_dense_matches_unfused_and_keeps_one_tensor(self, dtype, rms):
    x, s, b, _ = _inputs(dtype)
    rng = np.random.default_rng(1)
    k1, k2 = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 16)).astype(np.float32)
    b1 = rng.normal(size=32).astype(np.float32)
    w1, w2 = rng.normal(size=(3, 5, 32)), rng.normal(size=(3, 5, 16))

    def loss(fused, x, s, b, k1, k2, b1):
      if fused:
        f = invact_jax.rms_norm_dense if rms else invact_jax.layer_norm_dense
        args = (x, s, [k1, k2], [b1, None]) if rms else (x, s, b, [k1, k2], [b1, None])
        y1, y2 = f(*args)
      else:
        y1, y2 = invact_jax.norm_dense_reference(x, s, None if rms else b, [k1, k2], [b1, None],
                                                 rms=rms)
      return jnp.sum(y1.astype(jnp.float32) * w1) + jnp.sum(y2.astype(jnp.float32) * w2)

    args = tuple(jnp.asarray(a) for a in (x, s, b, k1, k2, b1))
    g = jax.grad(lambda *a: loss(True, *a), argnums=tuple(range(6)))(*args)
    with jax.enable_x64():
      g64 = jax.grad(lambda *a: loss(False, *a), argnums=tuple(range(6)))(
          *(jnp.asarray(np.asarray(a, np.float64)) for a in args))
    # float32: rounding only; 16-bit: xhat and the recomputed affine output are kept in the
    # dtype, as the unfused matmul keeps its 16-bit input.
    rel = 3e-5 if dtype == "float32" else 6 * _eps(dtype)
    for i, (a, c) in enumerate(zip(g, g64)):
      if rms and i == 2:
        continue
      c = np.asarray(c)
      err = np.max(np.abs(np.asarray(a, np.float64) - c)) / np.max(np.abs(c))
      self.assertLessEqual(err, rel, f"argument {i}")
    kept = [r for r in memory.residuals(lambda x: loss(True, x, *args[1:]), args[0])
            if not r.is_argument and r.bytes]
    full = [r for r in kept if r.shape[-1] == 64 and len(r.shape) == 3]
    self.assertEqual(len(full), 1)  # xhat only: no affine output, no input

  def test_errors_name_the_argument(self):
    with self.assertRaisesRegex(TypeError, "argument `x`"):
      invact_jax.layer_norm(jnp.ones((2, 4), jnp.int32))
    with self.assertRaisesRegex(ValueError, "argument `scale` must have shape"):
      invact_jax.layer_norm(jnp.ones((2, 4)), jnp.ones(3))
    with self.assertRaisesRegex(ValueError, r"argument `kernels\[0\]`"):
      invact_jax.layer_norm_dense(jnp.ones((2, 4)), None, None, [jnp.ones((3, 2))])
    with self.assertRaisesRegex(ValueError, "argument `biases`"):
      invact_jax.layer_norm_dense(jnp.ones((2, 4)), None, None, [jnp.ones((4, 2))], [])

  def test_nan_propagates_per_row(self):
    x = jnp.ones((3, 8)).at[1, 2].set(jnp.nan)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(invact_jax.layer_norm(x))))(x)
    self.assertTrue(np.all(np.isnan(np.asarray(g[1]))))
    self.assertTrue(np.all(np.isfinite(np.asarray(g)[[0, 2]])))

  def test_transforms(self):
    x, s, b, _ = _inputs("float32")
    f = lambda x: jnp.sum(jnp.sin(invact_jax.layer_norm(x, s, b)))  # noqa: E731
    g = jax.grad(f)(x)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), g, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(x), jnp.stack([jax.grad(f)(r) for r in x]),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f))(x), g, rtol=1e-6, atol=1e-6)

    def scanned(x):
      return jax.lax.scan(lambda c, _: (invact_jax.layer_norm(c, s, b) * 0.5 + c, None), x,
                          None, length=3)[0].sum()
    self.assertTrue(np.all(np.isfinite(np.asarray(jax.grad(scanned)(x)))))


class SoftmaxTest(parameterized.TestCase):

  @parameterized.product(dtype=DTYPES)
  def test_gradient_vs_float64_at_the_storage_floor(self, dtype):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(4, 3, 16)) * 4).astype(np.float32)
    w = rng.normal(size=x.shape)
    p, vjp = jax.vjp(lambda x: invact_jax.softmax(x, dtype=_np(dtype)), jnp.asarray(x))
    self.assertEqual(p.dtype, jnp.dtype(_np(dtype)))
    dp = w.astype(_np(dtype))
    (dx,) = vjp(jnp.asarray(dp))
    x64, dp64 = x.astype(np.float64), dp.astype(np.float64)
    p64 = np.exp(x64 - x64.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    grad = lambda p: p * (dp64 - (p * dp64).sum(-1, keepdims=True))  # noqa: E731
    want = grad(p64)
    floor = np.max(np.abs(grad(p64.astype(_np(dtype)).astype(np.float64)) - want))
    err = np.max(np.abs(np.asarray(dx, np.float64) - want))
    self.assertLessEqual(err, 1.5 * floor + 4 * np.finfo(np.float32).eps * np.max(np.abs(want)))

  def test_keeps_only_the_output(self):
    x = jnp.ones((2, 8, 8))
    kept = [r for r in memory.residuals(
        lambda x: jnp.sum(jnp.einsum("bqk,bkd->bqd", invact_jax.softmax(x, dtype=jnp.bfloat16),
                                     jnp.ones((2, 8, 4), jnp.bfloat16)).astype(jnp.float32)), x)
            if not r.is_argument and r.bytes]
    # The bf16 probabilities (kept by the matmul too: one buffer) and nothing in float32.
    self.assertTrue(all(r.dtype == "bfloat16" for r in kept if r.shape == (2, 8, 8)), kept)
    self.assertFalse([r for r in kept if r.shape == (2, 8, 8) and r.dtype == "float32"])

  def test_masked_rows_and_errors(self):
    x = jnp.array([[0.0, -jnp.inf], [-jnp.inf, -jnp.inf]])
    np.testing.assert_array_equal(np.isnan(invact_jax.softmax(x)),
                                  np.isnan(jax.nn.softmax(x)))
    with self.assertRaisesRegex(TypeError, "argument `x`"):
      invact_jax.softmax(jnp.ones(3, jnp.int32))
    with self.assertRaisesRegex(TypeError, "argument `dtype`"):
      invact_jax.softmax(jnp.ones(3), dtype=jnp.int8)


class DropoutTest(parameterized.TestCase):

  @parameterized.parameters("regenerate", "bits")
  def test_same_mask_and_gradient_as_reference(self, mode):
    x = jax.random.normal(jax.random.key(0), (4, 5, 24))
    key = jax.random.key(1)
    w = jnp.cos(jnp.arange(24.0))
    y = invact_jax.dropout(x, 0.1, key, mode=mode)
    np.testing.assert_array_equal(y, invact_jax.dropout_reference(x, 0.1, key))
    g = jax.grad(lambda x: jnp.sum(invact_jax.dropout(x, 0.1, key, mode=mode) * w))(x)
    g_ref = jax.grad(lambda x: jnp.sum(invact_jax.dropout_reference(x, 0.1, key) * w))(x)
    np.testing.assert_array_equal(g, g_ref)
    g_jit = jax.jit(jax.grad(lambda x, k: jnp.sum(invact_jax.dropout(x, 0.1, k, mode=mode) * w)))(
        x, key)
    np.testing.assert_array_equal(g_jit, g_ref)

  def test_residuals(self):
    x = jnp.ones((4, 64))
    key = jax.random.key(1)

    def kept(fn):
      return [(r.shape, r.dtype) for r in memory.residuals(lambda x: jnp.sum(fn(x) * 2.0), x)
              if not r.is_argument and r.bytes]
    self.assertEqual(kept(lambda x: invact_jax.dropout(x, 0.1, key, mode="bits")),
                     [((4, 8), "uint8")])
    regen = kept(lambda x: invact_jax.dropout(x, 0.1, key, mode="regenerate"))
    self.assertFalse([r for r in regen if r[0] == (4, 64) or r[0] == (4, 8)], regen)
    self.assertIn(((4, 64), "bool"), kept(lambda x: invact_jax.dropout_reference(x, 0.1, key)))

  def test_identity_and_errors(self):
    x = jnp.ones(3)
    self.assertIs(invact_jax.dropout(x, 0.1, None), x)
    with self.assertRaisesRegex(ValueError, "argument `rate`"):
      invact_jax.dropout(x, 1.0, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, "argument `mode`"):
      invact_jax.dropout(x, 0.1, jax.random.key(0), mode="store")


@pytest.mark.parametrize("spec", ["data", "model"])
def test_sharded_norm_and_softmax_have_no_collectives_on_batch(spec):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  sh = NamedSharding(mesh, P(spec, None, None))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 4, 64)), sh)
  s, b = jnp.ones(64), jnp.zeros(64)
  step = jax.jit(lambda x: jax.vjp(lambda x: invact_jax.softmax(invact_jax.layer_norm(x, s, b)),
                                   x)[1](jnp.cos(x))[0], in_shardings=sh, out_shardings=sh)
  hlo = step.lower(x).compile().as_text()
  assert not [c for c in ("all-gather", "all-reduce", "all-to-all") if c in hlo]
