"""invact_jax.invert finds the LM head in unmodified code (issue 40): a matmul (+ bias) whose
logits feed a cross-entropy against integer labels — optax's two losses, log_softmax or
logsumexp with the label's logit picked, a one-hot product, label smoothing — becomes
invact_jax.linear_cross_entropy per token; the program's own reduction follows."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import invact_jax
from tests.convert.test_program import assert_at_float32_floor

B, T, D, V = 2, 5, 16, 40


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
}


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
  n, v = 512, 8192
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
