"""The floor of a program: the least its backward must keep without recomputing a matmul.

Every input of a matmul (``dot_general``, a convolution) or of an attention kernel (a
``custom_vjp`` function the program calls: its own residuals) once, in the narrowest dtype
it has on the way; one bit per element of a non-monotone activation and its output; a
norm's ``xhat`` and a float32 statistic per row; a softmax's probabilities; everything
elementwise recomputed from those (a norm's scale and bias, a GLU's product, casts,
reshapes, transposes, bias adds, masks, positions).

The program is traced, its activations, norms and softmaxes found as :func:`invert` finds
them, and from every value a matmul or a nonlinear op needs, the walk goes back through
elementwise ops to the values they are computed from; what it stops at (an op's output, a
matmul's output, a custom call's output, a scan's carry) is kept once.  Arguments and
constants are free.  Scan bodies count once per iteration.
"""
from __future__ import annotations

import dataclasses
import math
import jax
import numpy as np

from invact_jax.convert import _graph
from invact_jax.convert import _pass
from invact_jax.convert import _primitives
from invact_jax.convert._graph import Lit
from invact_jax.ops.activations import base as _act_base
from invact_jax.ops.activations import registry

__all__ = ["FloorItem", "items"]


@dataclasses.dataclass(frozen=True)
class FloorItem:
  """One array the floor keeps.

  Attributes:
    what: its role (``"matmul input"``, ``"gelu output"``, ``"gelu bits"``, ``"layer_norm
      xhat"``, ``"layer_norm row statistic"``, ``"softmax output"``, ``"kernel residual"``).
    shape: its shape (scan bodies: with the scan's length in front).
    dtype: the dtype it is kept in.
    bytes: its size.
    where: the source line that computes it.
  """
  what: str
  shape: tuple
  dtype: str
  bytes: int
  where: str = ""


def _aval(g: _graph.Graph, ref):
  return jax.typeof(ref.val) if isinstance(ref, Lit) else g.avals[ref]


class _Walker:
  """The floor of one graph.  ``outer`` maps input index -> (walker, ref) for a nested body's
  inputs computed by the enclosing program (walked back there); other inputs are free,
  except ``carried`` ones (a scan's carry: a new value every iteration, kept here)."""

  def __init__(self, g: _graph.Graph, differentiable: set, prefix: tuple, opts,
               outer: dict | None = None, carried: frozenset = frozenset()):
    g = _pass.prepare(g, opts)
    self.g, self.prefix, self.opts = g, prefix, opts
    self.outer = {g.invars[k]: v for k, v in (outer or {}).items()}
    self.carried = {g.invars[k] for k in carried}
    self.items: dict = {}        # key -> FloorItem (keyed by the kept value)
    self.found = _pass.find(g, opts)
    self.owner: dict = {}        # node -> (kind, match)
    for m in self.found.norms:
      self.owner.update({i: ("norm", m) for i in m.nodes})
    for m in self.found.softmaxes:
      self.owner.update({i: ("softmax", m) for i in m.nodes})
    for m in self.found.forms:
      kind = "softmax" if m.pattern.form.kind == "softmax" else "act"
      self.owner.update({i: (kind, m) for i in m.nodes})
    for m in self.found.heads:
      self.owner.update({i: ("head", m) for i in m.nodes})
    # a softmax's shift (its max) gets no cotangent: softmax does not depend on it
    self.shifts = {(i, m.inputs[1]) for m in self.found.softmaxes if len(m.inputs) > 1
                   for i in m.nodes}
    self.diff = self._differentiable({g.invars[k] for k in differentiable})

  def _differentiable(self, out: set) -> set:
    """The values a cotangent reaches: computed from differentiated inputs (not through a
    ``stop_gradient``) and read, on such a path, by the program's outputs."""
    g = self.g
    for n in g.nodes:
      if n.prim.name != "stop_gradient" and any(
          not isinstance(r, Lit) and r in out for r in n.ins):
        out.update(n.outs)
    live = {r for r in g.outvars if not isinstance(r, Lit)}
    for i in range(len(g.nodes) - 1, -1, -1):
      n = g.nodes[i]
      if n.prim.name != "stop_gradient" and any(o in live for o in n.outs):
        live.update(r for r in n.ins if not isinstance(r, Lit) and (i, r) not in self.shifts)
    return out & live

  # -- recording
  def _add(self, key, what, shape, dtype, nbytes, where=""):
    count = math.prod(self.prefix) if self.prefix else 1
    if key not in self.items or self.items[key].bytes < nbytes * count:
      self.items[key] = FloorItem(what, self.prefix + tuple(shape), str(np.dtype(dtype)),
                                  nbytes * count, where)

  def _kept_dtype(self, ref, itemsize: int):
    dtype = np.dtype(self.g.avals[ref].dtype)
    if itemsize < dtype.itemsize and dtype.kind == "f":  # kept in the narrower float it is
      dtype = np.dtype(jax.numpy.bfloat16) if itemsize == 2 else np.dtype(np.float32)
    return dtype

  def _bytes(self, ref, itemsize: int) -> int:
    try:
      return math.prod(self.g.avals[ref].shape) * self._kept_dtype(ref, itemsize).itemsize
    except TypeError:
      return 0

  def anchor(self, ref, what: str, itemsize: int) -> None:
    """``ref`` kept once, in at most ``itemsize`` bytes per element."""
    a = self.g.avals[ref]
    dtype = self._kept_dtype(ref, itemsize)
    i = self.g.producer.get(ref, (None,))[0]
    where = self.g.nodes[i].where if i is not None else ""
    self._add(("value", ref), what, a.shape, dtype, math.prod(a.shape) * dtype.itemsize, where)

  def _leaf_kind(self, ref):
    """How ``ref`` is had: ``"free"`` (an argument, a constant: recomputed for nothing),
    ``"outer"`` (an input computed by the enclosing program), ``"keep"`` (an op's output, a
    matmul's, a carry: kept if needed), ``"recompute"`` (an elementwise op's output)."""
    g = self.g
    if isinstance(ref, Lit):
      return "free"
    if ref not in g.producer:
      if ref in self.outer:
        return "outer"
      return "keep" if ref in self.carried else "free"
    i, _ = g.producer[ref]
    if i in self.owner:
      kind, m = self.owner[i]
      return "keep" if self.found.output(g, m) == ref else "recompute"
    try:
      np.dtype(g.avals[ref].dtype)
    except TypeError:
      return "free"  # PRNG keys: recomputed from their source
    n = g.nodes[i]
    return "recompute" if n.prim.name in _primitives.RECOMPUTED or not n.ins else "keep"

  def _leaves(self, ref, itemsize: int, out: dict) -> dict:
    """What recomputing ``ref`` reads, back through elementwise ops: ``{leaf: itemsize}``."""
    kind = self._leaf_kind(ref)
    if kind == "free":
      return out
    if kind != "recompute":
      out[ref] = max(out.get(ref, 0), itemsize)
      return out
    n = self.g.nodes[self.g.producer[ref][0]]
    size = np.dtype(self.g.avals[ref].dtype).itemsize
    for r in n.ins:
      self._leaves(r, min(itemsize, size) if n.prim.name == "convert_element_type"
                   else itemsize, out)
    return out

  def _keep(self, ref, itemsize: int) -> None:
    kind = self._leaf_kind(ref)
    if kind == "outer":
      walker, outer_ref = self.outer[ref]
      walker.walk(outer_ref, itemsize)
    elif kind == "keep":
      i = self.g.producer.get(ref, (None,))[0]
      n = self.g.nodes[i] if i is not None else None
      if i in self.owner:
        k, m = self.owner[i]
        store = np.dtype(m.store).itemsize if k == "norm" else 1 << 30
        self.anchor(ref, self._what(k, m), min(itemsize, store))
      else:
        self.anchor(ref, "scan carry" if n is None else "matmul output"
                    if n.prim.name in _primitives.MATMULS else f"{n.prim.name} output", itemsize)
    elif kind == "recompute":
      self.anchor(ref, f"{self.g.nodes[self.g.producer[ref][0]].prim.name} output", itemsize)

  def walk(self, ref, itemsize: int = 1 << 30) -> None:
    """Keep what the backward needs to have ``ref``: recompute it from what it is computed
    from where that keeps no more bytes than ``ref`` itself, else keep ``ref``."""
    if self._leaf_kind(ref) != "recompute":
      self._keep(ref, itemsize)
      return
    leaves = self._leaves(ref, itemsize, {})
    new = sum(self._bytes(r, size) for r, size in leaves.items()
              if ("value", r) not in self.items)
    if new <= self._bytes(ref, itemsize):
      for r, size in leaves.items():
        self._keep(r, size)
    else:
      self._keep(ref, itemsize)

  @staticmethod
  def _what(kind, m) -> str:
    if kind == "head":
      return "linear_cross_entropy output"
    if kind == "norm":
      return f"{m.public} xhat"
    if kind == "softmax":
      return "softmax output"
    return f"{m.pattern.form.public} output"

  # -- the ops
  def run(self) -> "_Walker":
    g = self.g
    for m in self.found.norms:
      out = self.found.output(g, m)
      self.anchor(out, self._what("norm", m), np.dtype(m.store).itemsize)
      x = _aval(g, m.inputs[0])
      rows = math.prod(x.shape) // max(1, math.prod(x.shape[a] for a in m.axes))
      self._add(("rstd", out), f"{m.public} row statistic", (rows,), "float32", 4 * rows,
                g.nodes[m.root].where)
      if m.eps_mode.startswith("floor"):  # which side of its floor each row is on
        self._add(("side", out), f"{m.public} row factor", (rows,), "float32", 4 * rows,
                  g.nodes[m.root].where)
    for m in self.found.softmaxes:
      self.anchor(self.found.output(g, m), "softmax output", 1 << 30)
    for m in self.found.heads:  # the LM head: its input and a float32 log-sum-exp per token
      self.walk(m.x)
      self.walk(m.w)
      tokens = math.prod(_aval(g, m.x).shape[:-1])
      self._add(("lse", m.root), "linear_cross_entropy row statistic", (tokens,), "float32",
                4 * tokens, g.nodes[m.root].where)
    for m in self.found.forms:
      out = self.found.output(g, m)
      self.anchor(out, self._what("softmax" if m.pattern.form.kind == "softmax" else "act", m),
                  1 << 30)
      if m.pattern.form.kind == "softmax":
        continue
      entry = m.pattern.form.entry if m.pattern.form.kind == "activation" else \
          registry.get("silu")
      params = tuple((k, float(m.caught[k])) for k, _ in entry.params)
      if _act_base.Op(entry, params).has_bit:
        a = g.avals[out]
        packed = (*a.shape[:-1], math.ceil(a.shape[-1] / 8)) if a.shape else (1,)
        self._add(("bits", out), f"{m.pattern.form.public} bits", packed, "uint8",
                  math.prod(packed), g.nodes[m.root].where)
    for i, n in enumerate(g.nodes):
      if i not in self.owner:
        self._node(n)
    return self

  def _node(self, n) -> None:
    name = n.prim.name
    ins = [r for r in n.ins if not isinstance(r, Lit)]
    out_diff = any(o in self.diff for o in n.outs)
    if name in _primitives.MATMULS:
      for k, r in enumerate(n.ins[:2]):
        other = n.ins[1 - k]
        if not isinstance(other, Lit) and other in self.diff:
          self.walk(r)
    elif name in _primitives.CALLS:
      self._call(n)
    elif name == "scan":
      self._scan(n)
    elif name == "cond":
      self._cond(n)
    elif name in _primitives.NESTED:
      closed = n.params.get("jaxpr") or n.params.get("call_jaxpr")
      if closed is not None:
        self._nested(n, closed)
    elif not out_diff or name in _primitives.LINEAR:
      return
    elif name in ("mul", "div") and len(n.ins) == 2:
      a, b = n.ins
      diff = lambda r: not isinstance(r, Lit) and r in self.diff  # noqa: E731
      if diff(a):  # d/da needs b
        self.walk(b)
      if diff(b):  # d/db needs a (and b, for a quotient)
        self.walk(a)
        if name == "div":
          self.walk(b)
    else:  # nonlinear: its inputs
      for r in ins:
        self.walk(r)

  def _nested(self, n, closed) -> None:
    g2 = _graph.flatten(closed)
    outer = {k: (self, r) for k, r in enumerate(n.ins)}
    diff = {k for k, r in enumerate(n.ins) if not isinstance(r, Lit) and r in self.diff}
    self._merge(_Walker(g2, diff, self.prefix, self.opts, outer).run(), id(n))

  def _scan(self, n) -> None:
    p = n.params
    nc, ncar = _graph.scan_counts(p)
    g2 = _graph.flatten(p["jaxpr"])
    carry = range(nc, nc + ncar)
    # consts are walked back in the enclosing program once; the stacked xs too (their whole
    # stack is what the scan reads); the carry is a new value each iteration
    outer = {k: (self, r) for k, r in enumerate(n.ins) if k not in carry}
    diff = {k for k, r in enumerate(n.ins)
            if k in carry or (not isinstance(r, Lit) and r in self.diff)}
    w = _Walker(g2, diff, self.prefix + (int(p["length"]),), self.opts, outer,
                frozenset(carry))
    self._merge(w.run(), id(n))

  def _cond(self, n) -> None:
    """Every branch's floor: autodiff of a ``cond`` keeps each branch's residuals (the
    branch not taken fills its own with zeros), so the floor counts them all."""
    operands = n.ins[1:]  # n.ins[0] chooses the branch
    outer = {k: (self, r) for k, r in enumerate(operands)}
    diff = {k for k, r in enumerate(operands) if not isinstance(r, Lit) and r in self.diff}
    for b, closed in enumerate(n.params["branches"]):
      w = _Walker(_graph.flatten(closed), diff, self.prefix, self.opts, outer)
      self._merge(w.run(), (id(n), b))

  def _merge(self, w: "_Walker", tag) -> None:
    for k, item in w.items.items():
      self.items[(tag, k)] = item

  def _call(self, n) -> None:
    """A custom_vjp function the program calls (an attention kernel): its own residuals —
    its inputs walked back, its outputs kept once, anything else counted as it is."""
    ins = list(n.ins)
    structs = [jax.ShapeDtypeStruct(_aval(self.g, r).shape, _aval(self.g, r).dtype) for r in ins]
    try:
      res = _saved_residuals(lambda *vals: _graph.bind(n, list(vals)), structs)
    except Exception:  # pylint: disable=broad-except
      res = None  # not traceable alone: its inputs and outputs, conservatively
    if res is None:
      for r in ins:
        self.walk(r)
      for o in n.outs:
        self.anchor(o, "kernel output", 1 << 30)
      return
    outs = {(tuple(self.g.avals[o].shape), str(self.g.avals[o].dtype)): o for o in n.outs}
    for k, (aval, source) in enumerate(res):
      if source.startswith("from the argument"):
        idx = _argument_index(source)
        if idx is not None and idx < len(ins):
          self.walk(ins[idx])
        continue
      key = (tuple(aval.shape), str(aval.dtype))
      if key in outs:
        self.anchor(outs[key], "kernel output", 1 << 30)
      else:
        nbytes = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        self._add(("res", id(n), k), "kernel residual", tuple(aval.shape), aval.dtype, nbytes,
                  n.where)


def _argument_index(source: str) -> int | None:
  """The flat argument index in saved_residuals' "from the argument vals[3]" text."""
  import re  # pylint: disable=import-outside-toplevel
  m = re.search(r"\[(\d+)\]", source)
  return int(m.group(1)) if m else None


def _saved_residuals(f, structs):
  try:
    from jax.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  except ImportError:
    from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel

  def scalar(*vals):
    return sum(jax.numpy.sum(o.astype(jax.numpy.float32)) for o in f(*vals)
               if jax.numpy.issubdtype(o.dtype, jax.numpy.floating))
  return saved_residuals(scalar, *structs)


def items(fn, args, kwargs) -> list[FloorItem]:
  """The floor of ``fn``'s backward w.r.t. its floating-point array arguments."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  dyn = [i for i, leaf in enumerate(leaves)
         if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]

  def flat(*vals):
    ls = list(leaves)
    for i, v in zip(dyn, vals):
      ls[i] = v
    a, k = jax.tree.unflatten(tree, ls)
    return fn(*a, **k)
  vals = [leaves[i] for i in dyn]
  g = _graph.flatten(jax.make_jaxpr(flat)(*vals))
  floats = {k for k, v in enumerate(vals) if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)}
  w = _Walker(g, floats, (), _pass.options_for_analysis()).run()
  return sorted(w.items.values(), key=lambda it: (-it.bytes, it.what))
