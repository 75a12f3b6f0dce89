"""The deferred-normalization softmax: ``p = exp(s - max)``, ``o = p @ v``, ``o / sum(p)``
(the flash-attention form large-model code writes to save a pass), recognized and left as it
is written, with the reason: its autodiff already keeps what a converted softmax would — the
unnormalized probabilities, which the value matmul keeps anyway, one sum per row and the
unnormalized output — so there is nothing to convert.
"""
from __future__ import annotations

from invact_jax.convert import _graph
from invact_jax.convert import _primitives
from invact_jax.convert import _rule
from invact_jax.convert._graph import Lit

__all__ = ["DeferredSoftmaxRule", "AT_THE_FLOOR"]

AT_THE_FLOOR = ("softmax with deferred normalization (exp -> value matmul -> divide by the "
                "row sum): its autodiff keeps the unnormalized probabilities the matmul keeps "
                "anyway and a sum per row, at the floor as written")


def _readers(g: _graph.Graph, ref) -> list:
  """The nodes reading ``ref``, through casts (``(node index, the value it reads)``)."""
  out = []
  for c in g.consumers.get(ref, ()):
    n = g.nodes[c]
    if n.prim.name in _primitives.IDENTITY and len(n.outs) == 1:
      out += _readers(g, n.outs[0])
    else:
      out.append((c, ref))
  return out


def _source(g: _graph.Graph, ref):
  """``ref`` followed back through shape changes and casts."""
  while not isinstance(ref, Lit) and ref in g.producer:
    n = g.nodes[g.producer[ref][0]]
    if n.prim.name not in _primitives.SHAPE | _primitives.IDENTITY or len(n.ins) != 1:
      break
    ref = n.ins[0]
  return ref


def _normalizes(g: _graph.Graph, dot: int, row_sum: int) -> bool:
  """Whether a quotient divides the matmul's output by the row sum (spread back)."""
  o, total = g.nodes[dot].outs[0], g.nodes[row_sum].outs[0]
  for c, _ in _readers(g, o):
    n = g.nodes[c]
    if n.prim.name == "div" and _source(g, n.ins[1]) == total:
      return True
  return False


class DeferredSoftmaxRule(_rule.Rule):
  """Finds the form and leaves it alone with :data:`AT_THE_FLOOR` (no matches, no units)."""
  kind = "deferred_softmax"
  publics = ("softmax",)

  def find(self, g, claimed, outvars, opts):
    left = []
    for i, n in enumerate(g.nodes):
      if n.prim.name != "exp" or i in claimed or not n.outs:
        continue
      last = len(g.avals[n.outs[0]].shape) - 1
      readers = _readers(g, n.outs[0])
      sums = [c for c, _ in readers if g.nodes[c].prim.name == "reduce_sum"
              and tuple(g.nodes[c].params["axes"]) == (last,)]
      dots = [c for c, r in readers if g.nodes[c].prim.name == "dot_general"
              and _contracts_last(g.nodes[c], r, last)]
      if (len(sums) == 1 and dots and len(sums) + len(dots) == len(readers)
          and all(_normalizes(g, d, sums[0]) for d in dots)):
        left.append(([i], "softmax", AT_THE_FLOOR))
    return [], left


def _contracts_last(n, ref, last: int) -> bool:
  """Whether matmul ``n`` contracts its operand ``ref`` over ``ref``'s last axis."""
  (lc, rc), _ = n.params["dimension_numbers"]
  side = lc if n.ins[0] is ref or n.ins[0] == ref else rc
  return tuple(side) == (last,)
