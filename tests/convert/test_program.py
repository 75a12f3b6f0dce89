"""invact_jax.invert: the program-level conversion (ops found by their computation)."""
import dataclasses
import functools
import math
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.ad_checkpoint import checkpoint_name

import invact_jax
from invact_jax import memory
from invact_jax.ops.activations import registry


def _x(shape=(4, 32), dtype=jnp.float32, seed=0):
  return (2.5 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _rel_l2(a, b):
  la = [np.asarray(t, np.float64) for t in jax.tree.leaves(a)]
  lb = [np.asarray(t, np.float64) for t in jax.tree.leaves(b)]
  return float(np.sqrt(sum(np.sum((p - q) ** 2) for p, q in zip(la, lb))
                       / sum(np.sum(q ** 2) for q in lb)))


def _f64(tree):
  """float64 copies (placed as the originals where they are sharded arrays)."""
  def one(a):
    a64 = np.asarray(a, np.float64)
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.device_put(a64, sharding)
    return a64
  return jax.tree.map(one, tree)


def assert_at_float32_floor(loss, args, g, argnums=0, hand_loss=None):
  """``g`` (the converted gradient) is as close to the float64 gradient as JAX's own gradient
  in the input precision is: within 2x that measured floor, plus the inverted backward's own
  error — the hand-converted loss's distance where given, else the activation tests' bound
  of 6.5 float32 ulps per element (~4e-7 relative)."""
  g_ref = jax.jit(jax.grad(loss, argnums=argnums))(*args)
  with jax.enable_x64(True):
    g64 = jax.jit(jax.grad(loss, argnums=argnums))(*_f64(args))
  floor = _rel_l2(g_ref, g64)
  own = 6.5 * 2.0 ** -24
  if hand_loss is not None:
    own = max(own, _rel_l2(jax.jit(jax.grad(hand_loss, argnums=argnums))(*args), g64))
  assert _rel_l2(g, g64) <= 2 * max(floor, own), (_rel_l2(g, g64), floor, own)


def _activation_cases():
  """(registry entry, selector/params) for every entry, with non-default parameters."""
  params = {"elu": {"alpha": 0.7}, "celu": {"alpha": 0.7}, "leaky_relu": {"negative_slope": 0.2}}
  return [(a.name, {**dict(a.selector), **params.get(a.name, {})})
          for a in registry.ACTIVATIONS.values()]


class ActivationTest(parameterized.TestCase):

  @parameterized.parameters(
      [(c, d, "partial") for c in _activation_cases() for d in ("float32", "bfloat16")]
      # How the function object is reached does not depend on the activation: two of them.
      + [(c, "float32", r) for c in _activation_cases()[:3:2] for r in ("dict", "field")])
  def test_found_whatever_object_computes_it(self, case, dtype, route):
    """Found through a partial, a dict entry or a dataclass field; the forward output is the
    original's bit for bit; the gradient is at the float32 floor and, for the XLA path, close
    to the hand-converted one (the same backward on the same stored output)."""
    name, kwargs = case
    a = registry.get(name)
    original = functools.partial(a.original, **kwargs)
    if route == "dict":
      table = {"act": original}
      act = lambda h: table["act"](h)  # noqa: E731
    elif route == "field":
      @dataclasses.dataclass
      class Layer:
        fn: object = original
      act = Layer().fn
    else:
      act = original
    mine = functools.partial(getattr(invact_jax, a.public), **kwargs)
    w = _x((32, 32), jnp.float32, 1) / 8

    def loss(w, x, act):
      return jnp.sum(jnp.sin(act(x @ w.astype(x.dtype)).astype(jnp.float32)))
    x = _x(dtype=jnp.dtype(dtype))
    inv = invact_jax.invert(functools.partial(loss, act=act))
    g = jax.jit(jax.grad(inv))(w, x)
    assert inv.last_report.replaced == {a.public: 1}, inv.last_report
    h = x @ w.astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(invact_jax.invert(act))(h)),
                                  np.asarray(jax.jit(act)(h)))
    assert_at_float32_floor(functools.partial(loss, act=original), (w, x), g)
    g_hand = jax.jit(jax.grad(functools.partial(loss, act=mine)))(w, x)
    assert _rel_l2(g, g_hand) <= (1e-5 if dtype == "float32" else 1e-2), _rel_l2(g, g_hand)

  def test_residuals_are_the_output_and_the_packed_bit(self):
    x = _x((8, 64))
    loss = lambda x: jnp.sum(jnp.sin(jax.nn.gelu(x)))  # noqa: E731
    saved = memory.residuals(invact_jax.invert(loss), x)
    kinds = sorted((tuple(r.shape), str(r.dtype)) for r in saved)
    assert kinds == sorted([((8, 64), "float32"), ((8, 64), "float32"),  # y, and cos(y) of sin
                            (invact_jax.packed_shape((8, 64)), "uint8")]), kinds

  def test_nan_and_inf_propagate_as_the_hand_converted_op(self):
    x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 0.0, -1.0, 3.0])
    for a in ("gelu", "silu", "softplus"):
      f = getattr(jax.nn, a)
      g = jax.grad(lambda x: jnp.sum(invact_jax.invert(f)(x)))(x)
      g_hand = jax.grad(lambda x: jnp.sum(getattr(invact_jax, a)(x)))(x)
      np.testing.assert_array_equal(np.asarray(g), np.asarray(g_hand))


# ------------------------------------------------------------------------------ norms
def _flax_norm(cls, **kw):
  m = cls(**kw)
  return lambda x, *p: m.apply({"params": dict(zip(("scale", "bias"), p))}, x)


def _llama(x, w, eps=1e-6, dtype=jnp.float32):  # transformers' FlaxLlamaRMSNorm
  v = jnp.power(jnp.asarray(x, jnp.float32), 2).mean(-1, keepdims=True)
  return w * jnp.asarray(x / jnp.sqrt(v + eps), dtype=dtype)


def _gemma(x, w):  # transformers' FlaxGemmaRMSNorm: the scale is 1 + weight
  v = jnp.power(jnp.asarray(x, jnp.float32), 2).mean(-1, keepdims=True)
  return (1 + w) * jnp.asarray(x / jnp.sqrt(v + 1e-6), dtype=jnp.float32)


def _jnp_ln(x, w, b):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * w + b


def _jnp_ln_f32(x, w, b):
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(xf.var(-1, keepdims=True) + 1e-5) * w + b
  return y.astype(x.dtype)


def _jnp_ln_fast(x, w, b):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(x * x, -1, keepdims=True) - mean * mean
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


def _jnp_rms(x, w):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _eqx_ln(x, w, b):
  eqx = pytest.importorskip("equinox")
  m = eqx.tree_at(lambda m: (m.weight, m.bias), eqx.nn.LayerNorm(x.shape[-1], eps=1e-5), (w, b))
  return jax.vmap(jax.vmap(m))(x)


NORMS = {
    "linen_layer_norm": (lambda: _flax_norm(nn.LayerNorm, epsilon=1e-5), 2, "layer_norm"),
    "linen_layer_norm_two_pass": (lambda: _flax_norm(nn.LayerNorm, use_fast_variance=False),
                                  2, "layer_norm"),
    "linen_layer_norm_bf16_out": (lambda: _flax_norm(nn.LayerNorm, dtype=jnp.bfloat16), 2,
                                  "layer_norm"),
    "linen_rms_norm": (lambda: _flax_norm(nn.RMSNorm, epsilon=1e-5), 1, "rms_norm"),
    "transformers_llama": (lambda: _llama, 1, "rms_norm"),
    "transformers_gemma": (lambda: _gemma, 1, "rms_norm"),
    "jnp_layer_norm": (lambda: _jnp_ln, 2, "layer_norm"),
    "jnp_layer_norm_f32_stats": (lambda: _jnp_ln_f32, 2, "layer_norm"),
    "jnp_layer_norm_fast_variance": (lambda: _jnp_ln_fast, 2, "layer_norm"),
    "jnp_rms_norm": (lambda: _jnp_rms, 1, "rms_norm"),
    "equinox_layer_norm": (lambda: _eqx_ln, 2, "layer_norm"),
}


class NormTest(parameterized.TestCase):

  @parameterized.product(norm=tuple(NORMS), dtype=("float32", "bfloat16"))
  def test_forward_identical_and_gradient_close(self, norm, dtype):
    make, n_params, public = NORMS[norm]
    f = make()
    x = (_x((2, 8, 64), seed=3) + 1.5).astype(jnp.dtype(dtype))
    params = [1 + 0.1 * _x((64,), seed=4 + i) for i in range(n_params)]

    def loss(x, params):
      return jnp.sum(jnp.sin(3 * f(x, *params).astype(jnp.float32)))
    inv = invact_jax.invert(loss)
    g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, params)
    assert inv.last_report.replaced == {public: 1}, inv.last_report
    _, g_ref = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)
    # The norm's output itself (a sum over it may be reduced in another order once fused).
    z = jax.jit(invact_jax.invert(f))(x, *params)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(jax.jit(f)(x, *params)))
    hand_loss = None
    if z.dtype == jnp.float32 and dtype == "float32":  # the bound (float32 storage)
      assert _rel_l2(g, g_ref) <= 1e-5, _rel_l2(g, g_ref)
    elif z.dtype != x.dtype:  # xhat is kept in the output dtype, as invact_jax's norm does
      def hand_loss(x, params):
        out = getattr(invact_jax, public)(x, *params, epsilon=1e-6, dtype=z.dtype)
        return jnp.sum(jnp.sin(3 * out.astype(jnp.float32)))
    assert_at_float32_floor(loss, (x, params), g, argnums=(0, 1), hand_loss=hand_loss)

  def test_residuals_are_xhat_and_row_stats(self):
    f = _flax_norm(nn.LayerNorm)
    x, s, b = _x((16, 64)), jnp.ones(64), jnp.zeros(64)
    loss = lambda x, s, b: jnp.sum(jnp.sin(f(x, s, b)))  # noqa: E731
    saved = memory.residuals(invact_jax.invert(loss), x, s, b)
    shapes = sorted(tuple(r.shape) for r in saved if r.shape != (64,))  # minus scale, bias
    # xhat, the rows' rstd, and sin's cos(z); never x itself nor the centered copy
    assert shapes == [(16, 1), (16, 64), (16, 64)], shapes


# ----------------------------------------------------------------------------- softmax
class SoftmaxTest(parameterized.TestCase):

  @parameterized.parameters("jax", "hand", "hand_no_stop")
  def test_softmax_forms(self, form):
    def hand(x, stop=True):
      m = jnp.max(x, -1, keepdims=True)
      e = jnp.exp(x - (jax.lax.stop_gradient(m) if stop else m))
      return e / jnp.sum(e, -1, keepdims=True)
    f = {"jax": jax.nn.softmax, "hand": hand,
         "hand_no_stop": functools.partial(hand, stop=False)}[form]
    x = _x((4, 8, 16))
    loss = lambda x: jnp.sum(jnp.sin(3 * f(x)))  # noqa: E731
    inv = invact_jax.invert(loss)
    y, g = jax.value_and_grad(inv)(x)
    assert inv.last_report.replaced == {"softmax": 1}
    y_ref, g_ref = jax.value_and_grad(loss)(x)
    assert y == y_ref
    assert _rel_l2(g, g_ref) <= 1e-6


# ------------------------------------------------------------------ nested programs
def _block(h, w):
  h = nn.LayerNorm().apply({"params": {"scale": w[0], "bias": w[1]}}, h)
  return jax.nn.gelu(h @ w[2:].T[:, : h.shape[-1]])


class NestedTest(parameterized.TestCase):

  def _check(self, loss, args, expected):
    inv = invact_jax.invert(loss)
    y, g = jax.jit(jax.value_and_grad(inv))(*args)
    assert inv.last_report.replaced == expected, inv.last_report
    y_ref, g_ref = jax.jit(jax.value_and_grad(loss))(*args)
    assert y == y_ref
    assert_at_float32_floor(loss, args, g)
    return inv

  def test_scan_over_layers(self):
    ws = 1 + 0.1 * _x((3, 34, 32))
    def loss(ws, x):
      h, _ = jax.lax.scan(lambda h, w: (_block(h, w), None), x, ws)
      return jnp.sum(jnp.sin(h))
    self._check(loss, (ws, _x((4, 32))), {"layer_norm": 1, "gelu": 1})

  def test_checkpoint_keeps_its_policy(self):
    ws = 1 + 0.1 * _x((34, 32))
    policy = jax.checkpoint_policies.save_only_these_names("kept")
    def loss(ws, x):
      def body(h):
        return checkpoint_name(_block(h, ws), "kept")
      return jnp.sum(jnp.sin(jax.checkpoint(body, policy=policy)(x)))
    # (256 rows: at 16-64 converting this body raises its compiled temp and it is left
    # alone, test_a_checkpoint_body_that_converting_does_not_lower_is_left_as_written)
    inv = self._check(loss, (ws, _x((256, 32))), {"layer_norm": 1, "gelu": 1})
    # The policy still decides: only the named output is saved from inside the checkpoint.
    saved = memory.residuals(inv, ws, _x((256, 32)))
    assert any("kept" in str(r) for r in saved) or len(saved) <= 3, saved

  def test_a_checkpoint_body_that_converting_does_not_lower_is_left_as_written(self):
    """Converting a jax.checkpoint body only where its gradient compiles to less temp: at 64
    rows this one compiles to more converted (the residual read apart adds its copy), so it
    runs as written, the report naming both figures, and the temp is the original's."""
    ws = 1 + 0.1 * _x((34, 32))
    policy = jax.checkpoint_policies.save_only_these_names("kept")

    def loss(ws, x):
      return jnp.sum(jnp.sin(jax.checkpoint(
          lambda h: checkpoint_name(_block(h, ws), "kept"), policy=policy)(x)))
    x = _x((64, 32))
    inv = self._check(loss, (ws, x), {})
    whys = {y for _, _, y in inv.last_report.left_alone}
    assert [w for w, _, _ in inv.last_report.left_alone] == ["layer_norm", "gelu"], whys
    (why,) = whys
    assert re.search(r"inside jax.checkpoint .* raises its gradient's compiled temp \(([\d,]+) vs "
                     r"([\d,]+) bytes per call\); left as written", why), why
    temp = lambda f: memory.compiled(jax.jit(jax.grad(f)), ws, x).temp  # noqa: E731
    assert temp(inv) == temp(loss)

  def test_cond_branches(self):
    def loss(x, p):
      return jnp.sum(jax.lax.cond(p > 0, jax.nn.silu, jax.nn.gelu, x) ** 2)
    self._check(lambda x: loss(x, 1.0), (_x(),), {"silu": 1, "gelu": 1})

  def test_vmap_and_jit_inside(self):
    f = jax.jit(jax.vmap(lambda r: jax.nn.mish(r) * 2))
    self._check(lambda x: jnp.sum(f(x) ** 2), (_x(),), {"mish": 1})


@pytest.mark.parametrize("policy", ["dots", "dots_no_batch"])
def test_invert_never_raises_the_temp_of_a_scan_of_checkpointed_layers(policy):
  """Decoder layers under ``jax.checkpoint`` with JAX's dots policies in a ``lax.scan``: on JAX
  0.10 each body alone compiles to less temp converted, but the scan of them to more (+1.6 %
  / +5 % on XLA:CPU: XLA schedules the loop's backward differently).  The whole program is
  compiled both ways and the bodies left as written, with the reason: the temp is the
  policy's, never above it (on 0.12 each body's own check leaves them)."""
  B, T, D, F, H, L = 2, 64, 128, 512, 4, 3  # pylint: disable=invalid-name

  def ln(x, g, b):
    m, v = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g + b

  def layer(x, p):
    h = ln(x, p["g1"], p["b1"])
    q, k, v = (a.reshape(B, T, H, D // H) for a in jnp.split(h @ p["wqkv"], 3, -1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // H)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, D)
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(ln(x, p["g2"], p["b2"]) @ p["w1"]) @ p["w2"]
  saveable = {"dots": jax.checkpoint_policies.checkpoint_dots,
              "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]

  def loss(p, x):
    y, _ = jax.lax.scan(jax.checkpoint(lambda x, p: (layer(x, p), None), policy=saveable), x, p)
    return jnp.mean(y ** 2)
  shapes = {"wqkv": (D, 3 * D), "wo": (D, D), "w1": (D, F), "w2": (F, D)}
  p = {k: 0.02 * _x((L, *s)) for k, s in shapes.items()}
  p.update({k: jnp.ones((L, D)) for k in ("g1", "g2")}, **{k: jnp.zeros((L, D)) for k in ("b1", "b2")})
  x = _x((B, T, D))
  inv = invact_jax.invert(loss)
  temp = lambda f: memory.compiled(jax.grad(f), p, x).temp  # noqa: E731
  assert temp(inv) <= temp(loss)
  whys = {why for _, _, why in inv.last_report.left_alone}
  # (left as written by the whole program's check on JAX 0.10, by each body's on 0.12)
  assert inv.last_report.replaced or any("inside jax.checkpoint its policy decides" in w
                                         for w in whys), inv.last_report


def test_a_checkpoint_body_is_measured_once_for_every_trace(monkeypatch):
  """A program traced again (a training step and an evaluation of the same loss, another
  ``invert`` of it) reuses the body's two compiled figures: the same decision, no compile."""
  from invact_jax.convert import _fallback, _pass  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(_pass, "_MEASURED", {})
  ws = 1 + 0.1 * _x((34, 32))
  policy = jax.checkpoint_policies.save_only_these_names("kept")

  def loss(ws, x):
    return jnp.sum(jnp.sin(jax.checkpoint(
        lambda h: checkpoint_name(_block(h, ws), "kept"), policy=policy)(x)))
  measured, real = [], _fallback._compiled_temp  # pylint: disable=protected-access
  monkeypatch.setattr(_fallback, "_compiled_temp",  # (the first figures; the exact ones of a
                      lambda lowered, exact: measured.append(exact) or real(lowered, exact))
  reports = []
  for rows in (64, 64, 256):
    inv = invact_jax.invert(loss)
    jax.make_jaxpr(jax.grad(inv))(ws, _x((rows, 32)))
    reports.append((inv.last_report.replaced, inv.last_report.left_alone))
  assert measured.count(False) == 4  # 64 rows once, 256 rows once
  assert reports[0] == reports[1] and reports[0][0] == {} and reports[2][1] == []


def test_a_checkpoint_bodys_close_figures_are_measured_again_exactly(monkeypatch):
  """Two figures closer than what the measuring compile's can be above the default
  compile's (``memory.analysis_excess``) are measured again at the default's emitters; the
  decision is the one those give."""
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  from invact_jax.convert import _fallback, _pass  # pylint: disable=import-outside-toplevel
  ws = 1 + 0.1 * _x((34, 32))

  def loss(ws, x):
    return jnp.sum(jnp.sin(jax.checkpoint(lambda h: _block(h, ws))(x)))
  measured, real = [], _fallback._compiled_temp  # pylint: disable=protected-access
  monkeypatch.setattr(_fallback, "_compiled_temp",
                      lambda lowered, exact: measured.append(exact) or real(lowered, exact))
  reports = []
  for excess in (0, 1 << 40):
    monkeypatch.setattr(_pass, "_MEASURED", {})
    monkeypatch.setattr(memory, "analysis_excess", lambda temp, e=excess: e)
    inv = invact_jax.invert(loss)
    jax.make_jaxpr(jax.grad(inv))(ws, _x((64, 32)))
    reports.append(inv.last_report.replaced)
  assert measured == [False, False, False, False, True, True]
  assert reports[0] == reports[1]


# ------------------------------------------------------------------- left alone
def test_a_match_whose_intermediate_is_used_elsewhere_is_left_alone_and_said():
  def loss(x):
    s = jax.nn.sigmoid(x)
    return jnp.sum(x * s + s)          # SiLU's sigmoid is also used outside it
  inv = invact_jax.invert(loss)
  g = jax.grad(inv)(_x())
  np.testing.assert_allclose(g, jax.grad(loss)(_x()), rtol=1e-5)
  assert inv.last_report.replaced == {"sigmoid": 1}
  assert any("jax.nn.silu" == w and "also used elsewhere" in y
             for w, _, y in inv.last_report.left_alone), inv.last_report


def test_custom_vjp_bodies_are_not_entered_and_said():
  @jax.custom_vjp
  def mine(x):
    return jnp.tanh(x)
  mine.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g / jnp.cosh(x) ** 2,))
  inv = invact_jax.invert(lambda x: jnp.sum(mine(x)))
  g = jax.grad(inv)(_x())
  np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(mine(x)))(_x()), rtol=1e-5)
  assert inv.last_report.replaced == {}
  assert any("not entered" in y for _, _, y in inv.last_report.left_alone)
  assert "left alone" in str(inv.last_report)


def test_report_is_per_conversion_and_options_are_checked():
  inv = invact_jax.invert(lambda x: jnp.sum(jax.nn.gelu(x) + jax.nn.softmax(x)))
  for _ in range(2):
    jax.jit(inv)(_x())
    assert inv.last_report.replaced == {"gelu": 1, "softmax": 1}
  only = invact_jax.invert(lambda x: jnp.sum(jax.nn.gelu(x) + jax.nn.softmax(x)), only="softmax")
  only(_x())
  assert only.last_report.replaced == {"softmax": 1}
  with pytest.raises(ValueError, match="argument `only`"):
    invact_jax.invert(jnp.sum, only=("gelu", "nope"))
  with pytest.raises(ValueError, match="argument `implementation`"):
    invact_jax.invert(jnp.sum, implementation="cuda")


def test_static_arguments_and_pytrees_pass_through():
  def loss(params, x, *, train: bool):
    h = jax.nn.relu(x @ params["w"])
    return jnp.sum(h if train else -h)
  params = {"w": _x((32, 8))}
  inv = invact_jax.invert(loss)
  g = jax.grad(inv)(params, _x(), train=False)
  chex.assert_trees_all_close(g, jax.grad(loss)(params, _x(), train=False))
  assert inv.last_report.replaced == {"relu": 1}


def test_sharded_inputs_on_a_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  mesh = jax.make_mesh((8,), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jax.device_put(_x((16, 32)), sharding)
  w = _x((32, 32), seed=2) / 8
  loss = lambda w, x: jnp.sum(jnp.sin(3 * nn.LayerNorm().apply(  # noqa: E731
      {"params": {"scale": jnp.ones(32), "bias": jnp.zeros(32)}}, jax.nn.gelu(x @ w))))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv, argnums=1))(w, x)
  assert g.sharding.is_equivalent_to(sharding, 2)
  assert _rel_l2(g, jax.jit(jax.grad(loss, argnums=1))(w, x)) <= 1e-5
  assert inv.last_report.replaced == {"gelu": 1, "layer_norm": 1}


def test_kernel_backward_through_invert():
  """implementation="pallas": the matched ops' backward runs the Pallas kernels (interpreted
  on CPU) and agrees with the XLA path's."""
  w = _x((32, 32), seed=2) / 8

  def loss(w, x):
    h = nn.LayerNorm().apply({"params": {"scale": 1 + w[0], "bias": w[1]}}, x @ w)
    return jnp.sum(jnp.sin(jax.nn.gelu(h)))
  inv = invact_jax.invert(loss, implementation="pallas")
  g = jax.jit(jax.grad(inv))(w, _x())
  assert inv.last_report.replaced == {"gelu": 1, "layer_norm": 1}
  g_xla = jax.jit(jax.grad(invact_jax.invert(loss)))(w, _x())
  assert _rel_l2(g, g_xla) <= 1e-6, _rel_l2(g, g_xla)
  assert str(jax.make_jaxpr(jax.grad(inv))(w, _x())).count("pallas_call") == 2  # GELU, norm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quick_gelu_is_a_scaled_silu(dtype):
  """transformers' quick_gelu, x * sigmoid(1.702 x): one op keeping y and a bit."""
  def quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)
  w = _x((32, 32), seed=2) / 8
  loss = lambda w, x: jnp.sum(jnp.sin(quick_gelu(x @ w.astype(x.dtype)).astype(jnp.float32)))  # noqa: E731
  x = _x(dtype=jnp.dtype(dtype))
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(w, x)
  assert inv.last_report.forms == {"x * sigmoid(c * x) (quick_gelu)": 1}, inv.last_report
  h = x @ w.astype(x.dtype)
  np.testing.assert_array_equal(np.asarray(jax.jit(invact_jax.invert(quick_gelu))(h)),
                                np.asarray(jax.jit(quick_gelu)(h)))
  assert_at_float32_floor(loss, (w, x), g)
  saved = memory.residuals(invact_jax.invert(lambda h: jnp.sum(jnp.sin(quick_gelu(h)))), h)
  assert sorted(str(r.dtype) for r in saved) == sorted([dtype, dtype, "uint8"]), saved


_C = math.sqrt(2.0 / math.pi)
_HAND_GELUS = {  # GPT-2's tanh GELU as ports of it write it
    "half_first": lambda x: 0.5 * x * (1.0 + jnp.tanh(_C * (x + 0.044715 * x ** 3))),
    "x_first": lambda x: x * 0.5 * (1.0 + jnp.tanh(_C * (x + 0.044715 * x ** 3))),
    "products": lambda x: 0.5 * x * (1.0 + jnp.tanh(_C * (x + 0.044715 * x * x * x))),
    "power": lambda x: 0.5 * x * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * jnp.power(x, 3)))),
}


@pytest.mark.parametrize("spelling", sorted(_HAND_GELUS))
def test_a_tanh_gelu_written_by_hand_is_a_gelu(spelling):
  """nanoGPT's / transformers' ``gelu_new``: one GELU keeping y and a bit (before: only its
  tanh was converted), forward bit-identical, gradients at the float32 floor."""
  gelu = _HAND_GELUS[spelling]
  w = _x((32, 32), seed=2) / 8
  loss = lambda w, x: jnp.sum(jnp.sin(gelu(x @ w)))  # noqa: E731
  x = _x()
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(w, x)
  assert inv.last_report.replaced == {"gelu": 1}, inv.last_report
  assert jax.jit(inv)(w, x) == jax.jit(loss)(w, x)
  assert_at_float32_floor(loss, (w, x), g, hand_loss=lambda w, x: jnp.sum(jnp.sin(
      invact_jax.gelu(x @ w, approximate=True))))
  saved = memory.residuals(invact_jax.invert(lambda h: jnp.sum(jnp.sin(gelu(h)))), x)
  assert sorted(str(r.dtype) for r in saved) == ["float32", "float32", "uint8"], saved


def test_softmax_as_exp_of_x_minus_logsumexp():
  """``exp(x - logsumexp(x))`` is a softmax (``jax.nn.logsumexp``'s unused ``sign`` does not
  count as another use of its sum): keeps the probabilities alone."""
  w = _x((32, 32), seed=2) / 8
  soft = lambda s: jnp.exp(s - jax.nn.logsumexp(s, -1, keepdims=True))  # noqa: E731
  loss = lambda w, x: jnp.sum(jnp.sin(soft(x @ w) @ w))  # noqa: E731
  x = _x()
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(w, x)
  assert inv.last_report.forms == {"softmax as exp(x - logsumexp(x))": 1}, inv.last_report
  assert jax.jit(inv)(w, x) == jax.jit(loss)(w, x)
  assert_at_float32_floor(loss, (w, x), g)
  single = lambda h: jnp.sum(jnp.sin(soft(h)))  # noqa: E731
  saved = memory.residuals(invact_jax.invert(single), x)
  assert [r.shape for r in saved] == [x.shape, x.shape], saved  # the probabilities, sin's cos
  assert sum(r.bytes for r in saved) < sum(r.bytes for r in memory.residuals(single, x))


def test_shard_map_bodies_are_converted():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((8,), ("data",))
  x = jax.device_put(_x((16, 32)), jax.sharding.NamedSharding(mesh, P("data")))
  w = _x((32, 32), seed=2) / 8

  def make(norm, act):
    def loss(w, x):
      def local(w, x):
        h = norm(x @ w, 1 + w[0], w[1])
        return jax.lax.psum(jnp.sum(jnp.sin(act(h))), "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)
    return loss
  loss = make(lambda h, s, b: nn.LayerNorm().apply({"params": {"scale": s, "bias": b}}, h),
              jax.nn.gelu)
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv))(w, x)
  assert inv.last_report.replaced == {"gelu": 1, "layer_norm": 1}, inv.last_report
  assert jax.jit(inv)(w, x) == jax.jit(loss)(w, x)
  # The scale/bias gradients are summed over the shards (the transpose of their pvary).
  assert_at_float32_floor(loss, (w, x), g, hand_loss=make(invact_jax.layer_norm, invact_jax.gelu))


def test_a_norm_ending_in_a_cast_keeps_xhat_in_the_cast_dtype():
  """Flax's LayerNorm(dtype=bfloat16) with float32 parameters computes in float32 and casts at
  the end: the match ends at the cast (latest output first), so xhat is kept in bfloat16."""
  f = _flax_norm(nn.LayerNorm, dtype=jnp.bfloat16)
  x, s, b = _x((16, 64), jnp.bfloat16), jnp.ones(64), jnp.zeros(64)
  c = _x((16, 64), seed=5)
  loss = lambda x, s, b: jnp.sum(f(x, s, b).astype(jnp.float32) * c)  # noqa: E731
  inv = invact_jax.invert(loss)
  saved = memory.residuals(inv, x, s, b)
  big = sorted(str(r.dtype) for r in saved if tuple(r.shape) == (16, 64))
  assert big == ["bfloat16"], saved


def test_non_array_outputs_pass_through_unchanged():
  """has_aux with a string, a Python number or None: returned as the function returned them
  (before: a TypeError from tracing, or a Python int turned into an int32 array)."""
  def f(x):
    return jnp.sum(jax.nn.gelu(x)), ("step", 3, None, 2.5)
  inv = invact_jax.invert(f)
  x = jnp.linspace(-2.0, 2.0, 8)
  (v, aux), g = jax.value_and_grad(inv, has_aux=True)(x)
  (v_ref, aux_ref), _ = jax.value_and_grad(f, has_aux=True)(x)
  assert aux == aux_ref and type(aux[1]) is int and type(aux[3]) is float
  assert inv.last_report.replaced == {"gelu": 1}
  np.testing.assert_array_equal(np.asarray(v), np.asarray(v_ref))
  assert_at_float32_floor(lambda x: f(x)[0], (x,), g,
                          hand_loss=lambda x: jnp.sum(invact_jax.gelu(x)))
  assert invact_jax.invert(lambda x: 3)(x) == 3
  assert invact_jax.invert(lambda x: None)(x) is None


def _dropout_mlp(ws, x, key):
  """The README's XLA:CPU regression: unrolled exact-GELU layers with dropout after the
  activation compile to more temp once the activations are inverted."""
  h = x
  for i, w in enumerate(ws):
    h = jax.nn.gelu(h @ w, approximate=False)
    h = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape), h / 0.9, 0.0)
  return jnp.sum(h ** 2)


def test_fallback_temp_keeps_the_gradient_temp_at_most_the_original():
  ws = [jnp.full((128, 128), 0.01, jnp.float32) for _ in range(3)]
  args = (ws, jnp.ones((256, 128), jnp.float32), jax.random.key(0))

  def temp(f):
    return memory.compiled(jax.grad(f), *args).temp
  inv = invact_jax.invert(_dropout_mlp, fallback="temp")
  grad = jax.jit(jax.grad(inv))(*args)
  chex.assert_trees_all_close(grad, jax.grad(_dropout_mlp)(*args), rtol=1e-5, atol=1e-8)
  assert temp(inv) <= temp(_dropout_mlp)
  fell_back = [w for w, _, why in inv.last_report.left_alone + inv.last_report.recomputed
               if "fallback='temp'" in why]
  if temp(invact_jax.invert(_dropout_mlp)) > temp(_dropout_mlp):
    # the regression exists here: some site was recomputed from its input or left alone
    assert fell_back, inv.last_report
  else:
    assert not fell_back and inv.last_report.replaced == {"gelu": 3}, inv.last_report
  assert jax.jit(inv)(*args) == jax.jit(_dropout_mlp)(*args)


def _exact_gelu_mlp(layers, x):
  """LayerNorm -> Dense -> exact GELU -> Dense blocks (keras-hub ViT's MLP, written by hand):
  on XLA:CPU inverting the GELU compiles to more temp (its erf pieces stay live)."""
  for g, b, w1, b1, w2 in layers:
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    h = (x - m) * jax.lax.rsqrt(v + 1e-6) * g + b
    x = x + jax.nn.gelu(h @ w1 + b1, approximate=False) @ w2
  return jnp.sum(x ** 2)


def test_an_exact_gelu_mlp_inverted_compiles_to_less_temp_with_and_without_the_fallback():
  """XLA:CPU fused the exact GELU's last multiply into the inverted backward and kept its
  erfc pieces (above the original's temp; the fallback then recomputed the GELU from its
  input); with the residuals read apart (_common.read_apart) inverting alone is below."""
  k = iter(jax.random.split(jax.random.key(0), 8))
  d, f = 64, 256
  layers = [(jnp.ones(d), jnp.zeros(d), 0.1 * jax.random.normal(next(k), (d, f)), jnp.zeros(f),
             0.1 * jax.random.normal(next(k), (f, d))) for _ in range(2)]
  x = jax.random.normal(next(k), (4, 61, d))
  inv = invact_jax.invert(_exact_gelu_mlp, fallback="temp")

  def kept(f):
    return sum(r.bytes for r in memory.residuals(f, layers, x) if not r.is_argument)
  def temp(f):
    return memory.compiled(jax.grad(f), layers, x).temp
  original = temp(_exact_gelu_mlp)
  # measured: 49 % (JAX 0.10), 61 % (JAX 0.12, whose original compiles to 20 % less)
  assert temp(invact_jax.invert(_exact_gelu_mlp)) < 0.7 * original
  assert temp(inv) <= original
  report = inv.last_report
  assert not report.recomputed and not report.left_alone, report
  # each GELU keeps one activation (its input, or its output once inverted) and the norms
  # their xhat: at most 60 % of what autodiff keeps unconverted
  assert kept(inv) <= 0.6 * kept(_exact_gelu_mlp)
  assert jax.jit(inv)(layers, x) == jax.jit(_exact_gelu_mlp)(layers, x)
  # recomputing is autodiff of the same equations: the error is at most the inverted one's
  assert_at_float32_floor(_exact_gelu_mlp, (layers, x), jax.jit(jax.grad(inv))(layers, x),
                          hand_loss=invact_jax.invert(_exact_gelu_mlp))


def test_fallback_recomputes_then_leaves_alone_until_the_temp_is_not_above(monkeypatch):
  """Each site's alternative (an activation recomputed from its input) is measured alone and
  taken in that order; if that is not enough the recomputed ones are left alone in the same
  order; at worst the floor pass goes too (the program as it is)."""
  from invact_jax.convert import _fallback
  # what inverting / recomputing each site adds to an original temp of 100 MiB (left alone:
  # 0); the calls logged are the first measurements (a tie is measured again, exactly)
  invert_cost, recompute_cost, floor_cost = {0: 5, 1: 30, 2: -10}, {0: 2, 1: 8, 2: 0}, [0]
  calls = []

  def fake_temp(closed, graph, structs, positions, opts, exact=False):
    if opts is None:
      calls.extend([] if exact else [None])
      return 100 << 20
    calls.extend([] if exact else [(opts.skip, opts.recompute, opts.floor)])
    opts.recomputable = [True] * 3
    return (100 + floor_cost[0] * opts.floor + sum(
        0 if i in opts.skip else recompute_cost[i] if i in opts.recompute else invert_cost[i]
        for i in range(3))) << 20
  monkeypatch.setattr(_fallback, "gradient_temp", fake_temp)

  def f(w, x):
    return jnp.sum(jax.nn.gelu(jax.nn.gelu(jax.nn.gelu(x @ w) @ w) @ w))
  none = frozenset()

  def run():
    inv = invact_jax.invert(f, fallback="temp")
    inv(jnp.ones((8, 8)), jnp.ones((4, 8)))
    return inv, calls[2:]
  inv, measured = run()
  # 125 in all; recomputed alone: site 0 122, site 1 103, site 2 135 -> 1 (103), then 0 (100)
  assert measured == [(none, frozenset({i}), True) for i in range(3)] + [
      (none, frozenset({1}), True), (none, frozenset({0, 1}), True)]
  assert inv.last_report.replaced == {"gelu": 1} and len(inv.last_report.recomputed) == 2
  assert "recomputed from its input: gelu x2" in str(inv.last_report)
  n = len(calls)
  inv(jnp.ones((8, 8)), jnp.ones((4, 8)))  # the same signature: decided once
  assert len(calls) == n
  calls.clear()
  invert_cost.update({0: 10, 1: 12, 2: 5})  # 127; recomputing never helps: left alone
  recompute_cost.update({0: 11, 1: 13, 2: 6})
  inv, measured = run()
  assert measured[-3:] == [(frozenset({0}), frozenset({1, 2}), True),
                           (frozenset({0, 1}), frozenset({2}), True),
                           (frozenset({0, 1, 2}), none, True)]
  assert inv.last_report.replaced == {} and not inv.last_report.recomputed
  assert len(inv.last_report.left_alone) == 3
  calls.clear()
  floor_cost[0] = 1  # even with every site left alone the floor pass is above: it goes too
  inv, measured = run()
  assert measured[-1] == (frozenset({0, 1, 2}), none, True)
  assert inv.last_report.replaced == {}
  assert [w for w, _, _ in inv.last_report.left_alone] == ["floor pass"] + ["gelu"] * 3


def test_a_recomputed_activation_inside_scan_keeps_its_input(monkeypatch):
  """The recomputed variant inside a scan body (and under vmap): the activation keeps its
  input, not its output and bits, and the gradient is autodiff's."""
  from invact_jax.convert import _fallback

  def fake_temp(closed, graph, structs, positions, opts, exact=False):
    if opts is None:
      return 100
    opts.recomputable = [True]
    return 100 + (0 if opts.recompute else 1)
  monkeypatch.setattr(_fallback, "gradient_temp", fake_temp)

  def f(ws, x):
    def body(h, w):
      return jnp.sin(jax.nn.gelu(h @ w, approximate=False)), None
    return jnp.sum(jax.lax.scan(body, x, ws)[0])
  ws, x = 0.3 * jnp.ones((3, 8, 8)), jnp.linspace(-2.0, 2.0, 32).reshape(4, 8)
  inv = invact_jax.invert(f, fallback="temp")
  chex.assert_trees_all_close(jax.jit(jax.grad(inv))(ws, x), jax.grad(f)(ws, x), rtol=1e-6)
  assert inv.last_report.replaced == {} and len(inv.last_report.recomputed) == 1
  # per step: the layer's input (for the matmul), the GELU's input (recomputed from it: not
  # erfc's and exp's outputs as autodiff keeps), the sine's input; no packed bits
  shapes = [r.shape for r in memory.residuals(inv, ws, x) if not r.is_argument]
  assert sorted(shapes) == [(3, 4, 8)] * 3, shapes
  assert len([r for r in memory.residuals(f, ws, x) if not r.is_argument]) == 5
  xs = jnp.stack([x, -x])
  chex.assert_trees_all_close(jax.vmap(jax.grad(inv), (None, 0))(ws, xs),
                              jax.vmap(jax.grad(f), (None, 0))(ws, xs), rtol=1e-6)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"fallback": "yes"}, "argument `fallback`"),
    ({"fallback": "temp", "argnums": -1}, "argument `argnums`"),
    ({"fallback": "temp", "argnums": ()}, "argument `argnums`"),
    ({"fallback": "temp", "argnums": 2}, "argument `argnums`: 2 is out of range"),
])
def test_fallback_arguments_are_checked(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    invact_jax.invert(lambda w, x: jnp.sum(jax.nn.gelu(x @ w)), **kwargs)(
        jnp.ones((4, 4)), jnp.ones((2, 4)))


def test_fallback_under_vmap_scan_and_shard_map(monkeypatch):
  """The fallback decides on the traced program whatever transformation is around it: here
  site 0 (the first gelu) raises the temp, and the gradient is the plain one."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from invact_jax.convert import _fallback

  def fake_temp(closed, graph, structs, positions, opts, exact=False):
    if opts is None:
      return 100
    opts.recomputable = [True, True]
    return 100 + (0 if 0 in opts.skip | opts.recompute else 10)
  monkeypatch.setattr(_fallback, "gradient_temp", fake_temp)

  def f(w, x):
    return jnp.sum(jax.nn.gelu(jax.nn.gelu(x @ w) @ w))
  inv = invact_jax.invert(f, fallback="temp")
  w, xs = jnp.full((8, 8), 0.1), jnp.linspace(-1, 1, 3 * 4 * 8).reshape(3, 4, 8)
  want = jax.vmap(jax.grad(f), (None, 0))(w, xs)
  chex.assert_trees_all_close(jax.jit(jax.vmap(jax.grad(inv), (None, 0)))(w, xs), want,
                              rtol=1e-5)
  assert inv.last_report.replaced == {"gelu": 1}
  scanned = jax.jit(jax.grad(lambda w: jax.lax.scan(
      lambda c, x: (c + inv(w, x), None), 0.0, xs)[0]))(w)
  chex.assert_trees_all_close(scanned, want.sum(0), rtol=1e-5)
  n = len(jax.devices())
  mesh = jax.make_mesh((n,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(jnp.linspace(-1, 1, 2 * n * 8).reshape(2 * n, 8),
                     jax.sharding.NamedSharding(mesh, P("b")))
  want = jax.grad(f)(w, x)
  chex.assert_trees_all_close(jax.jit(jax.grad(inv))(w, x), want, rtol=1e-5)  # sharded input
  assert inv.last_report.replaced == {"gelu": 1}

  def sharded(g):
    return lambda w, x: jax.shard_map(lambda w, x: jax.lax.psum(g(w, x), "b"), mesh=mesh,
                                      in_specs=(P(), P("b")), out_specs=P())(w, x)
  # inside a shard_map body: nothing measured, every site converted, and said
  chex.assert_trees_all_close(jax.jit(jax.grad(sharded(inv)))(w, x), want, rtol=1e-5)
  assert inv.last_report.replaced == {"gelu": 2}
  assert any("shard_map" in why for _, _, why in inv.last_report.left_alone)


def test_residuals_of_a_converted_program_name_the_users_lines():
  """What the converted program keeps is attributed to the line that computed it in ``fn``
  (the conversion re-binds the program's equations in their source context)."""
  def loss(w, x):
    h = jnp.sin(x @ w)  # kept for the sine's derivative
    return jnp.sum(jax.nn.gelu(h @ w))
  args = (jnp.ones((8, 8)) / 8, jnp.ones((4, 8)))
  sources = [r.source for r in memory.residuals(invact_jax.invert(loss), *args)
             if not r.is_argument]
  assert sources and all(__file__ in s for s in sources), sources


@pytest.mark.parametrize("act, kw", [(jax.nn.elu, {}), (jax.nn.leaky_relu, {}),
                                     (jax.nn.elu, {"alpha": 0.5}),
                                     (jax.nn.leaky_relu, {"negative_slope": 0.2})])
def test_activations_with_their_default_parameters_are_converted(act, kw):
  """Called with its defaults, JAX inlines the parameter as a literal (no argument, no
  cast): the form traced at its defaults finds it, and the backward uses that value."""
  k = jax.random.split(jax.random.key(0), 2)
  x, w = jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (16, 16)) / 4
  f = lambda x, w: jnp.sum(act(x @ w - 0.5, **kw) @ w.T)  # noqa: E731
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  assert inv.last_report.replaced == {act.__name__: 1}, inv.last_report
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


def test_numpy_outputs_keep_their_dtype():
  """A NumPy output cannot depend on the traced inputs: returned as the function returned it
  (a float64 array stayed float64; before, it came back float32)."""
  f = lambda x: (jnp.sum(jax.nn.gelu(x)), np.arange(3, dtype=np.float64))  # noqa: E731
  _, const = invact_jax.invert(f)(jnp.ones(4))
  assert isinstance(const, np.ndarray) and const.dtype == np.float64


def test_closed_over_constants_of_any_dtype_pass_through():
  """A PRNG key the loss closes over (hk.transform's apply: fold_in and split of a constant
  key), integer and boolean constants: conversion leaves them as they are (a key folded like
  a number raised a TypeError)."""
  key, table, flags = jax.random.key(0), jnp.arange(16), jnp.arange(16) % 3 == 0

  def loss(w, x):
    h = x @ w
    m = jnp.mean(h, -1, keepdims=True)
    h = (h - m) * jax.lax.rsqrt(jnp.mean((h - m) ** 2, -1, keepdims=True) + 1e-5)
    k1, k2 = jax.random.split(jax.random.fold_in(key, 3))
    keep = jax.random.bernoulli(k1, 0.9, h.shape) & flags & (table[None] < 12)
    return jnp.sum(jnp.where(keep, jax.nn.gelu(h), 0.0)) + jax.random.uniform(k2)
  w = jax.random.normal(jax.random.key(1), (8, 16))
  x = jax.random.normal(jax.random.key(2), (4, 8))
  inv = invact_jax.invert(loss)
  np.testing.assert_array_equal(jax.jit(inv)(w, x), jax.jit(loss)(w, x))
  g = jax.jit(jax.grad(inv))(w, x)
  assert inv.last_report.replaced == {"gelu": 1, "layer_norm": 1}, inv.last_report
  assert_at_float32_floor(loss, (w, x), g)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_forward_is_jits_bit_for_bit_and_eager_calls_differ_by_rounding_only(dtype):
  """Under ``jax.jit`` (how training runs) invert(fn)'s forward is jit(fn)'s bit for bit, for
  norms written with jnp.var, jnp.linalg.norm and jax.nn.standardize.  Called eagerly the two
  can differ in the last bit: fn runs those jnp helpers as compiled programs of their own,
  invert evaluates the traced equations in other groups (docs/conversion.md).  Measured: at
  most 1 ulp of the output (float32 and float16, 2026-11-26); bound 2 ulp."""
  x = (jax.random.normal(jax.random.key(1), (2, 16, 384)) * 3 + 1).astype(dtype)
  programs = {
      "var": lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(
          jnp.var(x, -1, keepdims=True) + 1e-6),
      "linalg.norm": lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
      "standardize": lambda x: jax.nn.standardize(x, axis=-1)}
  for name, fn in programs.items():
    inv = invact_jax.invert(fn)
    np.testing.assert_array_equal(np.asarray(jax.jit(inv)(x)), np.asarray(jax.jit(fn)(x)),
                                  err_msg=name)
    eager, ref = np.asarray(inv(x), np.float64), np.asarray(fn(x), np.float64)
    ulp = np.spacing(np.abs(ref).astype(dtype)).astype(np.float64)
    assert np.all(np.abs(eager - ref) <= 2 * ulp), (name, float(np.max(np.abs(eager - ref) / ulp)))


@pytest.mark.parametrize("wrap", ["scan", "jit", "cond", "checkpoint"])
def test_nested_bodies_inside_shard_map(wrap):
  """A scan, jit or cond body within a shard_map (its values vary over the mesh's axes, so it
  cannot be traced on its own as the conversion traces nested bodies) is converted in place:
  forward bit-identical, gradients at the float32 floor.  A remat body there cannot be
  compiled on its own to check that converting it lowers the temp its policy keeps: it runs
  as written, said in the report (before: every such body ran as written; earlier, a
  ValueError from tracing it on its own)."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((8,), ("data",))
  w = 0.1 * _x((2, 32, 32))

  def make(standardize, gelu):
    def layer(h, w):
      return h + gelu(standardize(h) @ w)

    def local(w, x):
      if wrap == "checkpoint":
        h = jax.checkpoint(layer)(x, w[0])
      elif wrap == "jit":
        h = jax.jit(layer)(x, w[0])
      elif wrap == "cond":
        h = jax.lax.cond(jnp.sum(w) > -1e9, layer, lambda h, w: h, x, w[0])
      else:
        h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, w)
      return jax.lax.psum(jnp.sum(jnp.sin(h)), "data")

    def loss(w, x):
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)
    return loss
  loss = make(lambda h: jax.nn.standardize(h, axis=-1), jax.nn.gelu)
  x = jax.device_put(_x((8, 32)), jax.sharding.NamedSharding(mesh, P("data")))
  inv = invact_jax.invert(loss)
  assert jax.jit(inv)(w, x) == jax.jit(loss)(w, x)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(w, x)
  if wrap == "checkpoint":
    assert inv.last_report.replaced == {}, inv.last_report
    (why,) = {y for _, _, y in inv.last_report.left_alone}
    assert "inside a shard_map" in why and "left as written" in why, why
    for a, b in zip(g, jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return
  assert inv.last_report.replaced == {"gelu": 1, "layer_norm": 1}, inv.last_report
  assert not inv.last_report.left_alone, inv.last_report
  hand = make(lambda h: invact_jax.layer_norm(h, epsilon=1e-5), invact_jax.gelu)
  assert_at_float32_floor(loss, (w, x), g, argnums=(0, 1), hand_loss=hand)
