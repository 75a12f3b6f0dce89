"""The memory planner on any JAX program: :func:`plan` chooses, per tensor of the program's
layer loop, what the backward keeps, recomputes or offloads, under a byte budget.

The pipeline, for ``plan(fn, *example_args, budget=...)``:

1. Trace ``fn`` and find its layer loop: a ``lax.scan`` over stacked inputs (parameters),
   through nested ``jit`` calls and inside ``shard_map``s (profiled from one device's shapes
   and re-made where it stands; not where its layer names the mesh's axes: a collective, or
   a custom derivative traced with them, traces only with the mesh); of several, the one
   whose tensors weigh most (the report names the others).
2. The candidate tensors of one layer: the values the program names with
   ``checkpoint_name`` (MaxText, keras-hub, the project's models), and otherwise the outputs of
   its matmuls, convolutions and custom-derivative calls (``invert``'s converted sites),
   named ``matmul_0``, ``matmul_1``, ... in program order, each with its source line; and the
   matmuls' operands the layer computes elementwise (a norm's output, the probabilities:
   ``matmul_3_lhs``); a custom-derivative call's residuals that its forward computes go by
   the call's name (a flash attention's output and row log-sum-exp: without both kept,
   ``jax.checkpoint`` re-runs its forward), named inside the call
   (:mod:`invact_jax._vjp_residuals`).  Other elementwise values are always recomputed from
   them.  A ``jax.checkpoint`` the layer already has is replaced by the plan's.
3. Their costs from the program: bytes exactly from shape and dtype (per layer); the recompute
   FLOPs each saves counted on one layer's traced linearization (which holds the recompute a
   policy asks for) with XLA's cost-analysis conventions (:func:`invact_jax.memory.jaxpr_flops`:
   no lowering, no compile); the peak of keeping nothing compiled once (the minimum, and the
   base of the run-phase model).
4. :func:`invact_jax.planner.solve` (MONeT's integer program) chooses one set for every layer;
   where it keeps every tensor worth keeping, the program as written is compiled first (no
   recompute at all, if it fits); else the planned program is compiled: where XLA's temp is
   off its prediction by more than 5 % the bytes a kept tensor adds per layer are recalibrated
   (least squares over every plan compiled: XLA:CPU keeps 16-bit values as float32, say) and
   the plan solved again, and where it is above the budget the target is lowered by the
   excess.
5. The solved plan is one choice among the program's others, costed the same way
   (:func:`_cheapest`): JAX's none / full / dots / dots_no_batch, MaxText's presets whose
   names the layer has (:data:`MAXTEXT_PRESETS`), every set compiled on the way that fits,
   and a plan by runs of layers where one is predicted to pay (:func:`_per_run`).  A choice's
   recompute is its traced gradient step's FLOPs less the step without remat's (XLA's count
   of the compiled step); the least whose compiled temp fits is taken, so the plan never
   recomputes more than a fixed policy that fits.  So a plan costs two compiles where the
   model holds, plus the tracing.
6. The returned function is ``fn`` with the layer body under ``jax.checkpoint`` with the names
   policy of the plan (``planner.policy``: offloaded tensors go to ``pinned_host``), or the
   fixed policy taken, or one scan per run of layers.

With ``convert=True`` the same runs on ``invert(fn)`` too, from the program whose step does
the fewest FLOPs recomputing nothing up; a program that cannot beat a plan already made is
not planned, and the plan whose step does fewer FLOPs is taken.
"""
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

from invact_jax import _vjp_residuals, memory, planner, targets
from invact_jax.convert import _graph

__all__ = ["plan", "Planned", "PlanReport", "Tensor", "parse_budget", "FIXED_POLICIES",
           "MAXTEXT_PRESETS"]

# Equations whose outputs are candidates when the program names none of them itself.
_AUTO = {"dot_general": "matmul", "conv_general_dilated": "conv",
         "custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp"}
# Equations that only re-lay, re-type or slice a value: a matmul operand computed by them is
# the value they start from (a layer's weight sliced from its stack is an input).
_LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
                     "convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                     "split"})
_REMAT = ("checkpoint", "remat", "remat2")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# Re-solve rounds after the first when XLA's temp is above the budget or off the prediction.
_ROUNDS = 5
# A compiled plan further than this from its prediction recalibrates the bytes per tensor.
_TOLERANCE = 0.05
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
# Seconds per integer-program solve of a plan by runs of layers (past it, the best found: a
# 12-tensor, 8-layer profile took 9 s to prove its optimum).
_RUNS_SOLVE_SECONDS = 0.25
# A JAX policy or preset is compiled where its predicted temp is within this share above the
# budget (the prediction lists a layer's residuals; XLA fuses some away).
_SPARE = 0.15


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
class PlanReport:
  """What :func:`plan` chose and what it predicts.

  Attributes:
    loop: the planned layer loop (source line) and its length.
    depth: its number of layers.
    other_loops: the program's other layer loops, left as written.
    tensors: the candidates of one layer.
    keep, offload, recompute: the candidates' names by what every layer does with them.
    budget: the budget in bytes.
    predicted_bytes: the predicted compiled temp of ``jit(value_and_grad(planned))``.
    compiled_bytes: XLA's compiled temp of it.
    minimum_bytes: the compiled temp keeping nothing (every candidate recomputed).
    predicted_recompute_flops: FLOPs the plan recomputes per step (every layer): the
      planned step's FLOPs less those of the same step without remat, both counted on the
      traced gradient with XLA's cost-analysis conventions (:func:`memory.jaxpr_flops`: the
      compiled program's count, cuDNN's attention and Pallas kernels counted from their
      shapes).
    rounds: solves until the compiled temp fitted.
    as_written: whether the program as written fits: then it runs unchanged (every tensor
      kept, nothing recomputed) and ``predicted_bytes`` is its compiled temp.
    policy: the fixed choice the layers run under where it recomputes less than the solved
      plan and fits: JAX's (:data:`FIXED_POLICIES`), MaxText's preset (:data:`MAXTEXT_PRESETS`:
      ``keep`` holds its names), or ``"none"``: no remat, where the layer had a
      ``jax.checkpoint`` of its own (its ``predicted_bytes`` is its compiled temp); else None.
    runs: where layers differ (MONeT's and torchtitan's per-layer choice), ``(keep, offload,
      layers)`` per run of equal layers, first layers first (each run its own ``lax.scan``);
      then ``keep``/``offload`` name what every layer keeps/offloads.  Empty: every layer
      the same.
    compared: every choice weighed, one line each: what it recomputes and its compiled temp
      (or why it was not compiled): JAX's none / full / dots / dots_no_batch, MaxText's
      presets whose names the layer has, the solved plan(s).
    configuration: ``"as written"``, or ``"inverted"`` where ``plan(convert=True)`` took
      ``invact_jax.invert(fn)``.
    step_flops: FLOPs of the planned gradient step (XLA's cost-analysis conventions, every
      loop's body counted once per iteration: the layers, a chunked head's tiles), by which
      ``plan(convert=True)`` chooses between the programs (their backwards differ in more
      than the recompute); None without ``convert``.
    alternatives: with ``convert``, the other program: planned (its step's FLOPs and temp),
      infeasible (its minimum), or not planned (its step does more FLOPs than the chosen
      plan's even recomputing nothing).
  """
  loop: str
  depth: int
  other_loops: tuple[str, ...]
  tensors: tuple[Tensor, ...]
  keep: tuple[str, ...]
  offload: tuple[str, ...]
  recompute: tuple[str, ...]
  budget: int
  predicted_bytes: int
  compiled_bytes: int
  minimum_bytes: int
  predicted_recompute_flops: float
  rounds: int
  as_written: bool = False
  policy: str | None = None
  configuration: str = "as written"
  step_flops: float | None = None
  alternatives: tuple[str, ...] = ()
  runs: tuple[tuple[tuple[str, ...], tuple[str, ...], int], ...] = ()
  compared: tuple[str, ...] = ()

  def __str__(self) -> str:
    what = {**{n: "keep" for n in self.keep}, **{n: "offload" for n in self.offload}}
    if self.runs:
      first = 0
      for keep, off, layers in self.runs:
        for n in {*keep, *off} - set(what):
          what[n] = f"layers {first}-{first + layers - 1}: {'keep' if n in keep else 'offload'}"
        first += layers
    lines = [f"{self.configuration}: layer loop {self.loop} ({self.depth} layers)"
             + (": the program as written fits (nothing recomputed)" if self.as_written else "")
             + (": the layer fits without its own jax.checkpoint (no remat)"
                if self.policy == "none" else
                f": MaxText's {self.policy} preset fits and recomputes least"
                if self.policy in MAXTEXT_PRESETS else
                f": JAX's {self.policy} policy fits and recomputes least" if self.policy else "")
             + (f": {len(self.runs)} runs of layers (" + ", ".join(
                 str(r[2]) for r in self.runs) + ")" if self.runs else "")
             + "".join(f"\nleft as written: {w}" for w in self.other_loops)
             + "".join(f"\nnot taken: {a}" for a in self.alternatives),
             f"budget {self.budget:,} B: predicted {self.predicted_bytes:,} B, compiled "
             f"{self.compiled_bytes:,} B (keeping nothing: {self.minimum_bytes:,} B); recomputes "
             f"{self.predicted_recompute_flops:.3g} FLOPs per step",
             "| tensor | shape | dtype | bytes per layer | plan | where |", "|---|---|---|---:|---|---|"]
    lines += [f"| {t.name} | {list(t.shape)} | {t.dtype} | {t.bytes:,} | "
              f"{what.get(t.name, 'recompute')} | {t.where} |" for t in self.tensors]
    lines += [f"weighed: {c}" for c in self.compared]
    return "\n".join(lines)


def parse_budget(budget: int | float | str) -> int:
  """Bytes from a number or a string such as ``"300MiB"``, ``"1.5GB"``, ``"123456"``
  (fractions of a byte rounded down; any size of integer taken exactly).

  Raises:
    ValueError: not a finite number of at least one byte (the message names ``budget``).
    TypeError: not a number or a string.
  """
  value = budget
  if isinstance(budget, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
    if not m or m.group(2).lower() not in _UNITS:
      raise ValueError(f"argument `budget`: not a byte count: {budget!r} (e.g. 300MiB, 2GB, 123456)")
    number, unit = m.group(1), _UNITS[m.group(2).lower()]
    value = (int(number) * unit if re.fullmatch(r"[0-9]+", number)
             else float(number) * unit)
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"argument `budget` must be a number of bytes or a string such as '300MiB', "
                    f"got {budget!r}")
  if isinstance(value, (int, np.integer)):
    nbytes = int(value)
  elif not math.isfinite(float(value)):
    raise ValueError(f"argument `budget` must be a finite number of bytes, got {budget!r}")
  else:
    nbytes = math.floor(float(value))
  if nbytes < 1:
    raise ValueError(f"argument `budget` must be at least one byte, got {budget!r}")
  return nbytes


# --------------------------------------------------------------------------- the layer loop
@dataclasses.dataclass(frozen=True)
class _Loop:
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


def _as_loop(node: _graph.Node, within: tuple = ()) -> _Loop | None:
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
  return _Loop(node, inlined, graph, tensors, names, remat, within, calls)


def _read_by_the_backward(loop: _Loop) -> _Loop | None:
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


def _saved_bytes(loop: _Loop) -> dict[str, int]:
  """Bytes per layer of each candidate that the backward reads (what ``jax.checkpoint``
  saves when every candidate may be saved; a value the backward does not read is no
  candidate), from JAX's own residual list (:func:`invact_jax.memory.residuals`)."""
  out: dict[str, int] = {}
  for r in _layer_residuals(loop, [t.name for t in loop.tensors]):
    m = re.match(r"named '(.*)' from", r.source)
    if m:
      out[m.group(1)] = out.get(m.group(1), 0) + r.bytes
  return out


def _layer_scalar(loop: _Loop, keep: Sequence[str], fixed: str | None):
  """``(scalar, structs)``: one layer under the policy keeping ``keep`` (or JAX's ``fixed``)
  as a function of its floating-point inputs to a scalar (the sum of its floating outputs),
  and those inputs' shape structs."""
  body = _body(loop, keep, (), fixed)
  structs = _graph.shape_structs(loop.body.in_avals)
  positions = tuple(i for i, s in enumerate(structs) if jnp.issubdtype(s.dtype, jnp.inexact))

  def scalar(*diff):
    args = list(structs)
    for i, v in zip(positions, diff):
      args[i] = v
    return sum(jnp.sum(o.astype(jnp.float32)) for o in body(*args)
               if jnp.issubdtype(o.dtype, jnp.inexact))
  return scalar, tuple(structs[i] for i in positions)


def _layer_residuals(loop: _Loop, keep: Sequence[str], fixed: str | None = None) -> list:
  """What one layer under the plan's policy keeps for its backward besides its inputs."""
  scalar, structs = _layer_scalar(loop, keep, fixed)
  return [r for r in memory.residuals(scalar, *structs) if not r.is_argument]


def _may_fit(loop: _Loop, profile: planner.LayerProfile, budget: int, fixed: str,
             scale: float, spare: float = 0.1) -> bool:
  """Whether the layers under JAX policy ``fixed`` may fit ``budget`` (predicted as a plan
  is, with ``spare`` to spare), so that compiling is worth it."""
  kept = [r.bytes for r in _layer_residuals(loop, (), fixed)]
  added = scale * (loop.length * sum(kept) - max(kept, default=0))
  return profile.base_bytes + added <= (1 + spare) * budget


def _loops(closed) -> tuple[_graph.Graph, list[_Loop], list[str]]:
  """The program's graph; its layer loops, also those inside its ``shard_map``s, heaviest
  first (by their candidates' bytes; :func:`_read_by_the_backward` narrows a loop's
  candidates); and the loops inside a ``shard_map`` that cannot be planned (where, why)."""
  graph = _graph.flatten(closed)
  skipped = []

  def find(g: _graph.Graph, within: tuple) -> list[_Loop]:
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


def _enclosed_loops(closed) -> list[str]:
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


# ------------------------------------------------------------------------ applying a plan
def _tagged(loop: _Loop) -> Callable[..., list]:
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
  recompute; ``"none"`` has no policy: :func:`_body`)."""
  if fixed == "everything":
    return jax.checkpoint_policies.everything_saveable
  return (FIXED_POLICIES[fixed] if fixed in FIXED_POLICIES
          else planner.policy(tuple(keep), tuple(offload)))


def _body(loop: _Loop, keep: Sequence[str], offload: Sequence[str], fixed: str | None):
  """The layer body as a function under the plan (``fixed == "none"``: without remat)."""
  if fixed == "none":
    return _tagged(loop)
  return jax.checkpoint(_tagged(loop), policy=_policy(keep, offload, fixed), prevent_cse=False)


def _planned_body(loop: _Loop, keep: Sequence[str], offload: Sequence[str],
                  fixed: str | None = None):
  """The body's closed jaxpr under the plan's ``jax.checkpoint`` policy."""
  return jax.make_jaxpr(_body(loop, keep, offload, fixed))(
      *_graph.shape_structs(loop.body.in_avals))


def _rescan_runs(node: _graph.Node, bodies: Sequence[tuple[Callable, int]], invals) -> list:
  """The outputs of scan ``node`` on ``invals`` as one ``lax.scan`` per run of layers
  (``bodies``: (body, layers) in layer order), each over its slice of the stacked inputs, the
  carry passed on in the scan's direction and the stacked outputs joined."""
  p = node.params
  n_consts, n_carry = _graph.scan_counts(p)
  consts, carry = invals[:n_consts], list(invals[n_consts:n_consts + n_carry])
  xs = invals[n_consts + n_carry:]
  sizes = [n for _, n in bodies]
  # (split, not slices: its transpose joins the runs' gradients into one buffer; slices' pads
  # would add a stack-sized buffer per run)
  pieces = [jax.lax.split(x, sizes, axis=0) for x in xs]
  parts: list = [None] * len(bodies)
  for i in (reversed(range(len(bodies))) if p["reverse"] else range(len(bodies))):
    body, n = bodies[i]

    def step(c, x, body=body):
      outs = body(*consts, *c, *x)
      return list(outs[:n_carry]), list(outs[n_carry:])
    carry, parts[i] = jax.lax.scan(step, carry, [p_[i] for p_ in pieces],
                                   length=n, reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *(jnp.concatenate([part[j] for part in parts]) for j in range(len(parts[0])))]


def _run(closed, args_flat, keep, offload, fixed=None, runs=()) -> list:
  """The program of ``closed`` on ``args_flat`` with its heaviest layer loop planned (``runs``:
  ``(keep, offload, layers)`` per run of layers, each its own scan)."""
  graph, loops, _ = _loops(closed)
  if not loops:
    return _graph.evaluate(graph, list(args_flat))
  target = loops[0]
  if runs:
    bodies = [(_body(target, k, o, None), n) for k, o, n in runs]
    at_loop = lambda node, invals: _rescan_runs(node, bodies, invals)  # noqa: E731
  elif target.within:  # its values vary over the mesh's axes: the body is traced where it is
    body = _body(target, keep, offload, fixed)
    at_loop = lambda node, invals: _graph.rescan(node, body, invals)  # noqa: E731
  else:
    new = _planned_body(target, keep, offload, fixed)
    at_loop = lambda node, invals: _graph.bind(_graph.Node(  # noqa: E731
        node.prim, dict(node.params, jaxpr=new), node.ins, node.outs, eqn=node.eqn), invals)

  def hook(node, invals):
    if node is target.node:
      return at_loop(node, invals)
    for shard_map, body in target.within:
      if node is shard_map:
        return _graph.rewrap_shard_map(
            node, lambda *a, body=body: _graph.evaluate(body, list(a), nested=hook), invals)
    return None
  return _graph.evaluate(graph, list(args_flat), nested=hook)


def _apply(fn: Callable, keep, offload, fixed: str | None = None, runs=()) -> Callable:
  """``fn`` with the plan (or the JAX policy ``fixed``; ``runs``: per run of layers) applied
  to its heaviest layer loop (traced again per call; positional and keyword arguments as
  ``fn`` takes them)."""
  def planned(*args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))

    def flat(*vals):
      a, k = jax.tree.unflatten(tree, vals)
      return fn(*a, **k)
    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    outs = _run(closed, leaves, keep, offload, fixed, runs)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)
  return planned


# ---------------------------------------------------------------------------------- costs
# FLOPs counted per (the tagged layer's jaxpr, keep, fixed, transposed): planning one program
# at several budgets (scripts/plan_memory.py, the frontier's plan rows) counts each layer
# policy once.
_FLOPS: dict = {}
_FLOPS_SIZE = 4096


def _layer_flops(loop: _Loop, keep: Sequence[str], fixed: str | None = None) -> float:
  """FLOPs of one layer's forward and backward under the names policy keeping ``keep`` (or
  the JAX policy ``fixed``).

  Counted on the layer's linearization (the forward, the recompute the policy asks for and
  the tangent equations), plus the layer's transposed-against-tangent difference measured
  once on its gradient: the recompute is the only part a policy changes, and a gradient's
  trace (its transpose) takes twice a linearization's (GPT-2's layer: 0.10 vs 0.05 s)."""
  return (_counted(loop, keep, fixed) + _counted(loop, (), None, transposed=True)
          - _counted(loop, (), None))


def _counted(loop: _Loop, keep: Sequence[str], fixed: str | None,
             transposed: bool = False) -> float:
  """:func:`_count_layer_flops`, each (layer, policy, transposed) traced once."""
  key = (loop.signature, tuple(keep), fixed, transposed)
  if key not in _FLOPS:
    if len(_FLOPS) >= _FLOPS_SIZE:
      _FLOPS.clear()
    _FLOPS[key] = _count_layer_flops(loop, keep, fixed, transposed)
  return _FLOPS[key]


def _count_layer_flops(loop: _Loop, keep: Sequence[str], fixed: str | None,
                       transposed: bool = False) -> float:
  """XLA's FLOP count of one layer's gradient (``transposed``) or linearization under the
  policy."""
  scalar, structs = _layer_scalar(loop, keep, fixed)

  def linearized(*diff):
    value, tangents = jax.linearize(scalar, *diff)
    return value, tangents(*diff)
  f = jax.value_and_grad(scalar, argnums=tuple(range(len(structs)))) if transposed else linearized
  return memory.jaxpr_flops(jax.make_jaxpr(f)(*structs))


def _temp(fn: Callable, args, grad, keep, budget: int, offload=(), fixed=None) -> int:
  """Compiled temp of ``jit(grad(fn planned with keep/offload))`` (``grad``: the program's
  ``jax.value_and_grad`` with its ``argnums`` and ``has_aux``): see :func:`_measured`."""
  return _measured(grad(_apply(fn, keep, offload, fixed)), args, budget)


def _measured(gradient: Callable, args, budget: int) -> int:
  """``gradient``'s compiled temp at ``args`` as compared with ``budget``: measured at
  :func:`memory.analysis_options`, never below the default compile's figure, so what fits by
  it fits; where it lies above ``budget`` by no more than it can be above the default
  compile's (:func:`memory.analysis_excess`), the default compile's figure (measured again
  at :func:`memory.exact_analysis_options`)."""
  temp = memory.analysed(gradient, *args).temp
  if budget < temp and memory.undecided(temp, budget):
    temp = memory.analysed(gradient, *args, exact=True).temp
  return temp


def _has_pinned_host() -> bool:
  """Whether the current target's device has host memory to offload to (XLA:CPU's host
  memory is its own; a GPU compiled for without one has, but its transfer rates are not
  measured here: :func:`_offload_rate`)."""
  target = targets.current()
  if target.platform == "cpu":
    return False
  if target.deviceless:
    return target.platform == "gpu"
  try:
    kinds = jax.devices()[0].addressable_memories()
  except Exception:  # pylint: disable=broad-except
    return False
  return any(getattr(m, "kind", "") == "pinned_host" for m in kinds)


def _measured_rates() -> tuple[float, float]:
  """(bytes/s of a device -> pinned_host -> device round trip per byte each way, FLOP/s of a
  4096^3 bfloat16 matmul), timed on the device."""
  import time  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  x = jnp.ones((64, 2**20), jnp.float32)  # 256 MiB
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  back = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  jax.block_until_ready(jax.device_put(jax.device_put(x, host), back))
  t0 = time.perf_counter()
  jax.block_until_ready(jax.device_put(jax.device_put(x, host), back))
  bandwidth = 2 * x.nbytes / (time.perf_counter() - t0)
  a = jnp.ones((4096, 4096), jnp.bfloat16)
  mm = jax.jit(lambda a: a @ a)
  jax.block_until_ready(mm(a))
  t0 = time.perf_counter()
  for _ in range(10):
    out = mm(a)
  jax.block_until_ready(out)
  return bandwidth, 10 * 2 * 4096**3 / (time.perf_counter() - t0)


def _profile(loop: _Loop, low: int, offload_rate: float | None,
             scale: float = 1.0) -> planner.LayerProfile:
  """The layer loop's :class:`invact_jax.planner.LayerProfile`: ``low`` the compiled temp
  keeping nothing; a kept tensor adds its bytes times ``scale`` per layer (measured by
  compiling the plans that keep nothing and everything: XLA:CPU keeps 16-bit values as
  float32, say, and a program whose peak lies outside its layers adds less).
  ``offload_rate``: FLOPs the device computes in the time one byte goes to the host and back
  (None: offloading is not a choice)."""
  names = tuple(t.name for t in loop.tensors)
  f0 = _layer_flops(loop, ())
  gain = tuple(max(f0 - _layer_flops(loop, (n,)), 0.0) for n in names)
  full = max(f0 - _layer_flops(loop, names), 0.0)
  offload_cost = (tuple(offload_rate * t.bytes for t in loop.tensors)
                  if offload_rate is not None else ())
  # Keeping a tensor also takes it out of the layer the backward recomputes: one layer's
  # worth of it comes off the peak (the planner counts the largest among those kept).
  return _scaled(loop, planner.LayerProfile(
      configuration="as written", depth=loop.length, base_bytes=low, tags=names,
      tag_bytes=(0,) * len(names), tag_gain=gain, full_cost=full,
      tag_offload_cost=offload_cost), scale)


def _offload_rate(offload: bool | None, host_bandwidth: float | None,
                  flop_rate: float | None) -> float | None:
  """FLOPs per offloaded byte (out and back), or None where offloading is not a choice
  (compiling for a device without it: only where asked for, with both rates given)."""
  target = targets.current()
  if offload is False or (offload is None and (not _has_pinned_host() or target.deviceless)):
    return None
  if offload and not _has_pinned_host():
    raise ValueError(f"argument `offload`: the device ({target.device_kind}) has no "
                     "pinned_host memory to offload to")
  if target.deviceless and (host_bandwidth is None or flop_rate is None):
    raise ValueError(f"argument `{'host_bandwidth' if host_bandwidth is None else 'flop_rate'}`"
                     f": offloading on {target.name}, compiled for without the device, needs "
                     "the host's bandwidth and the device's FLOP rate given (they are measured "
                     "on the device only)")
  if host_bandwidth is None or flop_rate is None:
    measured = _measured_rates()
    host_bandwidth = measured[0] if host_bandwidth is None else host_bandwidth
    flop_rate = measured[1] if flop_rate is None else flop_rate
  for name, value in (("host_bandwidth", host_bandwidth), ("flop_rate", flop_rate)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"argument `{name}` must be a positive number, got {value!r}")
  return 2.0 * flop_rate / host_bandwidth


# ----------------------------------------------------------------------------------- plan
class Planned:
  """``fn`` with a memory plan applied to its layer loop: call it as ``fn``; ``.report`` is
  the :class:`PlanReport`."""

  def __init__(self, fn: Callable, report: PlanReport):
    self._fn = fn if report.as_written else _apply(fn, report.keep, report.offload,
                                                   report.policy, report.runs)
    self.report = report
    self.__wrapped__ = fn
    self.__name__ = getattr(fn, "__name__", "planned")
    self.__doc__ = getattr(fn, "__doc__", None)

  def __call__(self, *args, **kwargs):
    return self._fn(*args, **kwargs)


def _check_options(has_aux, convert, offload, host_bandwidth, flop_rate) -> None:
  """One line naming the first of :func:`plan`'s options that is not of its kind."""
  for name, value in (("has_aux", has_aux), ("convert", convert)):
    if not isinstance(value, bool):
      raise TypeError(f"argument `{name}` must be a bool, got {value!r}")
  if offload is not None and not isinstance(offload, bool):
    raise TypeError(f"argument `offload` must be a bool or None, got {offload!r}")
  for name, value in (("host_bandwidth", host_bandwidth), ("flop_rate", flop_rate)):
    if value is None:
      continue
    if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(float(value)) or not value > 0):
      raise ValueError(f"argument `{name}` must be a positive finite number, got {value!r}")


def _check(fn, args, argnums) -> tuple[int, ...]:
  if not callable(fn):
    raise TypeError(f"argument `fn` must be callable, got {type(fn).__name__}")
  if not args:
    raise ValueError("plan() needs example arguments: plan(fn, *example_args, budget=...)")
  nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
  if (not isinstance(nums, tuple) or not nums
      or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < len(args) for a in nums)):
    raise ValueError(f"argument `argnums` must be an int or a tuple of ints in [0, {len(args)}), "
                     f"got {argnums!r}")
  return nums


def _scale(loop: _Loop, observed: Sequence[tuple[Sequence[str], int]], low: int) -> float | None:
  """The bytes a kept tensor adds to the compiled temp per byte it holds, fitted to the
  compiled plans ``observed`` ((set kept, compiled temp) each; least squares on the relative
  error, so that no one plan's figure decides it alone); None where none keeps anything to
  measure by."""
  bytes_of = {t.name: t.bytes for t in loop.tensors}
  num = den = 0.0
  for keep, compiled in observed:
    nominal = loop.length * sum(bytes_of.get(t, 0) for t in keep)
    added = nominal - max((bytes_of.get(t, 0) for t in keep), default=0)
    if added > 0 and compiled > 0:
      num += added * max(compiled - low, 0) / compiled**2
      den += added**2 / compiled**2
  return num / den if den else None


def _observed(known: dict) -> list[tuple[frozenset, int]]:
  return [(k, t) for k, t in known.items() if isinstance(k, frozenset) and k]


def _scaled(loop: _Loop, profile: planner.LayerProfile, scale: float) -> planner.LayerProfile:
  nbytes = tuple(int(round(t.bytes * scale)) for t in loop.tensors)
  return dataclasses.replace(profile, tag_bytes=nbytes, tag_relief=nbytes)


def _fit(fn, args, grad, loop: _Loop, profile: planner.LayerProfile, budget: int,
         known: dict, scale: float):
  """(profile, keep, offload, predicted bytes, compiled temp, rounds, scale) of the cheapest
  solved plan whose compiled temp fits ``budget`` (where no round both fits and holds its
  prediction: the compiled set that fits and is predicted to recompute least, keeping nothing
  at the worst).  ``known``: compiled temps already measured, by the set kept.  The bytes a
  kept tensor adds (``scale``) start at their nominal size and are calibrated by the compiled
  plans: one off its prediction by more than :data:`_TOLERANCE` re-solves with the scale
  fitted to every plan compiled (a plan above the budget at its prediction lowers the target
  instead)."""
  target, tried = budget, set()
  for rounds in range(1, _ROUNDS + 2):
    try:
      p = planner.solve([profile], target, uniform=True)
    except planner.InfeasibleBudget:  # the lowered target went below every plan
      break
    keep, off = p.keep[0], (p.offload[0] if p.offload else ())
    every = frozenset(profile.tags)
    if not keep and not off and "all" not in tried:
      # Nothing predicted to fit: calibrate on keeping every candidate (where the program's
      # peak lies outside its layers, keeping adds little or nothing).
      tried.add("all")
      if every not in known:
        known[every] = _temp(fn, args, grad, profile.tags, budget)
      measured = _scale(loop, [(profile.tags, known[every])], profile.base_bytes)
      if measured is not None and measured < scale * 0.98:
        scale = measured
        profile = _scaled(loop, profile, scale)
        continue
    if not off and known.get(every, budget + 1) <= budget and _keeps_worth(profile, keep):
      # keeping every candidate is known to fit and recomputes no more: no compile
      everything = (profile.tags,) * profile.depth
      return profile, profile.tags, (), profile.peak(everything), known[every], rounds, scale
    compiled = (known[frozenset(keep)] if not off and frozenset(keep) in known
                else _temp(fn, args, grad, keep, budget, off))
    if not off:
      known[frozenset(keep)] = compiled
    measured = _scale(loop, _observed(known) + ([(keep, compiled)] if off else []),
                      profile.base_bytes)
    off_by = abs(p.predicted_bytes - compiled) > _TOLERANCE * compiled
    recalibrate = (measured is not None and off_by and abs(measured - scale) > 0.02 * scale
                   and (keep, off) not in tried)
    tried.add((keep, off))
    if compiled <= budget and not recalibrate:
      return profile, keep, off, p.predicted_bytes, compiled, rounds, scale
    if recalibrate:
      scale = measured
      profile = _scaled(loop, profile, scale)
    else:
      target -= max(compiled - budget, budget // 50)
  # No round both fitted and held its prediction: the compiled plan that fits and is predicted
  # to recompute least (keeping nothing, which fits, at the worst).
  cost, keep = min((profile.cost((k,) * profile.depth), k) for k in _fitting(profile, known, budget))
  return (profile, keep, (), profile.peak((keep,) * profile.depth), known[frozenset(keep)],
          rounds, scale)


def _fitting(profile: planner.LayerProfile, known: dict, budget: int) -> list[tuple[str, ...]]:
  """The sets kept (in the profile's order) whose compiled temp in ``known`` fits ``budget``."""
  return [tuple(t for t in profile.tags if t in k) for k, temp in known.items()
          if isinstance(k, frozenset) and temp <= budget]


def _keeps_worth(profile: planner.LayerProfile, keep) -> bool:
  """Whether ``keep`` holds every tensor whose keeping spares recompute."""
  return set(keep) >= {t for t, g in zip(profile.tags, profile.tag_gain) if g > 0}


def _written(fn, args, grad, loop: _Loop, profile: planner.LayerProfile, keep, budget: int,
             known: dict) -> int | None:
  """The compiled temp of the program as written (no recompute), where a plan keeping
  ``keep`` keeps every tensor worth keeping in a layer without its own ``jax.checkpoint`` (so
  that the program as written, if it fits, recomputes least); else None.  Compiled once per
  plan (``known["as written"]``), and only where keeping every candidate, which the layer as
  written keeps and more, is predicted to fit."""
  if loop.remat or not _keeps_worth(profile, keep):
    return None
  if "as written" not in known:
    if profile.peak((profile.tags,) * profile.depth) > budget:
      return None
    known["as written"] = _measured(grad(fn), args, budget)
  return known["as written"]


@dataclasses.dataclass(frozen=True)
class _Choice:
  """One way to run the layer loop: names kept/offloaded in every layer, or per run of layers
  (``runs``); a MaxText preset (``fixed`` its name, ``keep`` its names in the layer); or JAX's
  policy ``fixed`` (``"none"``: the layer without remat)."""
  label: str
  keep: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()
  fixed: str | None = None
  runs: tuple = ()

  @property
  def key(self) -> tuple:
    """What the compiled program depends on."""
    return (frozenset(self.keep), frozenset(self.offload),
            None if self.fixed in MAXTEXT_PRESETS else self.fixed, self.runs)

  def apply(self, fn: Callable) -> Callable:
    return _apply(fn, self.keep, self.offload, self.fixed, self.runs)


def _fixed_choices(loop: _Loop) -> list[_Choice]:
  """JAX's none / full / dots / dots_no_batch and MaxText's presets whose names the layer
  has (each with those of its names the layer has; presets alike there taken once)."""
  out = [_Choice("none", fixed="none"), _Choice("full")]
  out += [_Choice(name, fixed=name) for name in FIXED_POLICIES]
  named = {n.params["name"] for n in loop.graph.nodes if n.prim.name == "name"}
  seen = set()
  for name, saved in MAXTEXT_PRESETS.items():
    keep = tuple(n for n in saved if n in named)
    if keep and frozenset(keep) not in seen:
      seen.add(frozenset(keep))
      out.append(_Choice(name, keep, fixed=name))
  return out


class _Costs:
  """The FLOPs and compiled temps of a program's choices, each counted or compiled once.

  Recompute: the planned gradient step's FLOPs less the step without remat's, every loop's
  body once per iteration, counted on its trace (:func:`memory.jaxpr_flops`: XLA's count of
  the compiled step to a few operations, a cuDNN attention's and a Pallas kernel's counted
  from their shapes); ``estimate``: the same from one layer's count (:func:`_layer_flops`,
  cached per layer and policy) times the layers, which ranks the choices without tracing the
  program (it leaves out what remat adds outside the layer's own count, alike for every
  choice under a ``jax.checkpoint``).  Temps: :func:`_measured`."""

  def __init__(self, fn, args, grad, loop: _Loop, budget: int):
    self.fn, self.args, self.grad, self.loop, self.budget = fn, args, grad, loop, budget
    self.temps: dict = {}
    self._flops: dict = {}

  def step(self, choice: _Choice) -> float:
    if choice.key not in self._flops:
      closed = jax.make_jaxpr(self.grad(choice.apply(self.fn)))(*self.args)
      self._flops[choice.key] = memory.jaxpr_flops(closed, per_iteration=True)
    return self._flops[choice.key]

  def recompute(self, choice: _Choice) -> float:
    return max(self.step(choice) - self.step(_Choice("none", fixed="none")), 0.0)

  def counted(self, choice: _Choice) -> bool:
    """Whether ``choice``'s step was traced (its recompute is counted, not estimated)."""
    return choice.key in self._flops

  def estimate(self, choice: _Choice) -> float:
    fixed = None if choice.fixed in MAXTEXT_PRESETS else choice.fixed
    runs = choice.runs or ((choice.keep, choice.offload, self.loop.length),)
    none = _layer_flops(self.loop, (), "none")
    return sum(n * max(_layer_flops(self.loop, tuple(k) + tuple(o), fixed) - none, 0.0)
               for k, o, n in runs)

  def temp(self, choice: _Choice) -> int:
    if choice.key not in self.temps:
      self.temps[choice.key] = _measured(self.grad(choice.apply(self.fn)), self.args,
                                         self.budget)
    return self.temps[choice.key]


def _predicted_peak(loop: _Loop, profile: planner.LayerProfile, choice: _Choice,
                    scale: float) -> int:
  """The compiled temp predicted for ``choice``: a names plan's by the profile; a JAX policy's
  from the residuals it keeps per layer, at the calibrated bytes per kept byte."""
  if choice.runs:
    keep = [k for k, _, n in choice.runs for _ in range(n)]
    off = [o for _, o, n in choice.runs for _ in range(n)]
    return profile.peak(keep, off)
  if choice.fixed is None or choice.fixed in MAXTEXT_PRESETS:
    keep = tuple(t for t in choice.keep if t in profile.tags)
    off = tuple(t for t in choice.offload if t in profile.tags)
    return profile.peak((keep,) * profile.depth, (off,) * profile.depth)
  kept = [r.bytes for r in _layer_residuals(
      loop, (), "everything" if choice.fixed == "none" else choice.fixed)]
  return int(profile.base_bytes + scale * (loop.length * sum(kept) - max(kept, default=0)))


def _per_run(profile: planner.LayerProfile, budget: int, uniform_cost: float,
             uniform_temp: int, costs: _Costs) -> _Choice | None:
  """A plan whose runs of layers differ (MONeT's per-layer choice: the integer program over
  runs), each run its own ``lax.scan``, compiled where the profile predicts it recomputes at
  least 5 % less than the uniform plan and the uniform plan's compiled temp leaves at least
  10 % of the budget (:func:`_cheapest` takes it where it fits).  Splitting a scan costs XLA
  memory the profile does not hold (GPT-2's 12 layers in two runs keeping the same: +54 MiB
  on XLA:CPU, +36 MiB on the H100 compiled for, docs/planner.md), so few fit."""
  if profile.depth < 2 * planner.MIN_RUN or budget - uniform_temp < 0.1 * budget:
    return None  # (a budget the uniform plan leaves less than 10 % of has no room to split)
  try:
    p = planner.solve([profile], budget, uniform=False, time_limit=_RUNS_SOLVE_SECONDS)
  except planner.InfeasibleBudget:
    return None
  if p.uniform or p.predicted_cost > 0.95 * uniform_cost:
    return None
  offload = p.offload or ((),) * len(p.keep)
  runs = tuple((tuple(keep), tuple(off), len(list(group)))
               for (keep, off), group in itertools.groupby(zip(p.keep, offload)))
  choice = _Choice("per run", runs=runs)
  costs.temp(choice)
  return choice


def _cheapest(loop: _Loop, profile: planner.LayerProfile, scale: float, costs: _Costs,
              fits: _Choice, others: Sequence[_Choice]) -> tuple[_Choice, tuple[str, ...]]:
  """The choice that recomputes least among ``fits`` (compiled, within the budget) and
  ``others`` whose compiled temp fits; and a line per choice weighed.  A choice is counted
  on the program's trace only where its estimate lies below the best's (+0.5 % of full
  remat's), compiled only where it recomputes less than the best and is predicted within
  :data:`_SPARE` of the budget: so the solved plan is never worse than a fixed choice that
  fits, and costs no compile where it recomputes least."""
  best, why = fits, {}
  margin = 0.005 * costs.estimate(_Choice("full"))
  for c in sorted(others, key=costs.estimate):
    if costs.estimate(c) >= costs.estimate(best) + margin:
      why.setdefault(c.label, "estimated to recompute no less (not counted)")
      continue
    if costs.recompute(c) >= costs.recompute(best) * (1 - 1e-9):
      why.setdefault(c.label, "recomputes no less than the plan taken")
      continue
    if c.key not in costs.temps and (
        _predicted_peak(loop, profile, c, scale) > (1 + _SPARE) * costs.budget):
      why[c.label] = "predicted above the budget (not compiled)"
      continue
    if costs.temp(c) <= costs.budget:
      best = c
  lines = []
  for c in (fits, *others):
    temp = costs.temps.get(c.key)
    state = ("taken" if c is best else
             f"compiled {temp:,} B" + (" (above the budget)" if temp > costs.budget else "")
             if temp is not None else why.get(c.label, "not compiled"))
    flops = (f"recomputes {costs.recompute(c):.4g} FLOPs" if costs.counted(c)
             else f"estimated {costs.estimate(c):.4g} FLOPs")
    lines.append(f"{c.label}: {flops}; {state}")
  return best, tuple(lines)


def _plan_one(fn, args, grad, budget: int, rate: float | None,
              configuration: str, with_step: bool = False) -> PlanReport:
  """The plan of one program (``configuration`` names it in the report; ``with_step``: its
  ``step_flops`` counted): the solved plan, or the choice of :func:`_fixed_choices` or of
  :func:`_per_run` that recomputes less and fits compiled.

  Raises:
    ValueError: ``fn`` has no layer loop.
    planner.InfeasibleBudget: ``budget`` is below its compiled temp keeping nothing.
  """
  closed = jax.make_jaxpr(fn)(*args)
  _, loops, skipped = _loops(closed)
  loop = _read_by_the_backward(loops[0]) if loops else None
  if loop is None:
    raise ValueError("plan(): no layer loop in `fn`: it has no lax.scan over stacked inputs "
                     "(parameters) whose backward reads a matmul's or a checkpoint_name'd "
                     "value" + "".join(f"; {why}" for why in skipped + _enclosed_loops(closed)))
  low = _temp(fn, args, grad, (), budget)
  if budget < low:
    raise planner.InfeasibleBudget(budget, low)
  profile, known, rounds = _profile(loop, low, rate), {frozenset(): low}, 1
  first = planner.solve([profile], budget, uniform=True)
  as_written = None if any(first.offload or ()) else _written(
      fn, args, grad, loop, profile, first.keep[0], budget, known)
  costs = _Costs(fn, args, grad, loop, budget)
  common = dict(loop=f"{loop.where}, {loop.length} iterations", depth=loop.length,
                other_loops=tuple(f"{l.where}, {l.length} iterations" for l in loops[1:])
                + tuple(skipped), tensors=loop.tensors, budget=budget, minimum_bytes=low,
                configuration=configuration)
  if as_written is not None and as_written <= budget:  # nothing recomputed fits: no more compiles
    step = (memory.jaxpr_flops(jax.make_jaxpr(grad(fn))(*args), per_iteration=True)
            if with_step else None)
    return PlanReport(**common, keep=tuple(t.name for t in loop.tensors), offload=(),
                      recompute=(), predicted_bytes=as_written, compiled_bytes=as_written,
                      rounds=rounds, predicted_recompute_flops=0.0, as_written=True,
                      step_flops=step)
  profile, keep, off, predicted, compiled, rounds, scale = _fit(
      fn, args, grad, loop, profile, budget, known, 1.0)
  costs.temps.update({(k, frozenset(), None, ()): t for k, t in known.items()
                      if isinstance(k, frozenset)})
  solved = _Choice("plan", keep, off)
  costs.temps[solved.key] = compiled
  # every set compiled on the way that fits (the profile's bytes are a model: a set it
  # predicted above another may fit and recompute less), then the fixed choices
  others = [_Choice(f"plan kept {', '.join(k) or 'nothing'}", k)
            for k in _fitting(profile, known, budget) if frozenset(k) != frozenset(keep) or off]
  others += _fixed_choices(loop)
  runs = _per_run(profile, budget, profile.cost((keep,) * profile.depth, (off,) * profile.depth),
                  compiled, costs)
  others += [runs] if runs is not None else []
  best, compared = _cheapest(loop, profile, scale, costs, solved, others)
  if best is not solved:
    predicted = (_predicted_peak(loop, profile, best, scale) if best.runs
                 else costs.temps[best.key])
  every = lambda n: all(n in k for k, _, _ in best.runs)  # noqa: E731
  kept = (tuple(t.name for t in loop.tensors) if best.fixed == "none" else
          tuple(t.name for t in loop.tensors if every(t.name)) if best.runs else best.keep)
  offloaded = (tuple(t.name for t in loop.tensors if all(t.name in o for _, o, _ in best.runs))
               if best.runs else best.offload)
  return PlanReport(
      **common, keep=kept, offload=offloaded,
      recompute=tuple(t.name for t in loop.tensors if t.name not in set(kept) | set(offloaded)
                      and not (best.runs and any(t.name in {*k, *o} for k, o, _ in best.runs))),
      predicted_bytes=int(predicted), compiled_bytes=int(costs.temps[best.key]), rounds=rounds,
      predicted_recompute_flops=costs.recompute(best), policy=best.fixed, runs=best.runs,
      compared=compared, step_flops=costs.step(best) if with_step else None)


def _least_step_flops(fn, args, grad) -> float:
  """The least FLOPs a planned gradient step of ``fn`` can do: its layer loop recomputing
  nothing (a program without one is as it is; :func:`_plan_one` then says so)."""
  return memory.jaxpr_flops(jax.make_jaxpr(grad(_apply(fn, (), (), "none")))(*args),
                           per_iteration=True)


def plan(fn: Callable[..., Any], *example_args: Any, budget: int | float | str,
         argnums: int | Sequence[int] = 0, has_aux: bool = False, convert: bool = False,
         offload: bool | None = None,
         host_bandwidth: float | None = None, flop_rate: float | None = None,
         device: str | targets.Target | None = None) -> Planned:
  """``fn`` whose gradient's compiled temp fits ``budget``: the planner chooses what its layer
  loop keeps, recomputes or offloads (see the module doc).

  Args:
    fn: the loss (or any function whose gradient is taken), unmodified.
    *example_args: arguments to trace, profile and compile it with (arrays or shape structs).
    budget: bytes for the compiled temp of ``jax.jit(jax.value_and_grad(planned, argnums,
      has_aux=has_aux))``, or a string such as ``"300MiB"``.
    argnums: the arguments the gradient is taken of, as for ``jax.grad``.
    has_aux: ``fn`` returns ``(loss, auxiliary data)``, as for ``jax.grad``.
    convert: also plan ``invact_jax.invert(fn)`` (its activations, norms, softmax and LM head
      converted: MONeT's operator variants) and take the one whose planned step does fewer
      FLOPs within the budget (a program whose step, recomputing nothing, does at least the
      FLOPs of the plan made first is not planned: ``report.alternatives``).
    offload: whether tensors may go to host memory (None: where the device has
      ``pinned_host``).
    host_bandwidth: bytes/s between device and host, to cost offloading (None: measured).
    flop_rate: the device's FLOP/s, to weigh offloading against recomputing (None:
      measured).
    device: the target to plan for (:func:`invact_jax.targets.resolve`: ``"h100"``, ...;
      default: the current target, this machine unless inside
      :func:`invact_jax.targets.compiling_for`): ``fn`` is traced as for it and every
      profile and check is its compiler's (a GPU compiled for without one:
      docs/deviceless.md), so that the plan fits that device.  Offloading is off on such a
      device unless asked for with both rates.

  Returns:
    A :class:`Planned` function with ``fn``'s signature; ``.report`` holds the choice, the
    predicted and compiled temp and the predicted recompute FLOPs.

  Raises:
    ValueError: no layer loop in ``fn`` (a ``lax.scan`` over stacked inputs), or a bad
      argument (the message names it).
    planner.InfeasibleBudget: below the compiled temp of keeping nothing (the minimum, named).
  """
  nums = _check(fn, example_args, argnums)
  _check_options(has_aux, convert, offload, host_bandwidth, flop_rate)
  budget = parse_budget(budget)
  with targets.compiling_for(device):
    return _plan(fn, example_args, budget, nums, argnums, has_aux, convert, offload,
                 host_bandwidth, flop_rate)


def _plan(fn, example_args, budget: int, nums, argnums, has_aux: bool, convert: bool,
          offload, host_bandwidth, flop_rate) -> Planned:
  """:func:`plan` for the current target, its arguments checked."""
  grad = functools.partial(jax.value_and_grad, argnums=nums[0] if isinstance(argnums, int)
                           else nums, has_aux=has_aux)
  rate = _offload_rate(offload, host_bandwidth, flop_rate)
  programs = {"as written": fn}
  if convert:
    from invact_jax.convert import _program  # pylint: disable=import-outside-toplevel
    programs["inverted"] = _program.inverted_for_plan(fn)
  # The step's FLOPs, not the recompute alone: the converted backward's own arithmetic (an
  # inverse, a chunked head's recomputed logits) differs from the original's.  A program whose
  # step does at least the best plan's FLOPs even recomputing nothing is not planned (no
  # compiles): the programs are planned from the least such bound up.
  least = ({name: _least_step_flops(p, example_args, grad) for name, p in programs.items()}
           if len(programs) > 1 else {"as written": 0.0})
  reports, infeasible, others = {}, [], []
  key = lambda n: (reports[n].step_flops or reports[n].predicted_recompute_flops,  # noqa: E731
                   reports[n].compiled_bytes)
  for name in sorted(programs, key=least.__getitem__):
    best = min(reports, key=key) if reports else None
    if best is not None and least[name] >= reports[best].step_flops:
      others.append(f"{name}: not planned: its step does {least[name]:.4g} FLOPs or more, "
                    f"against {reports[best].step_flops:.4g} planned")
      continue
    try:
      reports[name] = _plan_one(programs[name], example_args, grad, budget, rate, name,
                                with_step=len(programs) > 1)
    except planner.InfeasibleBudget as e:
      infeasible.append(e.minimum_bytes)
      others.append(f"{name}: infeasible: keeping nothing it needs {e.minimum_bytes:,} B")
  if not reports:
    raise planner.InfeasibleBudget(budget, min(infeasible))
  best = min(reports, key=key)
  others += [f"{n}: planned: its step does {r.step_flops:.4g} FLOPs in {r.compiled_bytes:,} B"
             for n, r in reports.items() if n != best]
  return Planned(programs[best], dataclasses.replace(reports[best], alternatives=tuple(others)))
