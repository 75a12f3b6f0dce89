"""The test base every norm implementation reuses (``test_xla``, ``test_pallas``).

Gradients are compared with float64 references.  The tolerance is the measured floor: the
error of the same float64 math fed the *stored* xhat rounded to the dtype (what keeping the
output in that dtype makes unavoidable), times 1.5 plus a few ulps of the gradient's own
rounding.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from absl.testing import parameterized

import invact_jax
from tests.ops.implementation_case import ImplementationTestCase
from invact_jax import memory

DTYPES = ("float32", "bfloat16", "float16")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def np_dtype(dt):
  return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


def eps_of(dt):
  return float(ml_dtypes.finfo(np_dtype(dt)).eps)


def ln64(x, s, b, rms):
  x = np.asarray(x, np.float64)
  c = x if rms else x - x.mean(-1, keepdims=True)
  rstd = 1.0 / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6)
  xhat = c * rstd
  z = xhat * s + (0.0 if b is None else b)
  return xhat, rstd, z


def ln_grads64(x, s, b, dz, rms, xhat=None):
  """Analytic float64 gradients; ``xhat`` overrides the exact one (the floor's input)."""
  xh, rstd, _ = ln64(x, s, b, rms)
  xh = xh if xhat is None else np.asarray(xhat, np.float64)
  g = dz * s
  proj = (g * xh).mean(-1, keepdims=True)
  dx = rstd * (g - xh * proj) if rms else rstd * (g - g.mean(-1, keepdims=True) - xh * proj)
  return dx, (dz * xh).reshape(-1, x.shape[-1]).sum(0), dz.reshape(-1, x.shape[-1]).sum(0)


def norm_inputs(dt, seed=0, zero_scale=True):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(3, 5, 64)) * 3 + 1).astype(np_dtype(dt))
  s = rng.normal(size=64).astype(np.float32)
  if zero_scale:
    s[[3, 10]] = 0.0        # exact zeros: the known failure of scale-dividing norms
    s[17] = 1e-40           # a float32 denormal
  b = rng.normal(size=64).astype(np.float32)
  dz = rng.normal(size=(3, 5, 64))
  return x, s, b, dz


class NormTestBase(ImplementationTestCase):

  def norm(self, rms):
    if rms:
      return lambda x, s, b, **kw: invact_jax.rms_norm(x, s, implementation=self.impl, **kw)
    return lambda x, s, b, **kw: invact_jax.layer_norm(x, s, b, implementation=self.impl, **kw)

  @parameterized.product(dtype=DTYPES, rms=(False, True))
  def test_gradients_vs_float64_including_zero_scale(self, dtype, rms):
    x, s, b, dz = norm_inputs(dtype)
    f = self.norm(rms)
    z, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(s), jnp.asarray(b))
    self.assertEqual(z.dtype, jnp.dtype(np_dtype(dtype)))
    dx, ds, db = vjp(jnp.asarray(dz.astype(np_dtype(dtype))))
    dz_r = dz.astype(np_dtype(dtype)).astype(np.float64)
    x64 = x.astype(np.float64)
    bb = None if rms else b.astype(np.float64)
    exact = ln_grads64(x64, s.astype(np.float64), bb, dz_r, rms)
    xh = ln64(x64, s, b, rms)[0]
    floor = ln_grads64(x64, s.astype(np.float64), bb, dz_r, rms, xhat=xh.astype(np_dtype(dtype)))
    for got, want, fl, name in zip((dx, ds, db), exact, floor, ("dx", "dscale", "dbias")):
      if rms and name == "dbias":  # b is not an input of rms_norm
        self.assertFalse(np.any(np.asarray(got)))
        continue
      got = np.asarray(got, np.float64)
      self.assertTrue(np.all(np.isfinite(got)), name)
      floor_err = np.max(np.abs(fl - want))
      tol = 1.5 * floor_err + 8 * eps_of(dtype if name == "dx" else "float32") * np.max(np.abs(want))
      self.assertLessEqual(np.max(np.abs(got - want)), tol, name)
    # Zero-scale channels: their dscale is the exact sum of dz * xhat.
    ds = np.asarray(ds, np.float64)
    np.testing.assert_allclose(ds[[3, 10]], exact[1][[3, 10]],
                               rtol=0, atol=1.5 * np.max(np.abs(floor[1] - exact[1])) + 1e-4)

  @parameterized.parameters(False, True)
  def test_forward_matches_flax(self, rms):
    from flax import nnx
    x, s, b, _ = norm_inputs("float32", zero_scale=False)
    mod = (nnx.RMSNorm(64, rngs=nnx.Rngs(0)) if rms else nnx.LayerNorm(64, rngs=nnx.Rngs(0)))
    mod.scale.value = jnp.asarray(s)
    if not rms:
      mod.bias.value = jnp.asarray(b)
    ours = self.norm(rms)(jnp.asarray(x), jnp.asarray(s), jnp.asarray(b))
    np.testing.assert_allclose(ours, mod(jnp.asarray(x)), rtol=0, atol=3e-6)

  def test_residuals_are_xhat_and_row_statistics(self):
    x, s, b, _ = norm_inputs("bfloat16")
    x = jnp.asarray(x)
    f = self.norm(False)
    kept = [r for r in memory.residuals(lambda x: jnp.sum(f(x, s, b).astype(jnp.float32)), x)
            if not r.is_argument and r.bytes]
    self.assertCountEqual([(r.shape, r.dtype) for r in kept],
                          [((3, 5, 64), "bfloat16"), ((3, 5, 1), "float32")])
    ref = [r for r in memory.residuals(
        lambda x: jnp.sum(invact_jax.layer_norm_reference(x, s, b).astype(jnp.float32)), x)
           if not r.is_argument]
    self.assertGreater(sum(r.bytes for r in ref), sum(r.bytes for r in kept))

  @parameterized.product(dtype=("float32", "bfloat16"), rms=(False, True))
  def test_norm_dense_matches_unfused_and_keeps_one_tensor(self, dtype, rms):
    x, s, b, _ = norm_inputs(dtype)
    rng = np.random.default_rng(1)
    k1, k2 = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 16)).astype(np.float32)
    b1 = rng.normal(size=32).astype(np.float32)
    w1, w2 = rng.normal(size=(3, 5, 32)), rng.normal(size=(3, 5, 16))
    impl = self.impl

    def loss(fused, x, s, b, k1, k2, b1):
      if fused:
        if rms:
          y1, y2 = invact_jax.rms_norm_dense(x, s, [k1, k2], [b1, None], implementation=impl)
        else:
          y1, y2 = invact_jax.layer_norm_dense(x, s, b, [k1, k2], [b1, None], implementation=impl)
      else:
        y1, y2 = invact_jax.norm_dense_reference(x, s, None if rms else b, [k1, k2], [b1, None],
                                                 rms=rms)
      return jnp.sum(y1.astype(jnp.float32) * w1) + jnp.sum(y2.astype(jnp.float32) * w2)

    args = tuple(jnp.asarray(a) for a in (x, s, b, k1, k2, b1))
    with jax.default_matmul_precision("highest"):  # not TF32 on a GPU: rounding only
      g = jax.grad(lambda *a: loss(True, *a), argnums=tuple(range(6)))(*args)
    with jax.enable_x64():
      g64 = jax.grad(lambda *a: loss(False, *a), argnums=tuple(range(6)))(
          *(jnp.asarray(np.asarray(a, np.float64)) for a in args))
    # float32: rounding only; 16-bit: xhat and the recomputed affine output are kept in the
    # dtype, as the unfused matmul keeps its 16-bit input.
    rel = 3e-5 if dtype == "float32" else 6 * eps_of(dtype)
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

  def test_nan_propagates_per_row(self):
    x = jnp.ones((3, 8)).at[1, 2].set(jnp.nan)
    f = self.norm(False)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(f(x, None, None))))(x)
    self.assertTrue(np.all(np.isnan(np.asarray(g[1]))))
    self.assertTrue(np.all(np.isfinite(np.asarray(g)[[0, 2]])))

  @parameterized.parameters(False, True)
  def test_transforms(self, rms):
    x, s, b, _ = norm_inputs("float32")
    norm = self.norm(rms)
    f = lambda x: jnp.sum(jnp.sin(norm(x, s, b)))  # noqa: E731
    g = jax.grad(f)(x)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), g, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(x), jnp.stack([jax.grad(f)(r) for r in x]),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(f)))(x),
                               jnp.stack([jax.grad(f)(r) for r in x]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f))(x), g, rtol=1e-6, atol=1e-6)

    def scanned(x):
      return jax.lax.scan(lambda c, _: (norm(c, s, b) * 0.5 + c, None), x, None, length=3)[0].sum()
    self.assertTrue(np.all(np.isfinite(np.asarray(jax.grad(scanned)(x)))))

  @parameterized.parameters(((3, 0),), ((0, 16),), ((2, 0, 8),))
  def test_empty_rows_and_empty_features(self, shape):
    x = jnp.ones(shape)
    n = shape[-1]
    s, b = jnp.ones(n), jnp.zeros(n)
    for f in (self.norm(False), self.norm(True)):
      dx, ds, db = jax.grad(lambda x, s, b: jnp.sum(f(x, s, b)), argnums=(0, 1, 2))(x, s, b)
      self.assertEqual(dx.shape, shape)
      self.assertEqual(ds.shape, (n,))
    k = jnp.ones((n, 4))
    gd = jax.grad(lambda x, k: jnp.sum(invact_jax.layer_norm_dense(
        x, s, b, [k], implementation=self.impl)[0]), argnums=(0, 1))(x, k)
    self.assertEqual(gd[0].shape, shape)
    self.assertEqual(gd[1].shape, (n, 4))

  @parameterized.parameters("layer_norm", "rms_norm", "layer_norm_dense")
  def test_inside_shard_map_with_replicated_parameters(self, fn):
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 host devices (conftest.py)")
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
    x = jax.random.normal(jax.random.key(0), (16, 32))
    s, b, k = jnp.linspace(0.5, 1.5, 32), jnp.linspace(-1, 1, 32), jnp.ones((32, 8)) * 0.1
    impl = self.impl
    if fn == "layer_norm":
      f = lambda x, s, b, k: invact_jax.layer_norm(x, s, b, implementation=impl)  # noqa: E731
    elif fn == "rms_norm":
      f = lambda x, s, b, k: invact_jax.rms_norm(x, s, implementation=impl)  # noqa: E731
    else:
      f = lambda x, s, b, k: invact_jax.layer_norm_dense(x, s, b, [k], implementation=impl)[0]  # noqa: E731
    loss = lambda x, s, b, k: jnp.sum(jnp.sin(f(x, s, b, k)))  # noqa: E731

    def per_shard(x, s, b, k):  # replicated parameters: their gradients are summed over shards
      return jax.grad(loss, argnums=(0, 1, 2, 3))(x, s, b, k)
    sm = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("d"), P(), P(), P()),
                               out_specs=(P("d"), P(), P(), P())))
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    got = sm(put(x, P("d")), put(s, P()), put(b, P()), put(k, P()))
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, s, b, k)
    for a, c in zip(got, want):
      np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-5)

  @parameterized.parameters("data", "model")
  def test_sharded_rows_have_no_collectives(self, spec):
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 host devices (conftest.py)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(spec, None, None))
    x = jax.random.normal(jax.random.key(0), (8, 4, 200))
    s, b = jnp.linspace(0.5, 1.5, 200), jnp.zeros(200)
    f = self.norm(False)
    fn = lambda x: jax.vjp(lambda x: f(x, s, b), x)[1](jnp.cos(x))[0]  # noqa: E731
    step = jax.jit(fn, in_shardings=sh, out_shardings=sh)
    hlo = step.lower(jax.device_put(x, sh)).compile().as_text()
    if not self.HOST_CALLBACK:
      self.assertEqual([c for c in COLLECTIVES if c in hlo], [])
    np.testing.assert_allclose(step(jax.device_put(x, sh)), jax.jit(fn)(x), rtol=1e-6, atol=1e-6)
