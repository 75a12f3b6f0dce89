"""The norm rule: a LayerNorm or RMSNorm over any axes, found by its algebra
(:func:`._algebra.find_norms`), runs as a ``custom_vjp`` whose forward is the program's own
equations and whose residuals are ``xhat``, the float32 ``rstd`` per row and the parameters.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _algebra
from invact_jax.convert import graph as _graph
from invact_jax.convert import _match
from invact_jax.convert import _rule
from invact_jax.ops import _common
from invact_jax.ops.norms import base as _norm_base

__all__ = ["NormRule", "NormVJP"]


class NormVJP:
  """A norm found by its algebra: the program's equations forward; residuals xhat (in
  ``m.store``), rstd (compute dtype, per row) and the parameters' sources; the backward is
  invact_jax's norm backward (the implementation's row kernels when the statistics are over
  the last axis and the scale is a vector along it, XLA's over other axes), the parameters'
  gradients the VJP of ``xhat * scale + bias`` in them (so a folded or ``1 + weight`` scale
  is differentiated as the program wrote it).  The fused norm -> matmul units
  (:mod:`._fusion`) reuse :meth:`residuals`, :meth:`recompute` and :meth:`backward`."""

  def __init__(self, m: _algebra.NormMatch, region, implementation, target):
    self.m, self.region, self.implementation = m, region, implementation
    self.x_aval = _match.aval(target, m.inputs[0])
    self.out_aval = target.avals[target.nodes[m.root].outs[m.root_out]]
    self.ndim = len(self.x_aval.shape)
    self.rows_kernel = (m.layout == tuple(range(self.ndim)) and m.axes == (self.ndim - 1,)
                        and m.eps_mode == "var")
    self.sources = sorted({p[0] for p in m.params if p is not None and p[0] != "const"})
    self.target = target
    # No affine, the output in x's layout and in the dtype xhat is kept in: the output *is*
    # xhat (to rounding), so it is kept as xhat (one tensor, shared with its readers).
    self.output_is_xhat = (m.scale == {(): 1.0} and not m.bias
                           and m.layout == tuple(range(self.ndim))
                           and np.dtype(self.out_aval.dtype) == np.dtype(m.store)
                           and tuple(self.out_aval.shape) == tuple(self.x_aval.shape))

  def _symbols(self, src_vals: dict) -> list:
    """The parameters, each in the layout of ``x``."""
    out = []
    for p in self.m.params:
      if p is None:
        out.append(None)
        continue
      if p[0] == "const":
        v = jnp.asarray(p[1])
      else:
        v = src_vals[p[0]]
        for j in p[1]:
          v = _graph.bind(self.target.nodes[j], [v])[0]
      out.append(_algebra.to_x(v, p[2], self.ndim))
    return out

  def _affine(self, xh, src):
    """``(scale, bias)`` in the layout of ``x`` and the dtype of ``xh``."""
    m, cd = self.m, xh.dtype
    syms = self._symbols(dict(zip(self.sources, src)))
    scale = _algebra.evaluate_poly(m.scale, syms, xh) if m.scale else jnp.zeros((), cd)
    bias = _algebra.evaluate_poly(m.bias, syms, xh) if m.bias else jnp.zeros((), cd)
    return scale, bias

  def residuals(self, vals, z) -> tuple:
    """``(xhat, rstd, parameter sources)`` from the region's input values and output; under
    a floor, also the rows' projection factors (which side of the floor each row is on)."""
    m = self.m
    xhat, rstd, side = _norm_base.statistics(vals[0], m.rms, m.eps, m.axes, m.eps_mode)
    xhat = z if self.output_is_xhat else xhat.astype(m.store)
    res = (xhat, rstd, tuple(vals[i] for i in self.sources))
    return res if side is None else (*res, side)

  def recompute(self, res):
    """The norm's output recomputed from the residuals (``xhat * scale + bias`` in the compute
    dtype, then in the output's layout and dtype)."""
    xhat, rstd, src, *_ = res
    xh = xhat.astype(rstd.dtype)
    scale, bias = self._affine(xh, src)
    z = _algebra.from_x(xh * scale + bias, self.m.layout, tuple(self.out_aval.shape))
    return z.astype(self.out_aval.dtype)

  def backward(self, res, dz) -> tuple:
    """Cotangents of the region's inputs (None for constants) from the output's ``dz``."""
    m, ndim = self.m, self.ndim
    xhat, rstd, src, *factor = res
    cd = rstd.dtype
    xh, dzc = xhat.astype(cd), _algebra.to_x(dz.astype(cd), m.layout, ndim)
    scale, _ = self._affine(xh, src)
    n = self.x_aval.shape[-1]
    if self.rows_kernel and math.prod(jnp.shape(scale)) in (1, n) and xhat.size:
      vec = None if m.scale == {(): 1.0} else \
          jnp.broadcast_to(jnp.reshape(scale, (-1,)), (n,)).astype(cd)
      dx = _norm_base.kernel_or_xla(self.implementation, xhat).backward_dx(
          m.rms, xhat, rstd, dz, vec, self.x_aval.dtype)
    else:
      # the projection's term times a factor per row (to xhat times its square root): x /
      # (std + eps): (std + eps) / std = 1 / (1 - eps rstd) (a constant row's NaN, as sqrt's
      # derivative at 0 gives the program, included); under a floor, the kept factor
      xp = (xh * jax.lax.rsqrt(1.0 - m.eps * rstd) if m.eps_mode == "std" else
            xh * jnp.sqrt(factor[0]) if factor else xh)
      dx = _norm_base.dx_from_xhat(xp, rstd, dzc * scale, m.rms, m.axes).astype(
          self.x_aval.dtype)
    out = [None] * len(m.inputs)  # None: a zero cotangent (constants, a where's fill value)
    out[0] = dx
    if self.sources:
      _, vjp = jax.vjp(lambda *s: (lambda sb: xh * sb[0] + sb[1])(self._affine(xh, s)), *src)
      for i, g in zip(self.sources, vjp(dzc)):
        k = self.sources.index(i)
        out[i] = _common.cotangent_like(g.astype(src[k].dtype), src[k])
    return tuple(out)


def _norm_fn(rule: NormVJP):
  """The norm as a ``custom_vjp`` keeping xhat, rstd and the parameters' sources."""

  @jax.custom_vjp
  def f(*vals):
    return rule.region(*vals)

  def fwd(*vals):
    z = rule.region(*vals)
    return z, rule.residuals(vals, z)

  f.defvjp(fwd, lambda res, dz: rule.backward(_common.read_apart(res), dz))
  return f


class NormRule(_rule.Rule):
  """LayerNorm/RMSNorm by their algebra; every norm is claimed (so no softmax or activation
  rule reads inside one), converted where its name is wanted."""
  kind = "norm"
  publics = ("layer_norm", "rms_norm")
  candidates = {"rsqrt": "norm", "sqrt": "norm"}
  with_norms = True

  def find(self, g, claimed, outvars, opts):
    matches, left = _algebra.find_norms(g, claimed, outvars)
    return matches, [(nodes, "norm", why) for nodes, why in left]

  def wanted(self, match, names):
    return match.public in names

  def output(self, g, match):
    return g.nodes[match.root].outs[match.root_out]

  def build(self, g, match, opts):
    out = self.output(g, match)
    vjp = NormVJP(match, _match.region_of(g, match.nodes, match.inputs, out), opts.implementations["norm"], g)
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), [out],
                       _rule.single(_norm_fn(vjp)))
    return _rule.Built(unit, fusion=vjp)

  def role(self, match):
    return f"{match.public} xhat"

  def kept_itemsize(self, match):
    return np.dtype(match.store).itemsize

  def floor(self, audit, match):
    """``xhat`` in the narrowest dtype the program gives it, a float32 statistic per row (and
    a factor per row under an epsilon floor: which side of it each row is on)."""
    g = audit.g
    out = self.output(g, match)
    audit.anchor(out, self.role(match), self.kept_itemsize(match))
    x = _match.aval(g, match.inputs[0])
    rows = math.prod(x.shape) // max(1, math.prod(x.shape[a] for a in match.axes))
    audit.record(("rstd", out), f"{match.public} row statistic", (rows,), "float32", 4 * rows,
                 g.nodes[match.root].where)
    if match.eps_mode.startswith("floor"):
      audit.record(("side", out), f"{match.public} row factor", (rows,), "float32", 4 * rows,
                   g.nodes[match.root].where)
