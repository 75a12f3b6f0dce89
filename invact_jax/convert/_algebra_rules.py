"""How the norms' algebra follows each primitive: ``rule(a, node, values)`` on an
:class:`._algebra_follow.Analysis` ``a`` gives the symbolic value of the node's output from
its operands' (``values``: a polynomial each, None where one is not), or None; :data:`RULES`
keyed by primitive, as JAX's own interpreters are."""
from __future__ import annotations

import jax
import numpy as np

from invact_jax.convert import _polynomial
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit

__all__ = ["RULES", "TAKES_UNKNOWN"]


def _same(a, node, vals):
  """A cast, reshape, broadcast or transpose: the value (its layout is the node's)."""
  return vals[0]


def _select(a, node, vals):
  """A select by a constant predicate: the branch it picks."""
  pred = node.ins[0]
  if not isinstance(pred, Lit) and pred in a.consts:
    pred = Lit(a.consts[pred])
  if (isinstance(pred, Lit) and np.ndim(pred.val) == 0
      and not isinstance(pred.val, jax.core.Tracer)):
    return vals[1 + int(np.asarray(pred.val))]
  return None


def _neg(a, node, vals):
  return _polynomial.scale(vals[0], -1.0)


def _add_sub(a, node, vals):
  return _polynomial.add(vals[0], vals[1], 1.0 if node.prim.name == "add" else -1.0)


def _mul(a, node, vals):
  return _polynomial.mul(vals[0], vals[1])


def _square(a, node, vals):
  return _polynomial.mul(vals[0], vals[0])


def _integer_pow(a, node, vals):
  return _pow(a, vals[0], node.params["y"])


def _pow_node(a, node, vals):
  """``p ** e`` for a scalar literal ``e``."""
  e = node.ins[1]
  if not isinstance(e, Lit) or np.ndim(e.val) != 0:
    return None
  return _pow(a, vals[0], float(np.asarray(e.val)))


def _div(a, node, vals):
  inv = _pow(a, vals[1], -1)
  return None if inv is None else _polynomial.mul(vals[0], inv)


def _rsqrt(a, node, vals):
  r = a.radical(vals[0])
  return None if r is None else {((r, 1),): 1.0}


def _sqrt(a, node, vals):
  r = a.radical(vals[0])
  return None if r is None else {((r, -1),): 1.0}


def _max(a, node, vals):
  """A clip of a row statistic at a constant below it (the variance at 0), or a floor above
  0: the symbol ``max(p, c)``."""
  for v, c in ((vals[0], vals[1]), (vals[1], vals[0])):
    if not (_polynomial.X in _polynomial.syms(v)) and set(c) <= {()} and _polynomial.syms(v):
      if c.get((), 0.0) <= 0.0:
        return v
      if all(_polynomial.is_row(s) for s in _polynomial.syms(v)):
        return a.floor(v, c[()])
  return None


def _reduce_sum(a, node, vals):
  """A sum over the statistic's axes (its layout checked): ``x`` and ``x**2`` become the row
  moments ``n m1`` and ``n m2``; a sum over a parameter is not a statistic of ``x``."""
  out: dict = {}
  for m, c in vals[0].items():
    d = dict(m)
    k = d.pop(_polynomial.X, 0)
    if any(not _polynomial.is_row(s) for s in d):
      return None
    rest = tuple(sorted(d.items()))
    if k == 0:
      out = _polynomial.add(out, {rest: c * a.n})
    elif k in (1, 2):
      moment = _polynomial.M1 if k == 1 else _polynomial.M2
      out = _polynomial.add(out, {_polynomial.mono(*rest, (moment, 1)): c * a.n})
    else:
      return None
  return out


def _pow(a, p: dict, y: float) -> dict | None:
  """``p ** y``: ``1 / p`` of several terms as a row symbol, integer powers, and the square
  roots as radicals."""
  if y == -1 and len(p) > 1:
    return a.reciprocal(p)
  if float(y).is_integer():
    return _polynomial.power(p, int(y))
  if y in (-0.5, 0.5):
    r = a.radical(p)
    return None if r is None else {((r, 1 if y == -0.5 else -1),): 1.0}
  return None


#: Primitive -> its rule.
RULES = {
    **{p: _same for p in _primitives.IDENTITY | _primitives.SHAPE | {"transpose"}},
    "select_n": _select, "neg": _neg, "add": _add_sub, "sub": _add_sub, "mul": _mul,
    "square": _square, "integer_pow": _integer_pow, "pow": _pow_node, "div": _div,
    "rsqrt": _rsqrt, "sqrt": _sqrt, "max": _max, "reduce_sum": _reduce_sum,
}
#: The rules that read operands with no symbolic value (a select's constant branch, a cast).
TAKES_UNKNOWN = frozenset(p for p, rule in RULES.items() if rule in (_same, _select))
