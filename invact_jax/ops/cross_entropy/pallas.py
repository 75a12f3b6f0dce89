"""Pallas implementation of :func:`invact_jax.linear_cross_entropy`: the fused kernels of
:mod:`pallas_kernels.cross_entropy`, in which no tile of logits leaves the chip.

The forward kernel gives each token's log-sum-exp, label logit, logit sum and argmax; the
loss is assembled from them here with the XLA path's own formula (:class:`.base.Options`), so
both implementations compute the same loss from the same statistics.  The backward kernel
recomputes each tile's logits and adds its gradients into float32 ``dx``, ``dw`` and ``db``
(atomic adds: deterministic to float32 rounding only).  It keeps what the XLA path's
recomputing backward keeps: ``x``, ``w``, the labels and a float32 log-sum-exp per token.

Tokens split over devices run where they are (:func:`invact_jax.ops._partition.tokens`): each
device's kernels see its tokens and the whole weight, and the weight's gradient is each
device's sum, added up — no token is gathered, under ``jit`` with sharded tokens, a mesh with
explicit axes, or inside ``shard_map``.  Where a kernel cannot run as one (Pallas's
interpreter inside ``shard_map``, a CPU-testing limit) the same statistics and gradients are
computed by XLA (:func:`pallas_kernels.cross_entropy.forward_math`).

``implementation="pallas"`` runs it (interpret mode without a GPU; the backward recomputes
the logits whatever ``gradients`` defaults to); ``invact_jax.Implementation(name="pallas",
block_rows=..., num_warps=..., skip_below=...)`` sets its token block, warps and gradient
filter.  What it does not do (the XLA implementation does): a vocabulary split over devices
(``vocab_axis_name``), and what only :func:`invact_jax.invert` asks of a head (the program's
bfloat16 rounding of the logits, a one-hot's or a gather's values for labels outside the
vocabulary, a traced temperature); :meth:`PallasCrossEntropy.unsupported` names it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops import _partition
from invact_jax.ops.cross_entropy import base

__all__ = ["PallasCrossEntropy"]


@dataclasses.dataclass(frozen=True)
class PallasCrossEntropy(_implementation.ImplementationBase):
  """The fused Pallas kernels (Triton lowering on a GPU, interpret mode for tests).

  Attributes (besides :class:`~invact_jax.ops._implementation.ImplementationBase`'s):
    skip_below: a backward tile whose largest logits-gradient entry is below this adds
      nothing (Cut Cross-Entropy's gradient filtering; None, the default: every tile adds).
      docs/lm-head.md measures what it costs in gradient error.
  """
  name: ClassVar[str] = "pallas"
  skip_below: float | None = None

  def tiles(self):
    """The kernels' block sizes: ``block_rows`` tokens (default 64) by 128 vocabulary
    entries, 64 of the contraction per step; ``num_warps`` (default 4)."""
    from pallas_kernels import cross_entropy as kernels  # pylint: disable=import-outside-toplevel
    return kernels.Tiles(block_t=self.block_rows or 64, num_warps=self.num_warps or 4)

  def unsupported(self, opts: base.Options) -> str | None:
    """Why ``opts`` cannot run here, or None."""
    if opts.vocab_axis_name is not None:
      return "a vocabulary split over devices (vocab_axis_name)"
    if opts.logits_dtype is not None or opts.outside_lse is not None or opts.outside_nearest \
        or not opts.outside_gradient:
      return "the program-specific roundings and outside-label values invert's head keeps"
    return None

  def loss(self, x, w, b, y, opts: base.Options):
    """``(reduced loss, correct)`` of tokens ``x`` [N, d]."""
    return _head(x, w, b, y, opts, self)


def _labels_counted(y, opts: base.Options):
  counted = base._counted(y, opts)  # pylint: disable=protected-access
  return counted, jnp.where(counted, y, -1).astype(jnp.int32)


def _statistics(x, w, b, y, opts: base.Options, impl: PallasCrossEntropy):
  """``(per-token loss, lse, counted, correct)`` from the forward kernel."""
  from pallas_kernels import cross_entropy as kernels  # pylint: disable=import-outside-toplevel
  vocab = w.shape[opts.vocab_axis]
  counted, labels = _labels_counted(y, opts)

  def run(x, w, labels, b):
    kw = dict(vocab_axis=opts.vocab_axis, scale=opts.logit_scale,
              soft_cap=opts.logit_soft_cap, tiles=impl.tiles())
    if _partition.run_tile_math_directly(impl, x):
      return kernels.forward_math(x, w, labels, b, **kw)
    return kernels.forward(x, w, labels, b, interpret=impl.interpret, **kw)
  # per shard of the tokens: the weight whole on each, the statistics where their tokens are
  lse, picked, zsum, first = _partition.tokens(
      run, (True, False, True, False), (False,) * 4, x, w, labels, b,
      per_shard=_partition.per_shard(impl))
  inside = (labels >= 0) & (labels < vocab)
  s = opts.label_smoothing
  loss = lse - (1.0 - s) * opts.outside(inside, picked, lse)
  if s:
    loss = loss - s * zsum / vocab
  if opts.z_loss:
    loss = loss + opts.z_loss * lse * lse
  correct = counted & inside & (first == labels)
  return jnp.where(counted, loss, 0.0), lse, counted, correct


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head(x, w, b, y, opts: base.Options, impl: PallasCrossEntropy):
  loss, _, counted, correct = _statistics(x, w, b, y, opts, impl)
  return base._reduce(loss, counted, opts), correct  # pylint: disable=protected-access


def _head_fwd(x, w, b, y, opts, impl):
  loss, lse, counted, correct = _statistics(x, w, b, y, opts, impl)
  return (base._reduce(loss, counted, opts), correct), (x, w, b, y, lse)  # pylint: disable=protected-access


def _head_bwd(opts: base.Options, impl: PallasCrossEntropy, res, cts):
  """The fused kernels' backward: the logits recomputed per tile on the chip, ``dx`` and ``dw``
  (and ``db``) accumulated in float32, scaled by the cotangent (over the counted tokens for a
  mean)."""
  from pallas_kernels import cross_entropy as kernels  # pylint: disable=import-outside-toplevel
  x, w, b, y, lse = res
  g, _ = cts  # (``correct`` has no gradient)
  counted, labels = _labels_counted(y, opts)
  g = g.astype(jnp.float32)
  if opts.reduction == "mean":
    g = g / jnp.sum(counted).astype(jnp.float32)
  weights = jnp.where(counted, jnp.broadcast_to(g, counted.shape), 0.0)

  def run(x, w, labels, b, lse, weights):
    kw = dict(vocab_axis=opts.vocab_axis, scale=opts.logit_scale,
              soft_cap=opts.logit_soft_cap, smoothing=opts.label_smoothing, z_loss=opts.z_loss,
              skip_below=impl.skip_below, tiles=impl.tiles())
    if _partition.run_tile_math_directly(impl, x):
      grads = kernels.backward_math(x, w, labels, b, lse, weights, **kw)
    else:
      grads = kernels.backward(x, w, labels, b, lse, weights, interpret=impl.interpret, **kw)
    return grads if b is not None else grads[:2]
  # per shard of the tokens: dx where its tokens are, dw and db each shard's sum, added up
  summed = (False, True, True) if b is not None else (False, True)
  dx, dw, *db = _partition.tokens(run, (True, False, True, False, True, True), summed,
                                  x, w, labels, b, lse, weights,
                                  per_shard=_partition.per_shard(impl))
  db = db[0] if db else None
  return (_common.cotangent_like(dx.astype(x.dtype), x), _common.cotangent_like(dw.astype(w.dtype), w),
          None if b is None else _common.cotangent_like(db.astype(b.dtype), b), None)


_head.defvjp(_head_fwd, _head_bwd)
