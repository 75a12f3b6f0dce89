"""The softmax rule: a softmax over any axes, found by its algebra
(:func:`._algebra.find_softmaxes`), keeps its probabilities; the backward is
``p * (dp - sum(p * dp))``.
"""
from __future__ import annotations

import jax

from invact_jax.convert import _algebra
from invact_jax.convert import graph as _graph
from invact_jax.convert import _match
from invact_jax.convert import _rule
from invact_jax.ops import _common
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["SoftmaxRule"]


def _softmax_fn(m: _algebra.SoftmaxMatch, region, target):
  """A softmax found by its algebra: keeps the probabilities; the shift ``k`` (a max) gets a
  zero cotangent, as softmax does not depend on it."""
  x_dtype = _match.aval(target, m.inputs[0]).dtype

  @jax.custom_vjp
  def f(*vals):
    return region(*vals)

  def fwd(*vals):
    p = region(*vals)
    return p, p

  def bwd(p, dp):
    p = _common.read_apart(p)
    return (_softmax_base.backward(m.axes, x_dtype, p, dp), *(None for _ in m.inputs[1:]))

  f.defvjp(fwd, bwd)
  return f


class SoftmaxRule(_rule.Rule):
  """Softmax by its algebra (a shift, exponentials, a sum, a quotient)."""
  kind = "softmax"
  publics = ("softmax",)
  candidates = {"exp": "softmax"}
  with_norms = True

  def find(self, g, claimed, outvars, opts):
    matches, left = _algebra.find_softmaxes(g, claimed, outvars)
    return matches, [(nodes, "softmax", why) for nodes, why in left]

  def output(self, g, match):
    return g.nodes[match.root].outs[match.root_out]

  def build(self, g, match, opts):
    out = self.output(g, match)
    region = _match.region_of(g, match.nodes, match.inputs, out)
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), [out],
                       _rule.single(_softmax_fn(match, region, g)))
    return _rule.Built(unit, kept=True)

  def no_cotangent(self, match):
    return tuple(match.inputs[1:2])  # the shift (a max): softmax does not depend on it
