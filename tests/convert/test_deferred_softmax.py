"""The deferred-normalization softmax (exp -> value matmul -> divide by the row sum) is
recognized and left as written, with a reason that holds: its autodiff keeps nothing a
converted softmax would not."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import invact_jax
from invact_jax import memory
from invact_jax.convert._rule_deferred_softmax import AT_THE_FLOOR, MAX_MASK, STOPPED


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
  """At the floor where the max is behind stop_gradient; else the max, read by the shift
  alone, gets its gradient stopped (converted); where the max is read elsewhere too (a
  log-sum-exp returned beside the loss) it stays, and its location mask is kept (the next
  test measures both)."""
  def with_lse(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.exp(s - m)
    o = jnp.einsum("bqk,bkd->bqd", p, v) / jnp.sum(p, -1, keepdims=True)
    return jnp.sum(jnp.tanh(o)) + jnp.sum(m)
  for fn, reason, converted in ((functools.partial(_attention, stop=True), AT_THE_FLOOR, 0),
                                (functools.partial(_attention, stop=False), STOPPED, 1),
                                (with_lse, MAX_MASK, 0)):
    inv = invact_jax.invert(fn)
    jax.grad(inv, argnums=(0, 1, 2))(*_args())
    reasons = [why for what, _, why in inv.last_report.left_alone if what == "softmax"]
    assert reasons == [reason], inv.last_report
    assert sum(what == "softmax" for what, _, _ in inv.last_report.converted) == converted
    assert not any(what == "exp" for what, _, _ in inv.last_report.left_alone)


def test_a_stopped_max_keeps_no_mask_same_forward_and_the_gradient_of_its_exact_math():
  """Converted (the max's gradient stopped): the [q, k] residuals are the probabilities alone;
  the forward is bit for bit the program's; the gradient is as close to float64's as the
  program's own (whose max's gradient is zero only up to rounding)."""
  args = _args()
  fn = functools.partial(_attention, stop=False)
  inv = invact_jax.invert(fn)
  kept = [r.shape for r in memory.residuals(inv, *args) if not r.is_argument]
  assert kept.count((2, 16, 16)) == 1, kept
  assert jax.jit(inv)(*args) == jax.jit(fn)(*args)
  with jax.enable_x64(True):
    exact = [np.asarray(g) for g in
             jax.grad(fn, argnums=(0, 1, 2))(*[np.asarray(a, np.float64) for a in args])]
  err = lambda g: max(float(np.max(np.abs(np.asarray(a, np.float64) - b)))  # noqa: E731
                      for a, b in zip(g, exact))
  assert err(jax.grad(inv, argnums=(0, 1, 2))(*args)) <= 2 * err(
      jax.grad(fn, argnums=(0, 1, 2))(*args))


def test_what_its_autodiff_keeps_is_the_unnormalized_probabilities_a_sum_and_the_output():
  """p (shared with the matmul), per-row values and the output; a second [q, k] value, the
  max's location mask, where the max is not behind stop_gradient."""
  for stop, probabilities in ((True, 1), (False, 2)):
    kept = sorted(r.shape for r in memory.residuals(functools.partial(_attention, stop=stop),
                                                    *_args())
                  if not r.is_argument and r.bytes > 4)
    assert kept.count((2, 16, 16)) == probabilities, kept
    assert set(kept) <= {(2, 16, 16), (2, 16, 8), (2, 16, 1), (2, 16)}, kept


def test_normalized_by_a_reciprocal_too():
  """``o * (1 / l)`` and ``o * l ** -1`` divide as ``o / l`` does."""
  for recip in (lambda l: 1.0 / l, lambda l: l ** -1):
    def fn(q, k, v, recip=recip):
      s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
      p = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True)))
      o = jnp.einsum("bqk,bkd->bqd", p, v)
      return jnp.sum(jnp.tanh(o * recip(jnp.sum(p, -1, keepdims=True))))
    inv = invact_jax.invert(fn)
    jax.grad(inv)(*_args())
    assert [why for what, _, why in inv.last_report.left_alone] == [AT_THE_FLOOR], inv.last_report


def test_probabilities_read_elsewhere_are_not_this_form():
  inv = invact_jax.invert(lambda q, k, v: _attention(q, k, v, extra=True))
  jax.grad(inv)(*_args())
  assert AT_THE_FLOOR not in [why for _, _, why in inv.last_report.left_alone]


def _online(q, k, v, blocks=2, stop=False, scan=False):
  """The online (flash) form: key blocks accumulated with a running max, the rescale factors
  ``exp(m - m_new)``, divided by the running row sum after the last block (a Python loop, or
  a lax.scan over the blocks)."""
  kb = k.shape[1] // blocks
  ks, vs = (a.reshape(a.shape[0], blocks, kb, a.shape[-1]).swapaxes(0, 1) for a in (k, v))

  def block(carry, kv):
    m, l, acc = carry
    s = jnp.einsum("bqd,bkd->bqk", q, kv[0]) / 8.0
    m_new = jnp.maximum(m, jnp.max(s, -1, keepdims=True))
    m_new = jax.lax.stop_gradient(m_new) if stop else m_new
    p, c = jnp.exp(s - m_new), jnp.exp(m - m_new)
    return (m_new, l * c + jnp.sum(p, -1, keepdims=True),
            acc * c + jnp.einsum("bqk,bkd->bqd", p, kv[1])), None
  init = (jnp.full(q.shape[:2] + (1,), -jnp.inf), jnp.zeros(q.shape[:2] + (1,)), jnp.zeros(q.shape))
  if scan:
    (_, l, acc), _ = jax.lax.scan(block, init, (ks, vs))
  else:
    carry = init
    for i in range(blocks):
      carry, _ = block(carry, (ks[i], vs[i]))
    _, l, acc = carry
  return jnp.sum(jnp.tanh(acc / l))


def test_the_online_form_block_by_block_is_found_with_its_factors():
  """Unrolled or scanned, every exponential (the blocks' probabilities and the rescale
  factors) is found as this softmax, with the reason that holds for its max; the output is
  the attention's."""
  q, k, v = _args()
  s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
  exact = jnp.sum(jnp.tanh(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)))
  for scan in (False, True):
    for stop, reason in ((True, AT_THE_FLOOR), (False, MAX_MASK)):
      fn = functools.partial(_online, stop=stop, scan=scan)
      assert jnp.allclose(fn(q, k, v), exact, rtol=1e-5)
      inv = invact_jax.invert(fn)
      jax.grad(inv, argnums=(0, 1, 2))(q, k, v)
      left = inv.last_report.left_alone
      assert {why for what, _, why in left} == {reason}, inv.last_report
      assert len(left) == (2 if scan else 4), left  # (the scanned body holds one block)


def test_the_online_forms_max_mask_is_what_the_reason_says():
  """As written the online form keeps a [q, block] mask per block beside the probabilities
  unless its max is behind stop_gradient (4 blocks of 4 keys)."""
  for stop, per_block in ((True, 1), (False, 2)):
    kept = [r.shape for r in memory.residuals(functools.partial(_online, blocks=4, stop=stop),
                                              *_args()) if not r.is_argument]
    assert kept.count((2, 16, 4)) == 4 * per_block, kept


def test_a_local_softmax_combined_across_devices_is_this_form():
  """Each device's keys: the local attention returns ``exp(s - m) @ v``, the row max and the
  row sum unnormalized, combined across the mesh (``pmax``, rescale, ``psum``, divide; the
  sequence-parallel form) — found (the local exponentials and the rescale factors), not
  reported as unrecognized, with the reasons that hold: the max is read beyond its shift, so
  its location mask is kept beside the probabilities (its gradient cannot be stopped); the
  factors are per row."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((2,), ("x",))

  def local(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.exp(s - m)
    o, l = jnp.einsum("bqk,bkd->bqd", p, v), jnp.sum(p, -1, keepdims=True)
    c = jnp.exp(m - jax.lax.pmax(jax.lax.stop_gradient(m), "x"))  # (pmax has no derivative)
    return jax.lax.psum(o * c, "x") / jax.lax.psum(l * c, "x")

  def fn(q, k, v):
    return jnp.sum(jnp.tanh(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "x"),
                                                                      P(None, "x")),
                                          out_specs=P())(q, k, v)))
  q = _args()[0]
  k, v = (jax.device_put(jax.random.normal(jax.random.key(i), (2, 32, 8)),
                         NamedSharding(mesh, P(None, "x"))) for i in (1, 2))
  inv = invact_jax.invert(fn)
  np.testing.assert_array_equal(jax.jit(inv)(q, k, v), jax.jit(fn)(q, k, v))
  assert [(what, why) for what, _, why in inv.last_report.left_alone] == [
      ("softmax", MAX_MASK), ("softmax", AT_THE_FLOOR)], inv.last_report  # (p; the factors)
  kept = [r.shape for r in memory.residuals(fn, q, k, v) if not r.is_argument]
  # [q, k]-sized, per device (stacked over the 2): p and the max's location mask
  assert kept.count((4, 16, 16)) == 2, kept
