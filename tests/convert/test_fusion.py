"""invact_jax.invert's floor pass (convert/_fusion.py): matmuls keep what their neighbours keep
anyway — a norm feeding matmuls keeps xhat once, a GLU keeps its activation's output and the
up projection (not their product), a reshaped attention output is kept once, a bfloat16
value cast to float32 for a matmul is kept in bfloat16.  Forward bit-identical, gradients
at the float32 floor, residual sets checked exactly."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from models.reference_layers import flash_attention  # keeps q, k, v, o and a row lse
from tests import jit
from tests.convert.test_program import assert_at_float32_floor

D, FF, ROWS = 32, 48, 12


def _w(shape, seed):
  return jax.random.normal(jax.random.key(seed), shape) / math.sqrt(shape[0])


def _x(shape=(ROWS, D), dtype=jnp.float32, seed=0):
  return (1.0 + 2.0 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def layer_norm(x, g, b):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def rms_norm(x, w):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
  return w * xf.astype(x.dtype)


def _kept(fn, *args) -> list:
  """(shape, dtype) of every kept non-argument array of at least 2 dimensions, sorted."""
  return sorted((tuple(r.shape), r.dtype) for r in memory.residuals(fn, *args)
                if not r.is_argument and len(r.shape) > 1)


def _check(loss, args, argnums=0, hand_loss=None):
  """Converted forward bit-identical; gradient at the float32 floor (plus the inverted ops'
  own error: ``hand_loss``'s); returns the converted function."""
  inv = invact_jax.invert(loss)
  np.testing.assert_array_equal(np.asarray(jit(inv)(*args)), np.asarray(jit(loss)(*args)))
  g = jax.jit(jax.grad(inv, argnums=argnums))(*args)
  assert_at_float32_floor(loss, args, g, argnums=argnums, hand_loss=hand_loss)
  return inv


def test_a_norm_feeding_matmuls_keeps_xhat_once():
  """LayerNorm -> three projections (and RMSNorm with float32 statistics -> two): the norm
  and its matmuls keep xhat and the float32 rstd; the normalized output is not kept."""
  p = {"g": 1 + 0.1 * _x((D,), seed=1), "b": 0.1 * _x((D,), seed=2),
       "w": [_w((D, D), 3 + i) for i in range(3)]}

  def loss(p, x):
    z = layer_norm(x, p["g"], p["b"])
    q, k, v = (z @ w for w in p["w"])
    return jnp.sum(q * k + v)
  inv = _check(loss, (p, _x()), argnums=(0, 1))
  assert inv.last_report.replaced == {"layer_norm": 1}
  assert _kept(inv, p, _x()) == [((ROWS, 1), "float32")] + [((ROWS, D), "float32")] * 3  # xhat, q, k
  kept_unfused = _kept(invact_jax.invert(loss, floor=False), p, _x())
  assert kept_unfused.count(((ROWS, D), "float32")) == 4  # and the norm's output

  w2 = {"n": 1 + 0.1 * _x((D,), seed=4), "wg": _w((D, FF), 5), "wu": _w((D, FF), 6)}

  def rms_loss(w2, x):
    h = rms_norm(x, w2["n"])
    return jnp.sum((h @ w2["wg"]) * (h @ w2["wu"]))
  inv = _check(rms_loss, (w2, _x()), argnums=(0, 1))
  # xhat and rstd; the two projections (their product's inputs)
  assert _kept(inv, w2, _x()) == sorted([((ROWS, D), "float32"), ((ROWS, 1), "float32"),
                                         ((ROWS, FF), "float32"), ((ROWS, FF), "float32")])


def test_a_zero_scale_has_exact_gradients():
  """The normalized output is recomputed as xhat * scale + bias, never divided by the scale."""
  p = {"g": jnp.zeros(D).at[3].set(1.0), "b": 0.1 * _x((D,), seed=2), "w": _w((D, D), 3)}

  def loss(p, x):
    return jnp.sum(jnp.sin(layer_norm(x, p["g"], p["b"]) @ p["w"]))
  g = jax.jit(jax.grad(invact_jax.invert(loss), argnums=(0, 1)))(p, _x())
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))
  assert_at_float32_floor(loss, (p, _x()), g, argnums=(0, 1))


def test_a_glu_keeps_the_activation_output_and_up_not_their_product():
  p = {"wg": _w((D, FF), 1), "wu": _w((D, FF), 2), "wd": _w((FF, D), 3)}

  def loss(p, x):
    return jnp.sum(jnp.sin((jax.nn.silu(x @ p["wg"]) * (x @ p["wu"])) @ p["wd"]))
  inv = _check(loss, (p, _x()), argnums=(0, 1))
  assert inv.last_report.replaced == {"silu": 1}
  kept = _kept(inv, p, _x())
  assert kept == sorted([((ROWS, FF), "float32"), ((ROWS, FF), "float32"),
                         ((ROWS, FF // 8), "uint8"), ((ROWS, D), "float32")]), kept
  unfused = _kept(invact_jax.invert(loss, floor=False), p, _x())
  assert unfused.count(((ROWS, FF), "float32")) == 3, unfused  # silu's output, up, product


def test_an_attention_output_reshaped_for_its_projection_is_kept_once():
  b, t, h = 2, 6, 4
  p = {"wq": _w((D, D), 1), "wk": _w((D, D), 2), "wv": _w((D, D), 3), "wo": _w((D, D), 4)}
  x = _x((b, t, D))

  def loss(p, x):
    split = lambda a: a.reshape(b, t, h, D // h)  # noqa: E731
    o = flash_attention(split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"]), True)
    return jnp.sum(jnp.sin(o.reshape(b, t, D) @ p["wo"]))
  inv = _check(loss, (p, x), argnums=(0, 1))
  kept = [s for s, d in _kept(inv, p, x) if d == "float32"]
  # q, k, v, o (the kernel's own residuals) and the projection's output for sin: no copy
  # of o in the [b, t, D] layout.
  assert sorted(kept) == sorted([(b, t, h, D // h)] * 4 + [(b, h, t, 1), (b, t, D)]), kept
  unfused = [s for s, d in _kept(invact_jax.invert(loss, floor=False), p, x) if d == "float32"]
  assert unfused.count((b, t, D)) == 2, unfused


def test_a_bfloat16_value_cast_for_a_float32_matmul_is_kept_narrow():
  p = {"w1": _w((D, FF), 1), "w2": _w((FF, D), 2)}

  def loss(p, x):
    h = jnp.sin(x @ p["w1"].astype(jnp.bfloat16))  # not an op invert converts
    return jnp.sum(jnp.sin(h.astype(jnp.float32) @ p["w2"]))
  x = _x(dtype=jnp.bfloat16)
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(p, x)
  g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
  for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):  # the same VJP, recomputed
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  kept = _kept(inv, p, x)
  assert ((ROWS, FF), "float32") not in kept and ((ROWS, FF), "bfloat16") in kept, kept
  assert ((ROWS, FF), "float32") in _kept(invact_jax.invert(loss, floor=False), p, x)


def test_float32_probabilities_narrowed_for_the_pv_matmul_are_kept_once():
  """Keras's attention: float32 logits masked before and after the softmax, the
  probabilities cast to bfloat16 for P.V; the softmax keeps its float32 output anyway, so the
  matmul recomputes its bfloat16 operand from it (and the mask; the zeros are a constant)."""
  b, t, d = 2, 16, 8
  q, k, v = (jax.random.normal(jax.random.key(i), (b, t, d)).astype(jnp.bfloat16)
             for i in range(3))
  mask = jnp.tril(jnp.ones((t, t), bool))[None]

  def loss(q, k, v, mask):
    s = jnp.einsum("bqd,bkd->bqk", q, k).astype(jnp.float32) / 8.0
    p = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1), 0.0)
    return jnp.sum(jnp.einsum("bqk,bkd->bqd", p.astype(jnp.bfloat16), v).astype(jnp.float32) ** 2)
  inv = invact_jax.invert(loss)
  args = (q, k, v, mask)
  np.testing.assert_array_equal(np.asarray(jit(inv)(*args)), np.asarray(jit(loss)(*args)))
  for a, r in zip(jax.jit(jax.grad(inv, (0, 1, 2)))(*args),
                  jax.jit(jax.grad(loss, (0, 1, 2)))(*args)):  # the same VJPs, recomputed
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))
  kept, unfused = _kept(inv, *args), _kept(invact_jax.invert(loss, floor=False), *args)
  assert ((b, t, t), "bfloat16") not in kept and ((b, t, t), "bfloat16") in unfused
  # the masks are kept before their broadcast (arguments here): what stays is the float32
  # probabilities and the loss's own square
  assert kept == [((b, t, d), "float32"), ((b, t, t), "float32")], kept


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_select_keeps_its_mask_before_the_broadcast(dtype):
  """A boolean or integer predicate broadcast over batch and heads: the selects' backward
  needs only the predicate, kept in its small shape (here computed, not an argument)."""
  b, h, t = 3, 4, 16
  x = jax.random.normal(jax.random.key(0), (b, h, t, t)).astype(dtype)

  def loss(x):
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]   # [t, t] bool
    band = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) // 4  # [t, t] int
    y = jnp.where(causal, jnp.sin(x), -1e4)
    z = jax.lax.select_n(jnp.broadcast_to(jnp.clip(band, 0, 2), (b, h, t, t)),
                         y, 2 * y, jnp.cos(y))
    return jnp.sum(z.astype(jnp.float32) ** 2)
  inv = invact_jax.invert(loss)
  np.testing.assert_array_equal(np.asarray(jit(inv)(x), np.float32),
                                np.asarray(jit(loss)(x), np.float32))
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(inv))(x), np.float32),
                                np.asarray(jax.jit(jax.grad(loss))(x), np.float32))
  kept, plain = _kept(inv, x), _kept(loss, x)
  for small in ("bool", "int32"):
    assert ((b, h, t, t), small) in plain and ((b, h, t, t), small) not in kept, (kept, plain)
    assert ((t, t), small) in kept, kept


def test_a_post_norm_output_read_by_matmuls_and_the_residual_stream():
  """BERT's post-LN: the norm's output feeds the next projections and the residual add; the
  fused unit returns it too."""
  p = {"g": 1 + 0.1 * _x((D,), seed=1), "b": 0.1 * _x((D,), seed=2), "w1": _w((D, FF), 3),
       "w2": _w((FF, D), 4)}

  def make(gelu):
    def loss(p, x):
      for _ in range(2):
        x = layer_norm(x + gelu(x @ p["w1"], approximate=False) @ p["w2"], p["g"], p["b"])
      return jnp.sum(jnp.sin(x))
    return loss
  # GELU's inverted backward has its own error (ill-conditioned near its minimum): the
  # hand-converted model's distance is part of the bound.
  loss = make(jax.nn.gelu)
  inv = _check(loss, (p, _x()), argnums=(0, 1), hand_loss=make(invact_jax.gelu))
  assert inv.last_report.replaced == {"layer_norm": 2, "gelu": 2}


def test_a_matmul_reading_a_value_computed_from_another_of_the_group_is_not_fused():
  """``z @ tanh(z @ W)^T``: fusing both matmuls with the norm would make the program cyclic;
  the conversion keeps it correct."""
  p = {"g": 1 + 0.1 * _x((D,), seed=1), "b": 0.1 * _x((D,), seed=2), "w": _w((D, D), 3)}

  def loss(p, x):
    z = layer_norm(x, p["g"], p["b"])
    return jnp.sum(jnp.sin(z.T @ jnp.tanh(z @ p["w"])))
  _check(loss, (p, _x()), argnums=(0, 1))


@pytest.mark.parametrize("wrap", ["scan", "vmap", "remat", "shard_map"])
def test_under_transformations(wrap):
  """A pre-norm Llama-style layer (RMSNorm, SwiGLU) under scan, vmap, remat and shard_map:
  forward bit-identical, gradients at the float32 floor, the fused units inside."""
  layer_p = {"n": 1 + 0.1 * _x((D,), seed=1), "wg": _w((D, FF), 2), "wu": _w((D, FF), 3),
             "wd": _w((FF, D), 4)}

  def layer(p, x):
    h = rms_norm(x, p["n"])
    return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
  x = _x((8, ROWS, D))
  if wrap == "scan":
    p = jax.tree.map(lambda a: jnp.stack([a, 0.9 * a]), layer_p)

    def loss(p, x):
      return jnp.sum(jnp.sin(jax.lax.scan(lambda h, q: (layer(q, h), None), x, p)[0]))
  elif wrap == "vmap":
    p = layer_p
    loss = lambda p, x: jnp.sum(jnp.sin(jax.vmap(layer, (None, 0))(p, x)))  # noqa: E731
  elif wrap == "remat":
    p = layer_p
    loss = lambda p, x: jnp.sum(jnp.sin(jax.checkpoint(layer)(p, x)))  # noqa: E731
  else:
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
    mesh = jax.make_mesh((8,), ("data",))
    p = layer_p
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))

    def loss(p, x):
      local = lambda p, x: jax.lax.psum(jnp.sum(jnp.sin(layer(p, x))), "data")  # noqa: E731
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(p, x)
  inv = _check(loss, (p, x), argnums=(0, 1))
  if wrap == "remat":
    # Under jax.checkpoint (no policy: everything recomputed) the body is converted only
    # where that compiles to a lower temp, else left as written, said with the two figures.
    # Here XLA decides: converted on JAX 0.10 (the backward rules read their residuals apart,
    # _common.read_apart), left alone on JAX 0.12 (203,288 vs 172,800 bytes per call).
    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1)))  # noqa: E731
    ours, theirs = (memory.compiled(grad(f), p, x).temp for f in (inv, loss))
    if inv.last_report.replaced:
      assert inv.last_report.replaced == {"rms_norm": 1, "silu": 1}, inv.last_report
      assert ours < theirs, (ours, theirs)
    else:
      (why,) = {y for _, _, y in inv.last_report.left_alone}
      assert "inside jax.checkpoint" in why and "raises its gradient's compiled temp" in why, why
      assert ours == theirs, (ours, theirs)
    return
  assert inv.last_report.replaced == {"rms_norm": 1, "silu": 1}, inv.last_report
  unfused = sum(r.bytes for r in memory.residuals(invact_jax.invert(loss, floor=False), p, x))
  kept = sum(r.bytes for r in memory.residuals(inv, p, x))
  assert kept < unfused, (kept, unfused)


@pytest.mark.parametrize("wrap", ["scan", "vmap", "shard_map"])
def test_masked_narrowed_attention_under_transformations(wrap):
  """The mask and narrowing rules (Keras-style attention in bfloat16) inside scan, vmap and
  shard_map bodies: forward and gradients bit-identical to the unconverted program's."""
  b, t, d = 8, 16, 8
  q, k, v = (jax.random.normal(jax.random.key(i), (2, b, t, d)).astype(jnp.bfloat16)
             for i in range(3))

  def attn(q, k, v):
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    mask = jnp.broadcast_to(causal, (q.shape[0], t, t))
    s = jnp.einsum("bqd,bkd->bqk", q, k).astype(jnp.float32) / 8.0
    p = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1), 0.0)
    return jnp.sum(jnp.einsum("bqk,bkd->bqd", p.astype(jnp.bfloat16), v).astype(jnp.float32) ** 2)
  if wrap == "scan":
    def loss(q, k, v):
      return jax.lax.scan(lambda c, qkv: (c + attn(*qkv), None), 0.0, (q, k, v))[0]
  elif wrap == "vmap":
    def loss(q, k, v):
      return jnp.sum(jax.vmap(attn)(q, k, v))
  else:
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
    mesh = jax.make_mesh((8,), ("data",))

    def loss(q, k, v):
      local = lambda q, k, v: jax.lax.psum(attn(q[0], k[0], v[0]), "data")  # noqa: E731
      spec = P(None, "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=P())(q, k, v)
    q, k, v = (jax.device_put(a, jax.sharding.NamedSharding(mesh, P(None, "data")))
               for a in (q, k, v))
  inv = invact_jax.invert(loss)
  args = (q, k, v)
  np.testing.assert_array_equal(np.asarray(jit(inv)(*args)), np.asarray(jit(loss)(*args)))
  for a, r in zip(jax.jit(jax.grad(inv, (0, 1, 2)))(*args),
                  jax.jit(jax.grad(loss, (0, 1, 2)))(*args)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32))
  assert inv.last_report.replaced == {"softmax": 1}, inv.last_report
