"""Folding the program's reduction of the per-token losses into the head: a weighted sum (a
mean, a masked mean, weights, casts and reshapes) becomes per-token weights, the chain's
derivative (:func:`fold_reduction`)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from invact_jax.convert import graph as _graph
from invact_jax.convert import _head_match
from invact_jax.convert import _head_values
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit


def _linear_step(g: _graph.Graph, n, inside) -> str:
  """"" when node ``n`` is linear in the values ``inside`` (what it reads of them), else
  why not."""
  name = n.prim.name
  reads = [not isinstance(r, Lit) and r in inside for r in n.ins]
  out = g.avals[n.outs[0]]
  if len(n.outs) != 1 or not jnp.issubdtype(out.dtype, jnp.floating):
    return f"{name} of the per-token losses"
  if name in _primitives.LINEAR_UNARY and reads == [True]:
    return ""
  if name == "mul" and sum(reads) == 1:
    return ""
  if name == "div" and reads == [True, False]:
    return ""
  if name in ("add", "sub") and all(reads):
    return ""
  if name == "select_n" and not reads[0] and sum(reads) == 1 and all(
      reads[k] or _head_values.zero(g, n.ins[k]) for k in range(1, len(n.ins))):
    return ""
  return f"{name} of the per-token losses"


def fold_reduction(g: _graph.Graph, loss, outvars: set) -> tuple[_head_match.Fold | None, str]:
  """The program's reduction of the per-token losses ``loss`` as a :class:`Fold`, or
  ``(None, why)`` where it is not a weighted sum that ends in one scalar."""
  inside, nodes = {loss}, set()
  for i in range(g.producer[loss][0] + 1, len(g.nodes)):
    n = g.nodes[i]
    if not any(not isinstance(r, Lit) and r in inside for r in n.ins):
      continue
    why = _linear_step(g, n, inside)
    if why:
      return None, f"the program's reduction reads {why}"
    nodes.add(i)
    inside.update(n.outs)
  ends = [r for r in inside if r in outvars or not g.consumers.get(r) or any(
      c not in nodes for c in g.consumers[r])]
  if loss in ends:
    return None, "the per-token losses are also used as they are"
  if len(ends) != 1 or math.prod(g.avals[ends[0]].shape) != 1:
    return None, "the program's reduction does not end in one scalar"
  extras = []
  for i in sorted(nodes):
    for r in g.nodes[i].ins:
      if not isinstance(r, Lit) and r not in inside and r not in extras:
        extras.append(r)
  return _head_match.Fold(frozenset(nodes), ends[0], tuple(extras)), ""


def _wide_source(g: _graph.Graph, w, region: set) -> tuple:
  """``(source, absorbed nodes, transposed)``: where ``w`` is a 16-bit cast of a float32 or
  float64 value, possibly transposed before or after the cast (a tied embedding's
  ``table.astype(bf16).T``), each step read only by ``region`` and the steps after it, the
  wide value, those steps' nodes and whether one of them transposes; else ``(w, [], False)``."""
  steps, ref, readers = {}, w, set(region)  # "transpose"/"cast" -> its node
  while len(steps) < 2:
    if isinstance(ref, Lit) or ref not in g.producer or ref in g.outvars or any(
        c not in readers for c in g.consumers.get(ref, ())):
      break
    i = g.producer[ref][0]
    n = g.nodes[i]
    src = n.ins[0]
    if isinstance(src, Lit):
      break
    if n.prim.name == "transpose" and tuple(n.params["permutation"]) == (1, 0):
      kind = "transpose"
    elif (n.prim.name == "convert_element_type" and jnp.dtype(g.avals[ref].dtype).itemsize < 4
          and jnp.issubdtype(g.avals[src].dtype, jnp.floating)
          and jnp.dtype(g.avals[src].dtype).itemsize >= 4):
      kind = "cast"
    else:
      break
    if kind in steps:
      break
    steps[kind] = i
    readers.add(i)
    ref = src
  if "cast" not in steps:
    return w, [], False
  return ref, list(steps.values()), "transpose" in steps


def fold_and_weight(g: _graph.Graph, o, w, nodes: set, outvars: set, taken: set,
                    allow_fold: bool, unfoldable: str = "") -> tuple:
  """``(fold or None, why not, the head's weight, whether it is the matmul's weight
  transposed)``; a 16-bit cast of a float32 weight read only by the head (transposed before
  or after the cast or not) is taken into ``nodes`` and its source is the head's weight.
  ``unfoldable``: why the reduction may not be folded whatever it is ("": it may)."""
  fold, why = (None, unfoldable) if unfoldable else fold_reduction(g, o, outvars) \
      if allow_fold else (None, "inside a loop body (its forward's gradients would be kept per "
                                "step)")
  if fold is not None and fold.nodes & taken:
    fold, why = None, "the program's reduction overlaps another conversion"
  head_w, absorbed, transposed = _wide_source(g, w, nodes)
  nodes.update(absorbed)
  if fold is not None and jnp.dtype(g.avals[head_w].dtype).itemsize < 4:
    fold, why = None, ("a 16-bit weight (its float32 gradient accumulator would double the "
                       "gradient's memory)")
  return fold, why, head_w, transposed
