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
from typing import Any, Callable

import jax
import numpy as np

from invact_jax import memory, targets
from invact_jax.convert import graph as _graph
from invact_jax.convert import _pass
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit
from invact_jax.ops.cross_entropy import in_forward

__all__ = ["FloorItem", "FloorAudit", "FORWARD_GRADIENT", "floor_audit", "items"]


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
    self.owner: dict = {}        # node -> (rule, match): what the rule's floor accounts for
    for rule, m in self.found.matches:
      self.owner.update({i: (rule, m) for i in m.nodes})
    # inputs a match's gradient does not reach (a softmax's shift): not walked through it
    self.shifts = {(i, r) for rule, m in self.found.matches for r in rule.no_cotangent(m)
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

  # -- recording (also what a rule's :meth:`~._rule.Rule.floor` calls)
  def record(self, key, what: str, shape, dtype, nbytes: int, where: str = "") -> None:
    """An array of ``nbytes`` kept once per key (a scan body's: per iteration)."""
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
    self.record(("value", ref), what, a.shape, dtype, math.prod(a.shape) * dtype.itemsize,
                where)

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
      rule, m = self.owner[i]
      return "keep" if rule.output(g, m) == ref else "recompute"
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
    """Keep ``ref`` (at most ``itemsize`` bytes per element): walked back in the enclosing program,
    anchored as its rule's role, a matmul's or a carry's output, or an elementwise output kept
    as it is."""
    kind = self._leaf_kind(ref)
    if kind == "outer":
      walker, outer_ref = self.outer[ref]
      walker.walk(outer_ref, itemsize)
    elif kind == "keep":
      i = self.g.producer.get(ref, (None,))[0]
      n = self.g.nodes[i] if i is not None else None
      if i in self.owner:
        rule, m = self.owner[i]
        self.anchor(ref, rule.role(m), min(itemsize, rule.kept_itemsize(m)))
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

  # -- the ops
  def run(self) -> "_Walker":
    """The floor of the graph: each match's as its rule accounts for it, then every other
    equation's (matmul operands, nonlinear inputs, nested bodies)."""
    g = self.g
    for rule, m in self.found.matches:
      rule.floor(self, m)
    for i, n in enumerate(g.nodes):
      if i not in self.owner:
        self._node(n)
    return self

  def _node(self, n) -> None:
    """What the backward of equation ``n`` needs, outside every match: a matmul's operands, a
    nested call's, scan's or cond's floor, a product's or quotient's other operand, a nonlinear
    op's inputs (nothing for a linear one)."""
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
    """A scan's body's floor, once per iteration (its shapes prefixed by the length): its carry
    kept, its constants and stacked inputs walked back in the enclosing program."""
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
        self.record(("res", id(n), k), "kernel residual", tuple(aval.shape), aval.dtype, nbytes,
                  n.where)


def _argument_index(source: str) -> int | None:
  """The flat argument index in saved_residuals' "from the argument vals[3]" text."""
  import re  # pylint: disable=import-outside-toplevel
  m = re.search(r"\[(\d+)\]", source)
  return int(m.group(1)) if m else None


def _saved_residuals(f, structs):
  """JAX's ``saved_residuals`` of ``f``'s floating outputs summed to a scalar, at ``structs``."""
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


#: A :class:`FloorAudit` role: a gradient computed in the forward.
FORWARD_GRADIENT = "gradient computed in the forward"


@dataclasses.dataclass(frozen=True)
class FloorAudit:
  """What a differentiated function keeps against the floor (see :func:`floor_audit`).

  Attributes:
    kept: ``(Residual, role)`` per kept non-argument array; ``role`` is the floor item it
      stands for (``"gelu output"``, ``"rms_norm xhat"``, ``"matmul output"``, ...),
      :data:`FORWARD_GRADIENT` for a gradient computed in the forward (the LM head's
      ``gradients="forward"``), or ``"excess"`` when the floor has no array of its size and
      dtype left.
    floor: the floor's arrays (:class:`FloorItem`).
  """
  kept: tuple
  floor: tuple

  @property
  def kept_bytes(self) -> int:
    """Bytes of the kept activations (gradients computed in the forward not counted)."""
    return sum(r.bytes for r, role in self.kept if role != FORWARD_GRADIENT)

  @property
  def forward_gradient_bytes(self) -> int:
    """Bytes of gradients computed in the forward and kept for the backward to scale: the
    gradients' own buffers, made at the end of the forward instead of in the backward."""
    return sum(r.bytes for r, role in self.kept if role == FORWARD_GRADIENT)

  @property
  def floor_bytes(self) -> int:
    return sum(item.bytes for item in self.floor)

  @property
  def excess_bytes(self) -> int:
    return sum(r.bytes for r, role in self.kept if role == "excess")

  @property
  def ratio(self) -> float:
    """Kept bytes over the floor's (1.0: at the floor; a program with nothing to keep that
    keeps nothing is at it)."""
    if not self.floor_bytes:
      return 1.0 if not self.kept_bytes else float("inf")
    return self.kept_bytes / self.floor_bytes

  def table(self) -> str:
    """Markdown: every kept array with its role, then the totals."""
    lines = ["| shape | dtype | bytes | role | source |", "|---|---|---:|---|---|"]
    for r, role in self.kept:
      lines.append(f"| {r.shape} | {r.dtype} | {r.bytes} | {role} | {r.source} |")
    lines.append(f"| **kept** | | **{self.kept_bytes}** | {self.excess_bytes} excess | |")
    if self.forward_gradient_bytes:
      lines.append(f"| **gradients computed in the forward** | | "
                   f"**{self.forward_gradient_bytes}** | not counted as kept | |")
    lines.append(f"| **floor** | | **{self.floor_bytes}** | kept / floor = "
                 f"{self.ratio:.2f} | |")
    return "\n".join(lines)


def floor_audit(fn: Callable[..., Any], *args, device: str | targets.Target | None = None,
                **kwargs) -> FloorAudit:
  """Every array autodiff keeps for ``fn``'s backward against the floor.

  The floor is the least a backward must keep without recomputing a matmul: every matmul
  or attention-kernel input once in the narrowest dtype it has on the way, an activation's
  output (and one bit per element where it is non-monotone), a norm's ``xhat`` and a
  float32 statistic per row, a softmax's probabilities; everything elementwise recomputed
  from those.  It is computed from the *unconverted* computation (for a function made by
  :func:`invact_jax.invert`, from the function it converted), so the audit of ``fn`` and of
  ``invert(fn)`` compare with the same floor.

  Args:
    fn: a function with a scalar output, differentiated w.r.t. its floating-point array
      arguments (as :func:`invact_jax.memory.residuals` does).
    *args, **kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    device: the target ``fn`` is traced for (:func:`invact_jax.targets.resolve`; default
      the current one): its implementation choices (cuDNN's attention on a GPU) and the
      compiles a converted ``fn`` measures with are that device's.

  Returns:
    A :class:`FloorAudit`: each kept array with its role, the floor's arrays, the ratio.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> def mlp(x, w1, w2):
    ...   return jnp.sum(jax.nn.gelu(x @ w1) @ w2)
    >>> args = (jnp.ones((8, 16)), jnp.ones((16, 64)), jnp.ones((64, 16)))
    >>> invact_jax.floor_audit(mlp, *args).ratio > 4   # GELU's internals (5.82 on JAX 0.10)
    True
    >>> round(invact_jax.floor_audit(invact_jax.invert(mlp), *args).ratio, 2)  # GELU's y and bits
    1.0
  """
  if not callable(fn):
    raise TypeError("invact_jax.floor_audit: argument `fn` must be callable, got "
                    f"{type(fn).__name__}")
  with targets.compiling_for(device):
    return _floor_audit(fn, args, kwargs)


def _floor_audit(fn, args, kwargs) -> FloorAudit:
  """The audit of ``fn``: its kept arrays (JAX's residuals, largest first) each given the role of a
  floor item of its size and dtype, else ``excess``; gradients computed in the forward apart."""
  reference = getattr(fn, "invact_jax_original", fn)
  floor = tuple(items(reference, args, kwargs))
  left: dict = {}
  for item in floor:
    left.setdefault((item.bytes, item.dtype), []).append(item.what)
  kept = []
  for r in sorted((r for r in memory.residuals(fn, *args, **kwargs) if not r.is_argument),
                  key=lambda r: -r.bytes):
    if f"named '{in_forward.GRADIENT_NAME}'" in r.source:
      kept.append((r, FORWARD_GRADIENT))
      continue
    roles = left.get((r.bytes, r.dtype))
    kept.append((r, roles.pop(0) if roles else "excess"))
  return FloorAudit(tuple(kept), floor)
