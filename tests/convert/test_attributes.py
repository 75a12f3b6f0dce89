"""Flax integration: activation modules and the conversion of unmodified models."""
import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import invact_jax
from invact_jax import memory
from invact_jax.flax import LinenActivation, NnxActivation, activation


class LinenMlp(nn.Module):
  """Written the standard way: calls nn.gelu / jax.nn.silu inline."""
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(64)(x))
    x = jax.nn.silu(nn.Dense(64)(x))
    return nn.Dense(4)(x)


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(16, 64, rngs=rngs)
    self.fc2 = nnx.Linear(64, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.gelu(self.fc1(x), approximate=False))


class CapturedDefault(nn.Module):
  """The activation is captured at class definition: the conversion cannot see it."""
  act: callable = jax.nn.gelu

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(self.act(nn.Dense(64)(x)))


def _hidden_residuals(loss, *args, hidden=64):
  return [r for r in memory.residuals(loss, *args) if not r.is_argument and r.shape[-1] == hidden]


def test_linen_model_converted_same_outputs_params_fewer_residuals():
  model = LinenMlp()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = model.init(jax.random.key(1), x)
  loss = lambda p, x: jnp.sum(model.apply(p, x) ** 2)
  y_ref = model.apply(params, x)
  g_ref = jax.grad(loss)(params, x)
  with invact_jax.inverted() as report:
    params2 = model.init(jax.random.key(1), x)
    y = model.apply(params, x)
    g = jax.grad(loss)(params, x)
    saved = _hidden_residuals(loss, params, x)
  chex.assert_trees_all_equal_structs(params, params2)
  chex.assert_trees_all_equal(params, params2)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)
  assert report.forms.get("flax.linen.gelu", 0) > 0
  assert report.forms.get("jax.nn.silu", 0) > 0
  assert len(saved) < len(_hidden_residuals(loss, params, x))
  assert jax.nn.gelu is not report  # restored after the block
  assert "invact" not in getattr(jax.nn.gelu, "__module__", "")


def test_nnx_model_converted_via_invert():
  model = NnxMlp(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  x = jax.random.normal(jax.random.key(0), (8, 16))
  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)
  inv_loss = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv_loss))(state, x)
  g_ref = jax.grad(loss)(state, x)
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)
  assert inv_loss.last_report.replaced == {"gelu": 1}
  np.testing.assert_array_equal(np.asarray(jax.jit(inv_loss)(state, x)), np.asarray(loss(state, x)))


def test_captured_default_is_reported_not_silently_missed():
  model = CapturedDefault()
  x = jnp.ones((2, 16))
  params = model.init(jax.random.key(0), x)
  with pytest.warns(UserWarning, match="no activation call was replaced"):
    with invact_jax.inverted() as report:
      model.apply(params, x)
  assert report.replaced == {}


def test_only_and_bad_names():
  with invact_jax.inverted(only=("silu",), warn=False) as report:
    jax.nn.gelu(jnp.ones(3))
    jax.nn.silu(jnp.ones(3))
  assert report.forms == {"jax.nn.silu": 1}
  with pytest.raises(ValueError, match="argument `only`"):
    with invact_jax.inverted(only=("softmax",)):
      pass


def test_modules_match_functions():
  x = jnp.linspace(-3, 3, 12).reshape(3, 4)
  lin = LinenActivation(name_="gelu", options=(("approximate", False),))
  np.testing.assert_array_equal(lin.apply({}, x), jax.nn.gelu(x, approximate=False))
  np.testing.assert_array_equal(NnxActivation("silu")(x), jax.nn.silu(x))
  dense = nn.Dense(4)
  params = dense.init(jax.random.key(0), x)
  np.testing.assert_array_equal(activation("elu", alpha=0.5)(dense.apply(params, x)),
                                jax.nn.elu(dense.apply(params, x), 0.5))
  with pytest.raises(ValueError, match="argument `name`"):
    activation("softmax")


class LinenNormBlock(nn.Module):
  """Unmodified linen code with LayerNorm, softmax and RMSNorm."""
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(nn.LayerNorm()(x))
    a = jax.nn.softmax(h @ h.T)
    return nn.RMSNorm()(nn.gelu(a @ h))


@pytest.mark.default_compiler  # rtol 1e-5 measured with XLA's fusion emitters
def test_norms_and_softmax_converted_same_params_and_gradients_fewer_residuals():
  softmax_before, ln_call_before = jax.nn.softmax, nn.LayerNorm.__call__
  m = LinenNormBlock()
  x = jnp.arange(32.0).reshape(4, 8) / 7.0
  params = m.init(jax.random.key(0), x)
  loss = lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
  g0 = jax.grad(loss)(params, x)
  with invact_jax.inverted() as report:
    g1 = jax.grad(loss)(params, x)
    params1 = m.init(jax.random.key(0), x)
    kept1 = sum(r.bytes for r in memory.residuals(loss, params, x) if not r.is_argument)
  assert {"flax.linen.LayerNorm", "flax.linen.RMSNorm", "jax.nn.softmax"} <= set(report.forms)
  chex.assert_trees_all_equal_shapes_and_dtypes(params, params1)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-5)
  kept0 = sum(r.bytes for r in memory.residuals(loss, params, x) if not r.is_argument)
  assert kept1 < kept0
  # Outside the block, the originals are back.
  assert jax.nn.softmax is softmax_before and nn.LayerNorm.__call__ is ln_call_before
  with invact_jax.inverted(norms=False) as report:
    jax.grad(loss)(params, x)
  assert "flax.linen.LayerNorm" not in report.forms


def test_nnx_norms_converted_and_unsupported_calls_fall_back():
  class Net(nnx.Module):
    def __init__(self):
      self.ln = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
      self.rn = nnx.RMSNorm(8, rngs=nnx.Rngs(0))
      self.ln_axes = nnx.LayerNorm(4, reduction_axes=0, feature_axes=0, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.rn(jnp.sin(self.ln(x))) + self.ln_axes(x)  # x: [4, 8]

  net = Net()
  x = jnp.arange(32.0).reshape(4, 8) / 5.0
  f = lambda n, x: jnp.sum(jnp.cos(n(x)))  # noqa: E731
  g0 = nnx.state(nnx.grad(f)(net, x))
  with invact_jax.inverted() as report:
    g1 = nnx.state(nnx.grad(f)(net, x))
  assert report.forms == {"flax.nnx.LayerNorm": 1, "flax.nnx.RMSNorm": 1}
  chex.assert_trees_all_close(jax.tree.leaves(g1), jax.tree.leaves(g0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_modules_load_flax_checkpoints_and_match(rms):
  from invact_jax.flax import LinenLayerNorm, LinenRMSNorm, NnxLayerNorm, NnxRMSNorm
  x = jnp.arange(48.0).reshape(6, 8) / 9.0
  ref, ours = (nn.RMSNorm(), LinenRMSNorm()) if rms else (nn.LayerNorm(), LinenLayerNorm())
  params = ref.init(jax.random.key(0), x)
  chex.assert_trees_all_equal_shapes_and_dtypes(params, ours.init(jax.random.key(0), x))
  loss = lambda m: (lambda p: jnp.sum(jnp.sin(m.apply(p, x))))  # noqa: E731
  # Flax computes var = E[x^2] - E[x]^2 (cancels for rows with a large mean); ours is the
  # two-pass variance: no further from the float64 result than Flax's, to rounding.
  x64 = np.asarray(x, np.float64)
  c = x64 if rms else x64 - x64.mean(-1, keepdims=True)
  want = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6)
  err = lambda y: np.max(np.abs(np.asarray(y, np.float64) - want))  # noqa: E731
  assert err(ours.apply(params, x)) <= err(ref.apply(params, x)) + 1e-6
  chex.assert_trees_all_close(jax.grad(loss(ours))(params), jax.grad(loss(ref))(params),
                              atol=1e-4, rtol=1e-4)
  n_ref = (nnx.RMSNorm if rms else nnx.LayerNorm)(8, rngs=nnx.Rngs(0))
  n_ours = (NnxRMSNorm if rms else NnxLayerNorm)(8, rngs=nnx.Rngs(0))
  assert err(n_ours(x)) <= err(n_ref(x)) + 1e-6
  kept = lambda m: sum(r.bytes for r in memory.residuals(  # noqa: E731
      lambda x: jnp.sum(jnp.sin(m(x))), x) if not r.is_argument)
  assert kept(n_ours) < kept(n_ref)


def test_only_accepts_a_single_name_and_tanh_is_converted():
  with invact_jax.inverted(only="silu", warn=False) as report:
    jax.nn.silu(jnp.ones(3))
    jax.nn.gelu(jnp.ones(3))
  assert report.forms == {"jax.nn.silu": 1}
  with invact_jax.inverted(warn=False) as report:
    nn.tanh(jnp.ones(3))
  assert report.forms == {"flax.linen.tanh": 1}


def test_nested_blocks_count_in_every_report():
  x, w = jnp.ones((2, 4)), jnp.ones((4, 8))
  with invact_jax.inverted() as outer:
    with invact_jax.inverted() as inner:
      jax.grad(lambda w: jnp.sum(jax.nn.gelu(x @ w)))(w)
  assert outer.forms == inner.forms == {"jax.nn.gelu": 1}
  inner = invact_jax.invert(lambda w: jnp.sum(jax.nn.silu(x @ w)))
  f = invact_jax.invert(inner)  # the outer conversion sees the inner one's custom_vjp
  jax.grad(f)(w)
  assert inner.last_report.replaced == {"silu": 1}
  assert f.last_report.replaced == {}


def test_other_threads_are_unaffected_and_nothing_deadlocks():
  import threading
  x = jnp.linspace(-2, 2, 8)
  seen = {}

  def other():  # runs while the main thread is inside a block, and waits for nothing
    with invact_jax.inverted(warn=False) as r:
      jax.nn.relu(x)
    seen["other_report"] = r.forms

  with invact_jax.inverted(warn=False) as report:
    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=60)  # a block that waits on another thread's block must not deadlock
    assert not t.is_alive()
    jax.nn.gelu(x)
  assert seen["other_report"] == {"jax.nn.relu": 1}
  assert report.forms == {"jax.nn.gelu": 1}   # the other thread's relu is not counted here
  assert jax.nn.gelu(x) is not None


def test_thread_outside_any_block_gets_the_originals():
  import threading
  result = {}
  started, release = threading.Event(), threading.Event()

  def worker():
    started.wait(30)
    grad_fn = jax.grad(lambda x: jnp.sum(jax.nn.gelu(x)))
    from invact_jax import memory
    result["kept"] = len([r for r in memory.residuals(lambda x: jnp.sum(jax.nn.gelu(x)),
                                                       jnp.ones((4, 16))) if not r.is_argument])
    result["grad"] = grad_fn(jnp.ones(3))
    release.set()

  t = threading.Thread(target=worker)
  t.start()
  with invact_jax.inverted(warn=False) as report:
    started.set()
    release.wait(60)
  t.join(60)
  assert report.replaced == {}
  assert result["kept"] >= 3  # jax.nn's own residuals: the worker ran the original


def test_a_jit_traced_inside_the_block_keeps_its_trace_until_its_cache_is_cleared():
  """The documented limit of the attribute swap: JAX caches the trace made inside the block
  (the swapped attribute is not in its key); clear_cache() traces it again as jax.nn."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  f = jax.jit(lambda x, w: jnp.sum(jax.nn.gelu(x @ w) @ w.T))
  args = (jnp.ones((4, 8)), jnp.ones((8, 16)))
  kept = lambda: sorted(r.dtype for r in memory.residuals(f, *args) if not r.is_argument)  # noqa: E731
  plain = kept()
  f.clear_cache()
  with invact_jax.inverted(warn=False):
    inside = kept()
  assert "uint8" in inside and "uint8" not in plain  # the packed bits: inverted inside
  assert kept() == inside      # still the trace made inside
  f.clear_cache()
  assert kept() == plain
