"""Normalizations recognized by their algebra, whatever library wrote them.

A LayerNorm or RMSNorm is found from its statistics, not from a traced library form: for an
input ``x`` reduced over axes ``A`` (any axes: vmapped and penzai-named layers reduce over
whichever axis is theirs), every value computed from ``x`` is followed as a polynomial in

* ``x`` itself (elementwise), the row statistics ``m1 = mean_A(x)`` and ``m2 = mean_A(x^2)``,
* radicals ``r = (p)^(-1/2)`` of row polynomials ``p`` (``rsqrt(p)``, ``1/sqrt(p)``,
  ``reciprocal(sqrt(p))``, ``x / sqrt(p)``, ``p ** -0.5``),
* the parameters: values that do not depend on ``x`` and are constant across rows (a
  scale, a bias, Gemma's ``1 + weight``), and numeric constants,

through ``add``, ``sub``, ``mul``, ``div``, ``neg``, squares and powers, casts, broadcasts and
sums over ``A`` (``jnp.mean``, ``jnp.var``, ``E[x^2] - E[x]^2``, a clip of the variance at 0,
a ``where`` on a constant).  An output is a norm when its polynomial is

    LayerNorm:  (x - m1) * r * S + B      with r = (m2 - m1^2 + eps)^(-1/2)
    RMSNorm:     x       * r * S + B      with r = (m2 + eps)^(-1/2)

or, epsilon added to the standard deviation (``x / (std + eps)``), with ``q = 1 / (a *
r^-1 + e)`` (``r`` as above without eps; a reciprocal of a row polynomial of several terms)
in place of ``r``,

with ``S`` and ``B`` polynomials in the parameters alone (Keras folds the affine into
``x * (r * gamma) + (beta - m1 * r * gamma)``: the same polynomial).  So scale and bias are
found in any order or folded, with no affine (``jax.nn.standardize``), with statistics in
float32 or in the input dtype; anything else computed from ``x`` (a ``stop_gradient``, a
``dot_general``) makes the values after it opaque, and nothing is converted through it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _graph
from invact_jax.convert import _match
from invact_jax.convert import _primitives
from invact_jax.convert._graph import Lit

__all__ = ["NormMatch", "SoftmaxMatch", "find_norms", "find_softmaxes", "evaluate_poly",
           "to_x", "from_x"]

_MAX_TERMS = 48
_REL_TOL = 1e-6

X, M1, M2 = ("x",), ("m1",), ("m2",)


# ------------------------------------------------------------------------ polynomials
def _mono(*pairs) -> tuple:
  out: dict = {}
  for s, e in pairs:
    out[s] = out.get(s, 0) + e
  return tuple(sorted((s, e) for s, e in out.items() if e))


def _const(c: float) -> dict:
  return {(): float(c)} if c else {}


def _add(a: dict, b: dict, sign: float = 1.0) -> dict:
  out = dict(a)
  for m, c in b.items():
    total = out.get(m, 0.0) + sign * c
    if abs(total) <= _REL_TOL * max(abs(out.get(m, 0.0)), abs(c)):
      out.pop(m, None)
    else:
      out[m] = total
  return out


def _mul(a: dict, b: dict) -> dict | None:
  out: dict = {}
  for ma, ca in a.items():
    for mb, cb in b.items():
      m = _mono(*ma, *mb)
      out = _add(out, {m: ca * cb})
  return out if len(out) <= _MAX_TERMS else None


def _scale(a: dict, c: float) -> dict:
  return {m: v * c for m, v in a.items()} if c else {}


def _syms(p: dict) -> set:
  return {s for m in p for s, _ in m}


def _is_row(s) -> bool:
  return s in (M1, M2) or s[0] in ("r", "q", "f")


def _power(p: dict, n: int) -> dict | None:
  if n == 0:
    return _const(1.0)
  if n < 0:
    if len(p) != 1:  # only a monomial of row symbols and constants can be inverted
      return None
    (m, c), = p.items()
    if c == 0 or any(not _is_row(s) for s, _ in m):
      return None
    return {_mono(*((s, -e * -n) for s, e in m)): c ** n}
  out = _const(1.0)
  for _ in range(n):
    out = _mul(out, p)
    if out is None:
      return None
  return out


def _by_x_power(p: dict) -> dict:
  """{power of x: the polynomial multiplying it}."""
  out: dict = {}
  for m, c in p.items():
    k = dict(m).get(X, 0)
    rest = tuple((s, e) for s, e in m if s != X)
    out.setdefault(k, {})[rest] = c
  return out


# ------------------------------------------------------------------------------ match
_EPS_MODES = {"std": "epsilon added to the standard deviation",
              "floor_var": "the variance floored at epsilon",
              "floor_std": "the standard deviation floored at epsilon"}


@dataclasses.dataclass
class NormMatch:
  """A norm found by its algebra: what the conversion replaces and how.

  Attributes:
    rms: RMSNorm (no centring) or LayerNorm.
    eps: the constant added to the variance (or as ``eps_mode`` says).
    axes: the reduced axes of ``x``.
    nodes: the region's node indices (sorted); ``root``/``root_out``: the output's producer.
    inputs: the region's inputs; ``inputs[0]`` is ``x``.
    params: ``(input index, chain, layout)`` per parameter symbol: the region input it is
      computed from, the nodes (reshapes, broadcasts, casts) between them and the layout it
      is read in; ``("const", value, layout)`` for a constant array.
    scale, bias: polynomials in the parameter symbols (``("c", i)``); None: 1 and 0.
    store: the dtype ``xhat`` is kept in: the narrowest dtype the program itself gives a
      value computed from ``x`` on the way to the output (so the kept ``xhat`` is no less
      precise than what the program computed: a float32 copy is not kept where the
      program's normalized values were bfloat16, and float32 is kept where they were).
    layout: the output's layout: per dimension, the axis of ``x`` it runs along (None: a
      new axis of size 1); ``to_x`` moves an array from it to the layout of ``x``.
    eps_mode: where epsilon enters: "var" ``rsqrt(var + eps)``; "std" ``1 / (std + eps)``
      (the annotated Transformer's LayerNorm); "floor_var" ``rsqrt(max(var, eps))``;
      "floor_std" ``1 / max(std, eps)`` (torch's ``F.normalize``).
  """
  rms: bool
  eps: float
  axes: tuple
  nodes: list
  root: int
  root_out: int
  inputs: list
  params: list
  scale: dict
  bias: dict
  store: Any = None
  layout: tuple = ()
  eps_mode: str = "var"

  @property
  def public(self) -> str:
    return "rms_norm" if self.rms else "layer_norm"

  @property
  def name(self) -> str:
    kind = "RMSNorm" if self.rms else "LayerNorm"
    affine = [w for w, p in (("scale", self.scale), ("bias", self.bias))
              if _syms(p)] + ([_EPS_MODES[self.eps_mode]] if self.eps_mode != "var" else [])
    return f"{kind} by its algebra (axes {self.axes}{', ' if affine else ''}{', '.join(affine)})"


def _numeric(dtype) -> bool:
  """A NumPy-representable number type (not a PRNG key or another extended dtype)."""
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class _Analysis:
  """The symbolic values of everything computed from ``x`` (one candidate ``x``, ``axes``)."""

  def __init__(self, graph: _graph.Graph, x, axes: tuple):
    self.g, self.x, self.axes = graph, x, tuple(sorted(int(a) for a in axes))
    self.shape = tuple(_shape(graph, x))
    self.n = math.prod(self.shape[a] for a in self.axes)
    self.vals: dict = {x: {((X, 1),): 1.0}}
    # Layout of each value: per dimension, the axis of x it runs along (None: a new axis of
    # size 1).  Transposes, broadcasts and reshapes move axes; statistics are over ``axes``.
    self.layout: dict = {x: tuple(range(len(self.shape)))}
    self._cur = self.layout[x]  # the layout of the node being read (for its parameters)
    # Row symbols of row polynomials p, per kind: "r" p^(-1/2) (definition p), "q" 1 / p
    # (p of several terms), "f" max(p, c) (definition (p, c), c > 0).
    self.symbols: dict = {}    # (kind, canonical definition) -> the symbol
    self.defs: dict = {"r": [], "q": [], "f": []}  # kind -> definitions, by symbol index
    self.params: list = []     # (source ref, chain) per parameter symbol
    self.param_ids: dict = {}  # ref -> symbol index
    self.opaque: set = set()   # vars computed from x that are not polynomials
    self.consts: dict = {}     # small values computed from literals alone (folded)
    self.final: set = set()    # outputs of a narrowing cast: a norm may end there, not pass it

  # -- layouts
  def _valid(self, layout, shape, full: bool) -> bool:
    """A value computed from x in ``layout``: ``full`` ones run along every axis of x (in any
    order); every dimension of size above 1 along a distinct axis of x."""
    if layout is None or len(layout) != len(shape):
      return False
    big = [a for a, d in zip(layout, shape) if d != 1]
    if None in big or len(set(big)) != len(big):
      return False
    if full:
      return set(big) == {a for a, d in enumerate(self.shape) if d != 1}
    return True  # a row statistic, or one times a parameter (r * gamma): it may run along axes

  def _layout_of(self, node) -> tuple | None:  # pylint: disable=too-many-return-statements
    """The layout of ``node``'s output from its symbolic operands' layouts, or None."""
    name = node.prim.name
    out_shape = tuple(self.g.avals[node.outs[0]].shape)
    ins = [r for r in node.ins if r is self.x or (not isinstance(r, Lit) and r in self.vals)]
    layouts = [self.layout[r] for r in ins]
    if not layouts:
      return None
    m = layouts[0]
    if name == "reduce_sum":
      red = [int(a) for a in node.params["axes"]]
      if {m[i] for i in red} != set(self.axes) or len(red) != len(self.axes):
        return None
      return tuple(a for i, a in enumerate(m) if i not in red)
    if name == "transpose":
      return tuple(m[p] for p in node.params["permutation"])
    if name == "broadcast_in_dim":
      out = [None] * len(out_shape)
      for j, d in enumerate(node.params["broadcast_dimensions"]):
        out[d] = m[j]
      for i, d in enumerate(out_shape):
        if out[i] is None and d != 1:  # a row value spread along a reduced axis
          options = [a for a in self.axes if self.shape[a] == d and a not in out]
          if len(options) != 1:
            return None
          out[i] = options[0]
      return tuple(out)
    if name in ("reshape", "squeeze", "expand_dims"):
      src = tuple(_shape(self.g, ins[0]))
      big_s = [j for j, d in enumerate(src) if d != 1]
      big_t = [j for j, d in enumerate(out_shape) if d != 1]
      if [src[j] for j in big_s] != [out_shape[j] for j in big_t]:
        return None
      out = [None] * len(out_shape)
      for js, jt in zip(big_s, big_t):
        out[jt] = m[js]
      return tuple(out)
    # elementwise: operands of the output's rank, agreeing where they are not size 1
    out = [None] * len(out_shape)
    for r, lay in zip(ins, layouts):
      shape = tuple(_shape(self.g, r))
      if len(lay) != len(out_shape):
        if shape == () or len(lay) == 0:
          continue
        return None
      for i, (a, d) in enumerate(zip(lay, shape)):
        if d != 1 and out[i] is not None and out[i] != a:
          return None
        if out[i] is None and (d != 1 or a is not None):
          out[i] = a if d != 1 or out[i] is None else out[i]
    for i, d in enumerate(out_shape):  # an extent only a parameter gives: a reduced axis
      if d != 1 and (out[i] is None or self.shape[out[i]] != d):
        options = [a for a in self.axes if self.shape[a] == d and a not in out]
        if out[i] is not None or len(options) != 1:
          return None
        out[i] = options[0]
    return tuple(out)

  def _column_chain(self, ref):
    """``(source, nodes)``: the parameter ``ref``, read in the current node's layout, is (a
    reshape, broadcast or cast of) the value ``source``, constant across rows; None when it
    varies across rows.  The reduced axes are followed through each step."""
    if isinstance(ref, Lit):
      return None
    layout = self._cur
    shape = tuple(self.g.avals[ref].shape)
    if len(shape) > len(layout):
      return None
    offset = len(layout) - len(shape)
    axes = {i - offset for i in range(offset, len(layout)) if layout[i] in self.axes}
    ok = all(d == 1 or i in axes for i, d in enumerate(shape))
    nodes = []
    for _ in range(8):
      if ref not in self.g.producer:
        break
      i, _ = self.g.producer[ref]
      node = self.g.nodes[i]
      ins = [r for r in node.ins if not isinstance(r, Lit)]
      name = node.prim.name
      if name not in ("broadcast_in_dim", "convert_element_type", "reshape") or len(ins) != 1:
        break
      src = tuple(self.g.avals[ins[0]].shape)
      out = tuple(self.g.avals[ref].shape)
      if name == "broadcast_in_dim":
        dims = node.params["broadcast_dimensions"]
        src_axes = {j for j in range(len(src)) if dims[j] in axes}
      elif name == "reshape":
        big_src = [j for j, d in enumerate(src) if d != 1]
        big_out = [j for j, d in enumerate(out) if d != 1]
        if [src[j] for j in big_src] != [out[j] for j in big_out]:
          break
        src_axes = {js for js, jo in zip(big_src, big_out) if jo in axes}
      else:
        src_axes = axes
      if any(d != 1 and j not in src_axes for j, d in enumerate(src)):
        break
      nodes.insert(0, i)
      ref, ok, axes = ins[0], True, src_axes
    return (ref, nodes) if ok else None

  def _param(self, ref) -> dict | None:
    """The parameter symbol of an outside value (a column constant), or a constant."""
    if not isinstance(ref, Lit) and ref in self.consts:
      ref = Lit(self.consts[ref])
    if isinstance(ref, Lit):
      v = np.asarray(ref.val)
      if v.ndim == 0 or v.size == 1:
        return _const(float(v.reshape(())))
      layout = self._cur
      offset = len(layout) - v.ndim
      if offset < 0 or any(d != 1 and layout[i + offset] not in self.axes
                           for i, d in enumerate(v.shape)):
        return None
      # one symbol per constant array, however many literals of it the program holds
      key = ("lit", v.shape, v.dtype.str, v.tobytes()) if v.size <= 1 << 16 else ("lit", id(ref.val))
      if key not in self.param_ids:  # a constant array (a closed-over weight): its value
        self.param_ids[key] = len(self.params)
        self.params.append((ref, (ref, []), layout))
      return {((("c", self.param_ids[key]), 1),): 1.0}
    folded = self._literal_spread(ref)
    if folded is not None:
      return self._param(folded)
    chain = self._column_chain(ref)
    if chain is None:
      return None
    key = chain[0]  # one symbol per parameter, however many broadcasts of it the code makes
    if key not in self.param_ids:
      self.param_ids[key] = len(self.params)
      self.params.append((ref, chain, self._cur))
    return {((("c", self.param_ids[key]), 1),): 1.0}

  def _literal_spread(self, ref) -> Lit | None:
    """A constant array spread by broadcasts, casts and reshapes (a closed-over scale): the
    constant in the broadcasts' output rank with size-1 axes where they spread it, so one
    constant is one parameter symbol however many times the program broadcasts it."""
    nodes = []
    while not isinstance(ref, Lit) and ref in self.g.producer:
      node = self.g.nodes[self.g.producer[ref][0]]
      if node.prim.name not in ("broadcast_in_dim", "convert_element_type", "reshape") \
          or len(node.ins) != 1:
        return None
      nodes.insert(0, node)
      ref = node.ins[0]
    if not nodes or not isinstance(ref, Lit) or isinstance(ref.val, jax.core.Tracer):
      return None
    v, spread = np.asarray(ref.val), False
    for node in nodes:
      out = self.g.avals[node.outs[0]]
      if node.prim.name == "convert_element_type":
        v = v.astype(out.dtype)
      elif node.prim.name == "broadcast_in_dim":
        shape = [1] * len(out.shape)
        for j, d in zip(node.params["broadcast_dimensions"], v.shape):
          shape[j] = d
        v, spread = v.reshape(shape), True
      elif spread:
        return None  # a reshape after a broadcast: not followed
      else:
        v = v.reshape(out.shape)
    return Lit(v)

  def _symbol(self, kind: str, p: dict, c: float | None = None) -> tuple | None:
    """The row symbol of ``kind`` (see ``self.defs``) of the row polynomial ``p`` (and the
    floor ``c``), the same for the same definition; None where ``p`` is not a row
    polynomial."""
    if any(not _is_row(s) for s in _syms(p)):
      return None
    key = (kind, tuple(sorted((m, round(v, 12)) for m, v in p.items())),
           None if c is None else round(c, 12))
    if key not in self.symbols:
      self.symbols[key] = (kind, len(self.defs[kind]))
      self.defs[kind].append(p if c is None else (p, c))
    return self.symbols[key]

  def _radical(self, p: dict) -> tuple | None:
    """The symbol ``r`` with ``r = p^(-1/2)`` for a row polynomial ``p``."""
    return self._symbol("r", p)

  def _reciprocal(self, p: dict) -> dict | None:
    """``{q: 1}``, the symbol ``q = 1 / p`` of a row polynomial ``p`` of several terms (a
    standard deviation plus epsilon, ``sqrt(var) + eps``)."""
    q = self._symbol("q", p)
    return None if q is None else {((q, 1),): 1.0}

  def _floor(self, p: dict, c: float) -> dict:
    """``{f: 1}``, the symbol ``f = max(p, c)`` of a row polynomial ``p`` and a constant
    ``c > 0`` (a variance or norm kept from falling below ``c``)."""
    return {((self._symbol("f", p, c), 1),): 1.0}

  # -- one node
  def _value(self, ref):
    if ref is self.x or (not isinstance(ref, Lit) and ref in self.vals):
      return self.vals[ref]
    return self._param(ref)

  def _symbolic(self, ref) -> bool:
    return ref is self.x or (not isinstance(ref, Lit) and (ref in self.vals or ref in self.opaque))

  def _fold(self, node) -> None:
    """A small value computed from literals alone (Keras's ``n - ddof``, a clip's 0)."""
    if not node.ins or node.prim.multiple_results or len(node.outs) != 1:
      return
    if any(r is self.x or (not isinstance(r, Lit) and r not in self.consts) for r in node.ins):
      return
    if node.params.get("jaxpr") is not None:
      return
    vals = [r.val if isinstance(r, Lit) else self.consts[r] for r in node.ins]
    if any(isinstance(v, jax.core.Tracer) for v in vals):
      return
    if any(not _numeric(v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype)
           for v in vals) or \
        not _numeric(self.g.avals[node.outs[0]].dtype):
      return  # PRNG keys and other extended dtypes pass through untouched
    if node.prim.name in _primitives.SHAPE | _primitives.IDENTITY and np.size(vals[0]) == 1:
      # a broadcast of one number (Flax's zero mean of an RMSNorm): that number, any shape
      self.consts[node.outs[0]] = np.asarray(vals[0]).reshape(()).astype(
          self.g.avals[node.outs[0]].dtype)
      return
    if math.prod(self.g.avals[node.outs[0]].shape) != 1:
      return  # scalars only: an array computed from constants stays a parameter
    try:
      with jax.ensure_compile_time_eval():
        out = _graph.bind(node, vals)[0]
    except (TypeError, ValueError, NotImplementedError):
      return
    if not isinstance(out, jax.core.Tracer):
      self.consts[node.outs[0]] = np.asarray(out)

  def step(self, i: int) -> None:
    node = self.g.nodes[i]
    if not any(self._symbolic(r) for r in node.ins):
      self._fold(node)
      return
    out = None
    blocked = any(not isinstance(r, Lit) and (r in self.opaque or r in self.final)
                  for r in node.ins)
    layout = None
    if not blocked and len(node.outs) == 1:
      layout = self._layout_of(node)
      if layout is not None:
        self._cur = layout
        out = self._rule(node)
    o = node.outs[0] if node.outs else None
    if out is None:
      self.opaque.update(node.outs)
      return
    shape = tuple(self.g.avals[o].shape)
    if not self._valid(layout, shape, X in _syms(out)):
      self.opaque.add(o)
      return
    self.vals[o] = out
    self.layout[o] = layout
    if node.prim.name == "convert_element_type" and not isinstance(node.ins[0], Lit):
      src, dst = self.g.avals[node.ins[0]].dtype, self.g.avals[o].dtype
      if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
        self.opaque.add(o)
        self.vals.pop(o)
        return
      # Past a narrowing cast JAX's own backward rounds the cotangent to the narrow dtype;
      # a norm that swallowed the cast would not, so the norm's output is the cast.
      if jnp.finfo(dst).nmant < jnp.finfo(src).nmant and X in _syms(out):
        self.final.add(o)

  def _rule(self, node) -> dict | None:  # pylint: disable=too-many-return-statements,too-many-branches
    name, ins = node.prim.name, node.ins
    vals = [self._value(r) for r in ins]
    if name in _primitives.IDENTITY or name in _primitives.SHAPE or name == "transpose":
      return vals[0]
    if name == "select_n":
      pred = ins[0]
      if not isinstance(pred, Lit) and pred in self.consts:
        pred = Lit(self.consts[pred])
      if isinstance(pred, Lit) and np.ndim(pred.val) == 0 and not isinstance(pred.val, jax.core.Tracer):
        return vals[1 + int(np.asarray(pred.val))]
      return None
    if any(v is None for v in vals):
      return None
    if name == "neg":
      return _scale(vals[0], -1.0)
    if name in ("add", "sub"):
      return _add(vals[0], vals[1], 1.0 if name == "add" else -1.0)
    if name == "mul":
      return _mul(vals[0], vals[1])
    if name == "square":
      return _mul(vals[0], vals[0])
    if name == "integer_pow":
      return self._pow(vals[0], node.params["y"])
    if name == "pow":
      e = ins[1]
      if not isinstance(e, Lit) or np.ndim(e.val) != 0:
        return None
      return self._pow(vals[0], float(np.asarray(e.val)))
    if name == "div":
      inv = self._pow(vals[1], -1)
      return None if inv is None else _mul(vals[0], inv)
    if name == "rsqrt":
      r = self._radical(vals[0])
      return None if r is None else {((r, 1),): 1.0}
    if name == "sqrt":
      r = self._radical(vals[0])
      return None if r is None else {((r, -1),): 1.0}
    if name == "max":  # a clip of a row statistic at a constant below it (the variance at 0)
      a, b = vals  # or a floor above 0: the symbol max(p, c)
      for v, c in ((a, b), (b, a)):
        if not (X in _syms(v)) and set(c) <= {()} and _syms(v):
          if c.get((), 0.0) <= 0.0:
            return v
          if all(_is_row(s) for s in _syms(v)):
            return self._floor(v, c[()])
      return None
    if name == "reduce_sum":  # over the reduced axes: checked by its layout
      return self._sum(vals[0])
    return None

  def _pow(self, p: dict, y: float) -> dict | None:
    if y == -1 and len(p) > 1:
      return self._reciprocal(p)
    if float(y).is_integer():
      return _power(p, int(y))
    if y == -0.5:
      r = self._radical(p)
      return None if r is None else {((r, 1),): 1.0}
    if y == 0.5:
      r = self._radical(p)
      return None if r is None else {((r, -1),): 1.0}
    return None

  def _sum(self, p: dict) -> dict | None:
    out: dict = {}
    for m, c in p.items():
      d = dict(m)
      k = d.pop(X, 0)
      if any(not _is_row(s) for s in d):
        return None  # a sum over a parameter: not a statistic of x
      rest = tuple(sorted(d.items()))
      if k == 0:
        out = _add(out, {rest: c * self.n})
      elif k in (1, 2):
        out = _add(out, {_mono(*rest, (M1 if k == 1 else M2, 1)): c * self.n})
      else:
        return None
    return out

  # -- the norm test
  def _std_plus_eps(self, q) -> tuple | None:
    """``(radical r, a, e)`` where ``1 / q = a * r^-1 + e`` (``a > 0``): a standard deviation
    (``r``'s definition free of constants) scaled by ``a``, plus ``e``; else None."""
    definition = self.defs["q"][q[1]]
    e = definition.get((), 0.0)
    rest = [(m, c) for m, c in definition.items() if m != ()]
    if len(rest) != 1 or len(rest[0][0]) != 1:
      return None
    ((r, power),), a = rest[0]
    if r[0] != "r" or power != -1 or not a > 0.0 or self.defs["r"][r[1]].get((), 0.0):
      return None
    return r, a, e

  def _statistic(self, symbol, power: int) -> tuple | None:
    """``(mode, var, unit, eps)`` of the row symbol a norm's output is ``x`` times (to
    ``power``): ``var`` the row polynomial its variance is (a constant factor included),
    ``unit`` the factor that statistic comes with and ``eps`` the constant, for ``mode``
    (:attr:`NormMatch.eps_mode`) "var" ``(unit var + eps)^-1/2``, "std" ``1 / (unit
    sqrt(var) + eps)``, "floor_var" ``(unit max(var, eps))^-1/2`` and "floor_std" ``1 /
    max(unit sqrt(var), eps)``; None for anything else."""
    kind = symbol[0]
    if kind == "r" and power == 1:
      definition = self.defs["r"][symbol[1]]
      (m, unit), = definition.items() if len(definition) == 1 else ((None, 0.0),)
      if m is not None and len(m) == 1 and m[0][0][0] == "f" and m[0][1] == 1 and unit > 0:
        var, eps = self.defs["f"][m[0][0][1]]
        return "floor_var", var, unit, eps
      return "var", {k: c for k, c in definition.items() if k != ()}, 1.0, \
          definition.get((), 0.0)
    if kind == "q" and power == 1:
      found = self._std_plus_eps(symbol)
      if found is None:
        return None
      r, unit, eps = found
      return "std", self.defs["r"][r[1]], unit, eps
    if kind == "f" and power == -1:
      inner, eps = self.defs["f"][symbol[1]]
      if len(inner) != 1:
        return None
      (m, unit), = inner.items()
      if len(m) != 1 or m[0][0][0] != "r" or m[0][1] != -1 or not unit > 0:
        return None
      definition = self.defs["r"][m[0][0][1]]
      if definition.get((), 0.0):
        return None
      return "floor_std", definition, unit, eps
    return None

  def norm(self, p: dict) -> tuple | None:
    """``(rms, eps, scale, bias, eps_mode)`` when ``p`` is a norm's output polynomial (see
    :attr:`NormMatch.eps_mode`), else None."""
    parts = _by_x_power(p)
    if set(parts) - {0, 1} or 1 not in parts:
      return None
    lin, free = parts[1], parts.get(0, {})
    rows = {(s, e) for m in lin for s, e in m if _is_row(s)}
    if len(rows) != 1:
      return None
    ((symbol, power),) = rows
    scale: dict = {}
    for m, c in lin.items():
      d = dict(m)
      if d.pop(symbol, 0) != power or any(_is_row(s) for s in d):
        return None
      scale[tuple(sorted(d.items()))] = c
    found = self._statistic(symbol, power)
    if found is None:
      return None
    mode, var, unit, eps = found
    m1sq = _mono((M1, 2))
    # the statistic up to a constant factor k > 0 (a sum of squares, jnp.linalg.norm's, is
    # k = n times their mean): x * rsqrt(k var + eps) is the norm of epsilon eps / k, its
    # scale times k ** -1/2
    k = var.get(((M2, 1),), 0.0)
    if not k > 0.0:
      return None
    if _close(var, {((M2, 1),): k}):
      rms = True
    elif _close(var, {((M2, 1),): k, m1sq: -k}):
      rms = False
    else:
      return None
    if not eps >= 0.0:
      return None
    centre = {} if rms else _mul({_mono((M1, 1), (symbol, power)): -1.0}, scale)
    if centre is None:
      return None
    bias = _add(free, centre, -1.0)
    if any(_is_row(s) for s in _syms(bias)):
      return None
    if mode in ("std", "floor_std"):  # 1 / (a sqrt(k var) + e) = (std + e / a')^-1 / a'
      unit = unit * k ** 0.5
      return rms, float(eps) / unit, _scale(scale, 1.0 / unit), bias, mode
    # (unit (k var + e))^-1/2 = (var + e / k)^-1/2 (unit k)^-1/2, and so with a floor
    return rms, float(eps) / k, _scale(scale, (unit * k) ** -0.5), bias, mode


def _close(a: dict, b: dict) -> bool:
  if set(a) != set(b):
    return False
  return all(abs(a[m] - b[m]) <= _REL_TOL * max(1.0, abs(b[m])) for m in a)


# ------------------------------------------------------------------------------ search


def _candidates(g: _graph.Graph) -> list:
  """``(x, axes)`` per statistic: the value a ``reduce_sum`` reads, traced back through
  casts, squares and centring to the tensor it is computed from."""
  out = []
  for n in g.nodes:
    if n.prim.name != "reduce_sum":
      continue
    if not jnp.issubdtype(_dtype(g, n.ins[0]), jnp.floating):
      continue
    ref, shape = n.ins[0], tuple(_shape(g, n.ins[0]))
    for _ in range(6):
      if isinstance(ref, Lit) or ref not in g.producer:
        break
      p = g.nodes[g.producer[ref][0]]
      nxt = p.ins[0]
      if p.prim.name not in _primitives.SQUARES or tuple(_shape(g, nxt)) != shape:
        break
      if p.prim.name == "mul" and p.ins[0] != p.ins[1]:
        break
      if p.prim.name == "convert_element_type" and not (
          jnp.issubdtype(_dtype(g, nxt), jnp.floating)
          and jnp.finfo(_dtype(g, nxt)).nmant < jnp.finfo(_dtype(g, ref)).nmant):
        break  # only through an upcast for the statistics: a downcast is where x begins
      ref = nxt
    key = (ref, tuple(sorted(int(a) for a in n.params["axes"])))
    if not any(k[0] is key[0] and k[1] == key[1] for k in out):
      out.append(key)
  return out


def _shape(g: _graph.Graph, ref) -> tuple:
  return tuple(np.shape(ref.val)) if isinstance(ref, Lit) else tuple(g.avals[ref].shape)


def _dtype(g: _graph.Graph, ref):
  return np.asarray(ref.val).dtype if isinstance(ref, Lit) else g.avals[ref].dtype


def find_norms(g: _graph.Graph, claimed: set, outvars: set) -> tuple[list, list]:
  """The norms of ``g`` not overlapping ``claimed``: ``(matches, left_alone)``, the latter
  ``(radical node indices, why)`` for statistics whose normalized output is not converted."""
  matches, left, taken = [], [], set(claimed)
  pending = []  # (radical node indices, why) per candidate, reported once all are matched
  for x, axes in _candidates(g):
    a = _Analysis(g, x, axes)
    start = g.producer[x][0] + 1 if not isinstance(x, Lit) and x in g.producer else 0
    for i in range(start, len(g.nodes)):
      a.step(i)
    found = [(o, a.norm(v)) for o, v in a.vals.items() if X in _syms(v)]
    found = [(o, f) for o, f in found if f is not None
             and jnp.issubdtype(g.avals[o].dtype, jnp.floating)]
    # the radicals of this x's own statistics (not those of later norms computed from it)
    radicals = [i for i in range(start, len(g.nodes))
                if g.nodes[i].prim.name in _primitives.RADICALS
                and g.nodes[i].outs and g.nodes[i].outs[0] in a.vals
                and any(s[0] == "r" for s in _syms(a.vals[g.nodes[i].outs[0]]))]
    if not found:
      pending.append((radicals, None))
      continue
    found.sort(key=lambda t: -g.producer[t[0]][0])
    reason = None
    for o, (rms, eps, scale, bias, mode) in found:  # several norms may read one x (NeoX)
      root, root_out = g.producer[o]
      if root in taken:
        continue  # an intermediate value of a norm already found
      member = lambda r: r is not x and (r in a.vals or r in a.opaque)  # noqa: E731
      nodes = _graph.ancestors(g, root, member)
      chains = sorted({j for _, (_, chain), _ in a.params for j in chain}, reverse=True)
      inside = set(nodes)
      # a parameter's broadcast goes inside when only the region reads it (last node first)
      for j in chains:
        if all(c in inside or c == j for c in g.consumers.get(g.nodes[j].outs[0], ())):
          inside.add(j)
      if inside & taken:
        reason = reason or "it overlaps another conversion"
        continue
      if _match.escapes(g, inside, o, outvars):
        reason = reason or "its statistics escape (an intermediate value is also used elsewhere)"
        continue
      nodes = sorted(inside)
      produced = {k for j in nodes for k in g.nodes[j].outs}
      inputs = [x]
      for j in nodes:
        for r in g.nodes[j].ins:
          if not isinstance(r, Lit) and r not in produced and r not in inputs[1:] and r is not x:
            inputs.append(r)
      params = []
      for _, (source, chain), use in a.params:
        if isinstance(source, Lit):
          params.append(("const", source.val, use))
        else:  # from the deepest value of the chain that the region takes as an input
          refs = [source] + [g.nodes[j].outs[0] for j in chain]
          start_at = next((k for k in range(len(refs)) if refs[k] in inputs
                           and all(j in inside for j in chain[k:])), None)
          params.append(None if start_at is None else
                        (inputs.index(refs[start_at]), list(chain[start_at:]), use))
      used = _syms(scale) | _syms(bias)
      if any(params[s[1]] is None for s in used):
        reason = reason or "a parameter is computed inside the normalization"
        continue
      full = [g.avals[o2] for j in nodes for o2 in g.nodes[j].outs
               if o2 in a.vals and X in _syms(a.vals[o2])]
      store = min((av.dtype for av in full), key=lambda d: jnp.finfo(d).nmant)
      matches.append(NormMatch(rms, eps, a.axes, nodes, root, root_out, inputs, params,
                               scale, bias, store, a.layout[o], mode))
      taken.update(nodes)
    if not radicals and reason and not any(m.inputs[0] is x for m in matches):
      left.append(([g.producer[found[0][0]][0]], reason))
    pending.append((radicals, reason))
  # radicals no norm took (a later candidate's match may take a radical an earlier one saw)
  reported: set = set()
  for radicals, reason in pending:
    uncovered = [i for i in radicals if i not in taken and i not in reported]
    reported.update(uncovered)
    if uncovered:
      left.append((uncovered, reason or "its statistics are not a LayerNorm's or an "
                   "RMSNorm's (x - mean or x, scaled by the matching rsqrt)"))
  return matches, left


# ------------------------------------------------------------------------ evaluation
def evaluate_poly(p: dict, symbols: list, like) -> Any:
  """``p`` evaluated with parameter symbol ``i`` = ``symbols[i]`` (in ``like``'s dtype)."""
  total = None
  for m, c in p.items():
    term = jnp.asarray(c, like.dtype)
    for (kind, i), e in m:
      assert kind == "c", kind
      term = term * symbols[i].astype(like.dtype) ** e
    total = term if total is None else total + term
  return jnp.zeros((), like.dtype) if total is None else total


# ---------------------------------------------------------------------------- softmax
@dataclasses.dataclass
class SoftmaxMatch:
  """A softmax found by its algebra: ``p = e / sum_A(e)`` with ``e = exp(u - k)`` and ``k``
  constant along ``A`` (any shift cancels, so ``k`` may be a max computed elsewhere, behind
  transposes, or absent).  ``inputs``: ``[u]`` or ``[u, k]``."""
  axes: tuple
  nodes: list
  root: int
  root_out: int
  inputs: list

  public = "softmax"

  @property
  def name(self) -> str:
    return f"softmax by its algebra (axes {self.axes})"


def _through(g: _graph.Graph, ref, prims) -> tuple:
  """``(source, nodes)``: ``ref`` followed back through unary ``prims``."""
  nodes = []
  while not isinstance(ref, Lit) and ref in g.producer:
    i = g.producer[ref][0]
    n = g.nodes[i]
    ins = [r for r in n.ins if not isinstance(r, Lit)]
    if n.prim.name not in prims or len(ins) != 1:
      break
    nodes.append(i)
    ref = ins[0]
  return ref, nodes


def _masked(g: _graph.Graph, ref, fill: float) -> tuple | None:
  """``(mask, value, nodes)`` when ``ref`` is ``where(mask, value, fill)`` (``select_n(mask,
  fill, value)``, the fill a literal broadcast and cast), else None.  ``mask``: ``(source,
  spread)``, the mask followed back through the broadcasts each ``where`` makes of it (a
  causal mask [T, T] over [B, H, T, T]) and how they spread it (compared by
  :func:`_same_mask`); ``nodes`` include those broadcasts."""
  if isinstance(ref, Lit) or ref not in g.producer:
    return None
  i = g.producer[ref][0]
  n = g.nodes[i]
  if n.prim.name != "select_n" or len(n.ins) != 3 or isinstance(n.ins[2], Lit) or (
      np.asarray(n.ins[0].val).dtype if isinstance(n.ins[0], Lit)
      else g.avals[n.ins[0]].dtype) != np.bool_:
    return None
  const, chain = n.ins[1], []
  while not isinstance(const, Lit) and const in g.producer and len(g.nodes[
      g.producer[const][0]].ins) == 1 and g.nodes[g.producer[const][0]].prim.name in (
          "broadcast_in_dim", "convert_element_type"):
    chain.append(g.producer[const][0])
    const = g.nodes[chain[-1]].ins[0]
  if not isinstance(const, Lit) or np.size(const.val) != 1:
    return None
  if float(np.asarray(const.val).reshape(())) != fill:  # (-inf == -inf)
    return None
  mask, spread = n.ins[0], []
  while (not isinstance(mask, Lit) and mask in g.producer
         and g.nodes[g.producer[mask][0]].prim.name == "broadcast_in_dim"
         and len(g.nodes[g.producer[mask][0]].ins) == 1):
    spread.append(g.producer[mask][0])
    mask = g.nodes[spread[-1]].ins[0]
  how = tuple((tuple(g.nodes[b].params["broadcast_dimensions"]),
               tuple(g.avals[g.nodes[b].outs[0]].shape)) for b in spread)
  return (mask, how), n.ins[2], [i, *chain, *spread]


def _same_mask(a: tuple, b: tuple) -> bool:
  """Two masks of :func:`_masked`: the same source spread the same way."""
  return _same(a[0], b[0]) and a[1] == b[1]


def _same(a, b) -> bool:
  """The same program value, or the same constant array."""
  return a is b or (isinstance(a, Lit) and isinstance(b, Lit) and a.val is b.val)


def _widens(g: _graph.Graph, node) -> bool:
  """A cast to a floating dtype at least as precise as its input's."""
  src, dst = _dtype(g, node.ins[0]), g.avals[node.outs[0]].dtype
  return (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
          and jnp.finfo(dst).nmant >= jnp.finfo(src).nmant)


def find_softmaxes(g: _graph.Graph, claimed: set, outvars: set) -> tuple[list, list]:
  """The softmaxes of ``g`` written as ``exp(u - k) / sum(exp(u - k))`` over any axes:
  ``(matches, left_alone)``, the latter ``([exp node index], why)``."""
  matches, left, taken = [], [], set(claimed)
  for di, node in enumerate(g.nodes):
    if node.prim.name != "div" or any(isinstance(r, Lit) for r in node.ins):
      continue
    e, d = node.ins
    if e not in g.producer or g.nodes[g.producer[e][0]].prim.name != "exp":
      continue
    # the sum may be taken in a wider dtype (jax.nn.softmax sums bfloat16 in float32) and
    # cast back for the division
    s, chain = _through(g, d, ("broadcast_in_dim", "reshape", "expand_dims",
                               "convert_element_type"))
    if s not in g.producer or g.nodes[g.producer[s][0]].prim.name != "reduce_sum":
      continue
    si = g.producer[s][0]
    summed, up = _through(g, g.nodes[si].ins[0], ("convert_element_type",))
    where = None
    if summed != e:  # jax.nn.softmax(where=mask): the sum of the exponentials under the mask
      where = _masked(g, summed, 0.0)
      widened = _through(g, where[1], ("convert_element_type",)) if where else (None, [])
      if widened[0] != e:
        continue
      up = up + widened[1]
    if any(not _widens(g, g.nodes[j]) for j in up):
      continue
    chain = chain + up + (where[2] if where is not None else [])
    axes = tuple(sorted(int(a) for a in g.nodes[si].params["axes"]))
    shape = tuple(g.avals[e].shape)
    if tuple(g.avals[d].shape) != tuple(1 if i in axes else n for i, n in enumerate(shape)) \
        and tuple(g.avals[d].shape) != shape:
      continue
    ei = g.producer[e][0]
    v = g.nodes[ei].ins[0]
    nodes = [ei, si, *chain, di]
    inputs = [v]
    if not isinstance(v, Lit) and v in g.producer and g.nodes[g.producer[v][0]].prim.name == "sub":
      ui = g.producer[v][0]
      u, k = g.nodes[ui].ins
      kshape = tuple(g.avals[k].shape) if not isinstance(k, Lit) else ()
      if (not isinstance(u, Lit) and len(kshape) in (0, len(shape))
          and all(kshape[a] == 1 for a in axes if kshape)):
        nodes.append(ui)
        inputs = [u] + ([k] if not isinstance(k, Lit) else [])
    if isinstance(inputs[0], Lit) or not jnp.issubdtype(g.avals[e].dtype, jnp.floating):
      continue
    root, out = di, node.outs[0]
    if where is not None:
      # a masked softmax is one where the masked exponentials are 0 (their inputs -inf, as
      # jax.nn.softmax(where=) sets them): then the sum under the mask is the whole sum
      masked_in = _masked(g, inputs[0], -np.inf)
      if masked_in is None or not _same_mask(masked_in[0], where[0]):
        continue
      if not isinstance(where[0][0], Lit):
        inputs.append(where[0][0])
      after = list(g.consumers.get(out, ()))
      final = _masked(g, g.nodes[after[0]].outs[0], 0.0) if len(after) == 1 else None
      if final is not None and _same_mask(final[0], where[0]) and final[1] == out:
        root, out = after[0], g.nodes[after[0]].outs[0]  # where(mask, p, 0): kept instead
        nodes += [after[0], *final[2]]
    nodes = sorted(set(nodes))
    if set(nodes) & taken:
      continue
    if _match.escapes(g, set(nodes), out, outvars):
      left.append(([ei], "its exponentials or their sum are also used elsewhere"))
      continue
    matches.append(SoftmaxMatch(axes, nodes, root, 0, inputs))
    taken.update(nodes)
  return matches, left


# --------------------------------------------------------------------------- layouts
def to_x(v, layout: tuple, ndim: int):
  """``v``, an array (or a broadcastable one) in ``layout``, in the layout of ``x`` (rank
  ``ndim``; axes ``v`` does not run along have size 1)."""
  v = jnp.reshape(v, (1,) * (len(layout) - jnp.ndim(v)) + tuple(jnp.shape(v)))
  keep = [i for i, a in enumerate(layout) if a is not None]
  v = jnp.reshape(v, tuple(jnp.shape(v)[i] for i in keep))
  axes = [layout[i] for i in keep]
  v = jnp.transpose(v, sorted(range(len(axes)), key=lambda k: axes[k]))
  shape = [1] * ndim
  for a, d in zip(sorted(axes), jnp.shape(v)):
    shape[a] = d
  return jnp.reshape(v, tuple(shape))


def from_x(v, layout: tuple, shape: tuple):
  """``v``, an array in the layout of ``x``, in ``layout`` with ``shape`` (the inverse of
  :func:`to_x` for a full-size value)."""
  keep = [a for a in layout if a is not None]
  rest = [a for a in range(jnp.ndim(v)) if a not in keep]
  return jnp.reshape(jnp.transpose(v, keep + rest), shape)
