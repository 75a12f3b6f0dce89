"""The norms' algebra: the symbolic values of everything computed from a statistic's input
``x`` (:class:`Analysis`), polynomials over ``x``, its row moments and row symbols
(:mod:`._polynomial`), each equation by its primitive's rule (:mod:`._algebra_rules`), the
layouts values run in, and the norm test (:func:`norm_of`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _algebra_rules
from invact_jax.convert import graph as _graph
from invact_jax.convert import _polynomial
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit

__all__ = ["Analysis", "norm_of", "numeric", "shape_of", "dtype_of"]


def numeric(dtype) -> bool:
  """A NumPy-representable number type (not a PRNG key or another extended dtype)."""
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def shape_of(g: _graph.Graph, ref) -> tuple:
  return tuple(np.shape(ref.val)) if isinstance(ref, Lit) else tuple(g.avals[ref].shape)


def dtype_of(g: _graph.Graph, ref):
  return np.asarray(ref.val).dtype if isinstance(ref, Lit) else g.avals[ref].dtype


class Analysis:
  """The symbolic values of everything computed from ``x`` (one candidate ``x``, ``axes``)."""

  def __init__(self, graph: _graph.Graph, x, axes: tuple):
    self.g, self.x, self.axes = graph, x, tuple(sorted(int(a) for a in axes))
    self.shape = tuple(shape_of(graph, x))
    self.n = math.prod(self.shape[a] for a in self.axes)
    self.vals: dict = {x: {((_polynomial.X, 1),): 1.0}}
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

  def symbol(self, kind: str, p: dict, c: float | None = None) -> tuple | None:
    """The row symbol of ``kind`` (see ``self.defs``) of the row polynomial ``p`` (and the
    floor ``c``), the same for the same definition; None where ``p`` is not a row
    polynomial."""
    if any(not _polynomial.is_row(s) for s in _polynomial.syms(p)):
      return None
    key = (kind, tuple(sorted((m, round(v, 12)) for m, v in p.items())),
           None if c is None else round(c, 12))
    if key not in self.symbols:
      self.symbols[key] = (kind, len(self.defs[kind]))
      self.defs[kind].append(p if c is None else (p, c))
    return self.symbols[key]

  def radical(self, p: dict) -> tuple | None:
    """The symbol ``r`` with ``r = p^(-1/2)`` for a row polynomial ``p``."""
    return self.symbol("r", p)

  def reciprocal(self, p: dict) -> dict | None:
    """``{q: 1}``, the symbol ``q = 1 / p`` of a row polynomial ``p`` of several terms (a
    standard deviation plus epsilon, ``sqrt(var) + eps``)."""
    q = self.symbol("q", p)
    return None if q is None else {((q, 1),): 1.0}

  def floor(self, p: dict, c: float) -> dict:
    """``{f: 1}``, the symbol ``f = max(p, c)`` of a row polynomial ``p`` and a constant
    ``c > 0`` (a variance or norm kept from falling below ``c``)."""
    return {((self.symbol("f", p, c), 1),): 1.0}

  def value(self, ref):
    if ref is self.x or (not isinstance(ref, Lit) and ref in self.vals):
      return self.vals[ref]
    return param_of(self, ref)

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
    if any(not numeric(v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype)
           for v in vals) or \
        not numeric(self.g.avals[node.outs[0]].dtype):
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
      layout = layout_of(self, node)
      if layout is not None:
        self._cur = layout
        out = self._rule(node)
    o = node.outs[0] if node.outs else None
    if out is None:
      self.opaque.update(node.outs)
      return
    shape = tuple(self.g.avals[o].shape)
    if not self._valid(layout, shape, _polynomial.X in _polynomial.syms(out)):
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
      if jnp.finfo(dst).nmant < jnp.finfo(src).nmant and _polynomial.X in _polynomial.syms(out):
        self.final.add(o)

  def _rule(self, node) -> dict | None:
    """The symbolic value of ``node``'s output by its primitive's rule
    (:data:`._algebra_rules.RULES`), or None."""
    rule = _algebra_rules.RULES.get(node.prim.name)
    if rule is None:
      return None
    vals = [self.value(r) for r in node.ins]
    if node.prim.name not in _algebra_rules.TAKES_UNKNOWN and any(v is None for v in vals):
      return None
    return rule(self, node, vals)


def layout_of(an, node) -> tuple | None:  # pylint: disable=too-many-return-statements
  """The layout of ``node``'s output from its symbolic operands' layouts, or None."""
  name = node.prim.name
  out_shape = tuple(an.g.avals[node.outs[0]].shape)
  ins = [r for r in node.ins if r is an.x or (not isinstance(r, Lit) and r in an.vals)]
  layouts = [an.layout[r] for r in ins]
  if not layouts:
    return None
  m = layouts[0]
  if name == "reduce_sum":
    red = [int(a) for a in node.params["axes"]]
    if {m[i] for i in red} != set(an.axes) or len(red) != len(an.axes):
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
        options = [a for a in an.axes if an.shape[a] == d and a not in out]
        if len(options) != 1:
          return None
        out[i] = options[0]
    return tuple(out)
  if name in ("reshape", "squeeze", "expand_dims"):
    src = tuple(shape_of(an.g, ins[0]))
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
    shape = tuple(shape_of(an.g, r))
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
    if d != 1 and (out[i] is None or an.shape[out[i]] != d):
      options = [a for a in an.axes if an.shape[a] == d and a not in out]
      if out[i] is not None or len(options) != 1:
        return None
      out[i] = options[0]
  return tuple(out)


def column_chain(an, ref):
  """``(source, nodes)``: the parameter ``ref``, read in the current node's layout, is (a
  reshape, broadcast or cast of) the value ``source``, constant across rows; None when it
  varies across rows.  The reduced axes are followed through each step."""
  if isinstance(ref, Lit):
    return None
  layout = an._cur
  shape = tuple(an.g.avals[ref].shape)
  if len(shape) > len(layout):
    return None
  offset = len(layout) - len(shape)
  axes = {i - offset for i in range(offset, len(layout)) if layout[i] in an.axes}
  ok = all(d == 1 or i in axes for i, d in enumerate(shape))
  nodes = []
  for _ in range(8):
    if ref not in an.g.producer:
      break
    i, _ = an.g.producer[ref]
    node = an.g.nodes[i]
    ins = [r for r in node.ins if not isinstance(r, Lit)]
    name = node.prim.name
    if name not in ("broadcast_in_dim", "convert_element_type", "reshape") or len(ins) != 1:
      break
    src = tuple(an.g.avals[ins[0]].shape)
    out = tuple(an.g.avals[ref].shape)
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


def param_of(an, ref) -> dict | None:
  """The parameter symbol of an outside value (a column constant), or a constant."""
  if not isinstance(ref, Lit) and ref in an.consts:
    ref = Lit(an.consts[ref])
  if isinstance(ref, Lit):
    v = np.asarray(ref.val)
    if v.ndim == 0 or v.size == 1:
      return _polynomial.const(float(v.reshape(())))
    layout = an._cur
    offset = len(layout) - v.ndim
    if offset < 0 or any(d != 1 and layout[i + offset] not in an.axes
                         for i, d in enumerate(v.shape)):
      return None
    # one symbol per constant array, however many literals of it the program holds
    key = ("lit", v.shape, v.dtype.str, v.tobytes()) if v.size <= 1 << 16 else ("lit", id(ref.val))
    if key not in an.param_ids:  # a constant array (a closed-over weight): its value
      an.param_ids[key] = len(an.params)
      an.params.append((ref, (ref, []), layout))
    return {((("c", an.param_ids[key]), 1),): 1.0}
  folded = literal_spread(an, ref)
  if folded is not None:
    return param_of(an, folded)
  chain = column_chain(an, ref)
  if chain is None:
    return None
  key = chain[0]  # one symbol per parameter, however many broadcasts of it the code makes
  if key not in an.param_ids:
    an.param_ids[key] = len(an.params)
    an.params.append((ref, chain, an._cur))
  return {((("c", an.param_ids[key]), 1),): 1.0}


def literal_spread(an, ref) -> Lit | None:
  """A constant array spread by broadcasts, casts and reshapes (a closed-over scale): the
  constant in the broadcasts' output rank with size-1 axes where they spread it, so one
  constant is one parameter symbol however many times the program broadcasts it."""
  nodes = []
  while not isinstance(ref, Lit) and ref in an.g.producer:
    node = an.g.nodes[an.g.producer[ref][0]]
    if node.prim.name not in ("broadcast_in_dim", "convert_element_type", "reshape") \
        or len(node.ins) != 1:
      return None
    nodes.insert(0, node)
    ref = node.ins[0]
  if not nodes or not isinstance(ref, Lit) or isinstance(ref.val, jax.core.Tracer):
    return None
  v, spread = np.asarray(ref.val), False
  for node in nodes:
    out = an.g.avals[node.outs[0]]
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


def std_plus_eps(an, q) -> tuple | None:
  """``(radical r, a, e)`` where ``1 / q = a * r^-1 + e`` (``a > 0``): a standard deviation
  (``r``'s definition free of constants) scaled by ``a``, plus ``e``; else None."""
  definition = an.defs["q"][q[1]]
  e = definition.get((), 0.0)
  rest = [(m, c) for m, c in definition.items() if m != ()]
  if len(rest) != 1 or len(rest[0][0]) != 1:
    return None
  ((r, power),), a = rest[0]
  if r[0] != "r" or power != -1 or not a > 0.0 or an.defs["r"][r[1]].get((), 0.0):
    return None
  return r, a, e


def statistic(an, symbol, power: int) -> tuple | None:
  """``(mode, var, unit, eps)`` of the row symbol a norm's output is ``x`` times (to
  ``power``): ``var`` the row polynomial its variance is (a constant factor included),
  ``unit`` the factor that statistic comes with and ``eps`` the constant, for ``mode``
  (:attr:`NormMatch.eps_mode`) "var" ``(unit var + eps)^-1/2``, "std" ``1 / (unit
  sqrt(var) + eps)``, "floor_var" ``(unit max(var, eps))^-1/2`` and "floor_std" ``1 /
  max(unit sqrt(var), eps)``; None for anything else."""
  kind = symbol[0]
  if kind == "r" and power == 1:
    definition = an.defs["r"][symbol[1]]
    (m, unit), = definition.items() if len(definition) == 1 else ((None, 0.0),)
    if m is not None and len(m) == 1 and m[0][0][0] == "f" and m[0][1] == 1 and unit > 0:
      var, eps = an.defs["f"][m[0][0][1]]
      return "floor_var", var, unit, eps
    return "var", {k: c for k, c in definition.items() if k != ()}, 1.0, \
        definition.get((), 0.0)
  if kind == "q" and power == 1:
    found = std_plus_eps(an, symbol)
    if found is None:
      return None
    r, unit, eps = found
    return "std", an.defs["r"][r[1]], unit, eps
  if kind == "f" and power == -1:
    inner, eps = an.defs["f"][symbol[1]]
    if len(inner) != 1:
      return None
    (m, unit), = inner.items()
    if len(m) != 1 or m[0][0][0] != "r" or m[0][1] != -1 or not unit > 0:
      return None
    definition = an.defs["r"][m[0][0][1]]
    if definition.get((), 0.0):
      return None
    return "floor_std", definition, unit, eps
  return None


def norm_of(an, p: dict) -> tuple | None:
  """``(rms, eps, scale, bias, eps_mode)`` when ``p`` is a norm's output polynomial (see
  :attr:`NormMatch.eps_mode`), else None."""
  parts = _polynomial.by_x_power(p)
  if set(parts) - {0, 1} or 1 not in parts:
    return None
  lin, free = parts[1], parts.get(0, {})
  rows = {(s, e) for m in lin for s, e in m if _polynomial.is_row(s)}
  if len(rows) != 1:
    return None
  ((symbol, power),) = rows
  scale: dict = {}
  for m, c in lin.items():
    d = dict(m)
    if d.pop(symbol, 0) != power or any(_polynomial.is_row(s) for s in d):
      return None
    scale[tuple(sorted(d.items()))] = c
  found = statistic(an, symbol, power)
  if found is None:
    return None
  mode, var, unit, eps = found
  m1sq = _polynomial.mono((_polynomial.M1, 2))
  # the statistic up to a constant factor k > 0 (a sum of squares, jnp.linalg.norm's, is
  # k = n times their mean): x * rsqrt(k var + eps) is the norm of epsilon eps / k, its
  # scale times k ** -1/2
  k = var.get(((_polynomial.M2, 1),), 0.0)
  if not k > 0.0:
    return None
  if _polynomial.close(var, {((_polynomial.M2, 1),): k}):
    rms = True
  elif _polynomial.close(var, {((_polynomial.M2, 1),): k, m1sq: -k}):
    rms = False
  else:
    return None
  if not eps >= 0.0:
    return None
  centre = {} if rms else _polynomial.mul(
      {_polynomial.mono((_polynomial.M1, 1), (symbol, power)): -1.0}, scale)
  if centre is None:
    return None
  bias = _polynomial.add(free, centre, -1.0)
  if any(_polynomial.is_row(s) for s in _polynomial.syms(bias)):
    return None
  if mode in ("std", "floor_std"):  # 1 / (a sqrt(k var) + e) = (std + e / a')^-1 / a'
    unit = unit * k ** 0.5
    return rms, float(eps) / unit, _polynomial.scale(scale, 1.0 / unit), bias, mode
  # (unit (k var + e))^-1/2 = (var + e / k)^-1/2 (unit k)^-1/2, and so with a floor
  return rms, float(eps) / k, _polynomial.scale(scale, (unit * k) ** -0.5), bias, mode
