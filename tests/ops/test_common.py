"""The helpers every op family shares: argument checks, implementation resolution."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from invact_jax.ops import _common, _implementation


def test_static_scalar_and_axis():
  assert _common.static_scalar("f", "a", np.float32(0.5)) == 0.5
  assert _common.static_scalar("f", "a", jnp.float32(2.0)) == 2.0
  for bad, msg in (("a", "real number"), (True, "real number"), (np.ones(2), "shape"),
                   (1 + 2j, "real number")):
    with pytest.raises(TypeError, match=f"invact_jax.f: argument `a` must be a {msg}|"
                                        f"invact_jax.f: argument `a`.*{msg}"):
      _common.static_scalar("f", "a", bad)
  assert _common.static_axis("f", "axis", np.int64(-1), 3) == 2
  with pytest.raises(TypeError, match="argument `axis` must be an integer"):
    _common.static_axis("f", "axis", 1.0, 3)


def test_resolve():
  from invact_jax.ops.activations import api
  impls = api.IMPLEMENTATIONS
  assert _implementation.resolve(None, op="f", implementations=impls) is impls["xla"]
  with pytest.raises(ValueError, match="invact_jax.f: argument `implementation`"):
    _implementation.resolve("cuda", op="f", implementations=impls)
  with pytest.raises(ValueError, match="not available for this op"):
    _implementation.resolve("pallas", op="f", implementations={"xla": _implementation.XLA})
  b = _implementation.resolve(_implementation.Implementation(name="pallas", interpret=True),
                              op="f", implementations=impls)
  assert type(b) is type(impls["pallas"]) and b.name == "pallas" and b.interpret
  b = _implementation.resolve(_implementation.Implementation(name="pallas", interpret=True,
                                                             block_rows=64),
                              op="f", implementations=impls)
  assert type(b) is type(impls["pallas"]) and b.block_rows == 64 and b != impls["pallas"]
  assert type(impls["triton"]).kernels is not type(impls["pallas"]).kernels
  assert hash(b) == hash(dataclasses.replace(b))  # a static argument of the custom_vjps


def test_first_order_only_allows_first_order_and_refuses_second():
  f = lambda x: _common.first_order_only("gelu", jnp.sin, x)  # noqa: E731
  assert float(f(jnp.float32(0.0))) == 0.0
  with pytest.raises(NotImplementedError, match="invact_jax.gelu: higher-order"):
    jax.grad(f)(1.0)
