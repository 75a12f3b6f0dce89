"""The LM head's fused kernels: each [tokens, vocabulary] tile of logits is computed, consumed
and dropped on chip — no logits (or their gradient) are ever written to device memory.

* :func:`forward`: one program per block of tokens walks the vocabulary in tiles; per tile it
  contracts ``x`` with the weight (the weight read in its own dtype — a float32 master weight
  included — and cast to the tokens' dtype in the kernel, never copied), adds the bias,
  scales and soft-caps, and folds the tile into each token's online log-sum-exp, its label's
  logit, the sum of its logits (label smoothing) and its argmax (first index of the largest).
* :func:`backward`: one program per (token block, vocabulary tile) recomputes the tile's
  logits, forms its logits gradient ``g * (softmax * (1 + 2 zl lse) - (1 - s) onehot - s / V)``
  (through the soft cap and the scale) and adds ``dz @ w_tileᵀ`` into ``dx`` and
  ``x_blockᵀ @ dz`` into ``dw`` (and ``dz``'s column sums into ``db``) with atomic adds in
  float32: the sums' order varies from run to run (to float32 rounding; the XLA path is
  deterministic).  Optionally (``skip_below``) a tile whose largest gradient entry is below a
  threshold adds nothing (Cut Cross-Entropy's gradient filtering; off by default).

The loss math is the caller's (``invact_jax.ops.cross_entropy.pallas``); ``interpret=True``
runs the same kernels in Pallas's interpreter (CPU tests).  Block sizes are static:
``block_t`` tokens, ``block_v`` vocabulary entries and ``block_k`` of the contraction per step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import out_struct, varying_like

__all__ = ["Tiles", "forward", "backward", "forward_math", "backward_math"]


class Tiles:
  """A kernel's static block sizes and warps."""

  def __init__(self, block_t: int = 64, block_v: int = 128, block_k: int = 64,
               num_warps: int = 4, num_stages: int = 2):
    for name, v in (("block_t", block_t), ("block_v", block_v), ("block_k", block_k)):
      if v < 16 or v & (v - 1):
        raise ValueError(f"argument `{name}` must be a power of two >= 16, got {v}")
    self.t, self.v, self.k = block_t, block_v, block_k
    self.num_warps, self.num_stages = num_warps, num_stages

  def params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)

  def __repr__(self):
    return f"Tiles({self.t}, {self.v}, {self.k}, warps={self.num_warps})"


def _logits_tile(x_ref, w_ref, b_ref, r0, c0, *, n, d, vocab, tiles, vocab_axis, dot_dtype,
                 scale, cap, precision):
  """``(z, rmask, cmask)``: the capped logits of rows ``[r0, r0 + t)`` and vocabulary entries
  ``[c0, c0 + v)`` (float32, -inf outside the vocabulary) and which rows and entries exist.
  The operands are padded to whole tiles (:func:`_padded`): every load lies inside them."""
  t, v, k = tiles.t, tiles.v, tiles.k
  rmask = r0 + jnp.arange(t) < n
  cmask = c0 + jnp.arange(v) < vocab

  def step(i, acc):
    xb = x_ref[pl.ds(r0, t), pl.ds(i * k, k)].astype(dot_dtype)
    if vocab_axis == 1:
      wb = w_ref[pl.ds(i * k, k), pl.ds(c0, v)].astype(dot_dtype)
      return acc + plgpu.dot(xb, wb, precision=precision)
    wb = w_ref[pl.ds(c0, v), pl.ds(i * k, k)].astype(dot_dtype)
    return acc + plgpu.dot(xb, wb, trans_b=True, precision=precision)
  u = lax.fori_loop(0, d // k, step, jnp.zeros((t, v), jnp.float32))
  z = _capped_logits(u, None if b_ref is None else b_ref[pl.ds(c0, v)], scale=scale, cap=cap)
  return jnp.where(cmask[None, :], z, -jnp.inf), rmask, cmask


def _capped_logits(u, bias, *, scale: float, cap: float | None):
  """The logits from the float32 products ``u`` [rows, entries]: plus ``bias`` (read in float32;
  None: none), times ``scale``, through the soft cap ``cap * tanh(. / cap)`` (None: none)."""
  if bias is not None:
    u = u + bias.astype(jnp.float32)[None, :]
  if scale != 1.0:
    u = u * scale
  return cap * jnp.tanh(u / cap) if cap is not None else u


def _padded(a, multiples, value=0):
  """``a`` padded at the end of each axis to a multiple of ``multiples`` (a copy only where a
  size is not one already: the usual model shapes are)."""
  pads = [(0, -s % m) for s, m in zip(a.shape, multiples)]
  return a if not any(p for _, p in pads) else jnp.pad(a, pads, constant_values=value)


def _fwd_kernel(*refs, n, d, vocab, tiles, vocab_axis, dot_dtype, scale, cap, has_bias,
                precision):
  """One block of tokens' statistics: walks the vocabulary tile by tile into the online
  log-sum-exp, the label's logit, the logit sum and the first argmax."""
  it = iter(refs)
  x_ref, w_ref = next(it), next(it)
  b_ref = next(it) if has_bias else None
  y_ref = next(it)
  lse_ref, picked_ref, zsum_ref, first_ref = next(it), next(it), next(it), next(it)
  t, v = tiles.t, tiles.v
  r0 = pl.program_id(0) * t
  label = y_ref[pl.ds(r0, t)]

  def tile(j, carry):
    m, s, picked, zsum, top, first = carry
    c0 = j * v
    z, _, cmask = _logits_tile(x_ref, w_ref, b_ref, r0, c0, n=n, d=d, vocab=vocab, tiles=tiles,
                               vocab_axis=vocab_axis, dot_dtype=dot_dtype, scale=scale, cap=cap,
                               precision=precision)
    cols = c0 + jnp.arange(v)
    tmax = jnp.max(z, axis=1)
    m_new = jnp.maximum(m, tmax)
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
    picked = picked + jnp.sum(jnp.where(cols[None, :] == label[:, None], z, 0.0), axis=1)
    zsum = zsum + jnp.sum(jnp.where(cmask[None, :], z, 0.0), axis=1)
    # the tile's first largest entry (a NaN the largest, as jnp.argmax)
    nan = jnp.isnan(z)
    tnan = jnp.max(nan.astype(jnp.int32), axis=1) > 0  # (no reduce_or in Triton)
    big = jnp.int32(2**30)
    tfirst = jnp.where(tnan, jnp.min(jnp.where(nan, cols[None, :], big), axis=1),
                       jnp.min(jnp.where(z == tmax[:, None], cols[None, :], big), axis=1))
    tmax = jnp.where(tnan, jnp.nan, tmax)
    later = (tmax > top) | (tnan & ~jnp.isnan(top))
    return (m_new, s, picked, zsum, jnp.where(later, tmax, top),
            jnp.where(later, tfirst, first))
  lowest = jnp.full((t,), -jnp.inf, jnp.float32)
  zero = jnp.zeros((t,), jnp.float32)
  m, s, picked, zsum, _, first = lax.fori_loop(
      0, pl.cdiv(vocab, v), tile, (lowest, zero, zero, zero, lowest, jnp.zeros((t,), jnp.int32)))
  rows_at = pl.ds(r0, t)
  lse_ref[rows_at] = m + jnp.log(s)
  picked_ref[rows_at] = picked
  zsum_ref[rows_at] = zsum
  first_ref[rows_at] = first


def _precision(dot_dtype):
  """Exact float32 products for float32 operands (no TF32), as XLA's default here."""
  return lax.Precision.HIGHEST if jnp.dtype(dot_dtype) == jnp.float32 else None


def forward(x, w, labels, bias=None, *, vocab_axis: int = 1, scale: float = 1.0,
            soft_cap: float | None = None, tiles: Tiles | None = None,
            interpret: bool = False):
  """Per token of ``x`` [N, d] against the weight ``w`` ([d, V] for ``vocab_axis=1``, [V, d]
  for 0) and integer ``labels`` [N]: ``(lse, picked, zsum, first)``: the float32 log-sum-exp of
  its logits ``softcap((x @ w + bias) * scale)``, the logit at its label (0 where the label lies
  outside ``[0, V)``), the sum of its logits, and the index of its first largest logit."""
  tiles = tiles or Tiles()
  n, d = x.shape
  vocab = w.shape[vocab_axis]
  xp, wp, bp = _padded(x, (tiles.t, tiles.k)), _pad_weight(w, vocab_axis, tiles), (
      None if bias is None else _padded(bias, (tiles.v,)))
  yp = _padded(labels.astype(jnp.int32), (tiles.t,), -1)
  kernel = functools.partial(
      _fwd_kernel, n=n, d=xp.shape[1], vocab=vocab, tiles=tiles, vocab_axis=vocab_axis,
      dot_dtype=x.dtype, scale=float(scale), cap=None if soft_cap is None else float(soft_cap),
      has_bias=bias is not None, precision=_precision(x.dtype))
  rows = xp.shape[0]
  f32 = out_struct((rows,), jnp.float32, x, w, labels)
  call = pl.pallas_call(
      kernel, grid=(rows // tiles.t,),
      out_shape=[f32, f32, f32, out_struct((rows,), jnp.int32, x, w, labels)],
      compiler_params=tiles.params(), interpret=interpret, name="invact_head_forward")
  args = [xp, wp] + ([bp] if bias is not None else []) + [yp]
  return tuple(o[:n] for o in call(*args))


def _pad_weight(w, vocab_axis: int, tiles: Tiles):
  """``w`` padded to whole tiles: the contraction to ``block_k``, the vocabulary to
  ``block_v``."""
  return _padded(w, (tiles.k, tiles.v) if vocab_axis == 1 else (tiles.v, tiles.k))


def _logits_gradient(z, cols, label, lse, g, *, vocab, smoothing, z_loss, cap, scale):
  """The loss's gradient with respect to the pre-cap logits of rows ``label``/``lse``/``g`` and
  vocabulary entries ``cols``, from their capped logits ``z``: ``g * (softmax * (1 + 2 zl lse)
  - (1 - s) onehot - s / V)``, through the soft cap and the scale."""
  p = jnp.exp(z - lse[:, None])
  if z_loss:
    p = p * (1.0 + 2.0 * z_loss * lse)[:, None]
  dz = p - jnp.where(cols[None, :] == label[:, None], 1.0 - smoothing, 0.0)
  if smoothing:
    dz = dz - smoothing / vocab
  dz = dz * g[:, None]
  if cap is not None:
    dz = dz * (1.0 - (z / cap) ** 2)
  if scale != 1.0:
    dz = dz * scale
  return dz


def _bwd_kernel(*refs, n, d, vocab, tiles, vocab_axis, dot_dtype, scale, cap, has_bias,
                smoothing, z_loss, skip_below, precision):
  """One (token block, vocabulary tile): its logits recomputed, their gradient formed and
  added into ``dx``, ``dw`` and ``db`` with atomic adds (unless the filter drops the tile)."""
  it = iter(refs)
  x_ref, w_ref = next(it), next(it)
  b_ref = next(it) if has_bias else None
  y_ref, lse_ref, g_ref = next(it), next(it), next(it)
  _, _, _ = next(it), next(it), next(it)  # (the accumulators' inputs, aliased to the outputs)
  dx_ref, dw_ref, db_ref = next(it), next(it), next(it)
  t, v, k = tiles.t, tiles.v, tiles.k
  r0, c0 = pl.program_id(0) * t, pl.program_id(1) * v
  z, rmask, cmask = _logits_tile(x_ref, w_ref, b_ref, r0, c0, n=n, d=d, vocab=vocab,
                                 tiles=tiles, vocab_axis=vocab_axis, dot_dtype=dot_dtype,
                                 scale=scale, cap=cap, precision=precision)
  rows_at = pl.ds(r0, t)
  label, lse, g = y_ref[rows_at], lse_ref[rows_at], g_ref[rows_at]
  dz = _logits_gradient(z, c0 + jnp.arange(v), label, lse, g, vocab=vocab, smoothing=smoothing,
                        z_loss=z_loss, cap=cap, scale=scale)
  dz = jnp.where(cmask[None, :] & rmask[:, None], dz, 0.0)  # (last: -inf logits outside)

  def add():
    if b_ref is not None:
      plgpu.atomic_add(db_ref, pl.ds(c0, v), jnp.sum(dz, axis=0))
    dzw = dz.astype(dot_dtype)

    @pl.loop(0, d // k)
    def _(i):
      ks = pl.ds(i * k, k)
      xb = x_ref[rows_at, ks].astype(dot_dtype)
      if vocab_axis == 1:
        wb = w_ref[ks, pl.ds(c0, v)].astype(dot_dtype)
        plgpu.atomic_add(dw_ref, (ks, pl.ds(c0, v)),
                         plgpu.dot(xb, dzw, trans_a=True, precision=precision))    # [k, v]
        dx_part = plgpu.dot(dzw, wb, trans_b=True, precision=precision)           # [t, k]
      else:
        wb = w_ref[pl.ds(c0, v), ks].astype(dot_dtype)
        plgpu.atomic_add(dw_ref, (pl.ds(c0, v), ks),
                         plgpu.dot(dzw, xb, trans_a=True, precision=precision))    # [v, k]
        dx_part = plgpu.dot(dzw, wb, precision=precision)                         # [t, k]
      plgpu.atomic_add(dx_ref, (rows_at, ks), dx_part)

  if skip_below is None:
    add()
  else:  # a tile whose every gradient entry is below the threshold adds nothing
    lax.cond(jnp.max(jnp.abs(dz)) >= skip_below, add, lambda: None)


def backward(x, w, labels, bias, lse, g, *, vocab_axis: int = 1, scale: float = 1.0,
             soft_cap: float | None = None, smoothing: float = 0.0, z_loss: float = 0.0,
             skip_below: float | None = None, tiles: Tiles | None = None,
             interpret: bool = False):
  """``(dx [N, d], dw (w's layout), db [V] or None)``, float32: the gradients of
  ``sum_i g_i * loss_i`` with ``loss_i = (1 + zl lse_i) lse_i - (1 - s) z_i[y_i] - s mean(z_i)``
  (a label outside ``[0, V)``, -1 for an ignored token, has no one-hot), from the forward's
  ``lse`` [N] and per-token weights ``g`` [N] (0 for tokens that do not count).  ``skip_below``:
  a tile whose largest ``|dz|`` lies below it adds nothing (None: every tile adds)."""
  tiles = tiles or Tiles()
  n, d = x.shape
  vocab = w.shape[vocab_axis]
  xp, wp = _padded(x, (tiles.t, tiles.k)), _pad_weight(w, vocab_axis, tiles)
  bp = None if bias is None else _padded(bias, (tiles.v,))
  rows, dp = xp.shape
  kernel = functools.partial(
      _bwd_kernel, n=n, d=dp, vocab=vocab, tiles=tiles, vocab_axis=vocab_axis,
      dot_dtype=x.dtype, scale=float(scale), cap=None if soft_cap is None else float(soft_cap),
      has_bias=bias is not None, smoothing=float(smoothing), z_loss=float(z_loss),
      skip_below=skip_below, precision=_precision(x.dtype))
  # (inside shard_map the accumulators vary as the tokens do: each shard adds its own)
  zeros = [varying_like(jnp.zeros(shape, jnp.float32), x, w, g)
           for shape in (xp.shape, wp.shape, (wp.shape[vocab_axis],))]
  base = 2 + (bias is not None) + 3
  call = pl.pallas_call(
      kernel, grid=(rows // tiles.t, wp.shape[vocab_axis] // tiles.v),
      out_shape=[out_struct(z.shape, jnp.float32, x, w, g) for z in zeros],
      input_output_aliases={base: 0, base + 1: 1, base + 2: 2},
      compiler_params=tiles.params(), interpret=interpret, name="invact_head_backward")
  args = ([xp, wp] + ([bp] if bias is not None else [])
          + [_padded(labels.astype(jnp.int32), (tiles.t,), -1),
             _padded(lse.astype(jnp.float32), (tiles.t,)), _padded(g.astype(jnp.float32), (tiles.t,))]
          + zeros)
  dx, dw, db = call(*args)
  dw = dw[:d, :vocab] if vocab_axis == 1 else dw[:vocab, :d]
  return dx[:n, :d], dw, (db[:vocab] if bias is not None else None)


def _logits_math(x, w, bias, *, vocab_axis: int, scale: float, soft_cap: float | None):
  """All of :func:`_logits_tile`'s tiles at once (float32 [N, V])."""
  dot_dtype = x.dtype
  wt = w.astype(dot_dtype)
  u = jnp.dot(x, wt if vocab_axis == 1 else wt.T, precision=_precision(dot_dtype),
              preferred_element_type=jnp.float32)
  return _capped_logits(u, bias, scale=scale, cap=soft_cap)


def forward_math(x, w, labels, bias=None, *, vocab_axis: int = 1, scale: float = 1.0,
                 soft_cap: float | None = None, tiles: Tiles | None = None):
  """:func:`forward`'s statistics computed by XLA over the whole [N, V] logits at once (where a
  kernel cannot run as one: Pallas's interpreter inside ``shard_map``, which does not track
  the mesh axes values vary over); the same math, rounded as XLA rounds it."""
  del tiles
  z = _logits_math(x, w, bias, vocab_axis=vocab_axis, scale=float(scale), soft_cap=soft_cap)
  cols = jnp.arange(z.shape[1])
  picked = jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
  return (jax.nn.logsumexp(z, axis=1), picked, jnp.sum(z, axis=1),
          jnp.argmax(z, axis=1).astype(jnp.int32))


def backward_math(x, w, labels, bias, lse, g, *, vocab_axis: int = 1, scale: float = 1.0,
                  soft_cap: float | None = None, smoothing: float = 0.0, z_loss: float = 0.0,
                  skip_below: float | None = None, tiles: Tiles | None = None):
  """:func:`backward`'s gradients computed by XLA over the whole [N, V] logits at once (as
  :func:`forward_math`); ``skip_below`` drops the same tiles (``tiles``' token blocks by
  vocabulary tiles) as the kernel."""
  tiles = tiles or Tiles()
  z = _logits_math(x, w, bias, vocab_axis=vocab_axis, scale=float(scale), soft_cap=soft_cap)
  n, vocab = z.shape
  dz = _logits_gradient(z, jnp.arange(vocab), labels, lse, g, vocab=vocab,
                        smoothing=float(smoothing), z_loss=float(z_loss), cap=soft_cap,
                        scale=float(scale))
  if skip_below is not None:
    blocks = _padded(dz, (tiles.t, tiles.v))
    r, c = blocks.shape[0] // tiles.t, blocks.shape[1] // tiles.v
    big = jnp.max(jnp.abs(blocks.reshape(r, tiles.t, c, tiles.v)), axis=(1, 3)) >= skip_below
    keep = jnp.repeat(jnp.repeat(big, tiles.t, axis=0), tiles.v, axis=1)[:n, :vocab]
    dz = jnp.where(keep, dz, 0.0)
  dzw = dz.astype(x.dtype)
  wt = w.astype(x.dtype)
  prec = _precision(x.dtype)
  f32 = jnp.float32
  dx = jnp.dot(dzw, wt.T if vocab_axis == 1 else wt, precision=prec, preferred_element_type=f32)
  dw = (jnp.dot(x.T, dzw, precision=prec, preferred_element_type=f32) if vocab_axis == 1 else
        jnp.dot(dzw.T, x, precision=prec, preferred_element_type=f32))
  return dx, dw, (jnp.sum(dz, axis=0) if bias is not None else None)


def flops(n: int, d: int, vocab: int) -> dict[str, float]:
  """The kernels' matmul FLOPs: the forward's logits, the backward's recomputed logits and its
  two gradient products."""
  one = 2.0 * n * d * vocab
  return {"forward": one, "backward": 3 * one}

