"""invact_jax.invert finds the LM head in unmodified code: a matmul (+ bias) whose logits feed
a cross-entropy against integer labels — optax's two losses, log_softmax or logsumexp with the
label's logit picked, a one-hot product, label smoothing — becomes
invact_jax.linear_cross_entropy; the program's reduction is folded in where it is a weighted
sum (gradients in the forward), else the head is per token and the reduction follows."""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import invact_jax
from invact_jax import targets
from tests.convert.test_program import assert_at_float32_floor

B, T, D, V = 2, 5, 16, 40


def _gpu_compiler() -> bool:
  try:
    targets.resolve("h100")
  except RuntimeError:
    return False
  return True


def _inputs(dtype=jnp.float32, v=V):
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (B, T, D)).astype(dtype)
  w = (jax.random.normal(k[1], (D, v)) / 4).astype(dtype)
  b = (0.3 * jax.random.normal(k[2], (v,))).astype(dtype)
  return x, w, b, jax.random.randint(k[3], (B, T), 0, v)


def _pick(z, y):
  return jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]


FORMS = {
    "optax_integer_labels": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        (x @ w).astype(jnp.float32), y).mean(),
    "optax_one_hot": lambda x, w, b, y: optax.softmax_cross_entropy(
        x @ w + b, jax.nn.one_hot(y, w.shape[1])).mean(),
    "optax_smoothed": lambda x, w, b, y: optax.softmax_cross_entropy(
        x @ w, optax.smooth_labels(jax.nn.one_hot(y, w.shape[1]), 0.1)).sum(),
    "log_softmax_pick": lambda x, w, b, y: -jnp.mean(_pick(jax.nn.log_softmax(x @ w + b), y)),
    "logsumexp_minus_pick": lambda x, w, b, y: (lambda z: jnp.mean(
        jax.nn.logsumexp(z, axis=-1) - _pick(z, y)))(x @ w),
    "tied_embedding_masked": lambda x, w, b, y: jnp.sum(jnp.where(
        y > 3, optax.softmax_cross_entropy_with_integer_labels(x @ w.T.T, y), 0.0)) / jnp.sum(
            y > 3),
    # Gemma 2 / Griffin: c * tanh(z / c) before the cross-entropy
    "soft_capped": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        30.0 * jnp.tanh((x @ w + b) / 30.0), y).mean(),
    # the label's logit by NumPy advanced indexing (a gather of positions and labels)
    "advanced_index_flat": lambda x, w, b, y: (lambda z: jnp.mean(
        jax.nn.logsumexp(z, -1) - z[jnp.arange(B * T), y.reshape(-1)]))(
            (x @ w).reshape(-1, w.shape[1])),
    "advanced_index_3d": lambda x, w, b, y: (lambda z: jnp.mean(
        jax.nn.logsumexp(z, -1) - z[jnp.arange(B)[:, None], jnp.arange(T)[None, :], y]))(x @ w),
    # the label's logit from the flattened logits: row * V + label
    "flat_index": lambda x, w, b, y: (lambda z: jnp.mean(
        jax.nn.logsumexp(z, -1).reshape(-1)
        - z.reshape(-1)[jnp.arange(B * T) * w.shape[1] + y.reshape(-1)]))(x @ w),
    "flat_jnp_take": lambda x, w, b, y: (lambda z: jnp.mean(
        jax.nn.logsumexp(z, -1) - jnp.take(z.reshape(-1), y.reshape(-1) + w.shape[1] * jnp.arange(
            B * T))))((x @ w + b).reshape(-1, w.shape[1])),
    # optax's ``where=`` (>= 0.2.4): a per-token mask, its rows' loss set to zero; the mask
    # computed in the program or closed over
    "optax_where": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w + b, y, where=y > 3).sum() / jnp.sum(y > 3),
    "optax_where_closed_over": lambda x, w, b, y: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(x @ w, y, where=_KEEP)),
    # ... and of a one-hot: the dropped tokens' loss zero inside it (the head applies the mask)
    "optax_one_hot_where": lambda x, w, b, y: optax.softmax_cross_entropy(
        x @ w + b, jax.nn.one_hot(y, w.shape[1]), where=y > 3).sum() / jnp.sum(y > 3),
    # optax's safe_softmax_cross_entropy: a custom_jvp (``0 log 0 = 0``) the head is found in
    "optax_safe": lambda x, w, b, y: optax.safe_softmax_cross_entropy(
        x @ w + b, jax.nn.one_hot(y, w.shape[1])).mean(),
    "optax_safe_smoothed": lambda x, w, b, y: optax.safe_softmax_cross_entropy(
        x @ w, optax.smooth_labels(jax.nn.one_hot(y, w.shape[1]), 0.1)).sum(),
    # per sequence under vmap: the one-hot's positions (an iota) arrive broadcast
    "optax_one_hot_where_vmapped": lambda x, w, b, y: jax.vmap(
        lambda x, y: optax.softmax_cross_entropy(
            x @ w + b, jax.nn.one_hot(y, w.shape[1]), where=y > 3).sum())(x, y).sum() / jnp.sum(
                y > 3),
    # the weight times each token (jax.vmap of Equinox's Linear: ``weight @ x + bias``, the
    # weight [V, d]): the matmul's [V, B, T] logits transposed to [B, T, V]
    "weight_times_tokens_vmapped": lambda x, w, b, y: (
        optax.softmax_cross_entropy_with_integer_labels(
            jax.vmap(jax.vmap(lambda t: w.T @ t + b))(x), y).mean()),
    # logits scaled (T5's and MaxText's tied head: ``/ sqrt(d)``): the gradients in the forward
    # (a mean), or recomputed per token (a sum of squares)
    "scaled_logits_tied": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w.T.T / jnp.sqrt(float(D)), y).mean(),
    "scaled_logits_per_token": lambda x, w, b, y: jnp.sum(
        optax.softmax_cross_entropy_with_integer_labels((x @ w + b) * 0.7, y) ** 2),
    # the program's own shifts before the loss's: a max held constant, a scalar
    "shifted_by_the_programs_max": lambda x, w, b, y: (lambda z: -jnp.mean(_pick(
        jax.nn.log_softmax(z - jax.lax.stop_gradient(z.max(-1, keepdims=True))), y)))(x @ w),
    "shifted_by_a_scalar": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w + 1.5, y).mean(),
    # the one-hot's product with the log-probabilities as an einsum (a batched matmul)
    "one_hot_einsum": lambda x, w, b, y: -jnp.mean(jnp.einsum(
        "btv,btv->bt", jax.nn.one_hot(y, w.shape[1]), jax.nn.log_softmax(x @ w + b))),
    # the logits written twice (one matmul, as XLA merges them)
    "logits_written_twice": lambda x, w, b, y: jnp.mean(
        jax.nn.logsumexp(x @ w, -1) - _pick(x @ w, y)),
    # a bias closed over (a constant of the program, not an argument)
    "bias_closed_over": lambda x, w, b, y: optax.softmax_cross_entropy_with_integer_labels(
        x @ w + _BIAS, y).mean(),
    # the log-likelihood from the probabilities: log(softmax(z)) picked, or weighted by a
    # one-hot, and a softmax written out without a shift
    "log_of_the_softmax_picked": lambda x, w, b, y: -jnp.mean(jnp.log(_pick(
        jax.nn.softmax(x @ w + b), y))),
    "one_hot_times_log_of_the_softmax": lambda x, w, b, y: -jnp.mean(jnp.sum(jax.nn.one_hot(
        y, w.shape[1]) * jnp.log(jax.nn.softmax(x @ w)), -1)),
    "log_of_a_softmax_written_out": lambda x, w, b, y: (lambda e: -jnp.mean(jnp.log(_pick(
        e / jnp.sum(e, -1, keepdims=True), y))))(jnp.exp(x @ w)),
    # the log-probabilities picked by the one-hot's predicate (a select against zero)
    "where_one_hot": lambda x, w, b, y: -jnp.mean(jnp.sum(jnp.where(
        y[..., None] == jnp.arange(w.shape[1]), jax.nn.log_softmax(x @ w + b), 0.0), -1)),
    "optax_safe_vmapped": lambda x, w, b, y: jnp.mean(jax.vmap(
        lambda x, y: optax.safe_softmax_cross_entropy(x @ w, jax.nn.one_hot(y, w.shape[1])))(
            x, y)),
    # the one-hot as the identity's rows at the labels (a gather of ``jnp.eye(V)``)
    "identity_rows": lambda x, w, b, y: -jnp.mean(jnp.sum(
        jnp.eye(w.shape[1])[y] * jax.nn.log_softmax(x @ w + b), -1)),
    "identity_rows_optax": lambda x, w, b, y: optax.softmax_cross_entropy(
        x @ w, jnp.eye(w.shape[1], dtype=jnp.float32)[y.reshape(-1)].reshape(B, T, -1)).sum(),
}
_KEEP = np.arange(B * T).reshape(B, T) % 3 != 0
_BIAS = np.linspace(-1.0, 1.0, V, dtype=np.float32)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_head_is_found_in_every_form(name):
  f = FORMS[name]
  x, w, b, y = _inputs()
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1, 2)))(x, w, b, y)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert inv.last_report.left_alone == [], inv.last_report
  np.testing.assert_allclose(float(jax.jit(inv)(x, w, b, y)), float(jax.jit(f)(x, w, b, y)),
                             rtol=2e-6)
  assert_at_float32_floor(lambda x, w, b: f(x, w, b, y), (x, w, b), g, argnums=(0, 1, 2))


def test_a_bias_closed_over_from_an_outer_trace_is_the_heads_bias():
  x, w, b, y = _inputs()
  reports = []

  def step(x, w, b, convert):
    f = lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()
    if convert:
      f = invact_jax.invert(f)
      reports.append(f)
    return jax.value_and_grad(f, argnums=(0, 1))(x, w)

  want = jax.jit(functools.partial(step, convert=False))(x, w, b)
  got = jax.jit(functools.partial(step, convert=True))(x, w, b)
  assert reports[0].last_report.replaced == {"linear_cross_entropy": 1}, reports[0].last_report
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-6)
  for a, c in zip(got[1], want[1]):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


def test_an_equinox_linear_head_under_vmap_is_found():
  """Equinox's ``Linear`` computes ``weight @ x + bias`` per token: under ``jax.vmap`` the
  matmul is the weight times the tokens, transposed after."""
  eqx = pytest.importorskip("equinox")
  x, _, _, y = _inputs()
  head = eqx.nn.Linear(D, V, key=jax.random.key(1))
  f = lambda head, x: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
      jax.vmap(jax.vmap(head))(x), y).mean()
  inv = invact_jax.invert(f)
  loss, g = eqx.filter_jit(eqx.filter_value_and_grad(inv))(head, x)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  np.testing.assert_allclose(float(loss), float(eqx.filter_jit(f)(head, x)), rtol=2e-6)
  assert_at_float32_floor(lambda w, b: f(eqx.tree_at(lambda h: (h.weight, h.bias), head, (w, b)),
                                         x), (head.weight, head.bias), (g.weight, g.bias),
                          argnums=(0, 1))


def test_a_tied_embedding_read_as_v_by_d():
  """``x @ E.T`` with the embedding table E [V, d] (Flax's ``Embed.attend``)."""
  x, w, _, y = _inputs()
  emb = w.T

  def f(x, emb):
    logits = jnp.einsum("btd,vd->btv", x, emb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, emb)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert_at_float32_floor(f, (x, emb), g, argnums=(0, 1))


def test_bfloat16_logits_cast_to_float32():
  x, w, b, y = _inputs(jnp.bfloat16)
  f = FORMS["optax_integer_labels"]
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w, b, y)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  g0 = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, b, y)
  with jax.enable_x64(True):
    g64 = jax.grad(f, argnums=(0, 1))(*(np.asarray(a, np.float64) for a in (x, w, b)), y)
  err = lambda g: max(float(np.linalg.norm(np.asarray(a, np.float64) - c) / np.linalg.norm(c))  # noqa: E731
                      for a, c in zip(g, g64))
  assert err(g) <= 1.1 * err(g0), (err(g), err(g0))  # float32 logits: no worse than bf16 ones


def test_logits_used_elsewhere_are_left_alone_and_said():
  """The accuracy read from the same logits: they must exist, so nothing is replaced."""
  x, w, b, y = _inputs()

  def f(x, w, b, y):
    logits = x @ w
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss + 0.0 * jnp.mean(jnp.max(logits, -1))
  inv = invact_jax.invert(f)
  jax.grad(inv)(x, w, b, y)
  assert "linear_cross_entropy" not in inv.last_report.replaced
  assert any(w_ == "linear_cross_entropy" and "also used elsewhere" in why
             for w_, _, why in inv.last_report.left_alone), inv.last_report


@pytest.mark.parametrize("form", ["rows_kept", "mask_of_logits", "another_mask"])
def test_a_masked_log_sum_exp_whose_dropped_rows_are_kept_is_no_head(form):
  """A log-sum-exp under a per-token mask is a head only where the per-token losses' own
  select then drops the masked rows (as optax's ``where=`` does): their values (-inf) are
  kept otherwise; a mask of single logits, or a select by another mask, is no head either.
  Left as written, the values the original's."""
  x, w, b, y = _inputs()
  m, other = y > 3, y > 5
  vocab = jnp.broadcast_to(jnp.arange(V) < V - 3, (B, T, V))
  losses = {
      "rows_kept": lambda z: jax.nn.logsumexp(z, -1, where=m[..., None]) - _pick(z, y),
      "mask_of_logits": lambda z: optax.softmax_cross_entropy_with_integer_labels(
          z, y, where=vocab),
      "another_mask": lambda z: jnp.where(
          other, jax.nn.logsumexp(z, -1, where=m[..., None]) - _pick(z, y), 0.0),
  }
  f = lambda x, w: jnp.sum(jnp.where(jnp.isfinite(l := losses[form](x @ w)), l, 0.0))  # noqa: E731
  inv = invact_jax.invert(f)
  jax.grad(inv, argnums=(0, 1))(x, w)
  assert "linear_cross_entropy" not in inv.last_report.replaced, inv.last_report
  assert float(jax.jit(inv)(x, w)) == float(jax.jit(f)(x, w))


def test_the_log_of_a_clipped_probability_is_said():
  """``-log(clip(softmax(z)[y], eps, 1))`` is no cross-entropy where the clip bites (its
  gradient there is zero): left alone, the report names the head and why."""
  x, w, _, y = _inputs()

  def f(x, w):
    return -jnp.mean(jnp.log(jnp.clip(_pick(jax.nn.softmax(x @ w), y), 1e-9, 1.0)))
  inv = invact_jax.invert(f)
  jax.jit(inv)(x, w)
  assert "linear_cross_entropy" not in inv.last_report.replaced, inv.last_report
  assert any("the log of a probability clipped or offset" in why
             for _, _, why in inv.last_report.left_alone), inv.last_report


@pytest.mark.parametrize("form", ["where", "b_mask", "b_weights", "bias_minus_inf"])
def test_a_log_sum_exp_masked_along_the_vocabulary_is_said_and_a_bias_of_minus_inf_taken(form):
  """A vocabulary mask (``logsumexp``'s ``where=`` of [V], its ``b=``) or weights is no
  cross-entropy the head computes: the report names the head with why; a bias of -inf on the
  masked entries is a head's bias."""
  x, w, b, y = _inputs()
  kept = jnp.arange(V) < V - 3
  y = y % (V - 3)
  lse = {"where": lambda z: jax.nn.logsumexp(z, -1, where=kept),
         "b_mask": lambda z: jax.nn.logsumexp(z, -1, b=kept),
         "b_weights": lambda z: jax.nn.logsumexp(z, -1, b=jnp.linspace(0.5, 1.0, V)),
         "bias_minus_inf": lambda z: jax.nn.logsumexp(z, -1)}
  bias = (lambda z: z + jnp.where(kept, 0.0, -jnp.inf)) if form == "bias_minus_inf" else (
      lambda z: z)
  f = lambda x, w: (lambda z: jnp.mean(lse[form](z) - _pick(z, y)))(bias(x @ w))  # noqa: E731
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w)), rtol=2e-6)
  report = inv.last_report
  if form == "bias_minus_inf":
    assert report.replaced == {"linear_cross_entropy": 1}, report
    assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))
  else:
    assert "linear_cross_entropy" not in report.replaced, report
    assert any(what == "linear_cross_entropy" and "no cross-entropy of them was found" in why
               for what, _, why in report.left_alone), report


def test_a_one_hot_cross_entropy_under_a_per_token_mask_per_token():
  """optax's one-hot ``where=`` under a reduction that is not folded (a sum of squares): the
  per-token head applies the mask itself (the dropped tokens' loss zero, their gradient too)."""
  x, w, b, y = _inputs()
  f = lambda x, w: jnp.sum(optax.softmax_cross_entropy(  # noqa: E731
      x @ w, jax.nn.one_hot(y, V), where=y > 20) ** 2)
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  (form,) = inv.last_report.forms
  assert "per token, gradients by recomputing the logits" in form, form
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w)), rtol=2e-6)
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


#: Cross-entropies a program computes itself, as they read bfloat16 logits.
_BF16_CROSS_ENTROPIES = {
    "optax_integer_labels": optax.softmax_cross_entropy_with_integer_labels,
    "optax_one_hot": lambda z, y: optax.softmax_cross_entropy(z, jax.nn.one_hot(y, V)),
    "optax_safe": lambda z, y: optax.safe_softmax_cross_entropy(
        z, jax.nn.one_hot(y, V, dtype=z.dtype)),
    "log_softmax_pick": lambda z, y: -_pick(jax.nn.log_softmax(z), y)}


def _bfloat16_cross_entropy(form: str, y):
  """The loss ``form`` computes in bfloat16 on bfloat16 logits, cast to float32."""
  ce, bf = _BF16_CROSS_ENTROPIES[form], jnp.bfloat16
  return lambda x, w: jnp.mean(ce(x.astype(bf) @ w.astype(bf), y)).astype(jnp.float32)


@pytest.mark.parametrize("form", sorted(_BF16_CROSS_ENTROPIES))
def test_a_cross_entropy_the_program_computes_in_bfloat16_runs_in_float32(form):
  """Where the program computes the cross-entropy itself in bfloat16 (optax's losses on
  bfloat16 logits), the head keeps the logits' bfloat16 rounding but not that arithmetic: its
  loss is the float32 one of the same rounded logits (3e-8 from float64, measured), the
  original's is off by its bfloat16 log-sum-exp (6e-4 to 1.4e-3): not the original's value,
  the exception docs/lm-head.md names."""
  x, w, _, y = _inputs()
  bf = jnp.bfloat16
  f = _bfloat16_cross_entropy(form, y)
  inv = invact_jax.invert(f)
  jax.grad(inv, argnums=(0, 1))(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  z = np.asarray(jax.jit(lambda x, w: x.astype(bf) @ w.astype(bf))(x, w), np.float64)
  top = z.max(-1, keepdims=True)
  lse = top[..., 0] + np.log(np.exp(z - top).sum(-1))
  truth = float(np.mean(lse - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]))
  ours, original = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w))
  assert abs(ours - truth) <= 1e-6 * truth < abs(original - truth), (ours, original, truth)


def _logits_dots(fn, *args) -> list[str]:
  """The output types of ``fn``'s traced matmuls that give [tokens, V] logits (not the
  weight gradient's [D, V])."""
  text = str(jax.make_jaxpr(fn)(*args))
  return [t for t, rows in re.findall(r"(\w+)\[(\d+),%d\] = dot_general" % V, text)
          if int(rows) != D]


@pytest.mark.skipif(not _gpu_compiler(), reason="no XLA:GPU compiler here (make deviceless)")
def test_on_a_gpu_the_head_takes_the_bfloat16_logits_from_its_matmul():
  """Compiling for a GPU, the head's matmul writes the logits in the program's bfloat16 (a
  GPU's matmul rounds its float32 sum once, as the program's own does; docs/profile.md: no
  float32 tile written and read back to be rounded); on XLA:CPU, whose bfloat16-output dot
  does not, a float32 matmul rounded after."""
  x, w, _, y = _inputs()
  inv = invact_jax.invert(_bfloat16_cross_entropy("optax_integer_labels", y))
  grad = jax.grad(inv, argnums=(0, 1))
  grad(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  with targets.compiling_for("cpu"):
    assert set(_logits_dots(grad, x, w)) == {"f32"}
  with targets.compiling_for("h100"):
    assert set(_logits_dots(grad, x, w)) == {"bf16"}


@pytest.mark.parametrize("form", sorted(_BF16_CROSS_ENTROPIES))
def test_that_float32_arithmetic_changes_nothing_a_user_sees_beyond_bfloat16s_resolution(form):
  """The head's float32 cross-entropy where the program computes it in bfloat16: the loss
  moves by less than half a bfloat16 ulp of itself (0.15-0.35 measured: the program's own
  value, rounded to its dtype, is unchanged or one rounding away), and neither the loss nor a
  gradient is further from float64's (of the same rounded logits) than the program's own:
  the input's gradient as close (both are a bfloat16 matmul's rounding), the weight's
  closer (0.0014 vs 0.0022 of its largest entry).  So no option to keep the program's
  bfloat16 arithmetic: it would only be less exact."""
  x, w, _, y = _inputs()
  bf = jnp.bfloat16
  f = _bfloat16_cross_entropy(form, y)
  inv = invact_jax.invert(f)
  ours, original = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w))
  assert abs(ours - original) < 0.5 * 2.0 ** (np.floor(np.log2(abs(original))) - 7)
  with jax.enable_x64(True):
    rounded = [jnp.asarray(np.asarray(a.astype(bf), np.float64)) for a in (x, w)]
    exact = jax.grad(lambda x, w: jnp.mean(jax.nn.logsumexp(x @ w, -1) - _pick(x @ w, y)),
                     argnums=(0, 1))(*rounded)
    exact = [np.asarray(g) for g in exact]
  for g_ours, g_original, g in zip(jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w),
                                   jax.jit(jax.grad(f, argnums=(0, 1)))(x, w), exact):
    err = lambda a: float(np.max(np.abs(np.asarray(a, np.float64) - g)))  # noqa: E731,B023
    assert err(g_ours) <= err(g_original), (err(g_ours), err(g_original))


@jax.custom_vjp
def _xent_with_z_loss(logits, targets, z_loss):
  """A cross-entropy with its own derivative rule, as T5X and MaxText write theirs (a
  ``custom_vjp`` returning the loss plus ``z_loss * lse ** 2``, and that term)."""
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  zl = z_loss * jax.lax.square(jnp.squeeze(lse, -1))
  return -jnp.sum(targets * (logits - lse), axis=-1) + zl, zl


def _xent_fwd(logits, targets, z_loss):
  top = logits.max(-1, keepdims=True)
  e = jnp.exp(logits - top)
  total = e.sum(-1, keepdims=True)
  lse = jnp.log(total) + top
  zl = z_loss * jnp.square(lse[..., 0])
  return (-jnp.sum(targets * (logits - lse), -1) + zl, zl), (e / total, targets, z_loss, lse)


def _xent_bwd(res, g):
  p, targets, z_loss, lse = res
  # (the targets' cotangent left zero: they are a one-hot of integer labels here)
  return ((p - targets + 2 * z_loss * lse * p) * g[0][..., None], jnp.zeros_like(targets),
          jnp.zeros_like(z_loss))


_xent_with_z_loss.defvjp(_xent_fwd, _xent_bwd)


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_a_cross_entropy_with_its_own_custom_vjp_is_taken_whole(z_loss):
  """A ``custom_vjp`` cross-entropy (T5X's and MaxText's ``cross_entropy_with_logits``) on the
  head's logits: its forward is inlined and found (its z-loss the head's), the head replaces
  the call and its rule (the same derivative), and the program's masked mean — through a
  sharding constraint on the per-token losses, as MaxText writes it — is folded in."""
  x, w, _, y = _inputs()
  segments = (jnp.arange(B * T).reshape(B, T) % 4 != 0).astype(jnp.int32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def f(x, w):
    xent, _ = _xent_with_z_loss(x @ w, jax.nn.one_hot(y, V), z_loss)
    xent = jax.lax.with_sharding_constraint(xent, tokens) * (segments != 0)
    return jnp.sum(xent) / (jnp.sum(segments != 0) + 1e-8)
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  report = inv.last_report
  assert report.replaced == {"linear_cross_entropy": 1} and report.left_alone == [], report
  (form,) = report.forms
  assert "folded in, gradients in the forward" in form, form
  assert ("z-loss" in form) == bool(z_loss), form
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w)), rtol=2e-6)
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


def test_a_cross_entropy_call_whose_z_loss_is_also_a_metric_is_taken_with_it():
  """The call's z-loss output also used (a metric in the loss's auxiliary output, as MaxText
  returns it): the head takes the call whole and gives the metric from its own log-sum-exp,
  per token (the metric's gradient is known only in the backward: no fold), with the
  original's values and the gradients of the loss and of the metric that the call's body
  computes (the call's own rule drops the metric's cotangent, as MaxText's does)."""
  x, w, _, y = _inputs()

  def f(x, w, xent_fn=_xent_with_z_loss):
    xent, zl = xent_fn(x @ w, jax.nn.one_hot(y, V), 1e-2)
    return jnp.mean(xent), jnp.mean(zl)
  inv = invact_jax.invert(f)
  jax.grad(inv, argnums=(0, 1), has_aux=True)(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  (form,) = inv.last_report.forms
  assert "z-loss 0.01" in form and "log-sum-exp is also read" in form, form
  np.testing.assert_allclose(jax.jit(inv)(x, w), jax.jit(f)(x, w), rtol=2e-6)
  body = functools.partial(f, xent_fn=_xent_with_z_loss.fun)
  for k in range(2):  # the loss's gradient, then the metric's
    def part(x, w, fn, k=k):
      return fn(x, w)[k]
    assert_at_float32_floor(functools.partial(part, fn=body), (x, w), jax.jit(jax.grad(
        functools.partial(part, fn=inv), argnums=(0, 1)))(x, w), argnums=(0, 1))


LSE_READS = {  # the log-sum-exp read outside the loss, in the forms libraries write it
    "z_loss_reduced_on_its_own": lambda z, y: (  # (OLMo's)
        lambda lse: jnp.mean(lse - _pick(z, y)) + 1e-2 * jnp.mean(lse ** 2))(
            jax.nn.logsumexp(z, -1)),
    "lse_as_metrics": lambda z, y: (
        lambda lse: (jnp.mean(lse - _pick(z, y)), {"lse": jnp.mean(lse),
                                                   "z": jnp.mean(jnp.square(lse))}))(
            jax.nn.logsumexp(z, -1)),
    "praxis_z_loss_with_a_stopped_max": lambda z, y: (
        lambda m: (lambda lz: jnp.mean(lz - _pick(z, y)) + 1e-4 * jnp.mean(jnp.square(lz)))(
            jnp.log(jnp.sum(jnp.exp(z - m), -1, keepdims=True))[..., 0] + m[..., 0]))(
                jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True))),
}


@pytest.mark.parametrize("name", sorted(LSE_READS))
def test_a_log_sum_exp_read_outside_the_loss_comes_from_the_head(name):
  """A z-loss reduced apart from the cross-entropy, or the log-sum-exp returned as a metric:
  the head converts and computes those values from its own log-sum-exp (``a * lse + b *
  lse ** 2``), per token; loss, metrics and both gradients as the original's, and no
  [tokens, vocabulary] buffer."""
  x, w, _, y = _inputs()
  form = LSE_READS[name]
  aux = name == "lse_as_metrics"

  def f(x, w):
    return form(x @ w, y)

  def scalar(fn):
    return lambda x, w: sum(jax.tree.leaves(fn(x, w)))  # the loss and its metrics
  inv = invact_jax.invert(f)
  jax.jit(inv)(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert [f for f in inv.last_report.forms if "log-sum-exp is also read" in f], inv.last_report
  for a, b in zip(jax.tree.leaves(jax.jit(inv)(x, w)), jax.tree.leaves(jax.jit(f)(x, w))):
    np.testing.assert_allclose(a, b, rtol=2e-6)
  assert_at_float32_floor(scalar(f), (x, w), jax.jit(jax.grad(scalar(inv), argnums=(0, 1)))(
      x, w), argnums=(0, 1))
  if aux:  # the loss's gradient alone: the metrics' cotangents are zeros
    g = jax.jit(jax.grad(inv, argnums=(0, 1), has_aux=True))(x, w)[0]
    assert_at_float32_floor(lambda x, w: f(x, w)[0], (x, w), g, argnums=(0, 1))
  if name != "z_loss_reduced_on_its_own":
    return  # (the compiled buffers: one form is enough)
  n, v = 2048, 8192
  k = jax.random.split(jax.random.key(1), 3)
  xb, wb = jax.random.normal(k[0], (n, 64)), jax.random.normal(k[1], (64, v)) / 8
  yb = jax.random.randint(k[2], (n,), 0, v)
  text = jax.jit(jax.grad(scalar(lambda x, w: form(x @ w, yb)), argnums=(0, 1))).lower(
      xb, wb).compile().as_text()
  assert f"[{n},{v}]" in text
  text = jax.jit(jax.grad(scalar(invact_jax.invert(lambda x, w: form(x @ w, yb))), argnums=(
      0, 1))).lower(xb, wb).compile().as_text()
  assert f"[{n},{v}]" not in text and f"[{v},{n}]" not in text


TEMPERATURES = {  # logits times (or over) a traced scalar: a learnable temperature
    "times": (lambda x, w, b, s, y: optax.softmax_cross_entropy_with_integer_labels(
        (x @ w) * s, y).mean(), "times", True),
    "scalar_first_with_a_bias": (
        lambda x, w, b, s, y: optax.softmax_cross_entropy_with_integer_labels(
            s * (x @ w + b), y).mean(), "times", True),
    "divided": (lambda x, w, b, s, y: optax.softmax_cross_entropy_with_integer_labels(
        (x @ w) / s, y).mean(), "divided by", True),
    "exp_of_a_parameter": (lambda x, w, b, s, y: optax.softmax_cross_entropy_with_integer_labels(
        (x @ w) * jnp.exp(s), y).mean(), "times", True),
    "per_token_max": (lambda x, w, b, s, y: jnp.max(
        optax.softmax_cross_entropy_with_integer_labels((x @ w + b) * s, y)), "times", False),
    "then_soft_capped": (lambda x, w, b, s, y: optax.softmax_cross_entropy_with_integer_labels(
        3.0 * jnp.tanh((x @ w) * s / 3.0), y).mean(), "times", True),
}


@pytest.mark.parametrize("name", sorted(TEMPERATURES))
def test_logits_scaled_by_a_traced_scalar(name):
  """``(x @ w + b) * s`` with ``s`` traced (a learnable temperature, ``exp`` of a parameter):
  the head reads ``x * s`` and ``b * s`` (the same logits), so the loss, and the gradients of
  ``x``, ``w``, ``b`` and ``s``, are the original's at the float32 floor, folded or per token;
  no [tokens, vocabulary] buffer."""
  x, w, b, y = _inputs()
  f, how, folded = TEMPERATURES[name]
  s = jnp.float32(0.7)
  loss = functools.partial(f, y=y)
  inv = invact_jax.invert(loss)
  g = jax.jit(jax.grad(inv, argnums=(0, 1, 2, 3)))(x, w, b, s)
  (form,) = inv.last_report.forms
  assert f"logits {how} a traced scalar" in form, form
  assert ("folded in" in form) == folded, form
  np.testing.assert_allclose(jax.jit(inv)(x, w, b, s), jax.jit(loss)(x, w, b, s), rtol=2e-6)
  assert_at_float32_floor(loss, (x, w, b, s), g, argnums=(0, 1, 2, 3))
  if name == "times":
    n, v = 2048, 8192
    k = jax.random.split(jax.random.key(1), 3)
    xb, wb = jax.random.normal(k[0], (n, 64)), jax.random.normal(k[1], (64, v)) / 8
    yb = jax.random.randint(k[2], (n,), 0, v)
    big = lambda x, w, s: f(x, w, None, s, yb)  # noqa: E731
    text = jax.jit(jax.grad(invact_jax.invert(big), argnums=(0, 1, 2))).lower(
        xb, wb, s).compile().as_text()
    assert f"[{n},{v}]" not in text and f"[{v},{n}]" not in text


SPLITS = {  # how the program constrains its logits -> what the head does
    "tokens_only": ("data", None, None),
    "vocabulary_folded": ("data", None, "model"),
    "vocabulary_per_token": ("data", None, "model"),
    "vocabulary_of_flattened_logits": ("data", "model"),
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_logits_under_a_sharding_constraint(name):
  """Logits constrained to a sharding, as MaxText constrains its logits under its mesh: split
  over the tokens only, the constraint is a value passed on and the head converts (no logits
  left to constrain); split along the vocabulary too (a tensor-parallel head), the head runs
  per device in ``shard_map`` on its shard of the weight (``vocab_axis_name``), folded or
  per token, gathering no weight; constrained in a layout the tokens do not have (logits
  flattened to [tokens, V]), it is left alone and the report says why."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets 8")
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  spec = P(*SPLITS[name])
  x, w, b, y = _inputs(v=48)
  x, y = jnp.concatenate([x, x]), jnp.concatenate([y, y])  # a batch the 4 data shards split

  def f(x, w, b):
    z = x @ w + b
    if name == "vocabulary_of_flattened_logits":
      z = z.reshape(-1, z.shape[-1])
    z = jax.lax.with_sharding_constraint(z, jax.sharding.NamedSharding(mesh, spec))
    loss = optax.softmax_cross_entropy_with_integer_labels(z, y.reshape(z.shape[:-1]))
    return jnp.max(loss) if name == "vocabulary_per_token" else loss.mean()
  inv = invact_jax.invert(f)
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
  ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(None, "model")))
  grad = jax.jit(jax.grad(inv, argnums=(0, 1, 2)))
  g = grad(xs, ws, b)
  if name == "vocabulary_of_flattened_logits":
    assert inv.last_report.replaced == {}, inv.last_report
    assert any("shards of the vocabulary" in why for _, _, why in inv.last_report.left_alone)
    return
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  (form,) = inv.last_report.forms
  assert ("vocabulary split over mesh axes 'model'" in form) == name.startswith("vocabulary")
  assert ("folded in" in form) == (name != "vocabulary_per_token"), form
  np.testing.assert_allclose(jax.jit(inv)(xs, ws, b), jax.jit(f)(xs, ws, b), rtol=2e-6)
  assert_at_float32_floor(f, (x, w, b), g, argnums=(0, 1, 2))
  assert "all-gather" not in grad.lower(xs, ws, b).compile().as_text()


def test_the_logits_read_outside_the_loss_leave_the_head_alone():
  """What the log-sum-exp's reads do not cover: the logits themselves (an argmax accuracy)
  read elsewhere; the head stays as written and the report says why."""
  x, w, _, y = _inputs()

  def f(x, w):
    z = x @ w
    return (jnp.mean(jax.nn.logsumexp(z, -1) - _pick(z, y)),
            jnp.mean(jnp.argmax(z, -1) == y))
  inv = invact_jax.invert(f)
  jax.jit(inv)(x, w)
  assert inv.last_report.replaced == {}, inv.last_report
  assert any("also used elsewhere" in why for _, _, why in inv.last_report.left_alone)


LABELS = {  # labels the program computes -> whether the head reads through the computation
    "plus_one": (lambda y: y + 1, False),
    "minimum": (lambda y: jnp.minimum(y, 5), False),
    "from_constants": (lambda y: jnp.remainder(np.arange(B * T).reshape(B, T) * 7, V), False),
    "clip_to_the_vocabulary": (lambda y: jnp.clip(y, 0, V - 1), False),
    "copied_and_cast": (lambda y: jnp.array(y, copy=True).astype(jnp.int16), True),
}


@pytest.mark.parametrize("head", ["integer_labels", "one_hot"])
@pytest.mark.parametrize("name", sorted(LABELS))
def test_labels_the_program_computes_are_read_as_computed(name, head):
  """The head's labels are what the program's one-hot or pick reads: through shape changes,
  copies and casts (no arithmetic of the head's own), else the computed value itself, computed
  before the head (labels from constants alone, a clamp, NumPy's wrap of negative indices
  included): the loss is the original's."""
  compute, through = LABELS[name]
  x, w, _, y = _inputs()
  y = jnp.minimum(y, V - 2)  # (y + 1 stays in range)
  ce = {"integer_labels": optax.softmax_cross_entropy_with_integer_labels,
        "one_hot": lambda z, t: optax.softmax_cross_entropy(z, jax.nn.one_hot(t, V))}[head]
  f = lambda x, w, y: ce(x @ w, compute(y)).mean()  # noqa: E731
  inv = invact_jax.invert(f)
  # the labels' semantics: the value (the gradients given the labels: the forms' test above)
  np.testing.assert_allclose(float(jax.jit(inv)(x, w, y)), float(jax.jit(f)(x, w, y)),
                             rtol=2e-6)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  from invact_jax.convert import graph as _graph, _head_find  # pylint: disable=import-outside-toplevel
  graph = _graph.flatten(jax.make_jaxpr(f)(x, w, y))
  (m,), _ = _head_find.find_heads(graph, set(), set(graph.outvars))
  if head == "one_hot":  # (a pick by index reads NumPy's wrap of them, computed before it)
    assert (m.labels == graph.invars[2]) == through, name


PADDED = {  # labels -100 at padding -> (the program's loss, finite?)
    "one_hot_times_mask": lambda z, y, m: jnp.sum(optax.softmax_cross_entropy(
        z, jax.nn.one_hot(y, V)) * m) / jnp.sum(m),
    "one_hot_unmasked": lambda z, y, m: jnp.mean(optax.softmax_cross_entropy(
        z, jax.nn.one_hot(y, V))),
    "one_hot_smoothed": lambda z, y, m: jnp.mean(optax.softmax_cross_entropy(
        z, optax.smooth_labels(jax.nn.one_hot(y, V), 0.1))),
    "one_hot_per_token_squared": lambda z, y, m: jnp.sum(optax.softmax_cross_entropy(
        z, jax.nn.one_hot(y, V)) ** 2),
    "lse_minus_one_hot_pick": lambda z, y, m: jnp.mean(
        jax.nn.logsumexp(z, -1) - jnp.sum(jax.nn.one_hot(y, V) * z, -1)),
    "integer_labels_where": lambda z, y, m: jnp.sum(
        optax.softmax_cross_entropy_with_integer_labels(z, y, where=m)) / jnp.sum(m),
    "integer_labels_wrapped": lambda z, y, m: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(m, y, -1))),
    # clamped into the vocabulary by the program: label 0 there, not a row of zeros
    "one_hot_of_clamped_labels": lambda z, y, m: -jnp.mean(jnp.sum(jax.nn.one_hot(
        jnp.maximum(y, 0), V) * jax.nn.log_softmax(z), -1)),
    "integer_labels_clipped": lambda z, y, m: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(z, jnp.clip(y, 0, V - 1))),
    "where_one_hot_unmasked": lambda z, y, m: -jnp.mean(jnp.sum(jnp.where(
        y[..., None] == jnp.arange(V), jax.nn.log_softmax(z), 0.0), -1)),
    "integer_labels_per_token_where": lambda z, y, m: jnp.sum(
        optax.softmax_cross_entropy_with_integer_labels(z, y, where=m) ** 2),
    # jnp.eye(V)[y]: -100 wraps to V - 100 (still below 0 here) and XLA's gather takes the
    # nearest row, 0: the head reads the labels clamped alike
    "identity_rows": lambda z, y, m: optax.softmax_cross_entropy(z, jnp.eye(V)[y]).mean(),
    "identity_rows_above": lambda z, y, m: optax.softmax_cross_entropy(
        z, jnp.eye(V)[jnp.where(m, y, V + 3)]).mean(),
}


@pytest.mark.parametrize("name", sorted(PADDED))
def test_padding_labels_outside_the_vocabulary_give_the_programs_loss(name):
  """Labels -100 (or -1) at padding: a one-hot of them is a row of zeros (the token's loss is
  the share of its log-sum-exp the target does not weight: none for optax's loss, ``s``
  smoothed, all of it for ``lse - sum(onehot * z)``), a mask drops them, a pick by index
  wraps -1 to V - 1 as NumPy does — the converted head computes each as the program does,
  with no NaN."""
  x, w, _, y = _inputs()
  mask = y % 4 != 0
  padded = jnp.where(mask, y, -100)
  f = lambda x, w: PADDED[name](x @ w, padded, mask)  # noqa: E731
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  want = float(jax.jit(f)(x, w))
  assert math.isfinite(want)
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), want, rtol=2e-6)
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


#: A pick of the label's log-probability by a gather, per mode: what XLA's gather gives for a
#: label outside [0, V) (and the scatter of its transpose), the converted head gives too.
PICKS = {
    # jnp indexing (promise_in_bounds): the nearest entry, the token's gradient dropped whole
    "index": lambda lp, y: lp[jnp.arange(lp.shape[0]), y],
    # take_along_axis's default (fill with NaN): NaN, the token's gradient dropped whole
    "take_along_axis": lambda lp, y: jnp.take_along_axis(lp, y[:, None], -1)[:, 0],
    # clip: the nearest entry, its gradient there
    "clip": lambda lp, y: jnp.take_along_axis(lp, y[:, None], -1, mode="clip")[:, 0],
}


@pytest.mark.parametrize("name", sorted(PICKS))
@pytest.mark.parametrize("form", ["log_softmax", "lse_minus_logit"])
def test_a_label_outside_the_vocabulary_gives_what_the_programs_gather_gives(name, form):
  """Labels above V and below -V: the converted loss and gradients are the program's, NaN
  where the program's are (an out-of-range pick's value and gradient follow the gather's
  mode; a log-softmax's pick drops the token's whole gradient, a logit's pick its one-hot)."""
  x, w, _, y = _inputs()
  y = y.reshape(-1).at[:3].set(jnp.array([V + 1, 2 * V, -3 * V]))

  def f(x, w):
    z = (x @ w).reshape(-1, V)
    if form == "log_softmax":
      return -jnp.mean(PICKS[name](jax.nn.log_softmax(z), y))
    return jnp.mean(jax.nn.logsumexp(z, -1) - PICKS[name](z, y))
  inv = invact_jax.invert(f)
  got, want = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w))
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert math.isnan(got) == math.isnan(want) == (name == "take_along_axis")
  if not math.isnan(want):
    np.testing.assert_allclose(got, want, rtol=2e-6)
  for a, b in zip(jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w),
                  jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_zero_weight_drops_a_padding_tokens_nan_which_the_programs_product_keeps():
  """The one place the converted loss is not the program's: a pick by index of a label outside
  [0, V) is NaN (as the program's), and the program's ``loss * mask`` keeps that NaN, while the
  folded head counts a token of weight zero as zero — the masked loss the program meant.  The
  gradients are the program's (a zero weight's token has none)."""
  x, w, _, y = _inputs()
  mask = y % 4 != 0
  padded = jnp.where(mask, y, -100)
  f = lambda x, w: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
      x @ w, padded) * mask) / jnp.sum(mask)
  meant = lambda x, w: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
      x @ w, jnp.where(mask, padded, 0)) * mask) / jnp.sum(mask)
  inv = invact_jax.invert(f)
  assert math.isnan(float(jax.jit(f)(x, w)))
  np.testing.assert_allclose(float(jax.jit(inv)(x, w)), float(jax.jit(meant)(x, w)), rtol=2e-6)
  for a, b in zip(jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w),
                  jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_custom_jvp_that_is_no_cross_entropy_of_the_logits_stays_as_written():
  """Only a call the head's cross-entropy is computed through is inlined: optax's safe loss
  against soft targets, or of logits through ``jax.nn.relu`` (a custom_jvp the activation rule
  converts), is left as the program wrote it, the call's own derivative rule with it."""
  x, w, b, y = _inputs()
  q = jax.nn.softmax(jax.random.normal(jax.random.key(5), (B, T, V)))
  soft = lambda x, w: optax.safe_softmax_cross_entropy(x @ w, q).mean()  # noqa: E731
  relu = lambda x, w: optax.safe_softmax_cross_entropy(  # noqa: E731
      jax.nn.relu(x @ w), jax.nn.one_hot(y, V)).mean()
  for f, replaced in ((soft, {}), (relu, {"relu": 1})):
    inv = invact_jax.invert(f)
    g, want = (jax.jit(jax.grad(h, argnums=(0, 1)))(x, w) for h in (inv, f))
    assert inv.last_report.replaced == replaced, inv.last_report
    assert any("not entered" in why for _, _, why in inv.last_report.left_alone), inv.last_report
    assert float(jax.jit(inv)(x, w)) == float(jax.jit(f)(x, w))
    for a, b_ in zip(g, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-6, atol=1e-7)


def test_the_identity_whose_rows_were_the_one_hot_is_not_built_after_invert():
  x, w, b, y = _inputs()
  eqns = jax.make_jaxpr(invact_jax.invert(FORMS["identity_rows"]))(x, w, b, y).eqns
  shapes = {tuple(v.aval.shape) for e in eqns for v in e.outvars}
  assert (V, V) not in shapes and (B, T, V) not in shapes, shapes


def test_an_offset_diagonal_is_no_one_hot():
  """``jnp.eye(V, k=1)[y]`` picks the logit after the label's (and none for the last): no
  identity, no labelled head."""
  x, w, _, y = _inputs()
  f = lambda x, w: optax.softmax_cross_entropy(x @ w, jnp.eye(V, k=1)[y]).mean()  # noqa: E731
  inv = invact_jax.invert(f)
  assert float(jax.jit(inv)(x, w)) == float(jax.jit(f)(x, w))
  assert "linear_cross_entropy" not in inv.last_report.replaced


def test_soft_targets_are_not_a_labelled_head():
  """A cross-entropy against a distribution that is not a one-hot of integer labels (soft
  targets) is not linear_cross_entropy's: left as the program wrote it."""
  x, w, b, y = _inputs()
  q = jax.nn.softmax(jax.random.normal(jax.random.key(5), (B, T, V)))
  f = lambda x, w: optax.softmax_cross_entropy(x @ w, q).mean()  # noqa: E731
  inv = invact_jax.invert(f)
  jax.grad(inv)(x, w)
  assert "linear_cross_entropy" not in inv.last_report.replaced


def test_no_tokens_by_vocabulary_buffer_after_invert():
  n, v = 2048, 8192  # the CPU's default chunk (2^22 logits) is a quarter of the head
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (n, 64))
  w = jax.random.normal(k[1], (64, v)) / 8
  y = jax.random.randint(k[2], (n,), 0, v)
  f = lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()  # noqa: E731

  def shapes(fn):
    text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, w).compile().as_text()
    return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]+)\]", text)]
  assert any(n in s and v in s for s in shapes(f))
  assert not any(n in s and v in s for s in shapes(invact_jax.invert(f)))
  only = invact_jax.invert(f, only="linear_cross_entropy")
  jax.jit(only)(x, w)
  assert only.last_report.replaced == {"linear_cross_entropy": 1}
  skip = functools.partial(invact_jax.invert, only="gelu")(f)
  jax.jit(skip)(x, w)
  assert skip.last_report.replaced == {}


def _mask(y):
  return (y % 3) != 0


REDUCTIONS = {  # the per-token losses' reduction -> folded into the head or not
    "mean": (lambda loss, y, wt: loss.mean(), True),
    "masked_mean_where": (lambda loss, y, wt: jnp.sum(jnp.where(_mask(y), loss, 0.0))
                          / jnp.sum(_mask(y)), True),
    "masked_mean_jnp": (lambda loss, y, wt: jnp.mean(loss, where=_mask(y)), True),
    "masked_mean_product": (lambda loss, y, wt: jnp.sum(loss * _mask(y)) / jnp.sum(_mask(y)),
                            True),
    "weighted_sum": (lambda loss, y, wt: jnp.sum(loss * wt), True),
    "mean_of_row_sums": (lambda loss, y, wt: jnp.mean(jnp.sum(loss, axis=-1) * 0.5), True),
    "squared": (lambda loss, y, wt: jnp.mean(loss ** 2), False),
    "max": (lambda loss, y, wt: jnp.max(loss), False),
    "plus_a_constant": (lambda loss, y, wt: jnp.mean(loss + 1.0), False),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_the_programs_reduction_is_folded_where_it_is_a_weighted_sum(name):
  """A mean, masked means and weighted sums of the per-token losses are folded into the head
  (gradients in the forward, the report says so, the weights' gradient too); any other
  reduction keeps the per-token head and the report says why."""
  reduce, folds = REDUCTIONS[name]
  x, w, b, y = _inputs()
  wt = jax.random.uniform(jax.random.key(7), (B, T))

  def f(x, w, b, wt):
    return reduce(optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y), y, wt)
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1, 2, 3)))(x, w, b, wt)
  report = inv.last_report
  assert report.replaced == {"linear_cross_entropy": 1}, report
  (form,) = report.forms
  assert ("folded in, gradients in the forward" in form) == folds, form
  if not folds:
    assert "per token, gradients by recomputing the logits:" in form, form
  np.testing.assert_allclose(float(jax.jit(inv)(x, w, b, wt)), float(jax.jit(f)(x, w, b, wt)),
                             rtol=2e-6)
  assert_at_float32_floor(f, (x, w, b, wt), g, argnums=(0, 1, 2, 3))
  kept = {tuple(r.shape) for r in invact_jax.memory.residuals(inv, x, w, b, wt)
          if not r.is_argument}
  assert ((D, V) in kept) == folds, kept  # the weight's gradient, computed in the forward


def test_a_bfloat16_cast_of_a_float32_weight_is_read_as_the_float32_weight():
  """Flax's mixed precision (float32 parameters, bfloat16 compute): the head reads the float32
  weight, so its gradients are computed in the forward into the float32 gradient; a weight
  that is bfloat16 itself keeps the recomputing backward (a float32 accumulator would double
  its gradient's memory), and the report says so."""
  x, w, b, y = _inputs()
  xb = x.astype(jnp.bfloat16)

  def f(x, w):
    logits = (x @ w.astype(jnp.bfloat16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(xb, w)
  (form,) = inv.last_report.forms
  assert "folded in" in form, form
  assert g[1].dtype == jnp.float32
  kept = {(tuple(r.shape), str(r.dtype)) for r in invact_jax.memory.residuals(inv, xb, w)
          if not r.is_argument}
  assert ((D, V), "float32") in kept and ((D, V), "bfloat16") not in kept, kept
  g0 = jax.jit(jax.grad(f, argnums=(0, 1)))(xb, w)
  with jax.enable_x64(True):
    g64 = jax.grad(f, argnums=(0, 1))(np.asarray(xb, np.float64), np.asarray(w, np.float64))
  err = lambda g: max(_rel64(a, c) for a, c in zip(g, g64))  # noqa: E731
  assert err(g) <= 1.1 * err(g0), (err(g), err(g0))
  inv16 = invact_jax.invert(lambda x, w: optax.softmax_cross_entropy_with_integer_labels(
      (x @ w).astype(jnp.float32), y).mean())
  jax.jit(jax.grad(inv16, argnums=(0, 1)))(xb, w.astype(jnp.bfloat16))
  (form,) = inv16.last_report.forms
  assert "per token" in form and "16-bit weight" in form, form


@pytest.mark.parametrize("form", ["cast_then_transpose", "transpose_then_cast", "einsum",
                                  "cast_shared_with_the_embedding"])
def test_a_tied_float32_table_cast_and_transposed_is_read_as_the_table(form):
  """A tied embedding as the head (Llama 3.2, Gemma): ``h @ table.astype(bf16).T`` or
  ``h @ table.T.astype(bf16)`` reads the float32 [V, d] table, so the gradients are computed
  in the forward into its float32 gradient; where the bfloat16 cast is also the embedding's
  (read elsewhere) the head keeps the 16-bit weight and the recomputing backward."""
  x, w, _, y = _inputs()
  table, xb = w.T, x.astype(jnp.bfloat16)  # [V, D] float32

  def f(x, table):
    cast = table.astype(jnp.bfloat16)
    if form == "cast_shared_with_the_embedding":
      x = x + cast[y]  # the embedding reads the same bfloat16 cast
    head_w = {"cast_then_transpose": lambda: cast.T,
              "transpose_then_cast": lambda: table.T.astype(jnp.bfloat16),
              "einsum": lambda: None, "cast_shared_with_the_embedding": lambda: cast.T}[form]()
    logits = (jnp.einsum("...d,vd->...v", x, cast) if head_w is None else x @ head_w)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           y).mean()
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(xb, table)
  (form_text,) = inv.last_report.forms
  shared = form == "cast_shared_with_the_embedding"
  assert ("16-bit weight" in form_text) if shared else ("folded in" in form_text), form_text
  kept = {(tuple(r.shape), str(r.dtype)) for r in invact_jax.memory.residuals(inv, xb, table)
          if not r.is_argument}
  assert (((V, D), "float32") in kept) != shared, kept
  g0 = jax.jit(jax.grad(f, argnums=(0, 1)))(xb, table)
  assert g[1].dtype == g0[1].dtype == jnp.float32
  with jax.enable_x64(True):
    g64 = jax.grad(f, argnums=(0, 1))(np.asarray(xb, np.float64), np.asarray(table, np.float64))
  err = lambda g: max(_rel64(a, c) for a, c in zip(g, g64))  # noqa: E731
  assert err(g) <= 1.1 * err(g0), (err(g), err(g0))


def _rel64(a, c):
  a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
  return float(np.linalg.norm(a - c) / np.linalg.norm(c))


def test_per_token_losses_also_returned_keep_the_per_token_head():
  """The per-token losses returned beside their mean (an aux output): nothing to fold."""
  x, w, b, y = _inputs()

  def f(x, w):
    loss = optax.softmax_cross_entropy_with_integer_labels(x @ w, y)
    return loss.mean(), loss
  inv = invact_jax.invert(f)
  (g, aux) = jax.jit(jax.grad(inv, argnums=(0, 1), has_aux=True))(x, w)
  (form,) = inv.last_report.forms
  assert "per token" in form and "also used as they are" in form, form
  np.testing.assert_allclose(aux, f(x, w)[1], rtol=2e-6)
  g0 = jax.grad(f, argnums=(0, 1), has_aux=True)(x, w)[0]
  assert all(_rel64(a, c) <= 2e-6 for a, c in zip(g, g0))


def test_a_head_inside_a_scan_keeps_the_per_token_head():
  """Under a scan (microbatches) the forward's gradients would be kept per step: the head
  stays per token and the report says why; the gradients are the original's."""
  x, w, b, y = _inputs()

  def f(x, w):
    def step(total, xy):
      xi, yi = xy
      return total + optax.softmax_cross_entropy_with_integer_labels(xi @ w, yi).mean(), None
    return jax.lax.scan(step, 0.0, (x, y))[0]
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  (form,) = inv.last_report.forms
  assert "per token" in form and "loop body" in form, form
  assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))


def test_an_index_that_is_not_each_tokens_position_is_no_head():
  """z[(arange + 1) % n, labels] picks another token's logit: not a cross-entropy."""
  x, w, b, y = _inputs()

  def f(x, w):
    z = (x @ w).reshape(-1, V)
    return jnp.mean(jax.nn.logsumexp(z, -1) - z[(jnp.arange(B * T) + 1) % (B * T), y.reshape(-1)])
  inv = invact_jax.invert(f)
  jax.grad(inv, argnums=(0, 1))(x, w)
  assert "linear_cross_entropy" not in inv.last_report.replaced


@pytest.mark.parametrize("index", ["reversed_rows", "labels_alone", "other_stride",
                                   "shifted_where"])
def test_a_flat_index_that_is_not_row_times_vocabulary_plus_label_is_no_head(index):
  """From the flattened logits, only ``arange(rows) * V + labels`` picks each token's label
  logit; another token's row, the first row's entries or another stride is no cross-entropy."""
  x, w, _, y = _inputs()
  n, labels = B * T, y.reshape(-1)
  flat_index = {"reversed_rows": lambda: jnp.arange(n)[::-1] * V + labels,
                "labels_alone": lambda: labels,
                "other_stride": lambda: jnp.arange(n) * (V - 1) + labels,
                "shifted_where": lambda: (lambda i: jnp.where(labels > 3, i, i + 1))(
                    jnp.arange(n) * V + labels)}[index]

  def f(x, w):
    z = (x @ w).reshape(-1, V)
    return jnp.mean(jax.nn.logsumexp(z, -1) - z.reshape(-1)[flat_index()])
  inv = invact_jax.invert(f)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
  assert "linear_cross_entropy" not in inv.last_report.replaced, inv.last_report
  g0 = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
  assert all(np.array_equal(a, c) for a, c in zip(g, g0))


def test_the_head_keeps_the_programs_bfloat16_rounding_of_the_logits():
  """The converted head rounds the logits (and adds the bias) in the dtype the program's
  matmul produced them in: the loss within 1e-6 relative of the original's (the chunked
  log-sum-exp's summation order); before, float32 logits moved it by ~7e-5."""
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (4, 64, 32)).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (32, 500)) / 5).astype(jnp.bfloat16)
  b = (jax.random.normal(k[2], (500,)) / 5).astype(jnp.bfloat16)
  y = jax.random.randint(k[3], (4, 64), 0, 500)

  def bias(x, w, b):
    return optax.softmax_cross_entropy_with_integer_labels(
        (x @ w + b).astype(jnp.float32), y).mean()

  def master(x, w):  # a float32 weight cast where used: the head reads the float32 weight
    return optax.softmax_cross_entropy_with_integer_labels(
        (x @ w.astype(jnp.bfloat16)).astype(jnp.float32), y).mean()

  for f, args in ((bias, (x, w, b)), (master, (x, w.astype(jnp.float32)))):
    inv = invact_jax.invert(f)
    got, want = float(jax.jit(inv)(*args)), float(jax.jit(f)(*args))
    assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)

  def one_hot_first(x, w):  # the one-hot made before the matmul (as Keras does)
    target = jax.nn.one_hot(y, 500)
    return optax.softmax_cross_entropy((x @ w).astype(jnp.float32), target).mean()
  # (here XLA:CPU folds the jitted original's rounding away, the exception the next test
  # pins: the program's own value is the eager one)
  inv = invact_jax.invert(one_hot_first)
  got, want = float(jax.jit(inv)(x, w)), float(one_hot_first(x, w))
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def test_where_xla_folds_the_programs_rounding_of_bfloat16_logits_the_head_still_rounds():
  """docs/lm-head.md's exception: with [tokens, d] hidden states XLA:CPU folds the cast to
  float32 after a bfloat16 matmul into the matmul under jit (the original's logits unrounded,
  as its eager run's are not), while the converted head rounds them: within 3e-5 relative
  (8.9e-6 measured), and equal to the eager original's rounding up to the log-sum-exp's
  order.  Where XLA stops folding, the loss is the jitted original's within 1e-6 too."""
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (64, 32)).astype(jnp.bfloat16)
  w = (jax.random.normal(k[1], (32, 512)) / 6).astype(jnp.bfloat16)
  y = jax.random.randint(k[2], (64,), 0, 512)

  def f(x, w):
    return optax.softmax_cross_entropy_with_integer_labels((x @ w).astype(jnp.float32), y).mean()
  inv = invact_jax.invert(f)
  got, jitted, eager = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w)), float(f(x, w))
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert abs(got - eager) <= 1e-6 * abs(eager), (got, eager)
  folded = jitted != eager
  assert abs(got - jitted) <= (3e-5 if folded else 1e-6) * abs(jitted), (got, jitted, folded)


@pytest.mark.parametrize("square", ["power", "square", "product"])
def test_a_z_loss_and_labels_reshaped_on_their_way_are_found(square):
  """``lse - picked + zl * lse ** 2`` (PaLM's and MaxText's z-loss, any spelling of the square)
  becomes the head's ``z_loss``, and [batch, tokens] labels flattened against flattened
  logits (or flat labels against [batch, tokens, V] logits) are the tokens' labels: the
  forward the original's (within the log-sum-exp's order), the gradients at its float32
  floor."""
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (4, 16, 32))
  w = jax.random.normal(k[1], (32, 512)) / 6
  y = jax.random.randint(k[2], (4, 16), 0, 512)
  sq = {"power": lambda a: a ** 2, "square": jnp.square, "product": lambda a: a * a}[square]

  def z_loss(x, w):
    z = (x @ w).reshape(-1, 512)
    lse = jax.nn.logsumexp(z, -1)
    return jnp.mean(lse - jnp.take_along_axis(z, y.reshape(-1, 1), -1)[:, 0] + 1e-3 * sq(lse))

  def flat_labels(x, w):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y.reshape(-1).reshape(4, 16)).mean()
  for f in (z_loss, flat_labels):
    inv = invact_jax.invert(f)
    got, want = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w))
    assert inv.last_report.replaced == {"linear_cross_entropy": 1}, (f.__name__, inv.last_report)
    assert abs(got - want) <= 1e-6 * abs(want), (f.__name__, got, want)
    g = jax.jit(jax.grad(inv, argnums=(0, 1)))(x, w)
    assert_at_float32_floor(f, (x, w), g, argnums=(0, 1))
    if f is z_loss:
      (form,) = [what for _, what, _ in inv.last_report.converted]
      assert "z-loss 0.001" in form, form


def test_inlining_a_call_keeps_its_outputs_and_values_and_leaves_calls_it_cannot_inline():
  """``_graph.inline`` (what the head's prepare step runs): a ``custom_jvp`` call replaced by
  its body's nodes, the call's output keeping its id and the program its value; a call whose
  body returns its input unchanged stays a call."""
  from invact_jax.convert import graph as _graph  # pylint: disable=import-outside-toplevel

  @jax.custom_jvp
  def passthrough(v):
    return v
  passthrough.defjvp(lambda p, t: (p[0], t[0]))
  f = lambda x: passthrough(jax.nn.relu(x)) * 2.0  # noqa: E731
  x = jnp.linspace(-2.0, 2.0, 7)
  g = _graph.flatten(jax.make_jaxpr(f)(x))
  calls = [i for i, n in enumerate(g.nodes) if n.prim.name == "custom_jvp_call"]
  assert len(calls) == 2
  relu_out = g.nodes[calls[0]].outs[0]
  inlined, bodies = _graph.inline(g, calls)
  assert list(bodies) == [calls[0]]  # the pass-through body returns its input: no nodes
  assert [n.prim.name for n in inlined.nodes].count("custom_jvp_call") == 1
  assert inlined.producer[relu_out][0] == bodies[calls[0]][-1]
  np.testing.assert_array_equal(np.asarray(_graph.evaluate(inlined, [x])[0]),
                                np.asarray(f(x)))


def test_label_smoothing_over_llama_3s_vocabulary_is_found():
  """Label smoothing 0.1 over 128,256 tokens: its uniform weight s / V = 7.8e-7 (below the
  1e-6 the loss follower once dropped a coefficient at, absolute: the head was not found)
  is kept, as the shared arithmetic keeps a term that does not cancel (relative); the
  loss is the program's."""
  v, s = 128256, 0.1
  k = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (16, v)) / 4
  y = jax.random.randint(k[2], (8,), 0, v)

  def f(x, w):
    return optax.softmax_cross_entropy(x @ w, optax.smooth_labels(jax.nn.one_hot(y, v), s)).mean()
  inv = invact_jax.invert(f)
  got, want = float(jax.jit(inv)(x, w)), float(jax.jit(f)(x, w))
  assert inv.last_report.replaced == {"linear_cross_entropy": 1}, inv.last_report
  assert abs(got - want) <= 1e-6 * abs(want), (got, want)
