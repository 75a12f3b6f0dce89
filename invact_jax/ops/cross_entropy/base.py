"""The XLA implementation of the LM head's loss without its logits: a chunked linear +
cross-entropy ``custom_vjp`` whose backward recomputes the logits, the plain formula it is
tested against, and what both gradient modes share (options, tiles, the formula's pieces).

For tokens ``x`` [N, d], a weight ``w`` [d, V] (or [V, d]), an optional bias ``b`` [V] and
integer labels ``y`` [N], with ``z = x @ w + b`` (soft-capped to ``c * tanh(z / c)`` when a
cap ``c`` is given) and ``lse = logsumexp(z)``, each token's loss is

    loss = lse - (1 - s) * z[y] - s * mean(z) + zl * lse^2

(``s``: label smoothing, ``zl``: the z-loss weight), zero for ignored tokens.  Its gradient
in the logits is ``softmax(z) * (1 + 2 zl lse) - (1 - s) * onehot(y) - s / V`` (times the
cap's ``1 - (z / c)^2``).

Two gradient modes:

* ``gradients="forward"`` (:mod:`.in_forward`): for a scalar loss (a weighted sum of the
  per-token losses), the forward computes the gradients with the loss: three matmuls.
* ``gradients="backward"`` (this module): any reduction, ``"none"`` included.  Neither pass
  holds more than one tile of logits (``chunk_size`` tokens x ``vocab_chunk_size``
  vocabulary entries).  The forward runs over token chunks and, within each, over
  vocabulary tiles with an online log-sum-exp, keeping per token only its float32 ``lse``;
  the backward runs over vocabulary tiles and, within each, over token chunks, recomputing
  each tile's logits from ``x``, ``w`` and ``lse`` (a fourth matmul): a tile's weight
  gradient accumulates in a [d, tile] float32 buffer and is written once, the input gradient
  accumulates per token chunk.  The residuals are ``x``, ``w``, the bias, the labels and
  ``lse``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from invact_jax import targets
from invact_jax.ops import _common

__all__ = ["Options", "Shards", "GRADIENTS", "Gradients", "linear_cross_entropy", "with_lse", "reference",
           "default_mode", "default_tiles"]

#: The gradient modes: computed with the loss (scalar losses) or by recomputing the logits.
#: Where the head computes its gradients: in the forward (a scalar loss) or the backward.
Gradients = Literal["forward", "backward"]
GRADIENTS: tuple[str, ...] = get_args(Gradients)

# Default tiles: logits per tile, by gradient mode and platform, from the tile sweeps of
# `scripts/bench_lm_head.py --tiles` (docs/lm-head.md).  CPU: "backward" 2^20 (4 MiB in
# float32), up to 1024 tokens; "forward" 2^22 (16 MiB, 128 tokens at V = 32768) and
# weight-gradient updates of 2048 vocabulary entries.  Elsewhere (measured on an H100, bf16,
# N = 8192, d = 4096, V = 128256): "backward" 2^25, up to 8192 tokens (8192 x 4096: 1.51x the
# plain head where 1024 x 1024 took 3.24x); "forward" 2^28 and one update per chunk (2048
# tokens: 1.01x, where 512 tokens, 16 passes over the float32 weight-gradient accumulator,
# took 1.50x).
_BACKWARD = {"cpu": (1 << 20, 1024)}
_BACKWARD_OTHER = (1 << 25, 8192)
_FORWARD_ELEMENTS = {"cpu": 1 << 22}
_FORWARD_ELEMENTS_OTHER = 1 << 28
_FORWARD_UPDATE = {"cpu": 2048}
_MAX_FORWARD_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Options:
  """The loss's static options (hashable: the ``custom_vjp``'s non-differentiable argument).

  Attributes:
    vocab_axis: the weight's vocabulary axis (1: [d, V]; 0: [V, d], a tied embedding).
    reduction: ``"mean"`` (over the tokens not ignored), ``"sum"`` or ``"none"``.
    ignore_index: the label of tokens that do not count (padding), or None.
    label_smoothing, z_loss: their weights (0: off).
    logit_soft_cap: ``c`` of ``c * tanh(z / c)`` (Gemma 2), or None.
    chunk_size: tokens per tile of logits.
    vocab_chunk_size: vocabulary entries per tile ("backward"), or per update of the weight
      gradient ("forward": a tile holds its tokens' logits over the whole vocabulary).
    gradients: ``"forward"`` (computed with the loss, :mod:`.in_forward`; scalar losses) or
      ``"backward"`` (the backward recomputes the logits, this module).
    logits_dtype: the dtype the logits (and the bias added to them) are rounded to before
      the loss, as the program :func:`invact_jax.invert` replaced did (its matmul's output
      dtype); None: float32 throughout.
    outside_lse: the loss of a (counted) token whose label lies outside ``[0, V)``: None,
      NaN, as a pick of the label's logit gives (the plain formula's); else ``c``, the loss
      ``c * lse - s * mean(z) (+ zl * lse ** 2)``, gradient ``c * softmax - s / V`` (+ the
      z-loss's), as a product with a one-hot of such a label (a row of zeros) gives: what
      :func:`invact_jax.invert` keeps of a one-hot program (``c`` the share of the
      log-sum-exp its target does not weight: 0 for optax's ``softmax_cross_entropy``, ``s``
      smoothed, 1 for ``lse - sum(onehot * z)``).
    logit_scale: the logits' factor after the bias (and the rounding to ``logits_dtype``),
      before the soft cap: what :func:`invact_jax.invert` keeps of a program's scaled logits
      (T5's and MaxText's tied head: ``logits / sqrt(d)``); 1: none.
    vocab_axis_name: inside ``shard_map``, the mesh axis (or tuple of axes) the vocabulary
      is split over (a tensor-parallel head: the weight and bias hold this device's
      contiguous shard, in axis-index order); None: the whole vocabulary is here.
    outside_nearest: a label outside ``[0, V)`` picks the nearest entry's logit in the
      forward and no one-hot in the gradient (what :func:`invact_jax.invert` keeps of a
      program that picks the label's logit by jnp indexing: XLA's gather reads the nearest
      entry, the scatter of its transpose drops the update); False: :attr:`outside_lse`.
    outside_gradient: whether a (counted) token whose label lies outside ``[0, V)`` has a
      gradient (its softmax's); False: none (what :func:`invact_jax.invert` keeps of a
      program that picks a log-softmax's entry by a gather, whose transpose drops the whole
      row's update).
  """
  vocab_axis: int
  reduction: str
  ignore_index: int | None
  label_smoothing: float
  z_loss: float
  logit_soft_cap: float | None
  chunk_size: int
  vocab_chunk_size: int
  gradients: str = "backward"
  logits_dtype: str | None = None
  outside_lse: float | None = None
  logit_scale: float = 1.0
  vocab_axis_name: str | tuple | None = None
  outside_nearest: bool = False
  outside_gradient: bool = True

  def with_gradient(self, counted, labels, vocab: int):
    """The tokens that have a gradient: ``counted`` ones, less those whose label lies outside
    ``[0, V)`` where :attr:`outside_gradient` is False."""
    if self.outside_gradient:
      return counted
    return counted & (labels >= 0) & (labels < vocab)

  def pick_label(self, label, vocab: int):
    """The label whose logit a token's loss reads: the nearest inside ``[0, V)`` with
    :attr:`outside_nearest`, else ``label`` (an outside one picks none)."""
    return jnp.clip(label, 0, vocab - 1) if self.outside_nearest else label

  def outside(self, inside, picked, lse):
    """``picked`` where the label is ``inside`` ``[0, V)`` (or, with :attr:`outside_nearest`,
    everywhere: the nearest entry's); else NaN, or what stands for the pick in
    ``lse - (1 - s) * pick`` to make the loss :attr:`outside_lse` says."""
    if self.outside_nearest:
      return picked
    if self.outside_lse is None:
      return jnp.where(inside, picked, jnp.nan)
    return jnp.where(inside, picked,
                     (1.0 - self.outside_lse) / (1.0 - self.label_smoothing) * lse)

  def softmax_weight(self, inside, lse):
    """The softmax's weight in each token's logits gradient: 1, or :attr:`outside_lse` for a
    label outside ``[0, V)``, plus the z-loss's ``2 zl lse``; None where it is 1 for every
    token."""
    weight = None if self.outside_lse is None else jnp.where(
        inside, 1.0, self.outside_lse).astype(lse.dtype)
    if self.z_loss:
      weight = (1.0 if weight is None else weight) + 2.0 * self.z_loss * lse
    return weight


class Shards:
  """The vocabulary as this device holds it: ``local`` entries from ``offset`` of ``total``
  (one shard: the whole vocabulary, offset 0), and the row statistics across the shards."""

  def __init__(self, opts: Options, local: int):
    self.name, self.local = opts.vocab_axis_name, local
    if self.name is None:
      self.total, self.offset = local, 0
    else:
      self.total = local * _common.axis_size(self.name)
      self.offset = jax.lax.axis_index(self.name) * local

  def max(self, a):
    return a if self.name is None else jax.lax.pmax(a, self.name)

  def sum(self, a):
    return a if self.name is None else jax.lax.psum(a, self.name)

  def min(self, a):
    return a if self.name is None else jax.lax.pmin(a, self.name)


def first_max(m, first, tile_max, tile_first):
  """``(max, index)`` of a row's running maximum ``m`` at ``first`` and a tile's
  (``tile_max`` at ``tile_first``, later in the row): the first index of the largest value,
  as ``jnp.argmax`` gives it (a NaN the largest; a tie keeps the earlier index)."""
  later = (tile_max > m) | (jnp.isnan(tile_max) & ~jnp.isnan(m))
  return jnp.where(later, tile_max, m), jnp.where(later, tile_first, first)


def argmax_across(shards: Shards, m, first):
  """The global first index of the row maximum from each shard's ``(m, first)``: the least
  index among the shards holding the largest value (NaN the largest)."""
  if shards.name is None:
    return first
  top = shards.max(jnp.where(jnp.isnan(m), jnp.inf, m))
  has = jnp.where(jnp.isnan(m), jnp.inf, m) == top
  nan_anywhere = shards.max(jnp.isnan(m).astype(jnp.int32)) > 0
  has = jnp.where(nan_anywhere, jnp.isnan(m), has)
  return shards.min(jnp.where(has, first, jnp.iinfo(jnp.int32).max))


def _token_tile(tokens: int, limit: int) -> int:
  """Tokens per tile, at most ``limit``: a multiple of 8 that divides ``tokens`` where one
  does (no padding; a sharded token axis stays even), else ``tokens`` rounded up to 8."""
  t = next((c for c in range(min(limit, tokens) // 8 * 8, 7, -8) if tokens % c == 0), None)
  if t is None:
    t = min(limit, max(8, -(-tokens // 8) * 8))
  return max(1, min(t, tokens)) if tokens else 1


def default_mode(reduction: str, w_dtype) -> str:
  """The gradient mode a head gets by default.

  Args:
    reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    w_dtype: the weight's dtype.

  Returns:
    ``"forward"`` for a scalar loss whose weight-gradient accumulator is the gradient itself
    (a weight of 4 bytes or more), else ``"backward"``.
  """
  return "forward" if reduction != "none" and jnp.dtype(w_dtype).itemsize >= 4 else "backward"


def default_tiles(tokens: int, vocab: int, gradients: str = "backward",
                  platform: str | None = None) -> tuple[int, int]:
  """``(chunk_size, vocab_chunk_size)`` for a head of ``tokens`` x ``vocab`` logits.

  Args:
    tokens, vocab: the head's shape.
    gradients: the gradient mode (:data:`GRADIENTS`).
    platform: ``"cpu"``, ``"gpu"``, ... (default: the current target's,
      :func:`invact_jax.targets.platform`).

  Returns:
    "backward": about 2^20 logits per tile on CPU, up to 1024 tokens (2^25 elsewhere, up
    to 8192 tokens), the rest along the vocabulary.
    "forward": tokens whose logits over the whole vocabulary fill the platform's budget
    (2^22 elements on CPU, 2^28 elsewhere; 8 to 4096 tokens), and the weight gradient's
    update tile (2048 entries on CPU, the whole vocabulary elsewhere).
  """
  platform = platform or targets.platform()
  if gradients == "forward":
    elements = _FORWARD_ELEMENTS.get(platform, _FORWARD_ELEMENTS_OTHER)
    t = _token_tile(tokens, max(8, min(_MAX_FORWARD_TOKENS, elements // max(vocab, 1))))
    return t, max(1, min(vocab, _FORWARD_UPDATE.get(platform, vocab)))
  elements, most = _BACKWARD.get(platform, _BACKWARD_OTHER)
  t = _token_tile(tokens, most)
  return t, max(1, min(vocab, elements // t))


# ------------------------------------------------------------------------ the formula
def _logits(x, w, b, opts: Options, cd, temperature=None):
  """``x @ w (+ b)`` in ``cd`` (float32 accumulation; rounded to ``opts.logits_dtype`` first
  where the program it replaces rounded them), scaled, times the traced scalar
  ``temperature`` where one is given, soft-capped: ``(z, raw / cap, u)``, ``u`` the logits
  the temperature multiplies (None without one)."""
  contract = (1,) if opts.vocab_axis == 0 else (0,)
  # A GPU's matmul rounds its float32 accumulator to the 16-bit output once, as the program's
  # own 16-bit matmul does: no float32 tile written and read back to be rounded.  (Not on
  # XLA:CPU, whose 16-bit-output dot inside the head's loop does not round a float32 sum once:
  # 2e-4 off the program's loss, tests/convert/test_cross_entropy.py.)
  out = opts.logits_dtype if opts.logits_dtype is not None and targets.platform() == "gpu" else cd
  z = jax.lax.dot_general(x, w, (((1,), contract), ((), ())), preferred_element_type=out)
  if opts.logits_dtype is not None:
    z = z.astype(opts.logits_dtype)
    if b is not None:
      z = z + b.astype(opts.logits_dtype)
    z = z.astype(cd)
  elif b is not None:
    z = z + b.astype(cd)
  if opts.logit_scale != 1.0:
    z = z * opts.logit_scale
  u = None
  if temperature is not None:
    u, z = z, z * temperature.astype(cd)
  t = None
  if opts.logit_soft_cap is not None:
    t = jnp.tanh(z / opts.logit_soft_cap)
    z = opts.logit_soft_cap * t
  return z, t, u


def logits_chain(dz, t, opts: Options):
  """``dz`` (the gradient w.r.t. the capped logits) back through :func:`_logits`'s soft cap
  (``t`` its ``tanh``, None without a cap) and scale: the gradient w.r.t. the matmul's."""
  if t is not None:
    dz = dz * (1.0 - t * t)
  return dz if opts.logit_scale == 1.0 else dz * opts.logit_scale


def temperature_chain(dz, t, u, temperature, opts: Options):
  """``(the gradient w.r.t. the matmul's logits, the temperature's share)`` from ``dz`` (w.r.t.
  the capped logits) where :func:`_logits` multiplied ``u`` by a traced ``temperature``."""
  dv = dz if t is None else dz * (1.0 - t * t)
  return (logits_chain(dv * temperature.astype(dv.dtype), None, opts),
          jnp.sum(dv * u))


def _token_loss(z, y, counted, opts: Options):
  """Per-token loss and lse from capped logits ``z`` [c, V]: zero where not ``counted``; for
  a label outside ``[0, V)`` that is not ignored, what :meth:`Options.outside` says (NaN by
  default, as the plain formula's pick gives)."""
  lse = jax.nn.logsumexp(z, axis=-1)
  label = jnp.where(counted, y, 0)
  vocab = z.shape[-1]
  picked = opts.outside((label >= 0) & (label < vocab), jnp.take_along_axis(
      z, jnp.clip(label, 0, vocab - 1)[:, None].astype(jnp.int32), axis=-1)[:, 0], lse)
  s = opts.label_smoothing
  loss = lse - (1.0 - s) * picked
  if s:
    loss = loss - s * jnp.mean(z, axis=-1)
  if opts.z_loss:
    loss = loss + opts.z_loss * lse * lse
  return jnp.where(counted, loss, 0.0), lse


def _counted(y, opts: Options):
  """Tokens that count (not ``ignore_index``)."""
  if opts.ignore_index is None:
    return jnp.ones(y.shape, bool)
  return y != opts.ignore_index


def _reduce(per_token, counted, opts: Options):
  """The per-token losses reduced as ``opts.reduction`` says: none, their sum, or their mean over
  the counted tokens."""
  if opts.reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if opts.reduction == "sum":
    return total
  return total / jnp.sum(counted).astype(per_token.dtype)


def reference(x, w, b, y, opts: Options):
  """The plain formula, all logits at once, with JAX's own autodiff: the baseline."""
  cd = _common.compute_dtype(x.dtype)
  counted = _counted(y, opts)
  z, _, _ = _logits(x, w.astype(x.dtype), None if b is None else b.astype(x.dtype), opts, cd)
  per_token, _ = _token_loss(z, y, counted, opts)
  return _reduce(per_token, counted, opts)


# ------------------------------------------------------------------- the custom_vjp
def _chunks(a, c: int, fill=0):
  """``a`` [N, ...] as [n, c, ...]: chunk ``i`` holds tokens ``i, i + n, i + 2n, ...`` (padded
  with ``fill`` to ``n * c``).  Strided rather than contiguous, so that a token axis sharded
  over devices gives every chunk the same share of each device's tokens: a chunk is computed
  where its tokens are, with no gather."""
  n = -(-a.shape[0] // c)
  pad = n * c - a.shape[0]
  if pad:
    a = jnp.concatenate([a, jnp.full((pad, *a.shape[1:]), fill, a.dtype)])
  return jnp.swapaxes(a.reshape(c, n, *a.shape[1:]), 0, 1)


def _unchunk(a, size: int):
  """The inverse of :func:`_chunks`: [n, c, ...] -> the first ``size`` of [N, ...]."""
  return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])[:size]


def _tiles(vocab: int, cv: int) -> tuple[int, int]:
  """Full vocabulary tiles and the size of the last, partial one (0 if none)."""
  return vocab // cv, vocab % cv


def _weight_tile(w, b, start, size: int, opts: Options, dtype):
  """``w``'s (and ``b``'s) vocabulary entries ``[start, start + size)`` in ``dtype`` (the
  activations'); ``start`` may be traced."""
  ax = opts.vocab_axis
  wt = jax.lax.dynamic_slice_in_dim(w, start, size, axis=ax).astype(dtype)
  bt = None if b is None else jax.lax.dynamic_slice_in_dim(b, start, size).astype(dtype)
  return wt, bt


def _over_tiles(vocab: int, cv: int, body, carry):
  """``body(start, size, carry)`` for every vocabulary tile (a loop over the full ones, then
  the partial one)."""
  full, rest = _tiles(vocab, cv)
  if full:
    carry = jax.lax.fori_loop(0, full, lambda j, c: body(j * cv, cv, c), carry)
  if rest:
    carry = body(full * cv, rest, carry)
  return carry


def _zeros(like, dtype, *refs):
  """An accumulator for ``like``'s gradient: its shape and sharding (on the tokens' mesh when
  that has explicit axes: what a contraction over the tokens gives), varying inside
  ``shard_map`` where ``refs`` are."""
  z = jnp.zeros_like(like, dtype=dtype)
  sharding = _common.explicit_sharding(like, refs[0])
  if sharding is not None:
    z = jax.sharding.reshard(z, sharding)
  return _common.varying_like(z, *refs)


def _forward(x, w, b, y, opts: Options, temperature=None):
  """Per-token losses and float32 lse: over token chunks, and within each over vocabulary
  tiles with an online log-sum-exp."""
  cd = _common.compute_dtype(x.dtype)
  n = x.shape[0]
  shards = Shards(opts, w.shape[opts.vocab_axis])
  vocab = shards.total
  counted = _counted(y, opts)
  s = opts.label_smoothing

  def chunk(_, inputs):
    xc, yc, kc = inputs
    label = jnp.where(kc, yc, 0).astype(jnp.int32)

    def tile(start, size, acc):
      m, total, picked, zsum, top, first = acc
      wt, bt = _weight_tile(w, b, start, size, opts, x.dtype)
      z, _, _ = _logits(xc, wt, bt, opts, cd, temperature)
      m_new = jnp.maximum(m, jnp.max(z, axis=-1))
      total = total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
      here = jnp.arange(size, dtype=jnp.int32)[None, :] == (
          opts.pick_label(label, vocab) - shards.offset - start)[:, None]
      picked = picked + jnp.sum(jnp.where(here, z, 0.0), axis=-1)
      if s:
        zsum = zsum + jnp.sum(z, axis=-1)
      top, first = first_max(top, first, jnp.max(z, axis=-1),
                             jnp.argmax(z, axis=-1).astype(jnp.int32) + shards.offset + start)
      return m_new, total, picked, zsum, top, first
    row = xc[:, 0]  # per-token accumulators: the tokens' sharding (and vma)
    zeros = _common.varying_like(jnp.zeros_like(row, dtype=cd), xc, w)
    lowest = _common.varying_like(jnp.full_like(row, -jnp.inf, dtype=cd), xc, w)
    m, total, picked, zsum, top, first = _over_tiles(
        shards.local, opts.vocab_chunk_size, tile,
        (lowest, zeros, zeros, zeros, lowest,
         _common.varying_like(jnp.zeros_like(row, dtype=jnp.int32), xc, w)))
    first = argmax_across(shards, top, first)
    if shards.name is not None:  # the shards' statistics combined
      top = shards.max(m)
      total = shards.sum(total * jnp.exp(m - top))
      m, picked, zsum = top, shards.sum(picked), shards.sum(zsum)
    lse = m + jnp.log(total)
    inside = (label >= 0) & (label < vocab)
    loss = lse - (1.0 - s) * opts.outside(inside, picked, lse)
    if s:
      loss = loss - s * zsum / vocab
    if opts.z_loss:
      loss = loss + opts.z_loss * lse * lse
    correct = kc & inside & (first == label)  # the label is the argmax (the first largest)
    return None, (jnp.where(kc, loss, 0.0), lse, correct)
  _, (loss, lse, correct) = jax.lax.scan(chunk, None, (
      _chunks(x, opts.chunk_size), _chunks(y, opts.chunk_size),
      _chunks(counted, opts.chunk_size, False)))
  return _unchunk(loss, n), _unchunk(lse, n), counted, _unchunk(correct, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_cross_entropy(x, w, b, y, opts: Options, temperature=None):
  """``(loss, correct)``: the reduced loss (``opts.reduction``) of tokens ``x`` [N, d] and,
  per token, whether its label has the largest logit (no gradient); see the module doc.
  ``temperature``: a traced scalar the logits are multiplied by (after ``opts``'s rounding,
  bias and scale, before the cap; what :func:`invact_jax.invert` keeps of a learnable
  temperature), differentiated too; None: none."""
  loss, _, counted, correct = _forward(x, w, b, y, opts, temperature)
  return _reduce(loss, counted, opts), correct


def _fwd(x, w, b, y, opts, temperature):
  loss, lse, counted, correct = _forward(x, w, b, y, opts, temperature)
  return (_reduce(loss, counted, opts), correct), (x, w, b, y, lse, temperature)


def _bwd(opts: Options, res, cts):
  g, _ = cts  # ``correct`` has no gradient
  return _backward(opts, res, g, None)


def _backward(opts: Options, res, g, g_lse):
  """The gradients of the loss (cotangent ``g``) and, where ``g_lse`` is not None, of the
  per-token log-sum-exp (its cotangent ``g_lse`` [N]: ``g_lse * softmax`` in the logits)."""
  x, w, b, y, lse, temperature = res
  cd = lse.dtype
  n = x.shape[0]
  shards = Shards(opts, w.shape[opts.vocab_axis])
  vocab = shards.total
  ct = opts.chunk_size
  counted = _counted(y, opts)
  if opts.reduction == "mean":
    g = g.astype(cd) / jnp.sum(counted).astype(cd)
  scale = jnp.where(opts.with_gradient(counted, y, vocab),
                    jnp.broadcast_to(g.astype(cd), counted.shape), 0.0)
  s = opts.label_smoothing
  xs, ys, ls, ss = (_chunks(x, ct), _chunks(jnp.where(counted, y, 0).astype(jnp.int32), ct),
                    _chunks(lse, ct), _chunks(scale, ct))
  gls = None if g_lse is None else _chunks(g_lse.astype(cd), ct)
  wdt = x.dtype  # the matmuls run in the activations' dtype

  def tile(start, size, acc):
    dx, dw, db, dtemp = acc
    wt, bt = _weight_tile(w, b, start, size, opts, wdt)

    def chunk(i, inner):
      dx, dwt, dbt, dtemp = inner
      xc, yc, lc, sc = xs[i], ys[i], ls[i], ss[i]
      z, t, u = _logits(xc, wt, bt, opts, cd, temperature)
      p = jnp.exp(z - lc[:, None])
      weight = opts.softmax_weight((yc >= 0) & (yc < vocab), lc)
      here = jnp.arange(size, dtype=jnp.int32)[None, :] == (
          yc - shards.offset - start)[:, None]
      pw = p if weight is None else p * weight[:, None]
      dz = pw - jnp.where(here, 1.0 - s, 0.0) - s / vocab  # (w.r.t. the capped logits)
      if temperature is None:
        dz = logits_chain(dz, t, opts) * sc[:, None]
        if gls is not None:  # every token's log-sum-exp (ignored ones' too) read elsewhere
          dz = dz + logits_chain(p * gls[i][:, None], t, opts)
      else:
        dz = dz * sc[:, None] + (0.0 if gls is None else p * gls[i][:, None])
        dz, share = temperature_chain(dz, t, u, temperature, opts)
        dtemp = dtemp + share
      dzw = dz.astype(wdt)
      # the weight gradient sums over the tokens (sharded or not): it has the tile's type
      like_w = _common.explicit_sharding(wt, xc)
      if opts.vocab_axis == 0:  # w [V, d]
        dxc = jax.lax.dot_general(dzw, wt, (((1,), (0,)), ((), ())), preferred_element_type=cd)
        dwt = dwt + jax.lax.dot_general(dzw, xc.astype(wdt), (((0,), (0,)), ((), ())),
                                        preferred_element_type=cd, out_sharding=like_w)
      else:  # w [d, V]
        dxc = jax.lax.dot_general(dzw, wt, (((1,), (1,)), ((), ())), preferred_element_type=cd)
        dwt = dwt + jax.lax.dot_general(xc.astype(wdt), dzw, (((0,), (0,)), ((), ())),
                                        preferred_element_type=cd, out_sharding=like_w)
      dx = jax.lax.dynamic_update_index_in_dim(dx, dx[i] + dxc, i, 0)
      if dbt is not None:
        dbt = dbt + jnp.sum(dz, axis=0)
      return dx, dwt, dbt, dtemp
    dx, dwt, dbt, dtemp = jax.lax.fori_loop(0, xs.shape[0], chunk, (
        dx, _zeros(wt, cd, x, lse, w), None if b is None else _zeros(bt, cd, x, lse, w),
        dtemp))
    dw = jax.lax.dynamic_update_slice_in_dim(dw, dwt.astype(w.dtype), start,
                                             axis=opts.vocab_axis)
    if db is not None:
      db = jax.lax.dynamic_update_slice_in_dim(db, dbt.astype(b.dtype), start, axis=0)
    return dx, dw, db, dtemp
  dtemp = None if temperature is None else _common.varying_like(
      jnp.zeros((), cd), x, lse, w)
  dx, dw, db, dtemp = _over_tiles(shards.local, opts.vocab_chunk_size, tile, (
      _zeros(xs, cd, x, lse, w), _zeros(w, w.dtype, x, lse, w),
      None if b is None else _zeros(b, b.dtype, x, lse, w), dtemp))
  dx = shards.sum(_unchunk(dx, n)).astype(x.dtype)  # (each shard's share of the vocabulary)
  if dtemp is not None:  # (summed over the tokens and the vocabulary's shards)
    dtemp = _common.cotangent_like(shards.sum(dtemp).astype(temperature.dtype).reshape(
        jnp.shape(temperature)), temperature)
  return (_common.cotangent_like(dx, x), _common.cotangent_like(dw, w),
          None if b is None else _common.cotangent_like(db, b), None, dtemp)


linear_cross_entropy.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def with_lse(x, w, b, y, opts: Options, temperature=None):
  """``(loss, correct, lse)``: :func:`linear_cross_entropy` and each token's float32
  log-sum-exp of its (capped) logits, differentiable: what :func:`invact_jax.invert` gives a
  program that also reads the log-sum-exp (a z-loss reduced on its own, a metric)."""
  loss, lse, counted, correct = _forward(x, w, b, y, opts, temperature)
  return _reduce(loss, counted, opts), correct, lse


def _fwd_lse(x, w, b, y, opts, temperature):
  loss, lse, counted, correct = _forward(x, w, b, y, opts, temperature)
  return (_reduce(loss, counted, opts), correct, lse), (x, w, b, y, lse, temperature)


def _bwd_lse(opts: Options, res, cts):
  g, _, g_lse = cts
  return _backward(opts, res, g, g_lse)


with_lse.defvjp(_fwd_lse, _bwd_lse)
