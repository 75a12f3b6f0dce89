"""The floor pass of ``invert``: matmuls keep what their neighbours keep anyway.

After the activations, norms and softmaxes of a program are converted, each matmul
(``dot_general``) still keeps its operands for the weight and input gradients.  Where an
operand is an elementwise function of values the backward keeps anyway, keeping it too is a
second copy of the same information.  Two rewrites remove it (the floor: every matmul
input once, bits, float32 row statistics; everything elementwise recomputed):

* **norm -> matmuls**: a converted norm whose output ``z`` feeds matmuls (through reshapes,
  transposes, casts, copies) becomes one ``custom_vjp`` with those matmuls, keeping the norm's
  ``xhat`` and ``rstd`` and the matmuls' other operands; the backward recomputes
  ``z = xhat * scale + bias`` for the weight gradients (exact for every scale, zeros included:
  nothing is divided by it), as :func:`invact_jax.layer_norm_dense` does.
* **recomputed operands**: a matmul whose operand is computed elementwise (casts, reshapes,
  products, sums, scalings by a parameter) from *leaves* keeps the leaves instead of the
  operand when they are no more bytes than what the unconverted program keeps there: a GLU's
  ``act(gate) * up`` keeps ``act``'s output (kept by the activation anyway) and ``up``, not
  their product; an attention output reshaped for the output projection keeps the kernel's
  output once; a bfloat16 value cast to float32 for a matmul is kept in bfloat16.

Each rewrite is a :class:`invact_jax.convert._graph.Unit` whose forward runs the program's own
equations (bit-identical outputs) and whose backward is JAX's VJP of the same equations on
the recomputed operand, so gradients equal the unconverted program's up to the recomputed
norm output's rounding.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import graph as _graph
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit, Unit
from invact_jax.ops import _common

__all__ = ["fuse", "FREE", "ELEMENTWISE"]

FREE, ELEMENTWISE = _primitives.FREE, _primitives.ELEMENTWISE


def _nbytes(g: _graph.Graph, ref) -> int:
  """Bytes keeping ``ref`` costs: nothing for a literal or an input of the graph (arguments
  are the caller's; a scan body's inputs are slices and constants the scan already holds)."""
  if isinstance(ref, Lit) or ref not in g.producer:
    return 0
  a = g.avals[ref]
  try:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize
  except TypeError:  # extended dtypes (PRNG keys)
    return 0


def _is_float(g: _graph.Graph, ref) -> bool:
  """Whether ``ref`` is a floating value (bfloat16 included)."""
  if isinstance(ref, Lit):
    return False
  try:
    return bool(np.issubdtype(np.dtype(g.avals[ref].dtype), np.floating)) or \
        "bfloat16" in str(g.avals[ref].dtype)
  except TypeError:
    return False


def _itemsize(g: _graph.Graph, ref) -> int:
  return np.dtype(g.avals[ref].dtype).itemsize


def _producer(g: _graph.Graph, ref):
  if isinstance(ref, Lit) or ref not in g.producer:
    return None
  return g.producer[ref][0]


# ----------------------------------------------------------------------- convexity
def _convex(g: _graph.Graph, nodes: set, owner: dict) -> bool:
  """No path leaves ``nodes`` and comes back (through other nodes or other units, each unit
  taken as a whole): the group can run as one step."""
  hi = max(nodes)
  seen: set = set()

  def successors(i):
    unit = owner.get(i)
    members = unit.nodes if unit is not None else (i,)
    for j in members:
      for o in g.nodes[j].outs:
        yield from g.consumers.get(o, ())

  stack = [c for i in nodes for c in successors(i) if c not in nodes]
  while stack:
    j = stack.pop()
    if j in nodes:
      return False
    if j in seen or j > hi:
      continue
    seen.add(j)
    stack.extend(successors(j))
  return True


# -------------------------------------------------------------------- norm -> matmuls
def _dense_readers(g: _graph.Graph, z, taken: set, outvars: set):
  """The matmuls that read ``z`` through free unary ops: ``(chain nodes, dot nodes,
  values read elsewhere)``; None when no matmul reads it."""
  chain, dots, external = [], [], []

  def visit(v) -> bool:
    found = False
    for c in g.consumers.get(v, ()):
      n = g.nodes[c]
      if c in taken or c in chain or c in dots:
        if c not in chain and c not in dots:
          external.append(v)
        continue
      if n.prim.name == _primitives.DOT and sum(r is v for r in n.ins) == 1:
        dots.append(c)
        found = True
      elif _follows(g, n, v):
        chain.append(c)
        if visit(n.outs[0]):
          found = True
        else:
          chain.remove(c)
          external.append(v)
      else:
        external.append(v)
    if v in outvars:
      external.append(v)
    return found

  if not visit(z):
    return None
  return chain, dots, list(dict.fromkeys(external))


def _small(g: _graph.Graph, r, v) -> bool:
  """``r`` is a literal, smaller than ``v``, or a broadcast of something smaller (a scale)."""
  if isinstance(r, Lit):
    return True
  size = lambda ref: math.prod(g.avals[ref].shape)  # noqa: E731
  if size(r) < size(v):
    return True
  i = _producer(g, r)
  n = g.nodes[i] if i is not None else None
  return (n is not None and n.prim.name == "broadcast_in_dim" and not isinstance(n.ins[0], Lit)
          and size(n.ins[0]) < size(v))


def _follows(g: _graph.Graph, n, v) -> bool:
  """Node ``n`` computes a value of ``v``'s shape from ``v`` alone, or from ``v`` and
  something small (a cast, a reshape, a scale, a bias): the norm's fused unit recomputes it."""
  if len(n.outs) != 1:
    return False
  ins = [r for r in n.ins if not isinstance(r, Lit)]
  if n.prim.name in FREE:
    return ins == [v]
  if n.prim.name in ("mul", "add", "sub", "div") and sum(r is v for r in n.ins) == 1:
    other = [r for r in n.ins if r is not v]
    return (tuple(g.avals[n.outs[0]].shape) == tuple(g.avals[v].shape)
            and all(_small(g, r, v) for r in other))
  return False


def _weight_chain(g: _graph.Graph, ref, group: set, taken: set) -> tuple[list, Any]:
  """``ref`` (a matmul's other operand) followed back through casts and reshapes to a value
  the program does not compute from activations (an argument, a constant), when only the
  group reads the values in between: ``(nodes, source)``."""
  nodes = []
  while True:
    i = _producer(g, ref)
    if i is None or i in taken or g.nodes[i].prim.name not in FREE:
      break
    n = g.nodes[i]
    ins = [r for r in n.ins if not isinstance(r, Lit)]
    if len(ins) != 1 or any(c not in group and c not in nodes for c in g.consumers.get(ref, ())):
      break
    nodes.append(i)
    ref = ins[0]
  if nodes and _producer(g, ref) is not None:
    return [], None  # computed from something else: keep the operand as the program has it
  return nodes, ref


def _norm_dense_unit(g, rule, unit: Unit, found, taken: set, owner: dict, outvars: set):
  """One unit computing a converted norm and the matmuls that read it (through ``chain``), the
  weights' casts read only by them taken in; None where the group is not convex or its outputs
  escape."""
  chain, dots, external = found
  group = set(unit.nodes) | set(chain) | set(dots)
  for d in dots:  # casts of a weight that only these matmuls read come inside
    n = g.nodes[d]
    for r in n.ins:
      if isinstance(r, Lit) or r in {o for c in chain for o in g.nodes[c].outs} or r is unit.outputs[0]:
        continue
      nodes, _ = _weight_chain(g, r, group, taken)
      group.update(nodes)
  if not _convex(g, group, owner):
    return None
  z = unit.outputs[0]
  dense_nodes = sorted(group - set(unit.nodes))
  produced = {o for i in dense_nodes for o in g.nodes[i].outs}
  extra = []
  for i in dense_nodes:
    for r in g.nodes[i].ins:
      if not isinstance(r, Lit) and r not in produced and r is not z and r not in extra:
        extra.append(r)
  outputs = [v for v in external if v is z or v in produced]
  outputs += [g.nodes[d].outs[0] for d in dots]
  outputs = list(dict.fromkeys(outputs))
  dense = _graph.region(g, dense_nodes, [z] + extra, outputs)
  k = len(unit.inputs)

  @jax.custom_vjp
  def f(*vals):
    return dense(rule.region(*vals[:k]), *vals[k:])

  def fwd(*vals):
    zv = rule.region(*vals[:k])
    return dense(zv, *vals[k:]), (rule.residuals(vals[:k], zv), tuple(vals[k:]))

  def bwd(res, cts):
    nres, ext = res
    nres = _common.read_apart(nres)
    z_again = rule.recompute(nres)
    _, vjp = jax.vjp(dense, z_again, *ext)
    dz, *dext = vjp(tuple(cts))
    return (*rule.backward(nres, dz), *dext)

  f.defvjp(fwd, bwd)
  return Unit(frozenset(group), list(unit.inputs) + extra, outputs, f)


# --------------------------------------------------------------- recomputed operands
class _Walk:
  """The elementwise region a matmul's operands are computed in, back to its leaves."""

  def __init__(self, g: _graph.Graph, dot: int, taken: set, through_narrowing: bool = False):
    self.g, self.taken, self.through_narrowing = g, taken, through_narrowing
    self.nodes = {dot}
    self.leaves: list = []

  def leaf(self, v) -> None:
    if not isinstance(v, Lit) and v not in self.leaves:
      self.leaves.append(v)

  def settle(self) -> None:
    """Drop the leaves computed inside after all (a value first met as read elsewhere whose
    other readers joined the region later)."""
    produced = {o for i in self.nodes for o in self.g.nodes[i].outs}
    self.leaves = [v for v in self.leaves if v not in produced]

  def walk(self, v) -> None:
    g = self.g
    i = _producer(g, v)
    if i is None or i in self.taken or i in self.nodes:
      if i is None or i not in self.nodes:
        self.leaf(v)
      return
    if any(c not in self.nodes for c in g.consumers.get(v, ())):
      self.leaf(v)  # also read elsewhere: computed (and kept, if at all) anyway
      return
    n = g.nodes[i]
    name = n.prim.name
    ins = [r for r in n.ins if not isinstance(r, Lit)]
    if len(n.outs) == 1 and not ins and name in _primitives.CONSTANT:
      self.nodes.add(i)  # a constant spread over the operand (where(m, p, 0.0)'s zeros)
      return
    if len(n.outs) != 1 or not ins:
      self.leaf(v)
      return
    if name == "convert_element_type":
      src = ins[0]
      if not _is_float(g, src) or (_itemsize(g, src) > _itemsize(g, v)
                                   and not self.through_narrowing):
        self.leaf(v)  # a narrowing cast: the narrow value is the cheaper one to keep...
        return        # ...unless the wide one is kept anyway (the second walk)
    if name in FREE or name in ELEMENTWISE:
      self.nodes.add(i)
      for r in ins:
        self.walk(r)
    elif name == "broadcast_in_dim":
      self.nodes.add(i)
      self.leaf(ins[0])  # a parameter or a row statistic spread over the operand
    else:
      self.leaf(v)


def _kept_by_program(g: _graph.Graph, nodes: set, dot: int) -> set:
  """What the unconverted program keeps in ``nodes``: the matmul's operands and the inputs
  of the elementwise ops whose backward needs them."""
  out = set()
  for i in nodes:
    n = g.nodes[i]
    if i == dot or n.prim.name in _primitives.KEEPS_INPUTS:
      out.update(r for r in n.ins if not isinstance(r, Lit) and _is_float(g, r))
  return out


def _recompute_unit(g: _graph.Graph, walk: _Walk, dot: int) -> Unit:
  """Matmul ``dot`` as a ``custom_vjp`` keeping the walk's leaves (the values its operand is
  recomputed from) instead of the operand."""
  inputs = list(walk.leaves)
  outputs = [g.nodes[dot].outs[0]]
  region = _graph.region(g, walk.nodes, inputs, outputs)

  @jax.custom_vjp
  def f(*vals):
    return region(*vals)

  def fwd(*vals):
    return region(*vals), vals

  def bwd(vals, cts):
    vals = jax.lax.optimization_barrier(vals)  # not merged with the forward's values
    _, vjp = jax.vjp(region, *vals)
    return vjp(tuple(cts))

  f.defvjp(fwd, bwd)
  return Unit(frozenset(walk.nodes), inputs, outputs, f)


# ------------------------------------------------------------- broadcast masks
def _mask_unit(g: _graph.Graph, b: int, taken: set, outvars: set) -> Unit | None:
  """The selects that read a broadcast boolean (or integer) mask as one unit that keeps the
  mask before its broadcast: a select's backward needs only its predicate, and autodiff
  would keep the broadcast one (an attention mask spread over batch and heads)."""
  n = g.nodes[b]
  pred = n.outs[0]
  src = n.ins[0]
  if (isinstance(src, Lit) or _is_float(g, pred) or _nbytes(g, src) >= _nbytes(g, pred)
      or pred in outvars):  # (an argument costs nothing to keep: 0 bytes)
    return None
  readers = g.consumers.get(pred, [])
  if not readers or any(
      r in taken or g.nodes[r].prim.name != "select_n" or g.nodes[r].ins[0] is not pred
      or any(x is pred for x in g.nodes[r].ins[1:]) for r in readers):
    return None
  selects = sorted(set(readers))
  cases = [g.nodes[r].ins[1:] for r in selects]
  inputs = [src] + list(dict.fromkeys(x for c in cases for x in c if not isinstance(x, Lit)))
  outputs = [g.nodes[r].outs[0] for r in selects]
  region = _graph.region(g, [b, *selects], inputs, outputs)
  spread = _graph.region(g, [b], [src], [pred])
  avals = [g.avals[x] for x in inputs]  # the unit runs at the program's shapes

  def zero(aval):  # the cotangent of an input no case of a select reads
    if not jnp.issubdtype(aval.dtype, jnp.inexact):
      return np.zeros(aval.shape, jax.dtypes.float0)
    return jnp.zeros(aval.shape, aval.dtype)

  @jax.custom_vjp
  def f(*vals):
    return region(*vals)

  def fwd(*vals):
    return region(*vals), vals[0]

  def bwd(m, cts):
    (p,) = spread(m)
    grads = dict.fromkeys(inputs[1:])
    for case_refs, ct in zip(cases, cts):
      for i, x in enumerate(case_refs):
        if isinstance(x, Lit):
          continue
        which = (p == i) if p.dtype != np.bool_ else (p if i == 1 else ~p)
        part = jnp.where(which, ct, jnp.zeros_like(ct))
        grads[x] = part if grads[x] is None else grads[x] + part
    return tuple(zero(a) if k == 0 or grads[x] is None or not jnp.issubdtype(a.dtype, jnp.inexact)
                 else grads[x].astype(a.dtype) for k, (x, a) in enumerate(zip(inputs, avals)))

  f.defvjp(fwd, bwd)
  return Unit(frozenset([b, *selects]), inputs, outputs, f)


def fuse(g: _graph.Graph, units: list, fusable: list, kept: set, outvars: set) -> list:
  """``units`` with the norms that feed matmuls fused with them, and units for the matmuls
  whose operands are cheaper to recompute than to keep.

  Args:
    g: the program.
    units: the converted ops' units.
    fusable: ``(fusion, unit)`` per unit whose rule offers a fusion with the matmuls that read
      its output (:attr:`._rule.Built.fusion`: a norm's residuals, recomputation and
      backward).
    kept: values the converted ops' backward keeps anyway (activation and softmax outputs).
    outvars: the program's outputs.

  Returns:
    The units to run.
  """
  units = list(units)
  owner = {i: u for u in units for i in u.nodes}
  taken = set(owner)
  for rule, unit in fusable:
    found = _dense_readers(g, unit.outputs[0], taken, outvars)
    if found is None:
      continue
    fused = _norm_dense_unit(g, rule, unit, found, taken, owner, outvars)
    if fused is None:
      continue
    units[units.index(unit)] = fused
    for i in fused.nodes:
      owner[i] = fused
    taken |= fused.nodes
  anyway = set(kept) | {o for n in g.nodes if n.prim.name in _primitives.CUSTOM_CALLS for o in n.outs}
  for d, n in enumerate(g.nodes):
    if n.prim.name != _primitives.DOT or d in taken:
      continue
    # Two walks: stopping at narrowing casts, and through them (a bfloat16 copy of a float32
    # value kept anyway, e.g. a softmax's probabilities cast for the P.V matmul); the one that
    # keeps fewer bytes, if fewer than the unconverted program keeps.
    best = None
    for through in (False, True):
      walk = _Walk(g, d, taken, through)
      for r in n.ins:
        if not isinstance(r, Lit):
          walk.walk(r)
      walk.settle()
      if walk.nodes == {d}:
        continue
      before = sum(_nbytes(g, r) for r in _kept_by_program(g, walk.nodes, d) - anyway)
      after = sum(_nbytes(g, r) for r in set(walk.leaves) - anyway)
      if after < before and _convex(g, walk.nodes, owner) and (best is None or after < best[0]):
        best = (after, walk)
    if best is None:
      continue
    walk = best[1]
    unit = _recompute_unit(g, walk, d)
    units.append(unit)
    for i in unit.nodes:
      owner[i] = unit
    taken |= unit.nodes
  for b, n in enumerate(g.nodes):
    if n.prim.name == "broadcast_in_dim" and b not in taken:
      unit = _mask_unit(g, b, taken, outvars)
      if unit is not None and _convex(g, set(unit.nodes), owner):
        units.append(unit)
        for i in unit.nodes:
          owner[i] = unit
        taken |= unit.nodes
  return units
