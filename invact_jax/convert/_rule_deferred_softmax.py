"""The deferred-normalization softmax: ``p = exp(s - max)``, ``o = p @ v``, ``o / sum(p)``
(the flash-attention form large-model code writes to save a pass), also accumulated block by
block (the online form: ``acc = acc * c + p_i @ v_i`` and ``l = l * c + sum(p_i)`` with the
rescale factors ``c = exp(m - m_new)``, divided after the last block or carried out of a
loop's body), recognized by its algebra and left as it is written, with the reason: its
autodiff already keeps what a converted softmax would — the unnormalized probabilities, which
the value matmul keeps anyway, per-row sums and factors, and the unnormalized output — so
there is nothing to convert; where the row max the exponentials are shifted by is not behind
``stop_gradient``, its autodiff also keeps the max's location mask, and the reason says so.
"""
from __future__ import annotations

from invact_jax.convert import _graph
from invact_jax.convert import _primitives
from invact_jax.convert import _rule
from invact_jax.convert._graph import Lit

__all__ = ["DeferredSoftmaxRule", "AT_THE_FLOOR"]

_FORM = ("softmax with deferred normalization (exp -> value matmul -> divide by the row sum, "
         "at once or accumulated block by block)")
AT_THE_FLOOR = (f"{_FORM}: its autodiff keeps the unnormalized probabilities the matmul keeps "
                "anyway and per-row sums and factors, at the floor as written")
MAX_MASK = (f"{_FORM}: its autodiff keeps the unnormalized probabilities the matmul keeps "
            "anyway and per-row sums and factors, and also the row max's location mask (the "
            "probabilities' size), the max not being behind stop_gradient; left as written")


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


def _per_row(g: _graph.Graph, ref, like) -> bool:
  """Whether ``ref`` holds one value per row of ``like`` (a last axis of 1, or fewer axes,
  before a broadcast)."""
  src = _source(g, ref)
  if isinstance(src, Lit):
    return True
  shape = g.avals[src].shape
  return len(shape) == 0 or shape[-1] == 1 or len(shape) < len(g.avals[like].shape)


def _flows(g: _graph.Graph, starts: list) -> set:
  """``starts`` and what is computed from them by accumulating (adds), rescaling by one value
  per row, casting or reshaping: an online softmax's running numerator or denominator."""
  seen, todo = set(starts), list(starts)
  while todo:
    ref = todo.pop()
    for c in g.consumers.get(ref, ()):
      n = g.nodes[c]
      if len(n.outs) != 1 or n.outs[0] in seen:
        continue
      name, others = n.prim.name, [r for r in n.ins if r is not ref and r != ref]
      if ((name in _primitives.IDENTITY | _primitives.SHAPE and len(n.ins) == 1)
          or name in ("add", "add_any")
          or (name == "mul" and all(_per_row(g, r, ref) for r in others))):
        seen.add(n.outs[0])
        todo.append(n.outs[0])
  return seen


def _normalized(g: _graph.Graph, num: set, den: set, outvars: set) -> bool:
  """Whether a quotient divides a value of ``num`` by one of ``den`` (spread back), or both
  leave the graph (a loop's body carrying them to a division after the loop)."""
  for n in g.nodes:
    if n.prim.name == "div" and n.ins[0] in num and _source(g, n.ins[1]) in den | {
        n.ins[1]}:
      return True
  return bool(num & outvars) and bool(den & outvars)


def _rescales(g: _graph.Graph, ref, running: set) -> bool:
  """Whether ``ref`` (a product) is a running sum, or is added into one (the first block's
  rescaled initial value)."""
  return ref in running or any(g.nodes[c].prim.name in ("add", "add_any")
                               and g.nodes[c].outs[0] in running
                               for c, _ in _readers(g, ref))


def _shift_stopped(g: _graph.Graph, exp_node) -> bool:
  """Whether the value ``exp_node`` exponentiates is shifted only by values behind
  ``stop_gradient`` (or not shifted)."""
  arg = _source(g, exp_node.ins[0])
  if isinstance(arg, Lit) or arg not in g.producer:
    return True
  sub = g.nodes[g.producer[arg][0]]
  if sub.prim.name != "sub":
    return True
  todo, seen = [sub.ins[1]], set()
  while todo:
    ref = _source(g, todo.pop())
    if isinstance(ref, Lit) or ref not in g.producer or ref in seen:
      continue
    seen.add(ref)
    n = g.nodes[g.producer[ref][0]]
    if n.prim.name in ("reduce_max", "argmax"):
      return False
    if n.prim.name in ("max", "select_n"):
      todo += list(n.ins)
  return True


class DeferredSoftmaxRule(_rule.Rule):
  """Finds the form and leaves it alone with :data:`AT_THE_FLOOR` or :data:`MAX_MASK` (no
  matches, no units); an online form's rescale factors go with it."""
  kind = "deferred_softmax"
  publics = ("softmax",)

  def find(self, g, claimed, outvars, opts):
    left, num, den = [], set(), set()
    for i, n in enumerate(g.nodes):
      if n.prim.name != "exp" or i in claimed or not n.outs:
        continue
      last = len(g.avals[n.outs[0]].shape) - 1
      readers = _readers(g, n.outs[0])
      sums = [c for c, _ in readers if g.nodes[c].prim.name == "reduce_sum"
              and tuple(g.nodes[c].params["axes"]) == (last,)]
      dots = [c for c, r in readers if g.nodes[c].prim.name == "dot_general"
              and _contracts_last(g.nodes[c], r, last)]
      if len(sums) != 1 or not dots or len(sums) + len(dots) != len(readers):
        continue
      n_i = _flows(g, [g.nodes[d].outs[0] for d in dots])
      d_i = _flows(g, [g.nodes[sums[0]].outs[0]])
      if _normalized(g, n_i, d_i, outvars):
        num |= n_i
        den |= d_i
        left.append(([i], "softmax", AT_THE_FLOOR if _shift_stopped(g, n) else MAX_MASK))
    found, running = {j for nodes, _, _ in left for j in nodes}, num | den
    for i, n in enumerate(g.nodes):  # the online form's factors c = exp(m - m_new)
      readers = _readers(g, n.outs[0]) if n.prim.name == "exp" and n.outs else []
      if (i not in claimed and i not in found and readers
          and all(g.nodes[c].prim.name == "mul" and _rescales(g, g.nodes[c].outs[0], running)
                  for c, _ in readers)):
        left.append(([i], "softmax", AT_THE_FLOOR if _shift_stopped(g, n) else MAX_MASK))
    return [], left


def _contracts_last(n, ref, last: int) -> bool:
  """Whether matmul ``n`` contracts its operand ``ref`` over ``ref``'s last axis."""
  (lc, rc), _ = n.params["dimension_numbers"]
  side = lc if n.ins[0] is ref or n.ins[0] == ref else rc
  return tuple(side) == (last,)
