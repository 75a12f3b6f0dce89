"""Inverted activations on inputs sharded over a device mesh (8 virtual CPU devices)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.activation_cases import CASES

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by conftest.py)")
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@pytest.mark.parametrize("name", ["gelu_tanh", "gelu_erf", "silu", "mish", "tanh", "relu"])
@pytest.mark.parametrize("spec", [P("data", "model"), P("data", None), P(None, "model")])
def test_sharded_forward_backward_is_local(name, spec):
  ours, ref = CASES[name]
  mesh = _mesh()
  sharding = NamedSharding(mesh, spec)
  x = jax.random.normal(jax.random.key(0), (16, 256))
  xs = jax.device_put(x, sharding)
  step = jax.jit(lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x),
                 in_shardings=sharding, out_shardings=sharding)
  hlo = step.lower(xs).compile().as_text()
  found = [c for c in COLLECTIVES if c in hlo]
  assert not found, f"collectives in the sharded step: {found}"
  out = step(xs)
  assert out.sharding == sharding
  expect = jax.jit(lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x))(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))


@pytest.mark.parametrize("name", ["gelu", "silu", "tanh", "leaky_relu_negative"])
@pytest.mark.parametrize("spec", [P("data", "model"), P("data", None), P(None, "model"),
                                  P(("data", "model"), None)])
def test_sharded_pallas_kernels_run_per_shard(name, spec):
  """The kernels (interpret mode here) run per shard: no collectives, same result."""
  import invact_jax
  fns = {"gelu": invact_jax.gelu, "silu": invact_jax.silu, "tanh": invact_jax.tanh,
         "leaky_relu_negative": lambda x, **kw: invact_jax.leaky_relu(x, -0.2, **kw)}
  ours = lambda x: fns[name](x, implementation="pallas")  # noqa: E731
  mesh = _mesh()
  x = jax.random.normal(jax.random.key(0), (8, 4, 256))
  sharding = NamedSharding(mesh, P(*((spec[0], None) + tuple(spec[1:]))))
  xs = jax.device_put(x, sharding)
  fn = lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x)  # noqa: E731
  step = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)
  hlo = step.lower(xs).compile().as_text()
  found = [c for c in COLLECTIVES if c in hlo]
  assert not found, f"collectives around the sharded kernels: {found}"
  out = step(xs)
  assert out.sharding == sharding
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(x)))


def test_sharded_pallas_kernels_ragged_last_axis_is_correct():
  """Shards of 6 elements cannot hold whole mask bytes: the last axis is gathered, correctly."""
  import invact_jax
  mesh = _mesh()
  sharding = NamedSharding(mesh, P("data", "model"))
  x = jax.random.normal(jax.random.key(1), (4, 24))
  ours = lambda x: invact_jax.gelu(x, implementation="pallas")  # noqa: E731
  fn = lambda x: jax.vjp(ours, x)[1](jnp.cos(x))[0] + ours(x)  # noqa: E731
  out = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)(jax.device_put(x, sharding))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(x)))
