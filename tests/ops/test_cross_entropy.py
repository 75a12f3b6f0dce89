"""invact_jax.linear_cross_entropy: the LM head's loss without its logits.

In both gradient modes ("forward": computed with the loss; "backward": the backward
recomputes the logits): every option against the plain formula (values and gradients),
gradient error against float64 no worse than the plain head's in float32 and bfloat16, NaN
like the plain loss, bad input as one line naming the argument, no [tokens, vocabulary]
buffer in the compiled program, what each mode keeps, and the transformations (jit, vmap,
grad, scan, remat, shard_map, sharded inputs)."""
import dataclasses
import functools
import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import invact_jax

N, D, V = 37, 16, 50  # neither divides the tiles below: every remainder path runs
TILES = {"chunk_size": 8, "vocab_chunk_size": 16}


def _inputs(dtype=jnp.float32, n=N, v=V, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (n, D)).astype(dtype)
  w = (jax.random.normal(k[1], (D, v)) / math.sqrt(D) * 3).astype(dtype)
  b = (0.5 * jax.random.normal(k[2], (v,))).astype(dtype)
  y = jax.random.randint(k[3], (n,), 0, v)
  return x, w, b, y


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _loss_and_grads(fn, x, w, b, y, **kw):
  def f(x, w, b):
    out = fn(x, w, y, bias=b, **kw)
    return jnp.sum(out * jnp.linspace(0.5, 1.5, out.size).reshape(out.shape)) \
        if kw.get("reduction") == "none" else out
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b)


OPTIONS = {
    "mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
    "ignore_index": {"ignore_index": 7}, "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3}, "soft_cap": {"logit_soft_cap": 2.0},
    "everything": {"ignore_index": 7, "label_smoothing": 0.2, "z_loss": 1e-2,
                   "logit_soft_cap": 3.0},
}


MODES = ("forward", "backward")


def _option_inputs(name):
  x, w, b, y = _inputs()
  return (x, w, b, y.at[::3].set(7)) if "ignore_index" in OPTIONS[name] else (x, w, b, y)


@functools.lru_cache(maxsize=None)
def _option_reference(name):
  """The plain formula's loss and gradients for option ``name`` (both modes compare to it)."""
  return _loss_and_grads(invact_jax.linear_cross_entropy_reference, *_option_inputs(name),
                         **OPTIONS[name])


@pytest.mark.parametrize("name, mode", [  # per-token losses: "backward" only
    (k, m) for k in sorted(OPTIONS) for m in MODES if k != "none" or m == "backward"])
def test_each_option_matches_the_plain_formula(name, mode):
  kw = OPTIONS[name]
  x, w, b, y = _option_inputs(name)
  (l1, g1) = _loss_and_grads(invact_jax.linear_cross_entropy, x, w, b, y, **kw, **TILES,
                             gradients=mode)
  (l0, g0) = _option_reference(name)
  assert _rel(l1, l0) <= 2e-6, (l1, l0)
  for a, r in zip(g1, g0):
    assert _rel(a, r) <= 2e-6, _rel(a, r)


def test_the_plain_formula_is_optax_and_the_options_are_theirs():
  """The reference is optax's loss of the logits; label smoothing is optax's smoothed
  targets; z-loss adds lse^2; a soft cap is c * tanh(z / c)."""
  x, w, b, y = _inputs()
  logits = x @ w + b
  ref = invact_jax.linear_cross_entropy_reference
  np.testing.assert_allclose(
      ref(x, w, y, bias=b), optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
      rtol=1e-6)
  smooth = optax.smooth_labels(jax.nn.one_hot(y, V), 0.1)
  np.testing.assert_allclose(ref(x, w, y, bias=b, label_smoothing=0.1),
                             optax.softmax_cross_entropy(logits, smooth).mean(), rtol=1e-6)
  lse = jax.nn.logsumexp(logits, axis=-1)
  np.testing.assert_allclose(
      ref(x, w, y, bias=b, z_loss=0.01, reduction="none"),
      optax.softmax_cross_entropy_with_integer_labels(logits, y) + 0.01 * lse ** 2, rtol=1e-6)
  capped = 2.0 * jnp.tanh(logits / 2.0)
  np.testing.assert_allclose(ref(x, w, y, bias=b, logit_soft_cap=2.0),
                             optax.softmax_cross_entropy_with_integer_labels(capped, y).mean(),
                             rtol=1e-6)
  y2 = y.at[::2].set(-100)
  keep = y2 != -100
  np.testing.assert_allclose(
      ref(x, w, y2, bias=b, ignore_index=-100),
      jnp.sum(jnp.where(keep, optax.softmax_cross_entropy_with_integer_labels(
          logits, jnp.where(keep, y2, 0)), 0.0)) / jnp.sum(keep), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_tied_embedding_weight_and_leading_axes(mode):
  """``w`` given as [V, d] (vocab_axis=0), ``x`` [batch, seq, d], no bias."""
  x, w, _, y = _inputs()
  x3, y3 = x[:36].reshape(4, 9, D), y[:36].reshape(4, 9)
  ours = lambda x, e: invact_jax.linear_cross_entropy(x, e, y3, vocab_axis=0, gradients=mode,  # noqa: E731
                                                      **TILES)
  plain = lambda x, e: invact_jax.linear_cross_entropy_reference(x, e.T, y3)  # noqa: E731
  v1, g1 = jax.value_and_grad(ours, argnums=(0, 1))(x3, w.T)
  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1))(x3, w.T)
  assert _rel(v1, v0) <= 2e-6
  assert all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0))
  per_token = invact_jax.linear_cross_entropy(x3, w.T, y3, vocab_axis=0, reduction="none")
  assert per_token.shape == (4, 9) and per_token.dtype == jnp.float32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_error_against_float64_no_worse_than_the_plain_heads(dtype, mode):
  x, w, b, y = _inputs(jnp.dtype(dtype), n=64, v=300)
  kw = {"label_smoothing": 0.1, "z_loss": 1e-3}
  _, g1 = _loss_and_grads(invact_jax.linear_cross_entropy, x, w, b, y, chunk_size=16,
                          vocab_chunk_size=64, gradients=mode, **kw)

  def plain(x, w, y, bias, **kw):  # what users write: bf16 logits, float32 loss
    logits = (x @ w + bias).astype(jnp.float32)
    return optax.softmax_cross_entropy(logits, optax.smooth_labels(
        jax.nn.one_hot(y, w.shape[1]), kw["label_smoothing"])).mean() + kw["z_loss"] * jnp.mean(
            jax.nn.logsumexp(logits, axis=-1) ** 2)
  _, g0 = _loss_and_grads(plain, x, w, b, y, **kw)
  with jax.enable_x64(True):
    args = [np.asarray(a, np.float64) for a in (x, w, b)]
    _, g64 = _loss_and_grads(invact_jax.linear_cross_entropy_reference, *args, y, **kw)
  for a, r, e in zip(g1, g0, g64):
    assert _rel(a, e) <= 1.1 * _rel(r, e) + 1e-7, (_rel(a, e), _rel(r, e))


@pytest.mark.parametrize("mode", MODES)
def test_nan_propagates_like_the_plain_loss(mode):
  """An out-of-range label under jit (not checkable there) makes the loss NaN, as the plain
  formula's pick does; a NaN input makes it NaN."""
  x, w, b, y = _inputs()
  bad = jnp.asarray(y).at[3].set(V + 5)
  f = jax.jit(lambda y: invact_jax.linear_cross_entropy(x, w, y, bias=b, gradients=mode,
                                                        **TILES))
  r = jax.jit(lambda y: invact_jax.linear_cross_entropy_reference(x, w, y, bias=b))
  assert np.isnan(f(bad)) and np.isnan(r(bad))
  per = jax.jit(lambda y: invact_jax.linear_cross_entropy(x, w, y, reduction="none"))(bad)
  assert np.isnan(per[3]) and np.isfinite(np.delete(np.asarray(per), 3)).all()
  assert np.isnan(invact_jax.linear_cross_entropy(x.at[0, 0].set(jnp.nan), w, y,
                                                 gradients=mode))


@pytest.mark.parametrize("kwargs, arg", [
    ({"w": jnp.ones((D + 1, V))}, "`w`"),
    ({"w": jnp.ones((D,))}, "`w`"),
    ({"labels": jnp.zeros((N,), jnp.float32)}, "`labels`"),
    ({"labels": jnp.zeros((N + 1,), jnp.int32)}, "`labels`"),
    ({"labels": jnp.full((N,), V, jnp.int32)}, "`labels`"),
    ({"labels": jnp.full((N,), -1, jnp.int32)}, "`labels`"),
    ({"bias": jnp.ones((V + 1,))}, "`bias`"),
    ({"reduction": "avg"}, "`reduction`"),
    ({"chunk_size": 0}, "`chunk_size`"),
    ({"vocab_chunk_size": -4}, "`vocab_chunk_size`"),
    ({"chunk_size": 2.5}, "`chunk_size`"),
    ({"label_smoothing": 1.0}, "`label_smoothing`"),
    ({"z_loss": -1.0}, "`z_loss`"),
    ({"logit_soft_cap": 0.0}, "`logit_soft_cap`"),
    ({"vocab_axis": 2}, "`vocab_axis`"),
    ({"ignore_index": 1.5}, "`ignore_index`"),
    ({"x": jnp.ones((N, D), jnp.int32)}, "`x`"),
    ({"implementation": "mosaic"}, "implementation"),
    ({"gradients": "fwd"}, "`gradients`"),
    ({"gradients": "forward", "reduction": "none"}, "`gradients`"),
])
def test_bad_input_is_one_line_naming_the_argument(kwargs, arg):
  x, w, b, y = _inputs()
  call = {"x": x, "w": w, "labels": y, **kwargs}
  with pytest.raises((ValueError, TypeError)) as e:
    invact_jax.linear_cross_entropy(call.pop("x"), call.pop("w"), call.pop("labels"), **call)
  assert arg in str(e.value) and "\n" not in str(e.value), e.value


def _hlo_shapes(fn, *args):
  text = jax.jit(fn).lower(*args).compile().as_text()
  return {tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]+)\]", text)}


@pytest.mark.parametrize("mode", MODES)
def test_no_tokens_by_vocabulary_buffer_in_the_compiled_program(mode):
  n, v = 512, 4096
  x, w, b, y = _inputs(n=n, v=v)
  grad = jax.grad(lambda x, w: invact_jax.linear_cross_entropy(
      x, w, y, chunk_size=64, vocab_chunk_size=512, gradients=mode), argnums=(0, 1))
  shapes = _hlo_shapes(grad, x, w)
  assert not any(n in s and v in s for s in shapes), sorted(s for s in shapes if v in s)
  plain = jax.grad(lambda x, w: invact_jax.linear_cross_entropy_reference(x, w, y),
                   argnums=(0, 1))
  assert any(n in s and v in s for s in _hlo_shapes(plain, x, w))  # the check can fail
  ours = invact_jax.memory.compiled(grad, x, w).temp
  assert ours <= 0.1 * invact_jax.memory.compiled(plain, x, w).temp


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrap", ["vmap", "scan", "remat", "shard_map", "sharded"])
def test_under_transformations(wrap, mode):
  x, w, b, y = _inputs(n=32)
  f = lambda x, w, y: invact_jax.linear_cross_entropy(x, w, y, bias=b, gradients=mode,  # noqa: E731
                                                      **TILES)
  r = lambda x, w, y: invact_jax.linear_cross_entropy_reference(x, w, y, bias=b)  # noqa: E731
  xs, ys = x.reshape(4, 8, D), y.reshape(4, 8)
  if wrap == "vmap":
    run = lambda g: lambda w: jnp.sum(jax.vmap(g, (0, None, 0))(xs, w, ys))  # noqa: E731
  elif wrap == "scan":
    run = lambda g: lambda w: jax.lax.scan(  # noqa: E731
        lambda c, a: (c + g(a[0], w, a[1]), None), 0.0, (xs, ys))[0]
  elif wrap == "remat":
    run = lambda g: lambda w: jax.checkpoint(g)(x, w, y)  # noqa: E731
  else:
    if len(jax.devices()) < 8:
      pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    mesh = jax.make_mesh((8,), ("data",))
    xd = jax.device_put(x, NamedSharding(mesh, P("data")))
    yd = jax.device_put(y, NamedSharding(mesh, P("data")))
    if wrap == "sharded":  # tokens sharded (an explicit mesh): computed where they are
      w = jax.device_put(w, NamedSharding(mesh, P()))
      run = lambda g: lambda w: g(xd, w, yd)  # noqa: E731
      with jax.sharding.set_mesh(mesh):
        text = jax.jit(jax.grad(run(f))).lower(w).compile().as_text()
        v1, g1 = jax.jit(jax.value_and_grad(run(f)))(w)
        v0, g0 = jax.jit(jax.value_and_grad(run(r)))(w)
      assert not re.search(r"all-gather[^\n]*f32\[32,16\]", text), "x was gathered"
      assert _rel(v1, v0) <= 2e-6 and _rel(g1, g0) <= 2e-6, (_rel(v1, v0), _rel(g1, g0))
      return
    else:
      def run(g):
        def inner(w):
          local = lambda x, w, y: jax.lax.pmean(g(x, w, y), "data")  # noqa: E731
          return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                               out_specs=P())(xd, w, yd)
        return inner
  v1, g1 = jax.jit(jax.value_and_grad(run(f)))(w)
  v0, g0 = jax.jit(jax.value_and_grad(run(r)))(w)
  assert _rel(v1, v0) <= 2e-6 and _rel(g1, g0) <= 2e-6, (_rel(v1, v0), _rel(g1, g0))


@pytest.mark.parametrize("mode", MODES)
def test_a_traced_temperature_of_the_logits(mode):
  """A traced scalar the logits are multiplied by (after the rounding, bias and constant
  scale, before the soft cap: what ``invert`` keeps of a learnable temperature): loss and the
  gradients of x, w, the bias, the weights and the temperature are the plain formula's, with
  every option; in bfloat16 with the logits rounded as the program rounds them, the loss is
  the program's."""
  from invact_jax.ops.cross_entropy import base, in_forward  # pylint: disable=import-outside-toplevel
  x, w, b, y = _inputs()
  y = y.at[::5].set(7)
  weights = jax.random.uniform(jax.random.key(4), (N,))
  opts = base.Options(1, "sum" if mode == "forward" else "none", 7, 0.1, 1e-3, 3.0, 8, 16,
                      mode, logit_scale=0.5)

  def ours(x, w, b, weights, t):
    if mode == "forward":
      return in_forward.weighted_sum(x, w, b, y, weights, opts, t)[0]
    return jnp.sum(weights * base.linear_cross_entropy(x, w, b, y, opts, t)[0])

  def plain(x, w, b, weights, t):
    z = 3.0 * jnp.tanh((x @ w + b) * 0.5 * t / 3.0)
    per = optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(y == 7, 0, y))
    per = (0.9 * per + 0.1 * (jax.nn.logsumexp(z, -1) - jnp.mean(z, -1))
           + 1e-3 * jax.nn.logsumexp(z, -1) ** 2)
    return jnp.sum(jnp.where(y == 7, 0.0, weights * per))
  t = jnp.float32(1.3)
  v1, g1 = jax.value_and_grad(ours, argnums=(0, 1, 2, 3, 4))(x, w, b, weights, t)
  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1, 2, 3, 4))(x, w, b, weights, t)
  assert _rel(v1, v0) <= 2e-6, (v1, v0)
  assert all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0)), [_rel(a, r) for a, r in zip(g1, g0)]
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  rounded = dataclasses.replace(opts, logits_dtype="bfloat16", logit_soft_cap=None, z_loss=0.0,
                                label_smoothing=0.0, logit_scale=1.0)
  per = optax.softmax_cross_entropy_with_integer_labels((xb @ wb).astype(jnp.float32) * t,
                                                        jnp.where(y == 7, 0, y))
  program = jnp.sum(jnp.where(y == 7, 0.0, weights * per))
  if mode == "forward":
    got = in_forward.weighted_sum(xb, wb, None, y, weights, rounded, t)[0]
  else:
    got = jnp.sum(weights * base.linear_cross_entropy(xb, wb, None, y, rounded, t)[0])
  assert _rel(got, program) <= 2e-6, (got, program)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_a_vocabulary_split_over_a_mesh_axis(vocab_axis, mode):
  """``vocab_axis_name`` inside ``shard_map`` (a tensor-parallel head, tokens split over
  "data", the vocabulary over "model"): loss, accuracy and the gradients of x, w and the bias
  are the plain formula's with every option, and the compiled program gathers no weight;
  with the log-sum-exp read too (``base.with_lse``) and outside a shard_map (one line)."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  x, w, b, y = _inputs(n=32)
  y = y.at[::7].set(5)
  w = w if vocab_axis == 1 else w.T
  kw = dict(ignore_index=5, label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=3.0,
            vocab_axis=vocab_axis)
  w_spec = P(None, "model") if vocab_axis == 1 else P("model", None)

  def split(x, w, b):
    def local(x, w, b, y):
      loss, correct = invact_jax.linear_cross_entropy(
          x, w, y, bias=b, reduction="sum", gradients=mode, vocab_axis_name="model",
          return_correct=True, chunk_size=4, vocab_chunk_size=8, **kw)
      return jax.lax.psum(loss, "data"), correct
    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), w_spec, P("model"), P("data")),
                         out_specs=(P(), P("data")))(x, w, b, y)

  def plain(x, w, b):
    return invact_jax.linear_cross_entropy_reference(x, w, y, bias=b, reduction="sum", **kw)
  (v1, correct), g1 = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2), has_aux=True))(
      x, w, b)
  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1, 2))(x, w, b)
  assert _rel(v1, v0) <= 2e-6 and all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0)), (
      _rel(v1, v0), [_rel(a, r) for a, r in zip(g1, g0)])
  z = (x @ w if vocab_axis == 1 else x @ w.T) + b
  np.testing.assert_array_equal(correct, (y != 5) & (jnp.argmax(z, -1) == y))
  text = jax.jit(jax.grad(lambda w: split(x, w, b)[0])).lower(w).compile().as_text()
  assert "all-gather" not in text, "a weight was gathered"
  if mode == "backward":  # the log-sum-exp read: its gradient through the shards too
    opts = base.Options(vocab_axis, "none", 5, 0.1, 1e-3, 3.0, 4, 8, vocab_axis_name="model")

    def with_lse(x, w, b):
      def local(x, w, b, y):
        loss, _, lse = base.with_lse(x, w, b, y, opts)
        return jax.lax.psum(jnp.sum(loss + 0.5 * lse ** 2), "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), w_spec, P("model"),
                                                       P("data")), out_specs=P())(x, w, b, y)

    def plain_lse(x, w, b):
      zc = 3.0 * jnp.tanh(((x @ w if vocab_axis == 1 else x @ w.T) + b) / 3.0)
      per = invact_jax.linear_cross_entropy_reference(x, w, y, bias=b, reduction="none", **kw)
      return jnp.sum(per + 0.5 * jax.nn.logsumexp(zc, -1) ** 2)
    g1 = jax.jit(jax.grad(with_lse, argnums=(0, 1, 2)))(x, w, b)
    g0 = jax.grad(plain_lse, argnums=(0, 1, 2))(x, w, b)
    assert all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0)), [_rel(a, r) for a, r in zip(g1, g0)]
  with pytest.raises(ValueError, match="argument `vocab_axis_name` must name axes of the "
                                       "enclosing shard_map"):
    invact_jax.linear_cross_entropy(x, w, y, vocab_axis=vocab_axis, vocab_axis_name="model")
  if (vocab_axis, mode) == (1, "backward"):  # what the docs say of it left out, under jit
    ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, w_spec))
    for tile, gathered in ((8, True), (V, False)):
      text = jax.jit(jax.grad(lambda w, tile=tile: invact_jax.linear_cross_entropy(
          x, w, y, gradients=mode, vocab_chunk_size=tile))).lower(ws).compile().as_text()
      assert ("all-gather" in text) == gathered, tile


@pytest.mark.parametrize("mode", MODES)
def test_return_correct_is_the_accuracys_numerator(mode):
  x, w, b, y = _inputs()
  y = y.at[:5].set(7)
  loss, correct = invact_jax.linear_cross_entropy(x, w, y, bias=b, ignore_index=7,
                                                  return_correct=True, gradients=mode, **TILES)
  logits = x @ w + b
  expect = (jnp.argmax(logits, -1) == y) & (y != 7)
  np.testing.assert_array_equal(np.asarray(correct), np.asarray(expect))
  assert correct.dtype == jnp.bool_ and correct.shape == y.shape
  assert float(loss) == float(invact_jax.linear_cross_entropy(x, w, y, bias=b, ignore_index=7,
                                                              gradients=mode, **TILES))


@pytest.mark.parametrize("mode", MODES)
def test_a_tie_with_an_earlier_class_is_not_correct(mode):
  """``correct`` is ``argmax == label`` with jnp.argmax's first index: a zero head (every logit
  tied) is correct for label 0 only, at any tiling and on a vocabulary split over devices."""
  x = jnp.ones((16, 8), jnp.float32)
  y = jnp.arange(16) % 5
  for w in (jnp.zeros((8, 24)), jnp.round(jax.random.normal(jax.random.key(3), (8, 24)))):
    expect = jnp.argmax(x @ w, -1) == y
    for tiles in ({}, {"chunk_size": 4, "vocab_chunk_size": 5}):
      _, correct = invact_jax.linear_cross_entropy(x, w, y, return_correct=True,
                                                   gradients=mode, **tiles)
      np.testing.assert_array_equal(np.asarray(correct), np.asarray(expect))
  mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  w = jax.device_put(jnp.zeros((8, 24)), jax.sharding.NamedSharding(mesh, P(None, "model")))
  split = jax.shard_map(lambda x, w, y: invact_jax.linear_cross_entropy(
      x, w, y, return_correct=True, gradients=mode, vocab_axis_name="model")[1],
      mesh=mesh, in_specs=(P(), P(None, "model"), P()), out_specs=P())
  np.testing.assert_array_equal(np.asarray(split(x, w, y)), np.asarray(y == 0))


def test_wide_labels_keep_their_meaning_in_int32():
  """With x64, an int64 label of 2**32 + 3 is no class 3 (a cast to int32 would wrap it
  there): it is outside the vocabulary, NaN as the plain formula's pick; one equal to an
  ignore_index beyond int32 is ignored; with int32 labels such an ignore_index matches none."""
  with jax.enable_x64(True):
    x = jnp.ones((4, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
    y = jnp.array([1, 2**32 + 3, 3, 2**40], jnp.int64)
    f = jax.jit(lambda y: invact_jax.linear_cross_entropy(x, w, y, reduction="none"))
    loss = np.asarray(f(y))
    assert np.isnan(loss[[1, 3]]).all() and np.isfinite(loss[[0, 2]]).all()
    ignored = jax.jit(lambda y: invact_jax.linear_cross_entropy(
        x, w, y, reduction="none", ignore_index=2**40))(y)
    assert float(ignored[3]) == 0.0 and math.isnan(float(ignored[1]))
    narrow = invact_jax.linear_cross_entropy(x, w, (y % 16).astype(jnp.int32),
                                             reduction="none", ignore_index=2**40)
    assert np.isfinite(np.asarray(narrow)).all() and (np.asarray(narrow) > 0).all()


def _kept(fn, *args):
  return [(tuple(r.shape), str(r.dtype)) for r in invact_jax.memory.residuals(fn, *args)
          if not r.is_argument and math.prod(r.shape) > 1]


def test_a_float32_weight_with_bfloat16_tokens_is_kept_as_it_is():
  """Cast one tile at a time: the recomputing backward keeps the weight (an argument), not a
  bfloat16 copy of it; only x, the labels and a float32 lse per token are kept.  With the
  gradients in the forward, the float32 gradients are kept (the weight's is its gradient)."""
  x, w, _, y = _inputs()
  xb = x.astype(jnp.bfloat16)
  kept = _kept(lambda x, w: invact_jax.linear_cross_entropy(x, w, y, gradients="backward",
                                                            **TILES), xb, w)
  assert kept == [((N,), "float32")], kept  # the lse
  kept = _kept(lambda x, w: invact_jax.linear_cross_entropy(x, w, y, **TILES), xb, w)
  assert sorted(kept) == [((D, V), "float32"), ((N, D), "float32")], kept
  g = jax.grad(lambda w: invact_jax.linear_cross_entropy(xb, w, y, **TILES))(w)
  assert g.dtype == jnp.float32


def _casts_of(jaxpr, shape) -> tuple[int, int]:
  """``(outside loops, inside them)``: how many ``convert_element_type`` s of an array of
  ``shape`` the jaxpr holds (a ``scan``'s or ``while``'s body counted as inside)."""
  outside = inside = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "convert_element_type" and tuple(e.invars[0].aval.shape) == shape:
      outside += 1
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      o, i = _casts_of(sub, shape)
      if e.primitive.name in ("scan", "while"):
        inside += o + i
      else:
        outside, inside = outside + o, inside + i
  return outside, inside


def test_gradients_in_the_forward_cast_a_float32_weight_once():
  """With the gradients in the forward, a float32 weight is cast to the activations' dtype
  once per call, before the loop over token chunks, not in every chunk (docs/profile.md:
  per chunk it was a pass over the whole table)."""
  x, w, _, y = _inputs()
  xb = x.astype(jnp.bfloat16)
  grad = jax.grad(lambda x, w: invact_jax.linear_cross_entropy(x, w, y, **TILES), argnums=(0, 1))
  assert N // TILES["chunk_size"] > 1  # (several chunks)
  assert _casts_of(jax.make_jaxpr(grad)(xb, w).jaxpr, (D, V)) == (1, 0)


def test_the_default_mode_is_forward_where_its_accumulator_is_the_gradient():
  """A scalar loss with a float32 weight: the gradients, not x and w, are kept; a 16-bit
  weight or per-token losses: x, w and the lse are (the backward recomputes the logits)."""
  x, w, b, y = _inputs()
  assert sorted(_kept(lambda x, w: invact_jax.linear_cross_entropy(x, w, y, **TILES), x, w)) \
      == [((D, V), "float32"), ((N, D), "float32")]
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  assert _kept(lambda x, w: invact_jax.linear_cross_entropy(x, w, y, **TILES), xb, wb) == [
      ((N,), "float32")]
  assert _kept(lambda x, w: jnp.sum(invact_jax.linear_cross_entropy(
      x, w, y, reduction="none", **TILES)), x, w) == [((N,), "float32")]


@pytest.mark.parametrize("platform, mode, expected", [
    ("cpu", "backward", (1024, 1024)), ("cpu", "forward", (32, 2048)),
    ("gpu", "backward", (8192, 4096)), ("gpu", "forward", (2048, 128256))])
def test_default_tiles_per_platform_from_the_sweeps(platform, mode, expected):
  """docs/lm-head.md's sweeps: on CPU small tiles; on the H100 (N = 8192, V = 128256) 8192 x
  4096 for the recomputing backward, 2048 tokens over the whole vocabulary for gradients in
  the forward; the token tile divides the tokens where a multiple of 8 does."""
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  assert base.default_tiles(8192, 128256, mode, platform) == expected
  assert base.default_tiles(6000, 128256, mode, "gpu")[0] == (2000 if mode == "forward"
                                                              else 6000)  # divides 6000
  assert base.default_tiles(100, 512, mode, platform) == (100, 512)  # a tile of them all


@pytest.mark.parametrize("argnums, kept", [((0,), [(N, D)]), ((1,), [(D, V)]),
                                           ((0, 1), [(D, V), (N, D)])])
def test_gradients_in_the_forward_only_for_the_differentiated_arguments(argnums, kept):
  """Only inputs with a tangent get a gradient computed (and kept) in the forward."""
  x, w, b, y = _inputs()
  f = lambda x, w: invact_jax.linear_cross_entropy(x, w, y, gradients="forward", **TILES)  # noqa: E731
  shapes = sorted(s for s, _ in _kept(lambda *a: f(*[
      a[argnums.index(i)] if i in argnums else (x, w)[i] for i in range(2)]),
      *[(x, w)[i] for i in argnums]))
  assert shapes == kept, shapes
  g = jax.grad(f, argnums=argnums)(x, w)
  g0 = jax.grad(lambda x, w: invact_jax.linear_cross_entropy_reference(x, w, y),
                argnums=argnums)(x, w)
  assert all(_rel(a, r) <= 2e-6 for a, r in zip(g, g0))


def test_gradients_in_the_forward_hold_one_chunk_of_logits():
  """The logits' gradient is computed in the logits' buffer: the compiled temp is less than
  two chunks of float32 logits (x, the weight and their gradients are arguments/outputs)."""
  n, d, v, c, cv = 1024, 32, 8192, 128, 512
  x, w, _, y = _inputs(n=n, v=v)
  x = jnp.tile(x[:, :1], (1, d))
  w = jnp.tile(w[:1], (d, 1))
  grad = jax.grad(lambda x, w: invact_jax.linear_cross_entropy(
      x, w, y, chunk_size=c, vocab_chunk_size=cv, gradients="forward"), argnums=(0, 1))
  temp = invact_jax.memory.compiled(grad, x, w).temp
  chunk = c * v * 4
  assert chunk <= temp < 2 * chunk, (temp, chunk)


def test_weighted_sum_differentiates_its_weights_too():
  """The forward mode's core: sum(weights * loss), the weights' gradient the per-token loss."""
  from invact_jax.ops.cross_entropy import base, in_forward  # pylint: disable=import-outside-toplevel
  x, w, b, y = _inputs()
  weights = jax.random.uniform(jax.random.key(3), (N,))
  opts = base.Options(1, "sum", 7, 0.1, 1e-3, 2.0, 8, 16, "forward")
  y = y.at[::4].set(7)

  def ours(x, w, b, weights):
    return in_forward.weighted_sum(x, w, b, y, weights, opts)[0]

  def plain(x, w, b, weights):
    per = invact_jax.linear_cross_entropy_reference(
        x, w, y, bias=b, reduction="none", ignore_index=7, label_smoothing=0.1, z_loss=1e-3,
        logit_soft_cap=2.0)
    return jnp.sum(weights * per)
  v1, g1 = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(x, w, b, weights)
  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1, 2, 3))(x, w, b, weights)
  assert _rel(v1, v0) <= 2e-6
  assert all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0)), [_rel(a, r) for a, r in zip(g1, g0)]


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("outside", [0.0, 0.1, 1.0])
def test_labels_outside_the_vocabulary_as_a_one_hot_of_them_reads_them(outside, mode):
  """``Options.outside_lse`` ``c`` (what ``invert`` keeps of a one-hot program): a token whose
  label lies outside [0, V) has loss ``c * lse - s * mean(z) + zl * lse**2`` and the gradient
  of it (its one-hot a row of zeros: optax's loss has ``c = s``, ``lse - sum(onehot * z)``
  ``c = 1``); and a token of weight zero adds nothing, NaN or not."""
  from invact_jax.ops.cross_entropy import base, in_forward  # pylint: disable=import-outside-toplevel
  x, w, b, y = _inputs()
  y = y.at[::3].set(-100).at[1::7].set(V + 3)
  s, zl = 0.1, 1e-3
  weights = jax.random.uniform(jax.random.key(3), (N,)).at[::5].set(0.0)
  opts = base.Options(1, "sum" if mode == "forward" else "none", None, s, zl, None, 8, 16, mode,
                      None, outside)

  def ours(x, w, b, weights):
    if mode == "forward":
      return in_forward.weighted_sum(x, w, b, y, weights, opts)[0]
    return jnp.sum(weights * base.linear_cross_entropy(x, w, b, y, opts)[0])

  def plain(x, w, b, weights):
    z = x @ w + b
    lse = jax.nn.logsumexp(z, -1)
    inside = (y >= 0) & (y < V)
    pick = jnp.sum(jax.nn.one_hot(y, V) * z, -1)
    per = (jnp.where(inside, lse, outside * lse) - (1.0 - s) * pick - s * jnp.mean(z, -1)
           + zl * lse ** 2)
    return jnp.sum(weights * per)
  v1, g1 = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(x, w, b, weights)
  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1, 2, 3))(x, w, b, weights)
  assert _rel(v1, v0) <= 2e-6, (v1, v0)
  assert all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0)), [_rel(a, r) for a, r in zip(g1, g0)]
  if mode == "forward":  # labels outside, picked by index (NaN), at weight zero: no NaN
    nan_opts = dataclasses.replace(opts, outside_lse=None)
    total = in_forward.weighted_sum(x, w, b, y, jnp.where((y >= 0) & (y < V), weights, 0.0),
                                    nan_opts)[0]
    assert math.isfinite(float(total))


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_the_log_sum_exp_as_an_output_with_its_gradient(vocab_axis):
  """``base.with_lse``: each token's log-sum-exp of its capped logits (ignored tokens' too),
  and the gradients of ``sum(u * loss + a * lse + c * lse ** 2)`` with every option, against
  JAX's autodiff of the plain formula (what ``invert`` gives a program that also reads the
  log-sum-exp: a z-loss reduced on its own, a metric)."""
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  x, w, b, y = _inputs()
  y = y.at[::4].set(7)
  w = w if vocab_axis == 1 else w.T
  s, zl, cap = 0.1, 1e-3, 2.0
  u, a, c = (jax.random.uniform(k, (N,)) for k in jax.random.split(jax.random.key(5), 3))
  opts = base.Options(vocab_axis, "none", 7, s, zl, cap, 8, 16)

  def ours(x, w, b):
    loss, _, lse = base.with_lse(x, w, b, y, opts)
    return jnp.sum(u * loss + a * lse + c * lse * lse), lse

  def plain(x, w, b):
    z = (x @ w if vocab_axis == 1 else x @ w.T) + b
    z = cap * jnp.tanh(z / cap)
    lse = jax.nn.logsumexp(z, -1)
    per = invact_jax.linear_cross_entropy_reference(
        x, w, y, bias=b, reduction="none", ignore_index=7, label_smoothing=s, z_loss=zl,
        logit_soft_cap=cap, vocab_axis=vocab_axis)
    return jnp.sum(u * per + a * lse + c * lse * lse), lse
  (v1, lse1), g1 = jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True)(x, w, b)
  (v0, lse0), g0 = jax.value_and_grad(plain, argnums=(0, 1, 2), has_aux=True)(x, w, b)
  assert _rel(v1, v0) <= 2e-6 and _rel(lse1, lse0) <= 2e-6, (v1, v0)
  assert all(_rel(p, r) <= 2e-6 for p, r in zip(g1, g0)), [_rel(p, r) for p, r in zip(g1, g0)]


@pytest.mark.parametrize("reduction, mode", [
    ("mean", "forward"), ("mean", "backward"), ("sum", "forward"), ("none", "backward")])
def test_no_tokens(reduction, mode):
  """Zero tokens: the plain formula's value (NaN mean, zero sum, no per-token losses) and zero
  gradients, not an error."""
  x, w, _, _ = _inputs()
  x0, y0 = x[:0], jnp.zeros((0,), jnp.int32)
  f = lambda x, w: jnp.sum(invact_jax.linear_cross_entropy(  # noqa: E731
      x, w, y0, reduction=reduction, gradients=mode))
  value, (gx, gw) = jax.value_and_grad(f, argnums=(0, 1))(x0, w)
  assert (np.isnan(value) if reduction == "mean" else value == 0.0), value
  assert gx.shape == (0, D) and not np.any(gw), gw


@pytest.mark.parametrize("mode", MODES)
def test_a_chunk_larger_than_the_tokens_is_clamped(mode):
  x, w, _, y = _inputs()
  temp = lambda c: invact_jax.memory.compiled(jax.grad(lambda x: invact_jax.linear_cross_entropy(  # noqa: E731
      x, w, y, chunk_size=c, gradients=mode)), x).temp
  assert temp(10**6) == temp(N)


def test_a_second_call_with_other_shapes():
  f = jax.jit(jax.value_and_grad(lambda x, w, y: invact_jax.linear_cross_entropy(x, w, y),
                                 argnums=(0, 1)))
  for n, v in ((N, V), (24, 70)):
    x, w, _, y = _inputs(n=n, v=v)
    (v1, g1), (v0, g0) = f(x, w, y), jax.value_and_grad(
        lambda x, w: invact_jax.linear_cross_entropy_reference(x, w, y), argnums=(0, 1))(x, w)
    assert _rel(v1, v0) <= 2e-6 and all(_rel(a, r) <= 2e-6 for a, r in zip(g1, g0))
