"""The test base every activation implementation reuses (``test_xla``, ``test_pallas``,
``test_triton``), in the manner of jax's Pallas op tests: a subclass sets
``IMPLEMENTATION`` and ``INTERPRET``.

What it checks, per registry case and dtype: the forward against jax.nn (bit-identical on
the XLA path, within one rounding for kernels that compute 16-bit inputs in float32), the
packed bits against the XLA path's, gradients against float64 at the measured storage
floor, ``f(x) == vjp(f, x)[0]``, every transformation, special values, sharding.
"""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pytest
from absl.testing import parameterized

import invact_jax
import tests
from tests.ops.implementation_case import ImplementationTestCase
from invact_jax import accuracy
from invact_jax.ops.activations import api, base
from tests.ops.activations.cases import CASES, DTYPES, NONMONOTONE

SHAPES = ((), (0,), (7,), (3, 13), (2, 3, 16))
_EVERY_TRANSFORMATION = ("gelu_tanh", "sigmoid", "elu_with_bit", "hard_tanh", "silu", "relu")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def np_dtype(name):
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@functools.lru_cache(maxsize=None)
def audit(name, dtype):
  return accuracy.audit(name, dtype)


def raw_bits(a):
  """Raw bytes of an array (any shape, incl. 0-d), for bit-exact comparisons."""
  return np.asarray(a).reshape(-1).view(np.uint8)


def inputs(shape, dtype, seed=0):
  x = np.random.default_rng(seed).normal(0.0, 3.0, size=shape)
  return jnp.asarray(x.astype(np_dtype(dtype)))


def jit_each(f, jit=jax.jit):
  """``jit`` of ``f`` mapped over a list of arrays: one program for several shapes or dtypes
  (a compile's fixed cost is most of a tiny one's)."""
  return jit(lambda xs: [f(x) for x in xs])


def ulp_diff(a, b, dt):
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
  ulp = np.spacing(np.maximum(np.abs(a64), np.abs(b64)).astype(np_dtype(dt))).astype(np.float64)
  return np.where(same, 0.0, np.abs(a64 - b64) / ulp)


def forward_error(case, x, y):
  """max |y - f64(x)| in units of eps(dtype) * (1 + |x|), the conditioning scale of these
  functions (y ~ x for large x; cancellation in 1 + tanh(u) or x * sigmoid(x) at large -x)."""
  x64 = np.asarray(x, np.float64)
  with jax.enable_x64():
    y64 = np.asarray(case.reference()(jnp.asarray(x64)))
  eps = float(jnp.finfo(x.dtype).eps)
  finite = np.isfinite(y64)
  err = np.abs(np.asarray(y, np.float64) - y64)[finite] / (eps * (1.0 + np.abs(x64[finite])))
  return float(np.max(err, initial=0.0))


def grad_tolerance(case, dtype, true, floor=None):
  """The measured floor (1.2x, the audit's bound) plus rounding dx to the input dtype.

  ``floor``: per-point floors to use where larger than the audit's (default: the audit's)."""
  half_ulp = 0.5 * np.spacing(np.abs(true).astype(np_dtype(dtype))).astype(np.float64)
  bound = audit(case.audit_name, dtype).floor
  return 1.2 * (bound if floor is None else np.maximum(bound, floor)) + half_ulp


def mesh_2x4():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py sets XLA_FLAGS)")
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


class ActivationTestBase(ImplementationTestCase):
  # Kernel subclasses: the cases and shapes to run (interpret mode is slow).
  CASE_NAMES = tuple(CASES)
  # Whether interpret mode evaluates the tile math with XLA's ops (Pallas), so that it
  # matches the XLA path to one rounding; Triton's interpreter uses NumPy's transcendentals.
  INTERPRET_MATH_IS_XLA = True

  def exact_tile_math(self) -> bool:
    return self.INTERPRET and self.INTERPRET_MATH_IS_XLA

  def case(self, name):
    if name not in self.CASE_NAMES:
      self.skipTest(f"{name} not in this implementation's cases")
    return CASES[name]

  # ------------------------------------------------------------------------ forward
  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_forward_and_bits(self, name, dtype):
    """Every shape of SHAPES, each function compiled once for all of them (one program per
    function instead of one per shape: a compile's fixed cost is most of a tiny one's)."""
    self.skip_interpreted_float16(dtype)
    case = self.case(name)
    xs = [inputs(shape, dtype) for shape in SHAPES]
    ys, y_refs = jit_each(case.fn(self.impl))(xs), jit_each(case.reference())(xs)
    if self.exact_tile_math():  # kernels compute 16-bit inputs in float32 and round once
      y_tiles = jit_each(case.op.kernel_forward)(xs)
    for i, (shape, x, y, y_ref) in enumerate(zip(SHAPES, xs, ys, y_refs)):
      with self.subTest(shape=shape):
        self.assertEqual(y.dtype, y_ref.dtype)
        self.assertEqual(y.shape, y_ref.shape)
        if self.IMPLEMENTATION == "xla":
          np.testing.assert_array_equal(raw_bits(y), raw_bits(y_ref))
        elif self.exact_tile_math():
          self.assertLessEqual(float(np.max(ulp_diff(y, y_tiles[i], dtype), initial=0)), 1.0)
        else:
          # Compiled: the kernel's exp/tanh/log are Triton's (libdevice, ex2.approx), not
          # XLA's (Triton's interpreter: NumPy's), so bits differ by a few ulp; it must be as
          # accurate as jax.nn on this device.
          self.assertLessEqual(forward_error(case, x, y),
                               max(2.0, 2 * forward_error(case, x, y_ref)))
    if self.IMPLEMENTATION == "xla":
      return  # the residual bits below would be compared with themselves
    # The residual bits: the same as the XLA path's, bit for bit.
    op, impl = case.op, self.implementation()
    ms = jit_each(lambda x: impl.forward(op, x)[1])(xs)
    m_refs = jit_each(lambda x: base.XLA.forward(op, x)[1])(xs)
    for shape, m, m_ref in zip(SHAPES, ms, m_refs):
      with self.subTest(shape=shape, residual="bits"):
        if m_ref is None:
          self.assertIsNone(m)
        else:
          np.testing.assert_array_equal(np.asarray(m), np.asarray(m_ref))

  def implementation(self):
    return api.resolve(self.impl, op="test")

  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_primal_equals_vjp_primal(self, name, dtype):
    case = self.case(name)
    x = inputs((4, 40), dtype, seed=1)
    f = case.fn(self.impl)
    y = jax.jit(f)(x)
    y_vjp = jax.jit(lambda x: jax.vjp(f, x)[0])(x)
    np.testing.assert_array_equal(raw_bits(y), raw_bits(y_vjp))

  # ----------------------------------------------------------------------- gradients
  # (a 1-D and a 3-D shape: the rank does not reach the math; forward_and_bits has them all)
  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_gradient_vs_float64(self, name, dtype):
    self.skip_interpreted_float16(dtype)
    case = self.case(name)
    shapes = (SHAPES[2], SHAPES[4])
    xs = [inputs(shape, dtype, seed=2) for shape in shapes]
    dx = lambda f: lambda x: jax.vjp(f, x)[1](jnp.ones(x.shape, x.dtype))[0]  # noqa: E731
    gs, g_refs = jit_each(dx(case.fn(self.impl)))(xs), jit_each(dx(case.reference()))(xs)
    for shape, x, g, g_ref in zip(shapes, xs, gs, g_refs):
      with self.subTest(shape=shape):
        chex.assert_equal_shape([g, x])
        self.assertEqual(g.dtype, x.dtype)
        x64 = np.asarray(x, np.float64)
        true = case.entry.derivative64(x64, **dict(case.params))
        g64, gref64 = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
        tol = grad_tolerance(case, dtype, true)
        if case.entry.name == "leaky_relu":  # kink convention at -0.0 (see invact_jax.leaky_relu)
          keep = x64 != 0
          g64, gref64, true, tol = g64[keep], gref64[keep], true[keep], tol[keep]
        np.testing.assert_array_less(np.abs(g64 - true), tol + 1e-30)
        # Against jax.nn's own gradient: within our bound plus jax.nn's own error.
        np.testing.assert_array_less(np.abs(g64 - gref64), tol + np.abs(gref64 - true) + 1e-30)

  @parameterized.parameters(*CASES)
  def test_transformations(self, name):
    """Every transformation for the cases that span the custom_vjp's paths (a fitted
    backward with its bit, a closed form, a parameter with its bit, a piecewise-linear one
    whose bit is its derivative); jit of grad for the others (the same rule, another math)."""
    case = self.case(name)
    ours, ref = case.fn(self.impl), case.reference()
    x = inputs((5, 8, 24), "float32", seed=3)
    loss = lambda f: (lambda x: jnp.sum(jnp.sin(f(x))))  # noqa: E731
    g_ref = jax.grad(loss(ref))(x)
    tol = 1.2 * audit(case.audit_name, "float32").floor + 1e-6
    variants = {
        "grad": jax.grad(loss(ours)),
        "jit_grad": jax.jit(jax.grad(loss(ours))),
        "value_and_grad": lambda x: jax.value_and_grad(loss(ours))(x)[1],
        "vmap_grad": jax.vmap(jax.grad(loss(ours))),
        "jit_vmap_grad": jax.jit(jax.vmap(jax.grad(loss(ours)))),
        "grad_of_vmap": jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(ours)(x)))),
        "checkpoint": jax.grad(jax.checkpoint(loss(ours))),
        "remat_policy": jax.grad(jax.checkpoint(
            loss(ours), policy=jax.checkpoint_policies.nothing_saveable)),
        "scan": jax.grad(lambda x: jax.lax.scan(
            lambda c, xi: (c + jnp.sum(jnp.sin(ours(xi))), None), 0.0, x)[0]),
    }
    if name not in _EVERY_TRANSFORMATION:
      variants = {"jit_grad": variants["jit_grad"]}
    for vname, fn in variants.items():
      with self.subTest(vname):
        chex.assert_trees_all_close(fn(x), g_ref, atol=tol, rtol=0)

  @parameterized.parameters(*NONMONOTONE)
  def test_branch_point_and_minimum(self, name):
    # Inputs at and around x_min, including those whose output rounds to y_min.
    case = self.case(name)
    x_min, _ = accuracy.branch_point64(name)
    for dtype in DTYPES:
      dt = np_dtype(dtype)
      x = (x_min + np.linspace(-0.05, 0.05, 1001)).astype(dt)
      y, vjp = jax.vjp(case.fn(self.impl), jnp.asarray(x))
      g = vjp(jnp.ones_like(y))[0]
      true = accuracy.derivative64(name, x.astype(np.float64))
      err = np.abs(np.asarray(g, np.float64) - true)
      self.assertTrue(np.all(np.isfinite(np.asarray(g, np.float64))))
      # The floor of the y actually stored: op-by-op (eager) 16-bit forwards can round y
      # differently from the jitted audit's, with a larger floor at that point.
      floor_here = np.abs(accuracy.floor_derivative64(name, np.asarray(y), x) - true)
      np.testing.assert_array_less(err, grad_tolerance(case, dtype, true, floor_here))

  @parameterized.product(name=tuple(CASES), dtype=DTYPES)
  def test_nan_and_inf(self, name, dtype):
    case = self.case(name)
    ours, ref = case.fn(self.impl), case.reference()
    x = jnp.asarray(np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 1.0]).astype(np_dtype(dtype)))
    if self.IMPLEMENTATION == "xla":
      np.testing.assert_array_equal(raw_bits(ours(x)), raw_bits(ref(x)))
    g = np.asarray(jax.grad(lambda x: ours(x).astype(jnp.float32).sum())(x), np.float64)
    g_ref = np.asarray(jax.grad(lambda x: ref(x).astype(jnp.float32).sum())(x), np.float64)
    # NaN input: the same gradient as jax.nn (NaN, or relu's 0 / leaky_relu's slope).
    np.testing.assert_array_equal(g[:1], g_ref[:1])
    # Where the true derivative is finite (its limit at +-inf), ours is that value -- where
    # jax.nn's forward, the output the backward reads, is sound (accuracy.output_is_sound).
    x64, params = np.asarray(x, np.float64), dict(case.params)
    with np.errstate(invalid="ignore", over="ignore"):
      true = case.entry.derivative64(x64, **params)
      y_true = case.entry.forward64(x64, **params)
    sound = accuracy.output_is_sound(np.asarray(ref(x)), y_true)
    assert sound[-2:].all(), (name, y_true)  # 0 and 1 at least
    np.testing.assert_allclose(g[1:][sound[1:]],
                               true[1:][sound[1:]].astype(np_dtype(dtype)).astype(np.float64),
                               atol=1.2 * audit(case.audit_name, dtype).floor + 1e-7)

  # -------------------------------------------------------------------- higher order
  @parameterized.parameters(*CASES)
  def test_forward_mode_is_a_clear_error(self, name):
    case = self.case(name)
    with self.assertRaisesRegex(TypeError, "forward-mode|jvp"):
      jax.jvp(case.fn(self.impl), (jnp.ones(3),), (jnp.ones(3),))

  @parameterized.parameters(*CASES)
  def test_second_derivative(self, name):
    case = self.case(name)
    f = case.fn(self.impl)
    grad_sum = lambda x: jax.grad(lambda x: f(x).sum())(x).sum()  # noqa: E731
    if case.entry.piecewise_linear and self.IMPLEMENTATION == "xla":
      # f' is piecewise constant in y, so no tangent reaches the guard: f'' = 0, as jax.nn.
      x = jnp.linspace(-2.0, 2.0, 9) + 0.1
      chex.assert_trees_all_close(jax.hessian(lambda x: f(x).sum())(x),
                                  jax.hessian(lambda x: case.reference()(x).sum())(x))
      return
    with self.assertRaisesRegex(NotImplementedError, "higher-order derivatives are not supported"):
      jax.grad(grad_sum)(jnp.ones(3))

  # ----------------------------------------------------------------------- sharding
  @parameterized.product(name=("gelu_tanh", "silu", "tanh", "leaky_relu_with_bit"),
                         spec=(("data", "model"), ("data", None), (None, "model"),
                               (("data", "model"), None)))
  def test_sharded_runs_per_shard(self, name, spec):
    case = self.case(name)
    mesh = mesh_2x4()
    # Kernels: blocks of 16 rows, so that the whole array and every shard run a grid of
    # several blocks (interpret mode compiles a one-block grid differently: 1-2 ulp).
    ours = case.fn(self.impl if self.IMPLEMENTATION == "xla" else
                   dataclasses.replace(self.impl, block_rows=128 if self.HOST_CALLBACK else 16))
    x = jax.random.normal(jax.random.key(0), (8, 4, 256))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(spec[0], None, spec[1]))
    xs = jax.device_put(x, sharding)
    fn = lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x)  # noqa: E731
    step = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)
    hlo = step.lower(xs).compile().as_text()
    if not self.HOST_CALLBACK:
      self.assertEqual([c for c in COLLECTIVES if c in hlo], [])
    out = step(xs)
    self.assertEqual(out.sharding, sharding)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(x)))

  @parameterized.parameters((16,), (24,))
  def test_sharded_last_axis_not_whole_bytes(self, n):
    # 16 over 8 shards (2 per shard) and 24 over 4: shards cannot hold whole mask bytes.
    case = self.case("gelu_tanh")
    mesh = jax.sharding.Mesh(np.array(mesh_2x4().devices).reshape(-1), ("all",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "all"))
    x = jax.random.normal(jax.random.key(1), (4, n))
    ours = case.fn(self.impl)
    fn = lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x)  # noqa: E731
    out = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)(jax.device_put(x, sharding))
    # The surrounding XLA ops (cos, the sum) fuse differently when sharded: ~1 ulp.
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(fn)(x)), rtol=1e-6, atol=1e-7)

  @parameterized.parameters("gelu_tanh", "tanh")
  def test_inside_shard_map(self, name):
    case = self.case(name)
    mesh = mesh_2x4()
    P = jax.sharding.PartitionSpec
    ours = case.fn(self.impl)
    x = jax.random.normal(jax.random.key(2), (8, 64))
    fn = lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0]  # noqa: E731
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data", "model"),
                                    out_specs=P("data", "model")))
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", "model")))
    if self.INTERPRET and not self.INTERPRET_MATH_IS_XLA:
      # Inside shard_map interpret mode runs the tile math as XLA ops (see
      # invact_jax.ops._partition.run_tile_math_directly), outside it NumPy's.
      self.assert_within_gradient_budget(case, "float32", sharded(xs), jax.jit(fn)(x))
    else:
      np.testing.assert_array_equal(np.asarray(sharded(xs)), np.asarray(jax.jit(fn)(x)))

  def test_symbolic_batch_in_export(self):
    from jax import export
    case = self.case("gelu_tanh")
    (b,) = export.symbolic_shape("b")
    f = lambda x: jax.vjp(case.fn(self.impl), x)[1](jnp.cos(x))[0]  # noqa: E731
    exp = export.export(jax.jit(f))(jax.ShapeDtypeStruct((b, 64), jnp.float32))
    x = jax.random.normal(jax.random.key(3), (5, 64))
    if self.IMPLEMENTATION == "xla" or self.exact_tile_math():
      np.testing.assert_allclose(exp.call(x), jax.jit(f)(x), rtol=0, atol=0)
    else:  # a compiled kernel needs a static grid: the export runs the tile math as XLA ops,
      # i.e. the XLA implementation's math (compiled kernels use Triton's exp/tanh instead).
      f_xla = lambda x: jax.vjp(case.fn("xla"), x)[1](jnp.cos(x))[0]  # noqa: E731
      np.testing.assert_allclose(exp.call(x), jax.jit(f_xla)(x), rtol=1e-6, atol=1e-7)

  # --------------------------------------------------------------------- kernels only
  @parameterized.product(name=tuple(CASES), dtype=DTYPES, shape=((), (3, 13), (257, 24)),
                         block_rows=(None, 2))
  def test_backward_matches_xla(self, name, dtype, shape, block_rows):
    """The kernel backward from the XLA path's residuals: within one rounding of its dx."""
    if self.IMPLEMENTATION == "xla":
      self.skipTest("kernels only")
    self.skip_interpreted_float16(dtype)
    if self.INTERPRET and block_rows and shape != (257, 24):
      # (CI time) the interpreter's ragged last block is the (257, 24) case's; compiled
      # kernels run every case
      self.skipTest("interpret mode: small blocks on the (257, 24) case")
    case = self.case(name)
    op = case.op
    x = inputs(shape, dtype)
    y, m = tests.jit(lambda x: base.XLA.forward(op, x))(x)  # the XLA path's residuals
    dy = jnp.asarray(np.random.default_rng(1).normal(size=shape).astype(np_dtype(dtype)))
    dx_ref = tests.jit(lambda y, m, dy: base.XLA.backward(op, y, m, dy))(y, m, dy)
    if self.HOST_CALLBACK and block_rows:  # the interpreter runs each program in Python:
      block_rows = 16  # still a ragged last block (771 rows), in 49 programs instead of 386
    kb = dataclasses.replace(api.IMPLEMENTATIONS[self.IMPLEMENTATION], interpret=self.INTERPRET,
                             block_rows=block_rows)
    dx = tests.jit(lambda y, m, dy: kb.backward(op, y, m, dy))(y, m, dy)
    if self.INTERPRET and not self.INTERPRET_MATH_IS_XLA:
      # Other log/sqrt roundings (NumPy's): within the gradient's error budget of XLA's dx.
      self.assert_within_gradient_budget(case, dtype, dx, dx_ref, np.abs(np.asarray(dy, np.float64)))
    else:
      self.assertLessEqual(float(np.max(ulp_diff(dx, dx_ref, dtype), initial=0)), 1.0)

  def assert_within_gradient_budget(self, case, dtype, got, want, scale=1.0):
    """|got - want| <= 1.2 x the audit's floor (x scale) + one ulp of want."""
    want64 = np.asarray(want, np.float64)
    ulp = np.spacing(np.abs(want64).astype(np_dtype(dtype))).astype(np.float64)
    tol = 1.2 * audit(case.audit_name, dtype).floor * scale + ulp
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want64), tol + 1e-30)
