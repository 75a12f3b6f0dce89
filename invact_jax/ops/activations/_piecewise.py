"""Evaluation of the generated piecewise-Chebyshev fits, in plain jnp.

Only arithmetic, comparisons and ``where`` — no gathers — so the same code runs
in XLA and inside Pallas kernel bodies.  Pieces are selected per element by a
chain of ``where`` over their (few) coefficients, then one Clenshaw recurrence
runs in the compute dtype.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from invact_jax.ops.activations import _fits as _inverse_fits

__all__ = ["InverseFit", "FIT", "evaluate", "clenshaw", "chebyshev_pieces", "piece_index"]


@dataclasses.dataclass(frozen=True)
class Piece:
  lo: float
  hi: float
  coeffs: tuple[float, ...]

  @property
  def mid(self) -> float:
    return 0.5 * (self.lo + self.hi)

  @property
  def inv_half(self) -> float:
    return 2.0 / (self.hi - self.lo)


def _pieces(d) -> tuple[Piece, ...]:
  b = d["breaks"]
  return tuple(Piece(b[i], b[i + 1], tuple(c)) for i, c in enumerate(d["coeffs"]))


@dataclasses.dataclass(frozen=True)
class InverseFit:
  """Branch point and fits of f'(f^-1(y)) for one non-monotone activation."""
  name: str
  x_min: float          # float64 value
  x_min32: float        # rounded to float32: bit = (float32(x) < x_min32)
  y_min_hi: float       # y_min = y_min_hi + y_min_lo (float32 pair)
  y_min_lo: float
  sigma_right_end: float  # g == 1 beyond
  y_split: float        # left branch: near-minimum fit for y <= y_split, tail fit above
  right: tuple[Piece, ...]      # variable +sqrt(y - y_min)
  left_near: tuple[Piece, ...]  # variable -sqrt(y - y_min)
  left_tail: tuple[Piece, ...]  # variable sqrt(-log(-y)), fits f'/y


FIT = {
    name: InverseFit(
        name=name, x_min=d["x_min"], x_min32=d["x_min32"], y_min_hi=d["y_min_hi32"],
        y_min_lo=d["y_min_lo32"], sigma_right_end=d["sigma_right_end"], y_split=d["y_split"],
        right=_pieces(d["right"]), left_near=_pieces(d["left_near"]),
        left_tail=_pieces(d["left_tail"]))
    for name, d in _inverse_fits.FITS.items()
}


def clenshaw(t, coeffs):
  """Chebyshev series sum_k coeffs[k] T_k(t) by the Clenshaw recurrence, in the dtype of t."""
  b1 = jnp.zeros_like(t)
  b2 = jnp.zeros_like(t)
  t2 = 2.0 * t
  for c in reversed(coeffs[1:]):
    b1, b2 = t2 * b1 - b2 + c, b1
  return t * b1 - b2 + coeffs[0]


def chebyshev_pieces(var, idx, pieces):
  """sum_k c_k T_k((var - mid) / half) with the piece ``pieces[idx]`` chosen per element.

  Coefficients are selected by a chain of ``where`` (no gathers: it runs in kernel bodies).
  """
  dt = var.dtype

  def pick(values):
    out = jnp.full(var.shape, values[0], dt)
    for i, v in enumerate(values[1:], start=1):
      out = jnp.where(idx == i, jnp.asarray(v, dt), out)
    return out

  mid = pick([p.mid for p in pieces])
  inv_half = pick([p.inv_half for p in pieces])
  t = jnp.clip((var - mid) * inv_half, -1.0, 1.0)
  ncoef = len(pieces[0].coeffs)
  return clenshaw(t, [pick([p.coeffs[k] for p in pieces]) for k in range(ncoef)])


def piece_index(var, pieces):
  """Index of the piece containing ``var`` (clamped to the first/last piece)."""
  idx = jnp.zeros(var.shape, jnp.int32)
  for p in pieces[1:]:
    idx = idx + (var >= jnp.asarray(p.lo, var.dtype)).astype(jnp.int32)
  return idx



def evaluate(fit: InverseFit, y, left):
  """g(y, left) ~ f'(f^-1(y)) in the dtype of ``y`` (float32 or float64).

  Args:
    fit: the activation's :class:`InverseFit`.
    y: stored outputs, already cast to the compute dtype.
    left: boolean, True where x < x_min.
  """
  dt = y.dtype
  # y_min = hi + lo as a float32 pair; y - hi is exact near the minimum.  ``lo`` is made
  # data-dependent (times exactly 1) so that XLA's simplifier cannot fold (y - hi) - lo
  # into y - (hi + lo), which would lose lo; unlike an optimization barrier this keeps the
  # backward in one fusion.
  one = 1.0 + 0.0 * jnp.minimum(jnp.abs(y), 1.0)
  d = (y - jnp.asarray(fit.y_min_hi, dt)) - jnp.asarray(fit.y_min_lo, dt) * one
  s = jnp.sqrt(jnp.maximum(d, 0.0))
  tiny = jnp.finfo(dt).tiny
  w = jnp.sqrt(-jnp.log(jnp.clip(-y, tiny, 1.0)))
  near = y <= jnp.asarray(fit.y_split, dt)
  tail = left & ~near
  var = jnp.where(left, jnp.where(near, -s, w), s)
  # Global piece list: right pieces, then left-near, then left-tail; one index each.
  groups = ((fit.right, ~left), (fit.left_near, left & near), (fit.left_tail, tail))
  pieces = [p for group, _ in groups for p in group]
  idx = jnp.zeros(y.shape, jnp.int32)
  offset = 0
  for group, member in groups:
    local = jnp.zeros(y.shape, jnp.int32)
    for p in group[1:]:
      local = local + (var >= jnp.asarray(p.lo, dt)).astype(jnp.int32)
    idx = jnp.where(member, offset + local, idx)
    offset += len(group)

  val = chebyshev_pieces(var, idx, pieces)
  g = jnp.where(tail, y * val, val)
  g = jnp.where(~left & (s >= jnp.asarray(fit.sigma_right_end, dt)), jnp.ones_like(g), g)
  # y = NaN: from x = NaN (bit 0) -> NaN; from x = -inf (bit 1; jax.nn gives -inf * 0 = NaN)
  # -> the limit f'(-inf) = 0.
  return jnp.where(jnp.isnan(y), jnp.where(left, jnp.zeros_like(g), jnp.full_like(g, jnp.nan)), g)
