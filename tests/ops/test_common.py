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


def test_read_apart_gives_its_arrays_bit_for_bit_through_a_conditional_on_cpu():
  """The residuals a backward reads: the same bits (signed zeros, infinities, NaNs past the
  first element, subnormals), integer and empty arrays and non-arrays untouched, under jit,
  vmap, grad and scan; on CPU through one conditional (a fusion boundary XLA:CPU keeps), for
  another platform without the conditional's test."""
  x = jnp.array([1.5, -0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 1e-45, -3.0], jnp.float32)
  bits = lambda a: np.asarray(a).view(np.uint32)  # noqa: E731
  tree = {"x": x, "h": x.astype(jnp.bfloat16), "i": jnp.arange(3), "e": jnp.zeros((0,)),
          "s": "kept"}
  out = jax.jit(lambda t: _common.read_apart({k: v for k, v in t.items() if k != "s"}))(
      {k: v for k, v in tree.items() if k != "s"})
  assert (bits(out["x"]) == bits(x)).all()
  assert (np.asarray(out["h"]).view(np.uint16) == np.asarray(tree["h"]).view(np.uint16)).all()
  assert out["i"].tolist() == [0, 1, 2] and out["e"].shape == (0,)
  assert _common.read_apart(("kept", 3)) == ("kept", 3)
  assert (bits(jax.vmap(_common.read_apart)(jnp.stack([x, -x]))[1]) == bits(-x)).all()
  assert jax.grad(lambda v: jnp.sum(_common.read_apart(v) * v))(x[:1]).tolist() == [3.0]
  scanned = jax.lax.scan(lambda c, v: (c, _common.read_apart(v)), 0.0, x.reshape(2, 4))[1]
  assert (bits(scanned.reshape(-1)) == bits(x)).all()
  hlo = jax.jit(_common.read_apart).lower(x).compile().as_text()
  assert "conditional" in hlo
  from jax import export  # pylint: disable=import-outside-toplevel
  cuda = export.export(jax.jit(_common.read_apart), platforms=["cuda"])(
      jax.ShapeDtypeStruct(x.shape, x.dtype)).mlir_module()
  assert "stablehlo.compare" not in cuda  # (only the platform switch, on a constant index)
