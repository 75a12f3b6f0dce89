"""The LM head's loss with its gradients computed in the forward: three matmuls, no recompute.

When the loss is a weighted sum of the per-token losses (``reduction="mean"`` or ``"sum"``, or
a reduction :func:`invact_jax.invert` folded into the head), its cotangent is one scalar
``g``, and the gradients are ``g`` times what the forward can already compute.  So the
forward runs over chunks of ``chunk_size`` tokens, and per chunk:

1. the chunk's logits over the whole vocabulary, ``z = x_c @ w (+ b)`` [c, V] in float32
   (the only [c, V] buffer: the logits' gradient below is computed in its place);
2. the log-sum-exp, the loss and whether the label's logit is the largest;
3. the logits' gradient ``dz = weight * (softmax(z) (1 + 2 zl lse) - (1 - s) onehot - s / V)``
   (times the cap's ``1 - (z / c)^2``);
4. the chunk's input gradient ``dz @ w^T`` (written once) and the weight gradient
   ``x_c^T dz`` added to a float32 accumulator, ``vocab_chunk_size`` vocabulary entries at a
   time (an update never holds more than [d, vocab_chunk_size] besides the accumulator).

The residuals are the input, weight and bias gradients in float32 (the weight gradient's
accumulator *is* the gradient for a float32 weight; for a 16-bit weight it is a float32 copy
of its size) and, only where the weights are differentiated, the per-token losses; the
backward multiplies them by ``g``.  Only the gradients of inputs that have a tangent are
computed (``symbolic_zeros``).  The forward without gradients (no ``jax.grad``) runs the same
chunks without steps 3-4, so the loss is the same number either way.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from invact_jax.ops import _common
from invact_jax.ops.cross_entropy import base

__all__ = ["weighted_sum", "reduced", "GRADIENT_NAME"]

#: The ``checkpoint_name`` of the gradients this mode keeps (:func:`invact_jax.floor_audit`
#: tells them from activations by it).
GRADIENT_NAME = "linear_cross_entropy gradient"


def _chunk_loss(xc, lc, kc, w, b, opts: base.Options, shards: base.Shards, temperature=None):
  """One chunk's logits and loss: ``(z, u, lse, per-token loss, correct)``; ``w`` and ``b`` in
  the activations' dtype, ``lc`` the labels with ignored ones set to 0, ``kc`` whether a token
  counts; ``u`` the logits a traced ``temperature`` multiplies (None without one)."""
  cd = _common.compute_dtype(xc.dtype)
  vocab = shards.total
  z, _, u = base._logits(xc, w, b, opts, cd, temperature)
  inside = (lc >= 0) & (lc < vocab)
  here = opts.pick_label(lc, vocab) - shards.offset
  picked = jnp.take_along_axis(z, jnp.clip(here, 0, shards.local - 1)[:, None], axis=-1)[:, 0]
  if shards.name is not None:  # the shard holding the label gives its logit
    picked = shards.sum(jnp.where((here >= 0) & (here < shards.local), picked, 0.0))
  local_max = jnp.max(z, axis=-1)
  rowmax = shards.max(local_max)
  first = base.argmax_across(shards, local_max,
                             jnp.argmax(z, axis=-1).astype(jnp.int32) + shards.offset)
  # The shift reads the label's logit (and the mean), so they are computed before the logits'
  # gradient overwrites the logits: the chunk holds one [c, V] buffer, not two.
  shift = jnp.maximum(rowmax, jnp.where(inside, picked, -jnp.inf))
  s = opts.label_smoothing
  if s:
    zmean = shards.sum(jnp.sum(z, axis=-1)) / vocab
    shift = jnp.maximum(shift, zmean)
  shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shift), shift, 0.0))
  lse = shift + jnp.log(shards.sum(jnp.sum(jnp.exp(z - shift[:, None]), axis=-1)))
  correct = kc & inside & (first == lc)  # the label is the argmax (the first largest)
  picked = opts.outside(inside, picked, lse)
  loss = lse - (1.0 - s) * picked
  if s:
    loss = loss - s * zmean
  if opts.z_loss:
    loss = loss + opts.z_loss * lse * lse
  return z, u, lse, jnp.where(kc, loss, 0.0), correct


def _logits_grad(z, lse, lc, scale, opts: base.Options, shards: base.Shards, u=None,
                 temperature=None):
  """The chunk's ``d total / d z``, each token's row times its weight ``scale``, and the
  temperature's share of its gradient (None without one)."""
  vocab = shards.total
  s = opts.label_smoothing
  p = jnp.exp(z - lse[:, None])
  weight = opts.softmax_weight((lc >= 0) & (lc < vocab), lse)
  if weight is not None:
    p = p * weight[:, None]
  here = jnp.arange(z.shape[-1], dtype=jnp.int32)[None, :] == (lc - shards.offset)[:, None]
  dz = p - jnp.where(here, 1.0 - s, 0.0)
  if s:
    dz = dz - s / vocab
  t = None if opts.logit_soft_cap is None else z / opts.logit_soft_cap
  if temperature is not None:
    return base.temperature_chain(dz * scale[:, None], t, u, temperature, opts)
  return base.logits_chain(dz, t, opts) * scale[:, None], None


def _add_weight_grad(dw, xc, dzw, opts: base.Options):
  """``dw + x_c^T dz`` in ``dw``'s layout ([d, V] or [V, d]), one vocabulary tile at a time."""
  vocab = dzw.shape[1]
  cv = min(opts.vocab_chunk_size, vocab)
  ax = opts.vocab_axis
  like = _common.explicit_sharding(dw, xc)  # a sum over the (sharded) tokens

  def update(dw, start, size):
    dzt = jax.lax.dynamic_slice_in_dim(dzw, start, size, axis=1) if size < vocab else dzw
    dims = (((0,), (0,)), ((), ()))
    upd = (jax.lax.dot_general(dzt, xc, dims, preferred_element_type=dw.dtype, out_sharding=like)
           if ax == 0 else
           jax.lax.dot_general(xc, dzt, dims, preferred_element_type=dw.dtype, out_sharding=like))
    if size == vocab:
      return dw + upd
    cur = jax.lax.dynamic_slice_in_dim(dw, start, size, axis=ax)
    return jax.lax.dynamic_update_slice_in_dim(dw, cur + upd, start, axis=ax)
  return base._over_tiles(vocab, cv, lambda start, size, dw: update(dw, start, size), dw)


def _run(x, w, b, y, weights, opts: base.Options, need=(False, False, False, False),
         temperature=None):
  """The chunked pass: ``(per-token loss, correct, dx, dw, db, dtemperature)``; the gradients
  (of ``sum(weights * loss)``) are computed for the inputs ``need`` names (x, w, b, the
  temperature), else None."""
  cd = _common.compute_dtype(x.dtype)
  n = x.shape[0]
  c = opts.chunk_size
  counted = base._counted(y, opts)
  labels = jnp.where(counted, y, 0).astype(jnp.int32)
  need_x, need_w, need_b, need_t = need
  grads = any(need)
  shards = base.Shards(opts, w.shape[opts.vocab_axis])
  scale = jnp.where(opts.with_gradient(counted, y, shards.total), weights.astype(cd), 0.0)
  # The weight (and bias) in the activations' dtype once, before the chunk loop: a float32
  # master table is cast in one pass over it, not in one per chunk (docs/profile.md).
  wx, bx = w.astype(x.dtype), None if b is None else b.astype(x.dtype)

  def chunk(acc, inputs):
    dw, db, dt = acc
    xc, lc, kc, sc = inputs
    z, u, lse, loss, correct = _chunk_loss(xc, lc, kc, wx, bx, opts, shards, temperature)
    if not grads:
      return acc, (loss, correct, None)
    dz, share = _logits_grad(z, lse, lc, sc, opts, shards, u, temperature)
    if need_t:
      dt = dt + share
    dzw = dz.astype(x.dtype)  # the matmuls run in the activations' dtype
    dxc = None
    if need_x:  # contracted with the weight's vocabulary axis
      dxc = jax.lax.dot_general(dzw, wx, (((1,), (opts.vocab_axis,)), ((), ())),
                                preferred_element_type=cd)
    if need_w:
      dw = _add_weight_grad(dw, xc, dzw, opts)
    if need_b:
      db = db + jnp.sum(dz, axis=0)
    return (dw, db, dt), (loss, correct, dxc)

  init = (base._zeros(w, cd, x, w) if need_w else None,
          base._zeros(b, cd, x, w) if need_b else None,
          _common.varying_like(jnp.zeros((), cd), x, w) if need_t else None)
  (dw, db, dt), (loss, correct, dx) = jax.lax.scan(chunk, init, (
      base._chunks(x, c), base._chunks(labels, c), base._chunks(counted, c, False),
      base._chunks(scale, c)))
  loss, correct = base._unchunk(loss, n), base._unchunk(correct, n)
  if dx is not None:
    dx = shards.sum(base._unchunk(dx, n))  # (each shard's share of the vocabulary)
  if dt is not None:  # (summed over the tokens and the vocabulary's shards)
    dt = shards.sum(dt)
  return loss, correct, dx, dw, db, dt


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def weighted_sum(x, w, b, y, weights, opts: base.Options, temperature=None):
  """``(sum(weights * loss), correct)`` of tokens ``x`` [N, d], labels ``y`` [N] and per-token
  ``weights`` [N] (ignored tokens count 0 whatever their weight, and so does a token of
  weight 0 whatever its loss: a padding token's out-of-range label makes no NaN); the
  gradients are computed in the forward (see the module doc).  ``opts.reduction`` is not
  read.  ``temperature``: as :func:`.base.linear_cross_entropy`'s."""
  loss, correct, *_ = _run(x, w, b, y, weights, opts, temperature=temperature)
  return _total(loss, weights), correct


def _total(loss, weights):
  """``sum(weights * loss)`` over the tokens whose weight is not zero."""
  return jnp.sum(jnp.where(weights != 0, weights.astype(loss.dtype) * loss, 0.0))


def _fwd(x, w, b, y, weights, opts, temperature):
  """The forward: the loss, correct count and every gradient asked for (of the perturbed inputs) in
  one pass, the gradients kept to be scaled by the loss's cotangent."""
  tv = None if temperature is None else temperature.value
  need = (x.perturbed, w.perturbed, b is not None and b.perturbed,
          temperature is not None and temperature.perturbed)
  xv, wv, yv, weights_v = x.value, w.value, y.value, weights.value
  bv = None if b is None else b.value
  loss, correct, dx, dw, db, dt = _run(xv, wv, bv, yv, weights_v, opts, need, tv)
  total = _total(loss, weights_v)
  dx, dw, db = (None if g is None else checkpoint_name(g, GRADIENT_NAME) for g in (dx, dw, db))
  kept_loss = loss if weights.perturbed else None
  # Empty slices of the primals: their dtypes and mesh types for the cotangents, no bytes.
  like = [None if v is None else v[:0] for v in (xv, wv, bv, weights_v)]
  return (total, correct), (dx, dw, db, kept_loss, dt, tv, *like)


def _bwd(opts: base.Options, res, cts):
  """The backward: the gradients computed in the forward scaled by the loss's cotangent (none for a
  symbolic zero)."""
  del opts
  g, _ = cts  # ``correct`` has no gradient
  dx, dw, db, loss, dt, temperature, x, w, b, weights = res
  if isinstance(g, jax.custom_derivatives.SymbolicZero):
    return None, None, None, None, None, None
  g = g.astype(jnp.float64 if x.dtype == jnp.float64 else jnp.float32)

  def scaled(grad, primal):
    if grad is None:
      return None
    return _common.cotangent_like((g * grad).astype(primal.dtype), primal)
  return (scaled(dx, x), scaled(dw, w), None if b is None else scaled(db, b), None,
          scaled(loss, weights),
          None if temperature is None else scaled(dt.reshape(jnp.shape(temperature)),
                                                  temperature))


weighted_sum.defvjp(_fwd, _bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def weighted_sum_all(x, w, b, y, weights, opts: base.Options, temperature=None):
  """:func:`weighted_sum` computing every input's gradient in the forward (no symbolic
  zeros, which JAX's ``shard_map`` does not take in an eager call: inside a ``shard_map``)."""
  loss, correct, *_ = _run(x, w, b, y, weights, opts, temperature=temperature)
  return _total(loss, weights), correct


class _Given(NamedTuple):
  """A primal as a ``symbolic_zeros`` rule sees it: its value, differentiated."""
  value: object
  perturbed: bool = True


def _fwd_all(x, w, b, y, weights, opts, temperature):
  return _fwd(_Given(x), _Given(w), None if b is None else _Given(b), _Given(y, False),
              _Given(weights), opts, None if temperature is None else _Given(temperature))


weighted_sum_all.defvjp(_fwd_all, _bwd)


def _in_shard_map() -> bool:
  return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def weighted(x, w, b, y, weights, opts: base.Options, temperature=None):
  """:func:`weighted_sum`, or inside a ``shard_map`` :func:`weighted_sum_all`."""
  total_of = weighted_sum_all if _in_shard_map() else weighted_sum
  return total_of(x, w, b, y, weights, opts, temperature)


def reduced(x, w, b, y, opts: base.Options):
  """``(loss, correct)`` with ``opts.reduction`` ``"mean"`` (over the tokens that count; NaN
  when none does, with zero gradients, as the plain formula) or ``"sum"``."""
  cd = _common.compute_dtype(x.dtype)
  counted = base._counted(y, opts)
  if opts.reduction == "sum":
    return weighted(x, w, b, y, jnp.ones(y.shape, cd), opts)
  count = jnp.sum(counted).astype(cd)
  weight = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
  total, correct = weighted(x, w, b, y, jnp.broadcast_to(weight, y.shape), opts)
  return jnp.where(count > 0, total, jnp.nan), correct
