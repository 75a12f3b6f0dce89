"""The conversion pass over one graph: the rule table, finding, planning and evaluating.

:data:`RULES` in claim order; :func:`find` asks each rule for its matches outside what earlier
rules claimed; :func:`plan` numbers the sites (the fallback's choices refer to them), builds
each rule's unit, then runs the floor pass (:mod:`._fusion`); :func:`run` evaluates the graph
with the units swapped in, converting nested ``jit``, ``scan``, ``cond``, ``checkpoint`` and
``shard_map`` bodies through the same pass (:func:`nested`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax import targets
from invact_jax.convert import _fusion
from invact_jax.convert import graph as _graph
from invact_jax.convert import _report
from invact_jax.convert import _rule
from invact_jax.convert.graph import Lit
from invact_jax.convert._rule_deferred_softmax import DeferredSoftmaxRule
from invact_jax.convert._rule_forms import FormRule
from invact_jax.convert._rule_head import HeadRule
from invact_jax.convert._rule_norm import NormRule
from invact_jax.convert._rule_softmax import SoftmaxRule

__all__ = ["RULES", "candidates", "kinds", "Options", "Found", "prepare", "find", "plan", "run",
           "options_for_analysis"]

#: The recognizers in claim order: a node claimed by one is not offered to the next.
RULES: tuple[_rule.Rule, ...] = (HeadRule(), NormRule(), SoftmaxRule(), DeferredSoftmaxRule(),
                                 FormRule())


def candidates(names: frozenset | None = None) -> dict[str, str]:
  """Primitive -> the op an unclaimed one of them suggests (reported as left alone), of the
  rules converting one of ``names`` (None: every rule)."""
  return {k: v for r in RULES if names is None or names & set(r.publics)
          for k, v in r.candidates.items()}


def kinds(norms: bool = True) -> tuple[str, ...]:
  """The names ``invert(only=...)`` takes besides the activations' (the other rules'; without
  ``norms``, not those of the rules :attr:`~._rule.Rule.with_norms`)."""
  return tuple(dict.fromkeys(p for r in RULES if r.kind != "form" and (norms or not r.with_norms)
                             for p in r.publics))


@dataclasses.dataclass
class Options:
  """One conversion's settings and its report.

  Attributes:
    names: the public names to convert.
    implementations: the backward's implementation per op family (``"activation"``,
      ``"norm"``: entries of the families' ``IMPLEMENTATIONS``), as the rules read them.
    report: what the conversion did.
    floor: fuse the matmuls that read recomputable values (the floor pass).
    skip: sites (numbered in the order they are found) left alone.
    recompute: activation sites run as ``jax.checkpoint`` of themselves.
    recomputable: per site numbered so far (its number is its index), whether it can be
      recomputed.
    in_loop: converting a scan body (its residuals are kept per step).
    measure_remat: compile a ``jax.checkpoint`` body both ways and convert it only where
      that lowers its temp (:func:`_remat_body`); False converts it unmeasured (for
      ``invact_jax.plan``, which replaces the policy the measurement is made under).
    remat_as_written: leave every ``jax.checkpoint`` body as written (the whole program's
      check found that converting them raised its gradient's temp: the reason).
    remat_converted: the ``jax.checkpoint`` bodies converted so far inside a loop (where they
      were).
  """
  names: frozenset
  implementations: dict
  report: _report.ConversionReport
  floor: bool = True
  skip: frozenset = frozenset()
  recompute: frozenset = frozenset()
  recomputable: list = dataclasses.field(default_factory=list)
  in_loop: bool = False
  measure_remat: bool = True
  remat_as_written: str = ""
  remat_converted: list = dataclasses.field(default_factory=list)

  def site(self, public: str, where: str, recomputable: bool = False) -> str | None:
    """Number the next site: None if it is to be left alone (``skip``), ``"recompute"`` for
    an activation in ``recompute``, else ``"invert"``."""
    number = len(self.recomputable)
    self.recomputable.append(recomputable)
    if number in self.skip:
      self.report.left_alone.append((public, where, _report.FELL_BACK))
      return None
    if recomputable and number in self.recompute:
      self.report.recomputed.append((public, where, _report.FELL_BACK))
      return "recompute"
    return "invert"


def options_for_analysis() -> Options:
  """Options that find every op (for analyses of a program, not its conversion)."""
  from invact_jax.ops.activations import api as act_api  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import registry  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.norms import api as norm_api  # pylint: disable=import-outside-toplevel
  names = frozenset(registry.PUBLIC[n][0].public for n in registry.PUBLIC) | set(kinds())
  return Options(names, {"activation": act_api.IMPLEMENTATIONS["xla"],
                        "norm": norm_api.IMPLEMENTATIONS["xla"]},
                 _report.ConversionReport(), False)


@dataclasses.dataclass
class Found:
  """The ops found in a program, before anything is replaced: ``(rule, match)`` in claim
  order."""
  matches: list

  def of(self, kind: str) -> list:
    """The matches of the rules of ``kind``."""
    return [m for r, m in self.matches if r.kind == kind]


def prepare(g: _graph.Graph, opts: Options) -> _graph.Graph:
  """``g`` with its repeated equations merged (:func:`_graph.merge_duplicates`) and as every
  rule of ``opts.names`` prepares it (:meth:`_rule.Rule.prepare`), in claim order: the graph
  :func:`find` and :func:`run` work on."""
  g = _graph.merge_duplicates(g)
  for rule in RULES:
    if opts.names & set(rule.publics):
      g = rule.prepare(g, opts)
  return g


def find(g: _graph.Graph, opts: Options) -> Found:
  """Every op of ``opts.names`` in ``g`` that can be converted; what cannot is added to
  ``opts.report.left_alone`` with its reason."""
  claimed: set = set()
  outvars = {r for r in g.outvars if not isinstance(r, Lit)}
  found = Found([])
  explained: set = set()  # candidate nodes already reported with a reason
  suggest = candidates(opts.names)
  for rule in RULES:
    if not opts.names & set(rule.publics):
      continue
    matches, left = rule.find(g, claimed, outvars, opts)
    for m in matches:
      if rule.wanted(m, opts.names):
        claimed.update(m.nodes)
        found.matches.append((rule, m))
    for nodes, what, why in left:
      explained.update(nodes)
      opts.report.left_alone.append((what, g.nodes[nodes[0]].where, why))
  for i, n in enumerate(g.nodes):
    # (of constants, sqrt(head_dim), or of one number, exp(log_temperature): no candidate)
    if (i not in claimed and i not in explained and n.prim.name in suggest
        and not all(isinstance(r, Lit) for r in n.ins)
        and any(math.prod(g.avals[o].shape) > 1 for o in n.outs)):
      opts.report.left_alone.append(
          (n.prim.name, n.where, f"not part of a recognized {suggest[n.prim.name]} form"))
  return found


def plan(g: _graph.Graph, opts: Options) -> list:
  """The :class:`_graph.Unit` s that replace the converted matches of ``g``."""
  found = find(g, opts)
  units: list = []
  fusable: list = []  # (Built.fusion, unit): fused with the matmuls that read the unit
  kept: set = set()      # outputs of converted ops that their own backward keeps
  for rule, m in found.matches:
    where = g.nodes[m.root].where
    mode = opts.site(rule.public(m), where, rule.recomputable(m))
    if mode is None:
      continue
    if mode == "recompute":  # keeps its input; XLA fuses the recomputed derivative
      units.append(_graph.Unit(frozenset(m.nodes), list(m.inputs), [rule.output(g, m)],
                               _rule.single(jax.checkpoint(rule.region(g, m)))))
      continue
    built = rule.build(g, m, opts)
    units.append(built.unit)
    if built.fusion is not None:
      fusable.append((built.fusion, built.unit))
    if built.kept:
      kept.update(built.unit.outputs)
    opts.report.converted.append((rule.public(m), rule.describe(m), where))
  if opts.floor:
    units = _fusion.fuse(g, units, fusable, kept,
                         {r for r in g.outvars if not isinstance(r, Lit)})
  return units


def run(graph: _graph.Graph, args, opts: Options) -> list:
  """``graph`` evaluated on ``args`` with its converted units swapped in."""
  graph = prepare(graph, opts)
  return _graph.evaluate(graph, list(args), units=plan(graph, opts), nested=nested(opts))


# ---------------------------------------------------------------------- nested bodies
def contains_candidates(params) -> bool:
  """Whether a nested body among ``params`` computes a primitive some rule recognizes."""
  suggest = candidates()
  for v in params.values():
    j = getattr(v, "jaxpr", v)
    if hasattr(j, "eqns"):
      for e in j.eqns:
        if e.primitive.name in suggest or contains_candidates(e.params):
          return True
    elif isinstance(v, (tuple, list)) and v and hasattr(getattr(v[0], "jaxpr", None), "eqns"):
      if any(contains_candidates({"j": b}) for b in v):
        return True
  return False


# Constants of the enclosing program up to this size are seen as constants inside a body (a
# norm's epsilon is a scan constant when the layers are stacked).
_KNOWN_SIZE = 64


def _small_constants(refs, positions) -> dict:
  """``{body input index: Lit}`` for the small constants among ``refs`` at ``positions``."""
  return {k: refs[k] for k in positions
          if isinstance(refs[k], Lit) and np.size(refs[k].val) <= _KNOWN_SIZE
          and not isinstance(refs[k].val, jax.core.Tracer)}


def _branch_constants(node: _graph.Node) -> dict:
  """A ``cond``'s small constant operands by branch input index (its first operand, the
  index, is no branch input)."""
  return {k - 1: lit for k, lit in _small_constants(node.ins, range(1, len(node.ins))).items()}


def _convert_closed(closed, opts: Options, known: dict | None = None):
  """A converted copy of a nested body (same input and output types), or None.  ``known``:
  body input index -> the constant it always receives."""
  structs = _graph.shape_structs(closed.in_avals)
  graph = _body_graph(closed, known or {})
  new = jax.make_jaxpr(lambda *a: run(graph, a, opts))(*structs)
  same = all(a.shape == b.shape and a.dtype == b.dtype and
             getattr(a, "weak_type", False) == getattr(b, "weak_type", False)
             for a, b in zip(new.out_avals, closed.out_avals))
  return new if same else None


def _rebound(node: _graph.Node, invals, **params):
  return _graph.bind(_graph.Node(node.prim, dict(node.params, **params), node.ins, node.outs,
                                 eqn=node.eqn), invals)


# Nested calls whose bodies are converted by tracing them on their own (shape structs); inside
# a shard_map, where their values vary over the mesh's axes, they are traced in place instead
# (:func:`_in_place`), but for a remat, whose body is measured on its own.
_TRACED_ALONE = ("checkpoint", "remat", "remat2", "scan", "pjit", "jit", "cond")
_IN_SHARD_MAP = ("inside a shard_map: a {} body whose values vary over the mesh's axes cannot "
                 "be compiled on its own, and converting it unmeasured may raise the temp its "
                 "policy keeps; left as written")


def _in_place(node: _graph.Node, invals, opts: Options) -> list:
  """A scan, jit or cond inside a ``shard_map`` converted by tracing its body where it is
  (its values vary over the mesh's manual axes, so it cannot be traced on its own from shape
  structs): the scan re-made by ``lax.scan``, the jit inlined, the cond by ``lax.switch``;
  each with the same inputs, outputs and loop options."""
  name, p = node.prim.name, node.params
  if name == "scan":
    consts = range(_graph.scan_counts(p)[0])
    graph = _body_graph(p["jaxpr"], _small_constants(node.ins, consts))
    body_opts = dataclasses.replace(opts, in_loop=True)
    return _graph.rescan(node, lambda *a: run(graph, a, body_opts), invals)
  if name == "cond":
    known = _branch_constants(node)
    graphs = [_body_graph(b, known) for b in p["branches"]]
    return list(jax.lax.switch(invals[0], [lambda *a, g=g: tuple(run(g, a, opts))
                                            for g in graphs], *invals[1:]))
  graph = _body_graph(p["jaxpr"], _small_constants(node.ins, range(len(node.ins))))
  return run(graph, invals, opts)


def _body_graph(closed, known: dict) -> _graph.Graph:
  graph = _graph.flatten(closed)
  if known:
    graph = _graph.substitute(graph, {graph.invars[k]: lit for k, lit in known.items()})
  return graph


# The remat check's measurements by (converted body, original body, target): a program
# traced again (a training step and an evaluation of the same loss, a retrace) compiles the
# bodies once.
_MEASURED: dict = {}
_MEASURED_SIZE = 64


def forget_measurements() -> None:
  """Drop the remat check's kept figures (benchmarks timing a first conversion)."""
  _MEASURED.clear()


def _remat_body(node: _graph.Node, graph: _graph.Graph, opts: Options):
  """A ``jax.checkpoint`` call converted (a closed jaxpr holding the re-wrapped call), or None
  to run it as written.

  Under a remat the policy decides what is kept; converting the body can lower what the
  recomputed forward holds (the layer's saved inputs, the recomputed residuals) or, where the
  policy recomputes the sites anyway, only change how it recomputes them and raise the temp.
  So the body is compiled both ways (one layer: cheap beside the program) and converted only
  where that is strictly lower; otherwise its sites are left alone with the two figures.  The
  body is converted once, for the measurement; the chosen call is that conversion."""
  p = node.params
  structs = _graph.shape_structs(p["jaxpr"].in_avals)
  probe = dataclasses.replace(opts, report=_report.ConversionReport(),
                              recomputable=list(opts.recomputable))
  remat = functools.partial(jax.checkpoint, prevent_cse=p["prevent_cse"], policy=p["policy"])
  converted = jax.make_jaxpr(lambda *a: remat(lambda *b: run(graph, b, probe))(*a))(*structs)
  opts.recomputable[:] = probe.recomputable  # the sites keep their numbers either way
  sites = ([(public, where) for public, _, where in probe.report.converted]
           + [(public, where) for public, where, _ in probe.report.recomputed])
  if sites and opts.remat_as_written:
    opts.report.left_alone.extend((public, where, opts.remat_as_written) for public, where in sites)
    opts.report.left_alone.extend(probe.report.left_alone)
    return None
  if sites and opts.measure_remat:
    body = p["jaxpr"]  # (open: a checkpoint's body takes its constants as inputs)
    jaxpr, consts = getattr(body, "jaxpr", body), getattr(body, "consts", ())
    original = jax.make_jaxpr(remat(lambda *a: jax.core.eval_jaxpr(jaxpr, consts, *a)))(*structs)
    from invact_jax.convert import _fallback  # pylint: disable=import-outside-toplevel  # (a cycle)
    positions = [i for i, s in enumerate(structs) if jnp.issubdtype(s.dtype, jnp.inexact)]
    key = (str(converted), str(original), targets.current().key)
    if key not in _MEASURED:
      if len(_MEASURED) >= _MEASURED_SIZE:
        _MEASURED.clear()
      _MEASURED[key] = _fallback.gradient_temps((converted, original), structs, positions)
    ours, theirs = _MEASURED[key]
    if ours >= theirs:
      why = (f"inside jax.checkpoint its policy decides what is kept: converting the body "
             f"{'gains nothing' if ours == theirs else 'raises'} its gradient's compiled temp "
             f"({ours:,} vs {theirs:,} bytes per call); left as written")
      opts.report.left_alone.extend((public, where, why) for public, where in sites)
      opts.report.left_alone.extend(probe.report.left_alone)
      return None
  for mine, theirs_ in ((opts.report.converted, probe.report.converted),
                        (opts.report.left_alone, probe.report.left_alone),
                        (opts.report.recomputed, probe.report.recomputed)):
    mine.extend(theirs_)
  if sites and opts.in_loop:  # (a loop of them: the whole program is checked, _program)
    opts.remat_converted.append(node.where)
  return converted


def nested(opts: Options):
  """The hook :func:`_graph.evaluate` calls per nested call: its converted outputs, or None
  to run it as it is."""
  def convert(node: _graph.Node, invals):
    name, p = node.prim.name, node.params
    body = p.get("jaxpr") if name != "cond" else (p["branches"] or [None])[0]
    if (name in _TRACED_ALONE and body is not None
        and _graph.varies_over_mesh(getattr(body, "in_avals", ()))):
      if name in ("checkpoint", "remat", "remat2") or not contains_candidates(p):
        if contains_candidates(p):
          opts.report.left_alone.append((name, node.where, _IN_SHARD_MAP.format(name)))
        return None
      return _in_place(node, invals, opts)
    if name in ("checkpoint", "remat", "remat2"):
      converted = _remat_body(node, _graph.flatten(p["jaxpr"]), opts)
      return None if converted is None else list(
          jax.core.eval_jaxpr(converted.jaxpr, converted.consts, *invals))
    if _graph.is_shard_map(node):
      graph = _graph.flatten(p["jaxpr"])
      return _graph.rewrap_shard_map(node, lambda *a: run(graph, a, opts), invals)
    if name == "scan" or name in ("pjit", "jit"):
      consts = range(_graph.scan_counts(p)[0] if name == "scan" else len(node.ins))
      body_opts = dataclasses.replace(opts, in_loop=True) if name == "scan" else opts
      new = _convert_closed(p["jaxpr"], body_opts, _small_constants(node.ins, consts))
      return None if new is None else _rebound(node, invals, jaxpr=new)
    if name == "cond":
      known = _branch_constants(node)
      branches = [_convert_closed(b, opts, known) for b in p["branches"]]
      if any(b is None for b in branches):
        return None
      return _rebound(node, invals, branches=tuple(branches))
    if contains_candidates(p):
      opts.report.left_alone.append(
          (name, node.where, "not entered: the conversion does not rewrite inside "
           f"{name} (its own derivative rule or loop)"))
    return None
  return convert
