"""The layer loop of a program as the planner sees it: finding it (a ``lax.scan`` over stacked
inputs, through jit calls and shard_maps), its candidate tensors (named by the program, or
matmul / convolution / custom-derivative outputs named here), and one layer body under a
plan's ``jax.checkpoint`` policy (or JAX's, or none)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax import _vjp_residuals, memory
from invact_jax.convert import graph as _graph
from invact_jax.planner import integer_program

# Equations whose outputs are candidates when the program names none of them itself.
_AUTO = {"dot_general": "matmul", "conv_general_dilated": "conv",
         "custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp"}


# Equations that only re-lay, re-type or slice a value: a matmul operand computed by them is
# the value they start from (a layer's weight sliced from its stack is an input).
_LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
                     "convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                     "split"})


_REMAT = ("checkpoint", "remat", "remat2")


#: JAX's policies that save every matmul's output (those inside a custom derivative's forward
#: too): a plan takes one where it fits and recomputes less.
FIXED_POLICIES = {"dots": jax.checkpoint_policies.checkpoint_dots,
                  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")


_MLP = ("mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")


#: MaxText's remat presets by the ``checkpoint_name`` s each saves (its decoder's
#: ``remat_policy``): a plan weighs those whose names the program's layer has beside JAX's
#: policies, costed as every choice is.
MAXTEXT_PRESETS: dict[str, tuple[str, ...]] = {
    "minimal": (*_QKV, "out_proj", *_MLP),
    "minimal_with_context": (*_QKV, "out_proj", *_MLP, "context"),
    "save_dot_with_context_except_mlp": (*_QKV, "context", "out_proj"),
    "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_QKV, "out_proj"),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One candidate tensor of a layer.

  Attributes:
    name: its ``checkpoint_name`` (the program's own, or given here: ``matmul_3``).
    shape: its shape in one layer (a name used several times: the first).
    dtype: its dtype.
    bytes: bytes per layer (every value with this name).
    where: the source line that computes it.
    named_by: ``"program"`` or ``"invact_jax"``.
  """
  name: str
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  where: str
  named_by: str


@dataclasses.dataclass(frozen=True)
class Loop:
  node: _graph.Node
  body: Any                      # the body's closed jaxpr, jax.checkpoint inlined
  graph: _graph.Graph            # its graph (the refs of ``names``)
  tensors: tuple[Tensor, ...]
  names: dict                    # body output ref -> name (the values to tag)
  remat: bool = False            # whether the body has a jax.checkpoint of its own
  # The shard_maps it sits in, outermost first: (node, its body's graph) each.
  within: tuple = ()
  # custom_vjp calls whose residuals are named inside: node index -> {residual: name}.
  calls: dict = dataclasses.field(default_factory=dict)

  @property
  def where(self) -> str:
    return (self.node.where or "lax.scan") + (" inside a shard_map" if self.within else "")

  @property
  def length(self) -> int:
    return int(self.node.params["length"])

  @functools.cached_property
  def signature(self) -> str:
    """A digest of the tagged body's jaxpr text: what its FLOPs under a policy depend on."""
    text = str(jax.make_jaxpr(_tagged(self))(*_graph.shape_structs(self.body.in_avals)))
    return hashlib.sha256(text.encode()).hexdigest()


def _eval_inlined(closed, args) -> list:
  """Evaluate ``closed`` with every ``jax.checkpoint`` in it run as plain equations (the
  plan's policy replaces the program's own), and, for a body traced on its own out of a
  ``shard_map``, its ``pvary`` casts as the identity they are on values (:func:`_tagged`
  casts again where it runs in place)."""
  graph = _graph.flatten(closed)

  def hook(node, invals):
    if node.prim.name == "pvary":
      return list(invals)
    if node.prim.name not in _REMAT:
      return None
    return _eval_inlined(node.params["jaxpr"], invals)  # (open: its constants are inputs)
  return _graph.evaluate(graph, list(args), nested=hook)


def _as_varying(values: list) -> list:
  """``values`` cast to vary over every axis one of them varies over (as JAX casts the
  operands of an equation it traces inside a ``shard_map``)."""
  axes = [_graph.varying_axes(jax.typeof(v)) if isinstance(v, jax.Array) else frozenset()
          for v in values]
  union = frozenset().union(*axes)
  if not union:
    return values
  return [jax.lax.pcast(v, tuple(sorted(union - a)), to="varying") if union - a else v
          for v, a in zip(values, axes)]


def _nbytes(aval) -> int:
  return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _candidates(graph: _graph.Graph) -> tuple[tuple[Tensor, ...], dict, dict]:
  """The candidate tensors of a layer body's graph, ``{ref: name}`` of the values to tag, and
  ``{node index: {residual: name}}`` of the custom_vjp calls whose residuals are tagged
  inside (:func:`_call_residuals`)."""
  outputs = {r for r in graph.outvars if not isinstance(r, _graph.Lit)}
  named, auto, counts = {}, {}, {}
  for n in graph.nodes:
    if n.prim.name == "name":
      named.setdefault(str(n.params["name"]), []).append((n.outs[0], n.where))
  for n in graph.nodes:
    kind = _AUTO.get(n.prim.name)
    if kind is None:
      continue
    for ref in n.outs:
      aval = graph.avals[ref]
      readers = [graph.nodes[i] for i in graph.consumers.get(ref, [])]
      if (ref in outputs or not getattr(aval, "shape", ()) or not readers
          or not jnp.issubdtype(aval.dtype, jnp.inexact)
          or all(r.prim.name == "name" for r in readers)):  # named by the program already
        continue
      k = counts.get(kind, 0)
      counts[kind] = k + 1
      auto[ref] = (f"{kind}_{k}", n.where)
  _operands(graph, named, auto, outputs)
  tensors, names = [], {}
  calls, inside = _call_residuals(graph, auto)
  for name, refs in named.items():
    avals = [graph.avals[r] for r, _ in refs]
    tensors.append(Tensor(name, tuple(avals[0].shape), str(avals[0].dtype),
                          sum(_nbytes(a) for a in avals), refs[0][1], "program"))
  for ref, (name, where) in auto.items():
    a = graph.avals[ref]
    tensors.append(Tensor(name, tuple(a.shape), str(a.dtype), _nbytes(a), where, "invact_jax"))
    if ref not in inside:
      names[ref] = name
  return tuple(tensors), names, calls


def _call_residuals(graph: _graph.Graph, auto: dict) -> tuple[dict, set]:
  """The custom_vjp calls whose residuals are candidates: ``({node index: {residual: name}},
  the output refs named inside their call)``.  Every residual the call's forward computes
  goes by the name of the call's output (``custom_vjp_0``: a flash attention's output and
  its row log-sum-exp), one candidate: keeping all of them spares re-running the call's
  forward in the backward, keeping some spares nothing (:mod:`invact_jax._vjp_residuals`)."""
  calls, inside = {}, set()
  for i, n in enumerate(graph.nodes):
    if _AUTO.get(n.prim.name) != "custom_vjp" or not n.outs or n.outs[0] not in auto:
      continue
    found = _vjp_residuals.residuals(n)
    if not found:
      continue
    base = auto[n.outs[0]][0]
    names = {r.index: base for r in found}
    inside.update(n.outs[r.output] for r in found if r.output is not None)
    calls[i] = names
  return calls, inside


def _operands(graph: _graph.Graph, named: dict, auto: dict, outputs: set) -> None:
  """Add to ``auto`` the matmuls' operands that the layer computes with elementwise
  equations (a norm's output, a rotary embedding's, the probabilities, an activation times a
  gate), each named after the first matmul it feeds and its side (``matmul_0_lhs``,
  ``query_proj_lhs``): keeping one spares its chain's recompute.  A value the layer takes in,
  or one that is a candidate already (maybe re-laid or sliced), is none."""
  taken = set(auto) | {r for refs in named.values() for r, _ in refs}
  used = set(named) | {name for name, _ in auto.values()}
  # a matmul's output the program names (the name's input) goes by that name
  called = {graph.nodes[graph.producer[r][0]].ins[0]: name
            for name, refs in named.items() for r, _ in refs if r in graph.producer}
  for n in graph.nodes:
    kind = _AUTO.get(n.prim.name)
    if kind not in ("matmul", "conv"):
      continue
    out = n.outs[0]
    consumer = auto[out][0] if out in auto else called.get(out, kind)
    for side, src in zip(("lhs", "rhs"), n.ins):
      while (not isinstance(src, _graph.Lit) and src in graph.producer
             and graph.nodes[graph.producer[src][0]].prim.name in _LAYOUT):
        src = graph.nodes[graph.producer[src][0]].ins[0]
      if (isinstance(src, _graph.Lit) or src not in graph.producer or src in taken
          or src in outputs):
        continue
      aval = graph.avals[src]
      if getattr(aval, "shape", ()) and jnp.issubdtype(aval.dtype, jnp.inexact):
        name = f"{consumer}_{side}"
        name = next(f"{name}_{k}" for k in itertools.count(1) if f"{name}_{k}" not in used) \
            if name in used else name
        taken.add(src)
        used.add(name)
        auto[src] = (name, graph.nodes[graph.producer[src][0]].where)


def _as_loop(node: _graph.Node, within: tuple = ()) -> Loop | None:
  """The layer loop ``node`` is, or None (not a scan over stacked inputs; or, inside a
  ``shard_map``, one whose layer does not trace on its own: its collectives need the mesh)."""
  p = node.params
  if node.prim.name != "scan" or int(p.get("length", 0)) < 2:
    return None
  n_consts, n_carry = _graph.scan_counts(p)
  body = p["jaxpr"]
  if len(body.in_avals) <= n_consts + n_carry:
    return None
  structs = _graph.shape_structs(body.in_avals)  # (one device's shapes inside a shard_map)
  try:
    inlined = jax.make_jaxpr(lambda *a: _eval_inlined(body, a))(*structs)
  except NameError:  # a collective over an axis of the enclosing shard_map's mesh
    if within:
      return None
    raise
  graph = _graph.flatten(inlined)
  tensors, names, calls = _candidates(graph)
  remat = any(e.primitive.name in _REMAT for e in _eqns(body.jaxpr))
  return Loop(node, inlined, graph, tensors, names, remat, within, calls)


def read_by_the_backward(loop: Loop) -> Loop | None:
  """``loop`` with only the candidates the backward reads, at the bytes JAX saves of them
  (None if it reads none)."""
  saved = _saved_bytes(loop)
  tensors = tuple(dataclasses.replace(t, bytes=saved[t.name]) for t in loop.tensors
                  if saved.get(t.name))
  return dataclasses.replace(loop, tensors=tensors) if tensors else None


def _eqns(jaxpr):
  """The equations of ``jaxpr`` and of the jaxprs nested in it."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        yield from _eqns(inner)


def _saved_bytes(loop: Loop) -> dict[str, int]:
  """Bytes per layer of each candidate that the backward reads (what ``jax.checkpoint``
  saves when every candidate may be saved; a value the backward does not read is no
  candidate), from JAX's own residual list (:func:`invact_jax.memory.residuals`)."""
  out: dict[str, int] = {}
  for r in layer_residuals(loop, [t.name for t in loop.tensors]):
    m = re.match(r"named '(.*)' from", r.source)
    if m:
      out[m.group(1)] = out.get(m.group(1), 0) + r.bytes
  return out


def layer_scalar(loop: Loop, keep: Sequence[str], fixed: str | None):
  """``(scalar, structs)``: one layer under the policy keeping ``keep`` (or JAX's ``fixed``)
  as a function of its floating-point inputs to a scalar (the sum of its floating outputs),
  and those inputs' shape structs."""
  body = layer_body(loop, keep, (), fixed)
  structs = _graph.shape_structs(loop.body.in_avals)
  positions = tuple(i for i, s in enumerate(structs) if jnp.issubdtype(s.dtype, jnp.inexact))

  def scalar(*diff):
    args = list(structs)
    for i, v in zip(positions, diff):
      args[i] = v
    return sum(jnp.sum(o.astype(jnp.float32)) for o in body(*args)
               if jnp.issubdtype(o.dtype, jnp.inexact))
  return scalar, tuple(structs[i] for i in positions)


def layer_residuals(loop: Loop, keep: Sequence[str], fixed: str | None = None) -> list:
  """What one layer under the plan's policy keeps for its backward besides its inputs."""
  scalar, structs = layer_scalar(loop, keep, fixed)
  return [r for r in memory.residuals(scalar, *structs) if not r.is_argument]


def find_loops(closed) -> tuple[_graph.Graph, list[Loop], list[str]]:
  """The program's graph; its layer loops, also those inside its ``shard_map``s, heaviest
  first (by their candidates' bytes; :func:`read_by_the_backward` narrows a loop's
  candidates); and the loops inside a ``shard_map`` that cannot be planned (where, why)."""
  graph = _graph.flatten(closed)
  skipped = []

  def find(g: _graph.Graph, within: tuple) -> list[Loop]:
    out = []
    for n in g.nodes:
      if _graph.is_shard_map(n):
        inner = _graph.flatten(n.params["jaxpr"])
        out += find(inner, within + ((n, inner),))
      elif (loop := _as_loop(n, within)) is not None:
        out.append(loop)
      elif within and n.prim.name == "scan":
        skipped.append(f"{n.where or 'lax.scan'} inside a shard_map: its layer names the "
                       "mesh's axes (a collective, or a custom derivative traced with them), "
                       "so it traces only with the mesh, not on its own as the planner "
                       "profiles a layer")
    return out
  loops = find(graph, ())
  loops.sort(key=lambda l: -l.length * sum(t.bytes for t in l.tensors))
  return graph, loops, skipped


def enclosed_loops(closed) -> list[str]:
  """The scans over stacked inputs the planner does not reach, and what encloses them: a
  ``lax.cond`` branch, a ``while`` loop, another scan's body, a custom derivative (the
  planner plans a loop of the program's top level, through jit calls and shard_maps)."""
  out = []

  def walk(jaxpr, within):
    for e in jaxpr.eqns:
      name = e.primitive.name
      if within and name == "scan" and int(e.params.get("length", 0)) >= 2:
        out.append(f"a lax.scan of {e.params['length']} iterations at "
                   f"{_graph.where(e) or 'an unknown line'} lies inside {within}, where the "
                   "planner does not plan a loop (plan a function whose top level holds it)")
        continue
      if name in ("pjit", "jit", "closed_call", "core_call", "shard_map"):
        inner = within
      else:
        inner = {"cond": "a lax.cond branch", "while": "a while loop",
                 "scan": "a lax.scan's body"}.get(name, within or f"{name}'s body")
      for v in e.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
          j = getattr(j, "jaxpr", j)
          if hasattr(j, "eqns"):
            walk(j, inner)
  walk(getattr(closed, "jaxpr", closed), "")
  return out


def _tagged(loop: Loop) -> Callable[..., list]:
  """The layer body with its automatic candidates named (``checkpoint_name``)."""
  graph = loop.graph

  def run(*args):
    env = dict(zip(graph.invars, args))
    value = lambda r: r.val if isinstance(r, _graph.Lit) else env[r]  # noqa: E731
    for i, n in enumerate(graph.nodes):
      ins = [value(r) for r in n.ins]
      ins = _as_varying(ins) if loop.within else ins
      outs = (_vjp_residuals.bind_named(n, ins, loop.calls[i], _graph.bind) if i in loop.calls
              else _graph.bind(n, ins))
      for ref, out in zip(n.outs, outs):
        env[ref] = jax.ad_checkpoint.checkpoint_name(out, loop.names[ref]) if ref in loop.names else out
    return [value(r) for r in graph.outvars]
  return run


def _policy(keep: Sequence[str], offload: Sequence[str], fixed: str | None):
  """The ``jax.checkpoint`` policy of a plan: the names kept (and offloaded; a MaxText
  preset's are in ``keep``), or one of JAX's :data:`FIXED_POLICIES` (``"everything"``: no
  recompute; ``"none"`` has no policy: :func:`layer_body`)."""
  if fixed == "everything":
    return jax.checkpoint_policies.everything_saveable
  return (FIXED_POLICIES[fixed] if fixed in FIXED_POLICIES
          else integer_program.policy(tuple(keep), tuple(offload)))


def layer_body(loop: Loop, keep: Sequence[str], offload: Sequence[str], fixed: str | None):
  """The layer body as a function under the plan (``fixed == "none"``: without remat)."""
  if fixed == "none":
    return _tagged(loop)
  return jax.checkpoint(_tagged(loop), policy=_policy(keep, offload, fixed), prevent_cse=False)


def planned_layer_body(loop: Loop, keep: Sequence[str], offload: Sequence[str],
                       fixed: str | None = None):
  """The body's closed jaxpr under the plan's ``jax.checkpoint`` policy."""
  return jax.make_jaxpr(layer_body(loop, keep, offload, fixed))(
      *_graph.shape_structs(loop.body.in_avals))
