"""The deferred-normalization softmax (exp -> value matmul -> divide by the row sum) is
recognized and left as written, with a reason that holds: its autodiff keeps nothing a
converted softmax would not."""
import jax
import jax.numpy as jnp

import invact_jax
from invact_jax import memory
from invact_jax.convert._rule_deferred_softmax import AT_THE_FLOOR


def _attention(q, k, v, stop=True, extra=False):
  s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
  m = jnp.max(s, -1, keepdims=True)
  p = jnp.exp(s - (jax.lax.stop_gradient(m) if stop else m))
  o = jnp.einsum("bqk,bkd->bqd", p, v)
  out = jnp.sum(jnp.tanh(o / jnp.sum(p, -1, keepdims=True)))
  return out + jnp.sum(p) if extra else out


def _args():
  return [jax.random.normal(jax.random.key(i), (2, 16, 8)) for i in range(3)]


def test_found_and_left_alone_with_its_reason():
  for stop in (True, False):
    inv = invact_jax.invert(lambda q, k, v, stop=stop: _attention(q, k, v, stop))
    jax.grad(inv, argnums=(0, 1, 2))(*_args())
    reasons = [why for what, _, why in inv.last_report.left_alone if what == "softmax"]
    assert reasons == [AT_THE_FLOOR], inv.last_report
    assert not any(what == "exp" for what, _, _ in inv.last_report.left_alone)


def test_what_its_autodiff_keeps_is_the_unnormalized_probabilities_a_sum_and_the_output():
  kept = sorted(r.shape for r in memory.residuals(_attention, *_args()) if not r.is_argument
                and r.bytes > 4)
  assert (2, 16, 16) in kept and kept.count((2, 16, 16)) == 1, kept  # p, shared with the matmul
  assert set(kept) <= {(2, 16, 16), (2, 16, 8), (2, 16, 1), (2, 16)}, kept


def test_probabilities_read_elsewhere_are_not_this_form():
  inv = invact_jax.invert(lambda q, k, v: _attention(q, k, v, extra=True))
  jax.grad(inv)(*_args())
  assert AT_THE_FLOOR not in [why for _, _, why in inv.last_report.left_alone]
