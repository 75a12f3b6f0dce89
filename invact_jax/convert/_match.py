"""Matching a traced form against the program: the forms' patterns and the subgraph matcher.

A :class:`._forms.Form` is traced at the shapes and dtypes of a program value into a
:class:`Pattern` graph; :func:`match_at` walks the pattern back from its output and the
program back from the value together, equation by equation (same primitive, same parameters,
inputs matched in order or, for commutative primitives, swapped), binding the pattern's
inputs to program values and reading its sentinel constants (a numeric parameter such as
ELU's ``alpha``) back from the program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _forms
from invact_jax.convert import graph as _graph
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit

__all__ = ["Pattern", "FormMatch", "pattern", "root_signature", "signature", "match_at",
           "aval", "region_of", "escapes"]


@dataclasses.dataclass(frozen=True)
class Pattern:
  """A form traced at one shape and dtype.

  Attributes:
    form: the form.
    graph: its flattened trace.
    root: the node computing its output; ``root_out``: which output of that node.
    sentinels: ``id(Lit)`` -> the name of the numeric parameter that constant stands for.
  """
  form: _forms.Form
  graph: _graph.Graph
  root: int
  root_out: int
  sentinels: dict


@functools.lru_cache(maxsize=None)
def pattern(form: _forms.Form, shape: tuple, dtype: str) -> Pattern | None:
  """``form`` traced for an input of ``shape`` and ``dtype`` (its output the same), or None
  where the form does not produce that."""
  fn = form.build(np.dtype(dtype))
  if fn is None:
    return None
  try:
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(shape, np.dtype(dtype)))
  except (TypeError, ValueError):  # a form not defined for this dtype
    return None
  out = closed.out_avals
  if len(out) != 1 or out[0].shape != shape or out[0].dtype != np.dtype(dtype):
    return None
  g = _graph.flatten(closed)
  if isinstance(g.outvars[0], Lit) or g.outvars[0] not in g.producer:
    return None
  root, root_out = g.producer[g.outvars[0]]
  sentinels = {}
  wanted = {k: _forms.SENTINELS[k] for k in form.params}
  for n in g.nodes:
    for r in n.ins:
      if (isinstance(r, Lit) and np.shape(r.val) == ()
          and jnp.issubdtype(np.dtype(r.dtype), jnp.floating)):
        for name, value in wanted.items():
          if float(np.asarray(r.val)) == float(np.asarray(value, r.dtype)):
            sentinels[id(r)] = name
  return Pattern(form, g, root, root_out, sentinels)


@functools.lru_cache(maxsize=None)
def root_signature(form: _forms.Form, dtype: str):
  """The output equation's primitive and its inputs' primitives, from a small trace: a cheap
  test before the form is traced at a program's shapes."""
  pat = pattern(form, (2, 8), dtype)
  return None if pat is None else signature(pat.graph, pat.root)


def signature(graph: _graph.Graph, i: int) -> tuple:
  """Node ``i``'s primitive and the set of its inputs' producers' primitives."""
  def producer(r):
    if isinstance(r, Lit) or r not in graph.producer:
      return None
    return graph.nodes[graph.producer[r][0]].prim.name
  n = graph.nodes[i]
  return n.prim.name, frozenset(p for p in map(producer, n.ins) if p is not None)


class _Binding:
  """A partial match: pattern values bound to program values and back, pattern nodes to
  program nodes, the sentinels read, and program nodes taken in besides (casts inside
  ``shard_map``)."""
  __slots__ = ("to_program", "to_pattern", "nodes", "caught", "extra")

  def __init__(self):
    self.to_program, self.to_pattern, self.nodes, self.caught = {}, {}, {}, {}
    self.extra = set()

  def copy(self) -> "_Binding":
    b = _Binding()
    b.to_program, b.to_pattern = dict(self.to_program), dict(self.to_pattern)
    b.nodes, b.caught, b.extra = dict(self.nodes), dict(self.caught), set(self.extra)
    return b

  def restore(self, other: "_Binding") -> None:
    self.to_program, self.to_pattern = other.to_program, other.to_pattern
    self.nodes, self.caught, self.extra = other.nodes, other.caught, other.extra


def _is_tracer(v) -> bool:
  return isinstance(v, jax.core.Tracer)


class _Matcher:
  """Matches one :class:`Pattern` against one program graph (nodes in ``claimed`` excluded)."""

  def __init__(self, pat: Pattern, program: _graph.Graph, claimed: set):
    self.pat, self.program, self.claimed = pat, program, claimed
    self.pattern_inputs = set(pat.graph.invars)

  def value(self, pat_ref, prog_ref, b: _Binding) -> bool:
    """Whether pattern value ``pat_ref`` can be program value ``prog_ref`` (binding them)."""
    pattern_graph, program = self.pat.graph, self.program
    if isinstance(pat_ref, Lit):
      return self._literal(pat_ref, prog_ref, b)
    if not isinstance(prog_ref, Lit):  # inside shard_map: values cast to varying by pvary
      i = program.producer.get(prog_ref, (None,))[0]
      if (i is not None and program.nodes[i].prim.name == "pvary"
          and len(program.nodes[i].ins) == 1 and i not in self.claimed
          and i not in b.nodes.values()
          and not (pat_ref in pattern_graph.producer and pattern_graph.nodes[
              pattern_graph.producer[pat_ref][0]].prim.name == "pvary")):
        b.extra.add(i)
        return self.value(pat_ref, program.nodes[i].ins[0], b)
    if pat_ref in self.pattern_inputs:  # an input of the form: any value of its type
      if pat_ref in b.to_program:
        return b.to_program[pat_ref] is prog_ref
      if prog_ref in b.to_pattern:
        return False
      want, have = pattern_graph.avals[pat_ref], aval(program, prog_ref)
      if want.shape != have.shape or want.dtype != have.dtype:
        return False
      b.to_program[pat_ref], b.to_pattern[prog_ref] = prog_ref, pat_ref
      return True
    if isinstance(prog_ref, Lit) or prog_ref not in program.producer:
      return False
    if pat_ref in b.to_program:
      return b.to_program[pat_ref] == prog_ref
    if prog_ref in b.to_pattern:
      return False
    pat_node, pat_out = pattern_graph.producer[pat_ref]
    prog_node, prog_out = program.producer[prog_ref]
    if pat_out != prog_out or prog_node in self.claimed or prog_node in b.nodes.values():
      return False
    return self.node(pat_node, prog_node, b)

  def _literal(self, pat_lit: Lit, prog_ref, b: _Binding) -> bool:
    """Whether the program's value ``prog_ref`` matches the pattern's literal: equal, or any value
    where the literal is a sentinel (the caught parameter, bound in ``b``); a literal reaching
    through casts too."""
    if not isinstance(prog_ref, Lit):  # inside shard_map a literal arrives through pvary
      found = self._literal_through_casts(prog_ref, b)
      if found is None:
        return False
      b.extra.update(found[0])
      prog_ref = found[1]
    if _is_tracer(prog_ref.val):
      return False
    name = self.pat.sentinels.get(id(pat_lit))
    if name is None:
      return pat_lit.same(prog_ref)
    if np.shape(prog_ref.val) != () or np.dtype(prog_ref.dtype) != np.dtype(pat_lit.dtype):
      return False
    read = float(np.asarray(prog_ref.val))
    return b.caught.setdefault(name, read) == read

  def _literal_through_casts(self, prog_ref, b: _Binding):
    """``(node indices, Lit)`` where ``prog_ref`` is a literal made varying (``pvary``)
    and/or re-typed (``convert_element_type``) inside shard_map; None otherwise."""
    chain, dtype = [], None
    for _ in range(4):
      i = self.program.producer.get(prog_ref, (None,))[0]
      if i is None or i in self.claimed or i in b.nodes.values():
        return None
      n = self.program.nodes[i]
      if n.prim.name not in ("pvary", "convert_element_type") or len(n.ins) != 1:
        return None
      chain.append(i)
      dtype = dtype or self.program.avals[n.outs[0]].dtype
      prog_ref = n.ins[0]
      if isinstance(prog_ref, Lit):
        return chain, Lit(np.asarray(prog_ref.val).astype(dtype))
    return None

  def node(self, pat_node: int, prog_node: int, b: _Binding) -> bool:
    """Whether pattern node ``pat_node`` can be program node ``prog_node``."""
    pn, tn = self.pat.graph.nodes[pat_node], self.program.nodes[prog_node]
    if (pn.prim.name != tn.prim.name or len(pn.ins) != len(tn.ins)
        or len(pn.outs) != len(tn.outs) or not _graph.params_equal(pn.params, tn.params)):
      return False
    for po, to in zip(pn.outs, tn.outs):
      b.to_program[po], b.to_pattern[to] = to, po
    b.nodes[pat_node] = prog_node
    saved = b.copy()
    if all(self.value(a, c, b) for a, c in zip(pn.ins, tn.ins)):
      return True
    if pn.prim.name in _primitives.COMMUTATIVE and len(pn.ins) == 2:
      b.restore(saved)
      return all(self.value(a, c, b) for a, c in zip(pn.ins, reversed(tn.ins)))
    return False


@dataclasses.dataclass
class FormMatch:
  """A form found in the program.

  Attributes:
    pattern: the traced form.
    nodes: the program's node indices it covers (sorted).
    root: the program node computing its output.
    inputs: the program values bound to the form's input (one: ``x``).
    caught: the numeric parameters read back from the program.
  """
  pattern: Pattern
  nodes: list
  root: int
  inputs: list
  caught: dict

  @property
  def output_index(self) -> int:
    return self.pattern.root_out


def match_at(pat: Pattern, program: _graph.Graph, i: int, claimed: set) -> FormMatch | None:
  """``pat`` matched with its output at program node ``i``, or None."""
  if len(program.nodes[i].outs) <= pat.root_out:
    return None
  b = _Binding()
  if not _Matcher(pat, program, claimed).node(pat.root, i, b):
    return None
  inputs = [b.to_program.get(v) for v in pat.graph.invars]
  if any(r is None for r in inputs):
    return None
  return FormMatch(pat, sorted(set(b.nodes.values()) | b.extra), i, inputs, dict(b.caught))


def escapes(g: _graph.Graph, inside: set, out, outvars: set) -> bool:
  """Whether a value the nodes ``inside`` compute, other than ``out``, is used outside them
  (then converting saves nothing and the values would be computed anyway: left alone)."""
  return bool(escaping(g, inside, out, outvars))


def escaping(g: _graph.Graph, inside: set, out, outvars: set) -> list:
  """The values the nodes ``inside`` compute, other than ``out``, that are used outside them
  (in program order).  A reader whose results are all dropped (``jax.nn.logsumexp``'s unused
  ``sign``) uses nothing."""
  return [o for i in sorted(inside) for o in g.nodes[i].outs if o != out and (
      o in outvars or any(c not in inside and not _graph.dead(g, g.nodes[c], outvars)
                          for c in g.consumers.get(o, ())))]


def aval(g: _graph.Graph, ref):
  """The abstract value of a program value or literal."""
  return jax.typeof(ref.val) if isinstance(ref, Lit) else g.avals[ref]


def region_of(g: _graph.Graph, node_ids, ins, out) -> Callable[..., Any]:
  """The program's equations ``node_ids`` as a function of ``ins``, returning ``out``."""
  run = _graph.region(g, node_ids, ins, [out])
  return lambda *vals: run(*vals)[0]
