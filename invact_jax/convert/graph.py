"""A traced program as a flat graph: what the program-level conversion matches and runs.

``flatten(closed_jaxpr)`` inlines nested ``jit`` calls without shardings (``jax.nn`` and
``jax.numpy`` functions are jitted, so the same computation traces flat or nested depending
on the JAX version and on how it was called) and turns the rest into :class:`Node` s over
integer variable ids, literals and constants as :class:`Lit`.  ``run`` evaluates a graph with
a hook that may replace matched regions, and converts the bodies of ``scan``, ``cond`` and
``checkpoint`` through the same hook.

This reads JAX's jaxpr data structures (``eqn.primitive``, ``params``, ``invars``,
``outvars``, ``Literal``), which JAX documents for interpreters ("Writing custom Jaxpr
interpreters"); the names that moved between JAX 0.10 and 0.12 are looked up by duck type.
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from invact_jax.convert import _primitives

__all__ = ["Lit", "Node", "Graph", "Unit", "flatten", "inline", "substitute", "params_equal", "where", "bind", "schedule", "varies_over_mesh",
           "evaluate", "region", "ancestors", "scan_counts", "shape_structs"]


@dataclasses.dataclass(frozen=True, eq=False)
class Lit:
  """A literal or a constant of the program (compared by value)."""
  val: Any

  @property
  def dtype(self):
    return np.asarray(self.val).dtype if not hasattr(self.val, "dtype") else self.val.dtype

  def same(self, other: "Lit") -> bool:
    a, b = self.val, other.val
    if getattr(a, "shape", ()) != getattr(b, "shape", ()) or self.dtype != other.dtype:
      return False
    if np.size(a) > 64:
      return a is b
    return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))


@dataclasses.dataclass(eq=False)
class Node:
  prim: Any
  params: dict
  ins: list            # int variable ids or Lit
  outs: list           # int variable ids (-1: dropped)
  where: str = ""
  eqn: Any = None      # the original equation (source info and context for re-binding)


@dataclasses.dataclass(eq=False)
class Graph:
  nodes: list
  invars: list
  outvars: list
  avals: dict          # variable id -> aval
  producer: dict = dataclasses.field(default_factory=dict)   # id -> (node index, out index)
  consumers: dict = dataclasses.field(default_factory=dict)  # id -> [node index]

  def index(self) -> "Graph":
    self.producer.clear()
    self.consumers.clear()
    for i, n in enumerate(self.nodes):
      for k, o in enumerate(n.outs):
        self.producer[o] = (i, k)
      for r in n.ins:
        if not isinstance(r, Lit):
          self.consumers.setdefault(r, []).append(i)
    return self


_IDS = itertools.count()


def _is_literal(v) -> bool:
  return type(v).__name__ == "Literal"


def _is_drop(v) -> bool:
  return type(v).__name__ == "DropVar"


def where(eqn) -> str:
  """``file:line (function)`` of an equation's user frame, or ''."""
  try:
    from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # pylint: disable=broad-except
    return ""


def _unspecified(s) -> bool:
  return type(s).__name__ in ("UnspecifiedValue", "AutoLayout", "NoneType")


def _inlinable(eqn) -> bool:
  """A nested ``jit`` whose shardings/donations say nothing: inlining it changes nothing."""
  p = eqn.params
  if eqn.primitive.name not in ("pjit", "jit") or "jaxpr" not in p:
    return False
  return (all(_unspecified(s) for s in p.get("in_shardings", ()) + p.get("out_shardings", ()))
          and not any(p.get("donated_invars", ())) and not p.get("compiler_options_kvs"))


def flatten(closed) -> Graph:
  """The graph of a ClosedJaxpr (or an open Jaxpr with no constants)."""
  jaxpr = getattr(closed, "jaxpr", closed)
  consts = list(getattr(closed, "consts", ()))
  nodes, avals = [], {}

  def walk(jaxpr, env):
    def ref(v):
      return Lit(v.val) if _is_literal(v) else env[v]
    for eqn in jaxpr.eqns:
      ins = [ref(v) for v in eqn.invars]
      if _inlinable(eqn):
        inner = eqn.params["jaxpr"]
        sub = dict(zip(inner.jaxpr.constvars, (Lit(c) for c in inner.consts)))
        sub.update(zip(inner.jaxpr.invars, ins))
        walk(inner.jaxpr, sub)
        for o, r in zip(eqn.outvars, inner.jaxpr.outvars):
          if not _is_drop(o):
            env[o] = Lit(r.val) if _is_literal(r) else sub[r]
        continue
      outs = []
      for o in eqn.outvars:
        k = next(_IDS)
        avals[k] = o.aval
        if not _is_drop(o):
          env[o] = k
        outs.append(k)
      nodes.append(Node(eqn.primitive, dict(eqn.params), ins, outs, where(eqn), eqn))

  env = dict(zip(jaxpr.constvars, (Lit(c) for c in consts)))
  invars = []
  for v in jaxpr.invars:
    k = next(_IDS)
    env[v], avals[k] = k, v.aval
    invars.append(k)
  walk(jaxpr, env)
  outvars = [Lit(v.val) if _is_literal(v) else env[v] for v in jaxpr.outvars]
  return Graph(nodes, invars, outvars, avals).index()


def inline(graph: Graph, at) -> tuple[Graph, dict]:
  """``graph`` with the call nodes at indices ``at`` (``custom_jvp`` or ``custom_vjp`` calls:
  a body with a derivative rule of its own) replaced by their bodies' nodes, the calls'
  outputs keeping their ids; and ``{call index: its body's node indices in the new graph}``.
  A call whose body returns an input, a constant or one value twice stays as it is."""
  at, nodes, avals, bodies = set(at), [], dict(graph.avals), {}
  for i, n in enumerate(graph.nodes):
    inner = n.params.get("call_jaxpr", n.params.get("fun_jaxpr")) if i in at else None
    body = None if inner is None else flatten(inner)
    if body is None or len(set(body.outvars)) != len(body.outvars) or any(
        isinstance(r, Lit) or r not in body.producer for r in body.outvars):
      nodes.append(n)
      continue
    rename = dict(zip(body.invars, n.ins))
    rename.update(zip(body.outvars, n.outs))
    new = lambda r: r if isinstance(r, Lit) else rename.get(r, r)  # noqa: E731
    bodies[i] = list(range(len(nodes), len(nodes) + len(body.nodes)))
    nodes += [dataclasses.replace(b, ins=[new(r) for r in b.ins], outs=[new(r) for r in b.outs])
              for b in body.nodes]
    avals.update((k, a) for k, a in body.avals.items() if k not in rename)
  return Graph(nodes, list(graph.invars), list(graph.outvars), avals).index(), bodies


#: The primitives :func:`merge_duplicates` merges: a form's inputs a program may compute twice
#: (statistics are not merged: two norms of one input would share them and neither be whole).
MERGED = frozenset({"exp", "dot_general"})


def _pure(n: Node) -> bool:
  """A pure equation of one output whose parameters :func:`params_equal` compares whole."""
  return (n.eqn is not None and not n.eqn.effects and len(n.outs) == 1
          and n.prim.name not in _primitives.CUSTOM_CALLS  # (rules params_equal cannot see)
          and not any((callable(v) and not isinstance(v, type)) or hasattr(v, "call_wrapped")
                      for v in n.params.values()))


def merge_duplicates(graph: Graph) -> Graph:
  """``graph`` with each matmul or exponential that repeats an earlier one (the same
  parameters, and inputs that are the same values or computed alike by pure equations:
  ``jnp.exp(x) / jnp.sum(jnp.exp(x))``, ``jnp.exp(x - x.max()) / jnp.sum(jnp.exp(x -
  x.max()))``, ``x @ w`` written twice) read from the earlier one instead — what XLA's
  common-subexpression elimination does to the compiled program — so that a form is found
  whole; ``graph`` itself where none repeats.  Other repeats stay as they are (the value
  they compute is only recognized as the same)."""
  seen: dict = {}    # (primitive, canonical inputs) -> the nodes kept
  alike: dict = {}   # a value -> the earlier value computed alike
  rename: dict = {}  # a repeat's output -> the earlier node's
  nodes = []
  new = lambda r: r if isinstance(r, Lit) else rename.get(r, r)  # noqa: E731
  canon = lambda r: r if isinstance(r, Lit) else alike.get(r, r)  # noqa: E731
  for n in graph.nodes:
    n = dataclasses.replace(n, ins=[new(r) for r in n.ins])
    if _pure(n):
      ins = [canon(r) for r in n.ins]
      key = (n.prim, tuple(("lit", np.shape(r.val)) if isinstance(r, Lit) else r for r in ins))
      earlier = next((m for m, m_ins in seen.get(key, ()) if params_equal(m.params, n.params)
                      and all(a.same(b) if isinstance(a, Lit) else a == b
                              for a, b in zip(m_ins, ins))), None)
      if earlier is not None:
        alike[n.outs[0]] = canon(earlier.outs[0])
        if n.prim.name in MERGED:
          rename[n.outs[0]] = earlier.outs[0]
          continue
      else:
        seen.setdefault(key, []).append((n, ins))
    nodes.append(n)
  if not rename:
    return graph
  return Graph(nodes, list(graph.invars), [new(r) for r in graph.outvars],
               dict(graph.avals)).index()


def substitute(graph: Graph, values: dict) -> Graph:
  """A copy of ``graph`` whose nodes read ``values[ref]`` (a :class:`Lit`) instead of ``ref``
  (the inputs stay, unread)."""
  sub = lambda r: values.get(r, r) if not isinstance(r, Lit) else r  # noqa: E731
  nodes = [dataclasses.replace(n, ins=[sub(r) for r in n.ins]) for n in graph.nodes]
  return Graph(nodes, list(graph.invars), [sub(r) for r in graph.outvars],
               dict(graph.avals)).index()


def _jaxpr_key(j) -> str:
  return str(getattr(j, "jaxpr", j)) + "|" + ",".join(
      f"{np.shape(c)}:{getattr(c, 'dtype', type(c))}" for c in getattr(j, "consts", ()))


def params_equal(a: dict, b: dict) -> bool:
  """Equation parameters equal, with nested jaxprs compared by their printed structure and
  callables (custom_jvp rules, traced afresh each time) ignored."""
  if a.keys() != b.keys():
    return False
  for k, va in a.items():
    vb = b[k]
    if hasattr(va, "eqns") or hasattr(getattr(va, "jaxpr", None), "eqns"):
      if _jaxpr_key(va) != _jaxpr_key(vb):
        return False
    elif (callable(va) and not isinstance(va, type)) or hasattr(va, "call_wrapped"):
      continue
    else:
      try:
        if not bool(va == vb):
          return False
      except Exception:  # pylint: disable=broad-except
        if repr(va) != repr(vb):
          return False
  return True


def _source(eqn):
  """The user's source location of ``eqn`` as the context of what re-binding it produces (so
  residual tables and the floor audit name the user's line, not this module's)."""
  info = getattr(eqn, "source_info", None)
  if info is None:
    return contextlib.nullcontext()
  from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
  return source_info_util.user_context(info.traceback, name_stack=info.name_stack)


def bind(node: Node, invals: list) -> list:
  """Evaluate one node as JAX's ``eval_jaxpr`` does (with the equation's context and source
  location)."""
  params = node.prim.get_bind_params(node.params)
  ctx = getattr(node.eqn, "ctx", None)
  with _source(node.eqn), (ctx.manager if ctx is not None else contextlib.nullcontext()):
    out = node.prim.bind(*invals, **params)
  return list(out) if node.prim.multiple_results else [out]


@dataclasses.dataclass(eq=False)
class Unit:
  """Nodes of a graph replaced together by one function.

  Attributes:
    nodes: the replaced node indices (none of them runs; values they compute that are not in
      ``outputs`` must not be read outside the unit).
    inputs: the refs ``fn`` takes.
    outputs: the refs ``fn`` returns (values the rest of the program reads).
    fn: ``fn(*input values) -> sequence of output values``.
  """
  nodes: frozenset
  inputs: list
  outputs: list
  fn: Callable


def schedule(graph: Graph, units=()) -> list:
  """An order of evaluation: node indices and :class:`Unit` s, each after everything it
  reads (a unit runs as soon as its inputs exist, and no later than its first reader).

  Raises:
    ValueError: the units make the graph cyclic (a unit reads a value computed from one of
      its own outputs).
  """
  owner = {}
  for u in units:
    for i in u.nodes:
      owner[i] = u
  items = [u for u in units] + [i for i in range(len(graph.nodes)) if i not in owner]
  key = {id(u): min(u.nodes) for u in units}

  def ins(item):
    return item.inputs if isinstance(item, Unit) else graph.nodes[item].ins

  def outs(item):
    return item.outputs if isinstance(item, Unit) else graph.nodes[item].outs

  produced_by = {}
  for item in items:
    for o in outs(item):
      produced_by[o] = item
  waiting, readers = {}, {}
  for item in items:
    deps = {id(produced_by[r]) for r in ins(item)
            if not isinstance(r, Lit) and r in produced_by and produced_by[r] is not item}
    waiting[id(item)] = len(deps)
    for d in deps:
      readers.setdefault(d, []).append(item)
  order_key = lambda item: key[id(item)] if isinstance(item, Unit) else item  # noqa: E731
  ready = [(order_key(it), n, it) for n, it in enumerate(items) if waiting[id(it)] == 0]
  heapq.heapify(ready)
  counter = len(items)
  out = []
  while ready:
    _, _, item = heapq.heappop(ready)
    out.append(item)
    for r in readers.get(id(item), ()):
      waiting[id(r)] -= 1
      if waiting[id(r)] == 0:
        counter += 1
        heapq.heappush(ready, (order_key(r), counter, r))
  if len(out) != len(items):
    raise ValueError("the replaced regions make the program cyclic")
  return out


def evaluate(graph: Graph, args, *, units=(), nested: Callable | None = None) -> list:
  """Run ``graph`` on ``args``, with each :class:`Unit` of ``units`` computing its outputs
  instead of its nodes; ``nested(node, invals)``: outputs of a higher-order node (or None to
  bind it as it is)."""
  env = dict(zip(graph.invars, args))
  value = lambda r: r.val if isinstance(r, Lit) else env[r]  # noqa: E731
  results = {r for r in graph.outvars if not isinstance(r, Lit)}
  for item in schedule(graph, units):
    if not isinstance(item, Unit) and dead(graph, graph.nodes[item], results):
      continue  # (its inputs may be a unit's insides, computed no more)
    if isinstance(item, Unit):
      root = graph.producer.get(item.outputs[0]) if item.outputs else None
      with _source(graph.nodes[root[0]].eqn if root else None):  # what it keeps: the user's line
        outs = item.fn(*(value(r) for r in item.inputs))
      for k, v in zip(item.outputs, outs):
        env[k] = v
      continue
    n = graph.nodes[item]
    invals = [value(r) for r in n.ins]
    outs = nested(n, invals) if nested is not None else None
    if outs is None:
      outs = bind(n, invals)
    for k, v in zip(n.outs, outs):
      env[k] = v
  return [value(r) for r in graph.outvars]


def dead(graph: Graph, node: Node, results: set) -> bool:
  """Whether ``node`` computes nothing anything reads (``jax.nn.logsumexp``'s unused
  ``sign``) and has no effect (``results``: the graph's outputs)."""
  return (not getattr(node.eqn, "effects", True) and node.outs
          and not any(o in results or graph.consumers.get(o) for o in node.outs))


def region(graph: Graph, node_ids, ins: list, outs: list) -> Callable[..., tuple]:
  """The program's equations ``node_ids`` (in program order) as a function of ``ins``,
  returning the values ``outs``."""
  order = [graph.nodes[i] for i in sorted(node_ids)]

  def run(*vals):
    env = dict(zip(ins, vals))
    value = lambda r: r.val if isinstance(r, Lit) else env[r]  # noqa: E731
    for n in order:
      for k, v in zip(n.outs, bind(n, [value(r) for r in n.ins])):
        env[k] = v
    return tuple(env[o] for o in outs)
  return run


def ancestors(graph: Graph, root: int, member: Callable[[Any], bool]) -> list:
  """The nodes ``root`` is computed from, back through values ``member`` accepts (sorted)."""
  seen, stack = set(), [root]
  while stack:
    i = stack.pop()
    if i in seen:
      continue
    seen.add(i)
    for r in graph.nodes[i].ins:
      if not isinstance(r, Lit) and r in graph.producer and member(r):
        stack.append(graph.producer[r][0])
  return sorted(seen)


def scan_counts(params: dict) -> tuple[int, int]:
  """A ``scan`` equation's (number of consts, number of carries): JAX ≤ 0.11 names them
  ``num_consts``/``num_carry``; JAX 0.12 packs the inputs as ``ft_in`` = (consts, carry, xs)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def rewrap_shard_map(node: Node, body: Callable[..., Sequence], invals) -> list:
  """The outputs of ``shard_map`` node ``node`` on ``invals`` with ``body`` (a function of its
  body's inputs) as its body, under the node's mesh, specs, manual axes and check."""
  p = node.params
  return list(jax.shard_map(lambda *a: tuple(body(*a)), mesh=p["mesh"],
                            in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                            axis_names=frozenset(p.get("newly_manual_axes", ())),
                            check_vma=p.get("check_vma", True))(*invals))


def rescan(node: Node, body: Callable[..., Sequence], invals) -> list:
  """The outputs of ``scan`` node ``node`` on ``invals``, re-made by ``lax.scan`` where it
  is traced, with ``body`` (a function of the body's inputs: constants, carry, one step's
  slices) as its body and the node's length, direction and unrolling."""
  p = node.params
  n_consts, n_carry = scan_counts(p)
  consts, carry = invals[:n_consts], invals[n_consts:n_consts + n_carry]

  def step(c, x):
    outs = body(*consts, *c, *x)
    return list(outs[:n_carry]), list(outs[n_carry:])
  c, ys = jax.lax.scan(step, list(carry), list(invals[n_consts + n_carry:]), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"])
  return [*c, *ys]


def is_shard_map(node: Node) -> bool:
  """Whether ``node`` is a ``shard_map`` call :func:`rewrap_shard_map` can re-make."""
  return (node.prim.name == "shard_map"
          and {"mesh", "in_specs", "out_specs", "jaxpr"} <= set(node.params))


def varying_axes(aval) -> frozenset:
  """The ``shard_map`` manual axes values of ``aval`` vary over (none outside one)."""
  return frozenset(getattr(getattr(aval, "mat", None), "varying", ()) or ())


def varies_over_mesh(avals) -> bool:
  """Whether values of these avals vary over a ``shard_map``'s manual axes: a body that takes
  them only traces inside its shard_map, not on its own from :func:`shape_structs`."""
  return any(varying_axes(a) for a in avals)


def shape_structs(avals) -> list:
  return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
          for a in avals]
