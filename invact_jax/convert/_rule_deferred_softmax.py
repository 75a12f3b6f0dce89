"""The deferred-normalization softmax: ``p = exp(s - max)``, ``o = p @ v``, ``o / sum(p)``
(the flash-attention form large-model code writes to save a pass), also accumulated block by
block (the online form: ``acc = acc * c + p_i @ v_i`` and ``l = l * c + sum(p_i)`` with the
rescale factors ``c = exp(m - m_new)``, divided after the last block or carried out of a
loop's body) or combined across devices (each device's keys: a local attention returns its
unnormalized output, row max and row sum, rescaled to the mesh's max and summed with ``psum``
before the division: the sequence-parallel form), recognized by its algebra and left as it is written, with the reason: its
autodiff already keeps what a converted softmax would — the unnormalized probabilities, which
the value matmul keeps anyway, per-row sums and factors, and the unnormalized output — so
there is nothing to convert.  Where the row max the exponentials are shifted by is not behind
``stop_gradient``, its autodiff also keeps the max's location mask: in the single-pass form,
with the max read by the shift alone, the max's gradient (zero: the output does not depend on
the shift) is stopped; elsewhere the reason says so.
"""
from __future__ import annotations

import dataclasses

import jax

from invact_jax.convert import graph as _graph
from invact_jax.convert import _match
from invact_jax.convert import _primitives
from invact_jax.convert import _rule
from invact_jax.convert.graph import Lit

__all__ = ["DeferredSoftmaxRule", "AT_THE_FLOOR", "MAX_MASK", "STOPPED"]

_FORM = ("softmax with deferred normalization (exp -> value matmul -> divide by the row sum, "
         "at once, accumulated block by block or combined across devices)")
AT_THE_FLOOR = (f"{_FORM}: its autodiff keeps the unnormalized probabilities the matmul keeps "
                "anyway and per-row sums and factors, at the floor as written")
STOPPED = (f"{_FORM}: converted where its row max is read by the shift alone (its gradient "
           "stopped, as the output does not depend on it); its autodiff keeps the unnormalized "
           "probabilities the matmul keeps anyway and per-row sums, at the floor")
MAX_MASK = (f"{_FORM}: its autodiff keeps the unnormalized probabilities the matmul keeps "
            "anyway and per-row sums and factors, and also the row max's location mask (the "
            "probabilities' size), the max not being behind stop_gradient; left as written")


def _readers(g: _graph.Graph, ref, through=_primitives.IDENTITY) -> list:
  """The nodes reading ``ref``, through casts (or the primitives ``through``): ``(node
  index, the value it reads)``."""
  out = []
  for c in g.consumers.get(ref, ()):
    n = g.nodes[c]
    if n.prim.name in through and len(n.outs) == 1:
      out += _readers(g, n.outs[0], through)
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
  """``starts`` and what is computed from them by accumulating (adds, sums across devices),
  rescaling by one value per row, casting or reshaping: an online softmax's running numerator
  or denominator, or a local one's combined across devices."""
  seen, todo = set(starts), list(starts)
  while todo:
    ref = todo.pop()
    for c in g.consumers.get(ref, ()):
      n = g.nodes[c]
      if len(n.outs) != 1 or n.outs[0] in seen:
        continue
      name, others = n.prim.name, [r for r in n.ins if r is not ref and r != ref]
      if ((name in _primitives.IDENTITY | _primitives.SHAPE and len(n.ins) == 1)
          or name in ("add", "add_any") or name in _primitives.DEVICE_SUMS
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
    if n.prim.name == "mul" and any(a in num and _reciprocal_of(g, b) in den
                                    for a, b in (n.ins, n.ins[::-1])):
      return True
  return bool(num & outvars) and bool(den & outvars)


def _reciprocal_of(g: _graph.Graph, ref):
  """``d`` where ``ref`` is ``1 / d`` or ``d ** -1`` (spread back), else None."""
  ref = _source(g, ref)
  if isinstance(ref, Lit) or ref not in g.producer:
    return None
  n = g.nodes[g.producer[ref][0]]
  if n.prim.name == "div" and isinstance(n.ins[0], Lit) and float(n.ins[0].val) == 1.0:
    return _source(g, n.ins[1])
  if n.prim.name == "integer_pow" and n.params.get("y") == -1:
    return _source(g, n.ins[0])
  return None


def _rescales(g: _graph.Graph, ref, running: set) -> bool:
  """Whether ``ref`` (a product) is a running sum, or is added into one (the first block's
  rescaled initial value)."""
  return ref in running or any(g.nodes[c].prim.name in ("add", "add_any")
                               and g.nodes[c].outs[0] in running
                               for c, _ in _readers(g, ref))


def _shift(g: _graph.Graph, exp_node) -> int | None:
  """The index of the subtraction ``s - shift`` whose result (spread back) ``exp_node``
  exponentiates, or None where it exponentiates something else."""
  arg = _source(g, exp_node.ins[0])
  if isinstance(arg, Lit) or arg not in g.producer:
    return None
  sub = g.producer[arg][0]
  return sub if g.nodes[sub].prim.name == "sub" else None


def _shift_stopped(g: _graph.Graph, exp_node) -> bool:
  """Whether the value ``exp_node`` exponentiates is shifted only by values behind
  ``stop_gradient`` (or not shifted)."""
  sub = _shift(g, exp_node)
  if sub is None:
    return True
  todo, seen = [g.nodes[sub].ins[1]], set()
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


@dataclasses.dataclass(frozen=True)
class ShiftMatch:
  """The row max a deferred softmax is shifted by, read by that shift alone: its gradient,
  zero in exact arithmetic, is stopped (so autodiff keeps no location mask)."""
  nodes: tuple
  root: int
  inputs: tuple

  public = "softmax"
  name = "deferred-normalization softmax (its row max behind stop_gradient)"
  output_index = 0


def _uses(g: _graph.Graph, ref) -> set:
  """The nodes reading ``ref``, through casts and shape changes."""
  return {c for c, _ in _readers(g, ref, _primitives.IDENTITY | _primitives.SHAPE)}


def _stoppable(g: _graph.Graph, exp_index: int, dots: list, total: int, outvars: set):
  """The index of the ``reduce_max`` the exponentials ``exp_index`` are shifted by, where its
  gradient may be stopped: the max of the values it shifts, read by that shift alone, in the
  single-pass form whose matmul outputs and row sum are read by their division alone (so the
  program's output does not depend on the shift); else None."""
  sub_index = _shift(g, g.nodes[exp_index])
  if sub_index is None:
    return None
  sub = g.nodes[sub_index]
  shift = _source(g, sub.ins[1])
  if isinstance(shift, Lit) or shift not in g.producer or shift in outvars:
    return None
  r = g.producer[shift][0]
  if (g.nodes[r].prim.name != "reduce_max"
      or _source(g, g.nodes[r].ins[0]) != _source(g, sub.ins[0])
      or _uses(g, shift) != {sub_index} or _uses(g, sub.outs[0]) != {exp_index}):
    return None
  ends = [g.nodes[d].outs[0] for d in dots] + [g.nodes[total].outs[0]]
  if any(ref in outvars or not all(g.nodes[c].prim.name == "div" for c in _uses(g, ref))
         for ref in ends):
    return None
  return r


class DeferredSoftmaxRule(_rule.Rule):
  """Finds the form and leaves it alone with :data:`AT_THE_FLOOR` or :data:`MAX_MASK`, or,
  where the row max is read by its shift alone, stops the max's gradient (:class:`ShiftMatch`,
  :data:`STOPPED`); an online form's rescale factors go with it."""
  kind = "deferred_softmax"
  publics = ("softmax",)
  with_norms = True

  def find(self, g, claimed, outvars, opts):
    matches, left, num, den = [], [], set(), set()
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
      if not _normalized(g, n_i, d_i, outvars):
        continue
      num |= n_i
      den |= d_i
      stopped = _shift_stopped(g, n)
      shift = None if stopped else _stoppable(g, i, dots, sums[0], outvars)
      if shift is not None and shift not in claimed:
        matches.append(ShiftMatch((shift,), shift, (g.nodes[shift].ins[0],)))
      left.append(([i], "softmax", AT_THE_FLOOR if stopped else
                   STOPPED if shift is not None else MAX_MASK))
    found, running = {j for nodes, _, _ in left for j in nodes}, num | den
    for i, n in enumerate(g.nodes):  # the online form's factors c = exp(m - m_new)
      readers = _readers(g, n.outs[0]) if n.prim.name == "exp" and n.outs else []
      if (i not in claimed and i not in found and readers
          and all(g.nodes[c].prim.name == "mul" and _rescales(g, g.nodes[c].outs[0], running)
                  for c, _ in readers)):
        left.append(([i], "softmax", AT_THE_FLOOR if _shift_stopped(g, n) else MAX_MASK))
    return matches, left

  def output(self, g, match):
    return g.nodes[match.root].outs[0]

  def build(self, g, match, opts):
    region = _match.region_of(g, match.nodes, match.inputs, self.output(g, match))
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), [self.output(g, match)],
                       _rule.single(lambda *v: jax.lax.stop_gradient(region(*v))))
    return _rule.Built(unit)

  def role(self, match):
    return "softmax row max"

  def floor(self, audit, match):
    """Nothing of its own: the stopped row max has no cotangent; the probabilities and row
    sums around it are the program's matmul operands and statistics, walked as they are."""
    del audit, match


def _contracts_last(n, ref, last: int) -> bool:
  """Whether matmul ``n`` contracts its operand ``ref`` over ``ref``'s last axis."""
  (lc, rc), _ = n.params["dimension_numbers"]
  side = lc if n.ins[0] is ref or n.ins[0] == ref else rc
  return tuple(side) == (last,)
