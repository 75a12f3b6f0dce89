"""``invert(fn)``: the program-level conversion.

``fn`` is traced to a jaxpr; every activation, LayerNorm/RMSNorm and softmax in it is found
by its computation, whatever Python object the model called: activations (and
``jax.nn.softmax``'s ``custom_jvp`` call) as the equations of one of :data:`._forms.FORMS`
traced at the same shapes and dtypes; norms and softmaxes over any axes by their algebra
(:mod:`._algebra`).  Each match is then run as a ``jax.custom_vjp`` whose forward is the
*program's own equations* (so the forward output is bit for bit the unconverted one) and
whose residuals and backward are invact_jax's:

* activation: ``y`` (+ the packed branch bit), backward of the registry entry;
* norm: ``xhat`` (in the narrowest dtype the program normalized in) and the float32 ``rstd``
  of each row, plus the parameters;
* softmax: the probabilities.

The conversion enters nested ``jit`` (inlined when it carries no shardings), ``scan``,
``cond``, ``checkpoint`` (the body is re-wrapped with the user's policy) and ``shard_map``
(re-wrapped with its mesh and specs) bodies.  It leaves alone, and reports, what it cannot
rewrite soundly: a match whose intermediate values are also used elsewhere, and
``custom_jvp``/``custom_vjp`` functions (their own derivative rules) and ``while`` loops (no
reverse-mode derivative, so nothing to save) that contain candidate primitives.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _algebra
from invact_jax.convert import _cross_entropy
from invact_jax.convert import _forms
from invact_jax.convert import _fusion
from invact_jax.convert import _graph
from invact_jax.convert._graph import Lit
from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.activations import api as _act_api
from invact_jax.ops.activations import base as _act_base
from invact_jax.ops.activations import registry
from invact_jax.ops.cross_entropy import base as _ce_base
from invact_jax.ops.cross_entropy import in_forward as _ce_in_forward
from invact_jax.ops.norms import api as _norm_api
from invact_jax.ops.norms import base as _norm_base
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["invert", "ProgramReport"]

_COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or"})
# Primitives that suggest an op the conversion may have missed (reported when unclaimed).
_CANDIDATES = {"erf": "activation", "erfc": "activation", "logistic": "activation",
               "tanh": "activation", "rsqrt": "norm", "sqrt": "norm", "exp": "softmax"}
_KINDS = ("layer_norm", "rms_norm", "softmax", "linear_cross_entropy")
# Form kinds fallback="temp" may recompute from their input instead of leaving them alone.
_RECOMPUTABLE = frozenset({"activation", "scaled_silu"})
_FELL_BACK = ("inverting it raised the gradient's compiled temp above the unconverted "
              "program's (fallback='temp')")


@dataclasses.dataclass
class ProgramReport:
  """What one ``invert`` conversion did.

  Attributes:
    converted: ``(public name, form, where)`` per converted op, ``where`` the source line of
      the equation that produced its output.
    left_alone: ``(what, where, why)`` per candidate that was not converted.
    recomputed: ``(public name, where, why)`` per activation that ``fallback="temp"`` runs as
      ``jax.checkpoint`` of its own equations instead of inverting it: it keeps its input and
      recomputes its derivative in the backward.
  """
  converted: list = dataclasses.field(default_factory=list)
  left_alone: list = dataclasses.field(default_factory=list)
  recomputed: list = dataclasses.field(default_factory=list)

  @property
  def replaced(self) -> dict[str, int]:
    """Converted ops by invact_jax function name (``{"gelu": 12, "layer_norm": 25}``)."""
    return dict(collections.Counter(p for p, _, _ in self.converted))

  @property
  def forms(self) -> dict[str, int]:
    """Converted ops by the form they were recognized as."""
    return dict(collections.Counter(f for _, f, _ in self.converted))

  def __str__(self) -> str:
    if not self.converted:
      text = "invact_jax.invert: nothing was converted"
    else:
      text = "invact_jax.invert converted: " + ", ".join(
          f"{k} x{v}" for k, v in sorted(self.replaced.items()))
    for title, entries in (("recomputed from its input", self.recomputed),
                           ("left alone", self.left_alone)):
      if entries:
        groups = collections.Counter((w, y) for w, _, y in entries)
        text += f"; {title}: " + "; ".join(f"{w} x{n} ({y})" for (w, y), n in groups.items())
    return text


# --------------------------------------------------------------------------- patterns
@dataclasses.dataclass(frozen=True)
class _Pattern:
  form: _forms.Form
  graph: _graph.Graph
  root: int            # node index of the output's producer
  root_out: int        # which output of that node
  wild: dict           # id(Lit) -> sentinel name


@functools.lru_cache(maxsize=None)
def _pattern(form: _forms.Form, shape: tuple, xd: str, pd: str, od: str) -> _Pattern | None:
  fn = form.build(np.dtype(xd), np.dtype(pd), np.dtype(od))
  if fn is None:
    return None
  d = shape[-1] if shape else 1
  structs = [jax.ShapeDtypeStruct(shape, np.dtype(xd))] + [
      jax.ShapeDtypeStruct((d,), np.dtype(pd)) for _ in form.roles[1:]]
  try:
    closed = jax.make_jaxpr(fn)(*structs)
  except (TypeError, ValueError):  # a form not defined for these dtypes
    return None
  out = closed.out_avals
  if len(out) != 1 or out[0].shape != shape or out[0].dtype != np.dtype(od):
    return None
  g = _graph.flatten(closed)
  if isinstance(g.outvars[0], Lit) or g.outvars[0] not in g.producer:
    return None
  root, root_out = g.producer[g.outvars[0]]
  wild = {}
  sentinels = {k: _forms.SENTINELS[k] for k in form.params}
  for n in g.nodes:
    for r in n.ins:
      if (isinstance(r, Lit) and np.shape(r.val) == ()
          and jnp.issubdtype(np.dtype(r.dtype), jnp.floating)):
        for k, s in sentinels.items():
          if float(np.asarray(r.val)) == float(np.asarray(s, r.dtype)):
            wild[id(r)] = k
  return _Pattern(form, g, root, root_out, wild)


@functools.lru_cache(maxsize=None)
def _root_signature(form: _forms.Form, xd: str, pd: str, od: str):
  """The output equation's primitive and its inputs' primitives, from a small trace: a cheap
  test before the form is traced at a program's shapes."""
  pat = _pattern(form, (2, 8), xd, pd, od)
  return None if pat is None else _signature(pat.graph, pat.root)


def _signature(graph: _graph.Graph, i: int) -> tuple:
  def prim(r):
    if isinstance(r, Lit) or r not in graph.producer:
      return None
    return graph.nodes[graph.producer[r][0]].prim.name
  n = graph.nodes[i]
  return n.prim.name, frozenset(p for p in map(prim, n.ins) if p is not None)


# --------------------------------------------------------------------------- matching
class _State:
  __slots__ = ("v", "t", "nodes", "caught", "extra")

  def __init__(self):
    self.v, self.t, self.nodes, self.caught, self.extra = {}, {}, {}, {}, set()

  def copy(self):
    s = _State()
    s.v, s.t, s.nodes, s.caught = dict(self.v), dict(self.t), dict(self.nodes), dict(self.caught)
    s.extra = set(self.extra)
    return s

  def restore(self, other):
    self.v, self.t, self.nodes, self.caught = other.v, other.t, other.nodes, other.caught
    self.extra = other.extra


def _is_tracer(v) -> bool:
  return isinstance(v, jax.core.Tracer)


class _Matcher:
  def __init__(self, pat: _Pattern, target: _graph.Graph, claimed: set):
    self.p, self.g, self.claimed = pat, target, claimed
    self.pin = set(pat.graph.invars)

  def ref(self, pr, tr, st: _State) -> bool:
    P, T = self.p.graph, self.g
    if isinstance(pr, Lit):
      if not isinstance(tr, Lit):  # inside shard_map a literal arrives through pvary
        found = self._literal_through_casts(tr, st)
        if found is None:
          return False
        st.extra.update(found[0])
        tr = found[1]
      if _is_tracer(tr.val):
        return False
      name = self.p.wild.get(id(pr))
      if name is None:
        return pr.same(tr)
      if np.shape(tr.val) != () or np.dtype(tr.dtype) != np.dtype(pr.dtype):
        return False
      val = float(np.asarray(tr.val))
      if st.caught.setdefault(name, val) != val:
        return False
      return True
    if not isinstance(tr, Lit):  # inside shard_map: values cast to varying by pvary
      i = self.g.producer.get(tr, (None,))[0]
      if (i is not None and self.g.nodes[i].prim.name == "pvary" and len(self.g.nodes[i].ins) == 1
          and i not in self.claimed and i not in st.nodes.values()
          and not (pr in P.producer and P.nodes[P.producer[pr][0]].prim.name == "pvary")):
        st.extra.add(i)
        return self.ref(pr, self.g.nodes[i].ins[0], st)
    if pr in self.pin:  # an input of the form: a program variable or constant array
      if pr in st.v:
        return st.v[pr] is tr
      if tr in st.t:
        return False
      pa = P.avals[pr]
      ta = _aval(T, tr)
      if pa.shape != ta.shape or pa.dtype != ta.dtype:
        return False
      st.v[pr], st.t[tr] = tr, pr
      return True
    if isinstance(tr, Lit):
      return False
    if pr in st.v:
      return st.v[pr] == tr
    if tr in st.t:
      return False
    if tr not in T.producer:
      return False
    pi, pk = P.producer[pr]
    ti, tk = T.producer[tr]
    if pk != tk or ti in self.claimed or ti in st.nodes.values():
      return False
    return self.node(pi, ti, st, pr, tr)

  def _literal_through_casts(self, tr, st):
    """``(node indices, Lit)`` where ``tr`` is a literal made varying (``pvary``) and/or
    re-typed (``convert_element_type``) inside shard_map; None otherwise."""
    chain, dtype = [], None
    for _ in range(4):
      i = self.g.producer.get(tr, (None,))[0]
      if i is None or i in self.claimed or i in st.nodes.values():
        return None
      n = self.g.nodes[i]
      if n.prim.name not in ("pvary", "convert_element_type") or len(n.ins) != 1:
        return None
      chain.append(i)
      dtype = dtype or self.g.avals[n.outs[0]].dtype
      tr = n.ins[0]
      if isinstance(tr, Lit):
        return chain, Lit(np.asarray(tr.val).astype(dtype))
    return None

  def node(self, pi, ti, st, pr=None, tr=None) -> bool:
    pn, tn = self.p.graph.nodes[pi], self.g.nodes[ti]
    if (pn.prim.name != tn.prim.name or len(pn.ins) != len(tn.ins)
        or len(pn.outs) != len(tn.outs) or not _graph.params_equal(pn.params, tn.params)):
      return False
    for po, to in zip(pn.outs, tn.outs):
      st.v[po], st.t[to] = to, po
    st.nodes[pi] = ti
    saved = st.copy()
    if all(self.ref(a, b, st) for a, b in zip(pn.ins, tn.ins)):
      return True
    if pn.prim.name in _COMMUTATIVE and len(pn.ins) == 2:
      st.restore(saved)
      return all(self.ref(a, b, st) for a, b in zip(pn.ins, reversed(tn.ins)))
    return False


@dataclasses.dataclass
class _Match:
  pattern: _Pattern
  nodes: list          # target node indices (sorted)
  root: int
  inputs: list         # target refs, in the form's role order
  caught: dict


def _try(pat: _Pattern, target: _graph.Graph, ti: int, claimed: set) -> _Match | None:
  if len(target.nodes[ti].outs) <= pat.root_out:
    return None
  st = _State()
  if not _Matcher(pat, target, claimed).node(pat.root, ti, st):
    return None
  inputs = [st.v.get(v) for v in pat.graph.invars]
  if any(i is None for i in inputs):
    return None
  return _Match(pat, sorted(set(st.nodes.values()) | st.extra), ti, inputs, dict(st.caught))


def _escapes(match: _Match, target: _graph.Graph, outvars: set) -> bool:
  """An intermediate of the match is used outside it (then converting saves nothing and the
  values would have to be computed anyway): left alone."""
  return _algebra.escapes(target, set(match.nodes),
                          target.nodes[match.root].outs[match.pattern.root_out], outvars)


# ------------------------------------------------------------------------ replacements
def _aval(target: _graph.Graph, ref):
  return jax.typeof(ref.val) if isinstance(ref, Lit) else target.avals[ref]


def _region(target: _graph.Graph, match: _Match) -> Callable[..., Any]:
  """The program's own equations of the match, as a function of its inputs."""
  return _region_of(target, match.nodes, match.inputs,
                    target.nodes[match.root].outs[match.pattern.root_out])


def _region_of(target: _graph.Graph, node_ids, ins, out) -> Callable[..., Any]:
  """The program's equations ``node_ids`` as a function of ``ins``, returning ``out``."""
  run = _graph.region(target, node_ids, ins, [out])
  return lambda *vals: run(*vals)[0]


def _activation_fn(match: _Match, region, implementation):
  entry = match.pattern.form.entry
  params = tuple((k, float(match.caught[k])) for k, _ in entry.params)
  op = _act_base.Op(entry, params)

  @jax.custom_vjp
  def f(x):
    return region(x)

  def fwd(x):
    y = region(x)
    return y, (y, _act_base.packed_bits(op, x))

  def bwd(res, dy):
    return (implementation.backward(op, *res, dy),)

  f.defvjp(fwd, bwd)
  return f


def _scaled_silu_fn(match: _Match, region, implementation):
  """``y = x * sigmoid(c x) = silu(c x) / c``: keeps y and SiLU's bit of ``c x``; the backward
  is ``dy * silu'(c x)`` from ``silu(c x) = c y`` (rounded to y's dtype, as SiLU stores it)."""
  c = float(match.caught["c"])
  op = _act_base.Op(registry.get("silu"), ())

  @jax.custom_vjp
  def f(x):
    return region(x)

  def fwd(x):
    y = region(x)
    return y, (y, _act_base.packed_bits(op, x.astype(_common.compute_dtype(x.dtype)) * c))

  def bwd(res, dy):
    y, packed = res
    s = (y.astype(_common.compute_dtype(y.dtype)) * c).astype(y.dtype)
    return (implementation.backward(op, s, packed, dy),)

  f.defvjp(fwd, bwd)
  return f


class _NormRule:
  """A norm found by its algebra: the program's equations forward; residuals xhat (in
  ``m.store``), rstd (compute dtype, per row) and the parameters' sources; the backward is
  invact_jax's norm backward (the implementation's row kernels when the statistics are over
  the last axis and the scale is a vector along it, XLA's over other axes), the parameters'
  gradients the VJP of ``xhat * scale + bias`` in them (so a folded or ``1 + weight`` scale
  is differentiated as the program wrote it).  The fused norm -> matmul units
  (:mod:`._fusion`) reuse :meth:`residuals`, :meth:`recompute` and :meth:`backward`."""

  def __init__(self, m: _algebra.NormMatch, region, implementation, target):
    self.m, self.region, self.implementation = m, region, implementation
    self.x_aval = _aval(target, m.inputs[0])
    self.out_aval = target.avals[target.nodes[m.root].outs[m.root_out]]
    self.ndim = len(self.x_aval.shape)
    self.rows_kernel = (m.layout == tuple(range(self.ndim)) and m.axes == (self.ndim - 1,))
    self.sources = sorted({p[0] for p in m.params if p is not None and p[0] != "const"})
    self.target = target
    # No affine, the output in x's layout and in the dtype xhat is kept in: the output *is*
    # xhat (to rounding), so it is kept as xhat (one tensor, shared with its readers).
    self.output_is_xhat = (m.scale == {(): 1.0} and not m.bias
                           and m.layout == tuple(range(self.ndim))
                           and np.dtype(self.out_aval.dtype) == np.dtype(m.store)
                           and tuple(self.out_aval.shape) == tuple(self.x_aval.shape))

  def _symbols(self, src_vals: dict) -> list:
    """The parameters, each in the layout of ``x``."""
    out = []
    for p in self.m.params:
      if p is None:
        out.append(None)
        continue
      if p[0] == "const":
        v = jnp.asarray(p[1])
      else:
        v = src_vals[p[0]]
        for j in p[1]:
          v = _graph.bind(self.target.nodes[j], [v])[0]
      out.append(_algebra.to_x(v, p[2], self.ndim))
    return out

  def _affine(self, xh, src):
    """``(scale, bias)`` in the layout of ``x`` and the dtype of ``xh``."""
    m, cd = self.m, xh.dtype
    syms = self._symbols(dict(zip(self.sources, src)))
    scale = _algebra.evaluate_poly(m.scale, syms, xh) if m.scale else jnp.zeros((), cd)
    bias = _algebra.evaluate_poly(m.bias, syms, xh) if m.bias else jnp.zeros((), cd)
    return scale, bias

  def residuals(self, vals, z) -> tuple:
    """``(xhat, rstd, parameter sources)`` from the region's input values and output."""
    xhat, rstd = _norm_base.normalize(vals[0], self.m.rms, self.m.eps, self.m.axes)
    xhat = z if self.output_is_xhat else xhat.astype(self.m.store)
    return xhat, rstd, tuple(vals[i] for i in self.sources)

  def recompute(self, res):
    """The norm's output recomputed from the residuals (``xhat * scale + bias`` in the compute
    dtype, then in the output's layout and dtype)."""
    xhat, rstd, src = res
    xh = xhat.astype(rstd.dtype)
    scale, bias = self._affine(xh, src)
    z = _algebra.from_x(xh * scale + bias, self.m.layout, tuple(self.out_aval.shape))
    return z.astype(self.out_aval.dtype)

  def backward(self, res, dz) -> tuple:
    """Cotangents of the region's inputs (None for constants) from the output's ``dz``."""
    m, ndim = self.m, self.ndim
    xhat, rstd, src = res
    cd = rstd.dtype
    xh, dzc = xhat.astype(cd), _algebra.to_x(dz.astype(cd), m.layout, ndim)
    scale, _ = self._affine(xh, src)
    n = self.x_aval.shape[-1]
    if self.rows_kernel and math.prod(jnp.shape(scale)) in (1, n) and xhat.size:
      vec = None if m.scale == {(): 1.0} else \
          jnp.broadcast_to(jnp.reshape(scale, (-1,)), (n,)).astype(cd)
      dx = _norm_base.kernel_or_xla(self.implementation, xhat).backward_dx(
          m.rms, xhat, rstd, dz, vec, self.x_aval.dtype)
    else:
      dx = _norm_base.dx_from_xhat(xh, rstd, dzc * scale, m.rms, m.axes).astype(
          self.x_aval.dtype)
    out = [None] * len(m.inputs)  # None: a zero cotangent (constants, a where's fill value)
    out[0] = dx
    if self.sources:
      _, vjp = jax.vjp(lambda *s: (lambda sb: xh * sb[0] + sb[1])(self._affine(xh, s)), *src)
      for i, g in zip(self.sources, vjp(dzc)):
        k = self.sources.index(i)
        out[i] = _common.cotangent_like(g.astype(src[k].dtype), src[k])
    return tuple(out)


def _algebra_norm_fn(rule: _NormRule):
  """The norm as a ``custom_vjp`` keeping xhat, rstd and the parameters' sources."""

  @jax.custom_vjp
  def f(*vals):
    return rule.region(*vals)

  def fwd(*vals):
    z = rule.region(*vals)
    return z, rule.residuals(vals, z)

  f.defvjp(fwd, rule.backward)
  return f


def _head_fn(m: _cross_entropy.HeadMatch, target):
  """A matmul + cross-entropy as :func:`invact_jax.linear_cross_entropy`: with the program's
  reduction folded in (the per-token weights are the reduction's derivative; the gradients
  are computed in the forward), or per token (the program's reduction follows)."""
  loss_ref = target.nodes[m.root].outs[0]
  loss_aval, x_aval = target.avals[loss_ref], _aval(target, m.x)
  d, n = x_aval.shape[-1], math.prod(x_aval.shape[:-1])
  vocab = _aval(target, m.w).shape[m.vocab_axis]
  mode = "forward" if m.fold else "backward"
  chunk, vocab_chunk = _ce_base.default_tiles(n, vocab, mode)
  opts = _ce_base.Options(m.vocab_axis, "sum" if m.fold else "none", None, float(m.smoothing),
                          0.0, None, chunk, vocab_chunk, mode)
  heads = 4 if m.bias is not None else 3  # x, w, (bias,) labels; then the reduction's reads

  if m.fold is None:
    def per_token(x, w, *rest):
      b = rest[0] if m.bias is not None else None
      loss, _ = _ce_base.linear_cross_entropy(x.reshape(n, d), w, b, rest[-1].reshape(n), opts)
      return (m.sign * loss).reshape(loss_aval.shape).astype(loss_aval.dtype)
    return per_token

  out_aval = target.avals[m.fold.out]
  reduce = _region_of(target, m.fold.nodes, [loss_ref, *m.fold.extras], m.fold.out)

  def folded(*vals):
    x, w, labels = vals[0], vals[1], vals[heads - 1]
    b = vals[2] if m.bias is not None else None
    extras = vals[heads:]
    # the reduction is linear in the losses: its derivative is each token's weight
    _, pull = jax.vjp(lambda loss: reduce(loss, *extras),
                      jnp.zeros(loss_aval.shape, loss_aval.dtype))
    (weights,) = pull(jnp.ones(out_aval.shape, out_aval.dtype))
    weights = m.sign * weights.reshape(n).astype(_common.compute_dtype(x.dtype))
    total, _ = _ce_in_forward.weighted_sum(x.reshape(n, d), w, b, labels.reshape(n), weights,
                                           opts)
    return total.reshape(out_aval.shape).astype(out_aval.dtype)
  return folded


def _algebra_softmax_fn(m: _algebra.SoftmaxMatch, region, target):
  """A softmax found by its algebra: keeps the probabilities; the shift ``k`` (a max) gets a
  zero cotangent, as softmax does not depend on it."""
  x_dtype = _aval(target, m.inputs[0]).dtype

  @jax.custom_vjp
  def f(*vals):
    return region(*vals)

  def fwd(*vals):
    p = region(*vals)
    return p, p

  def bwd(p, dp):
    return (_softmax_base.backward(m.axes, x_dtype, p, dp), *(None for _ in m.inputs[1:]))

  f.defvjp(fwd, bwd)
  return f


def _softmax_fn(match: _Match, region, target):
  x_dtype = _aval(target, match.inputs[0]).dtype

  @jax.custom_vjp
  def f(x):
    return region(x)

  def fwd(x):
    p = region(x)
    return p, p

  def bwd(p, dp):
    return (_softmax_base.backward(-1, x_dtype, p, dp),)

  f.defvjp(fwd, bwd)
  return f


# --------------------------------------------------------------------------- the pass
@dataclasses.dataclass
class _Options:
  names: frozenset
  activation: Any  # the activations' implementation (activations.api.IMPLEMENTATIONS)
  norm: Any        # the norms' implementation (norms.api.IMPLEMENTATIONS)
  report: ProgramReport
  floor: bool = True  # fuse the matmuls that read recomputable values (the floor pass)
  skip: frozenset = frozenset()  # sites (numbered in the order they are found) left alone
  recompute: frozenset = frozenset()  # activation sites run as jax.checkpoint of themselves
  # Per site numbered so far (its number is its index): whether it can be recomputed.
  recomputable: list = dataclasses.field(default_factory=list)
  in_loop: bool = False  # converting a scan body (its residuals are kept per step)

  def site(self, public: str, where: str, recomputable: bool = False) -> str | None:
    """Number the next site: None if it is to be left alone (``skip``), ``"recompute"`` for
    an activation in ``recompute``, else ``"invert"``."""
    number = len(self.recomputable)
    self.recomputable.append(recomputable)
    if number in self.skip:
      self.report.left_alone.append((public, where, _FELL_BACK))
      return None
    if recomputable and number in self.recompute:
      self.report.recomputed.append((public, where, _FELL_BACK))
      return "recompute"
    return "invert"


def options_for_analysis() -> _Options:
  """Options that find every op (for analyses of a program, not its conversion)."""
  return _Options(_names(None, True), _act_api.IMPLEMENTATIONS["xla"],
                  _norm_api.IMPLEMENTATIONS["xla"], ProgramReport(), False)


def _allowed(form: _forms.Form, names: frozenset) -> bool:
  return form.public in names


@dataclasses.dataclass
class Found:
  """The ops found in a program (before anything is replaced).

  Attributes:
    norms: :class:`._algebra.NormMatch` per norm.
    softmaxes: :class:`._algebra.SoftmaxMatch` per softmax found by its algebra.
    forms: matches of :data:`._forms.FORMS` (activations and ``jax.nn.softmax`` calls).
    heads: :class:`._cross_entropy.HeadMatch` per matmul + cross-entropy.
  """
  norms: list
  softmaxes: list
  forms: list
  heads: list = dataclasses.field(default_factory=list)

  def output(self, target: _graph.Graph, m):
    """The program value a match computes."""
    if isinstance(m, _cross_entropy.HeadMatch):
      return m.output(target)
    k = m.pattern.root_out if isinstance(m, _Match) else m.root_out
    return target.nodes[m.root].outs[k]


def find(target: _graph.Graph, opts: _Options) -> Found:
  """Every op of ``opts.names`` in ``target`` that can be converted; what cannot is added to
  ``opts.report.left_alone`` with its reason."""
  claimed: set = set()
  outvars = {r for r in target.outvars if not isinstance(r, Lit)}
  found = Found([], [], [])
  explained: set = set()  # candidate nodes already reported with a reason
  def take(kind: str, matches: list, left: list, into: list) -> None:
    for m in matches:
      if kind != "norm" or m.public in opts.names:
        claimed.update(m.nodes)
        into.append(m)
    for nodes, why in left:
      explained.update(nodes)
      opts.report.left_alone.append((kind, target.nodes[nodes[0]].where, why))
  if "linear_cross_entropy" in opts.names:  # first: its log-softmax is no softmax to keep
    take("linear_cross_entropy", *_cross_entropy.find_heads(
        target, claimed, outvars, allow_fold=not opts.in_loop), found.heads)
  if opts.names & {"layer_norm", "rms_norm"}:
    take("norm", *_algebra.find_norms(target, claimed, outvars), found.norms)
  if "softmax" in opts.names:
    take("softmax", *_algebra.find_softmaxes(target, claimed, outvars), found.softmaxes)
  candidates = []
  for ti, tn in enumerate(target.nodes):
    if tn.outs:
      aval = target.avals[tn.outs[0]]
      if aval.shape and jnp.issubdtype(aval.dtype, jnp.floating):
        candidates.append((ti, tuple(aval.shape), np.dtype(aval.dtype).name,
                           _signature(target, ti)))
  for form in (f for f in _forms.FORMS if _allowed(f, opts.names)):
    # Latest output first: a form that ends in a cast (Flax's dtype=) matches at the cast,
    # not at the equation before it (the norm then keeps xhat in the cast's dtype).
    for ti, shape, od, sig in reversed(candidates):
      if ti in claimed:
        continue
      for xd, pd in ((od, od),):  # activations and softmax: input dtype = output dtype
        want = _root_signature(form, xd, pd, od)
        if want is None or want[0] != sig[0] or not want[1] <= sig[1]:
          continue
        pat = _pattern(form, shape, xd, pd, od)
        if pat is None:
          continue
        m = _try(pat, target, ti, claimed)
        if m is None:
          continue
        if m.pattern.form.kind == "scaled_silu" and not m.caught["c"] > 0:
          continue  # x * sigmoid(c x) with c <= 0 is not a scaled SiLU's branch structure
        if _escapes(m, target, outvars):
          opts.report.left_alone.append(
              (form.name, target.nodes[ti].where,
               "an intermediate value is also used elsewhere"))
          break
        claimed.update(m.nodes)
        found.forms.append(m)
        break
  for i, n in enumerate(target.nodes):
    if (i not in claimed and i not in explained and n.prim.name in _CANDIDATES
        and not all(isinstance(r, Lit) for r in n.ins)):  # sqrt(head_dim) is no candidate
      opts.report.left_alone.append(
          (n.prim.name, n.where, f"not part of a recognized {_CANDIDATES[n.prim.name]} form"))
  return found


def _plan(target: _graph.Graph, opts: _Options) -> list:
  """The :class:`_graph.Unit` s that replace the converted matches of ``target``."""
  found = find(target, opts)
  found.norms = [m for m in found.norms
                 if opts.site(m.public, target.nodes[m.root].where)]
  found.heads = [m for m in found.heads
                 if opts.site(m.public, target.nodes[m.root].where)]
  found.softmaxes = [m for m in found.softmaxes
                     if opts.site(m.public, target.nodes[m.root].where)]
  modes = [(m, opts.site(m.pattern.form.public, target.nodes[m.root].where,
                         m.pattern.form.kind in _RECOMPUTABLE)) for m in found.forms]
  found.forms = [m for m, mode in modes if mode == "invert"]
  recomputed = [m for m, mode in modes if mode == "recompute"]
  units: list = []
  norm_units: list = []  # (rule, unit) for the fusion with the matmuls that read the norm
  kept: set = set()      # outputs of converted ops that their own backward keeps
  for m in found.norms:
    out = found.output(target, m)
    region = _region_of(target, m.nodes, m.inputs, out)
    rule = _NormRule(m, region, opts.norm, target)
    unit = _graph.Unit(frozenset(m.nodes), list(m.inputs), [out], _single(_algebra_norm_fn(rule)))
    units.append(unit)
    norm_units.append((rule, unit))
    opts.report.converted.append((m.public, m.name, target.nodes[m.root].where))
  for m in found.heads:
    out = found.output(target, m)
    units.append(_graph.Unit(frozenset(m.nodes), list(m.inputs), [out],
                             _single(_head_fn(m, target))))
    opts.report.converted.append((m.public, m.name, target.nodes[m.root].where))
  for m in found.softmaxes:
    out = found.output(target, m)
    region = _region_of(target, m.nodes, m.inputs, out)
    units.append(_graph.Unit(frozenset(m.nodes), list(m.inputs), [out],
                             _single(_algebra_softmax_fn(m, region, target))))
    kept.add(out)
    opts.report.converted.append((m.public, m.name, target.nodes[m.root].where))
  for m in found.forms:
    region = _region(target, m)
    kind = m.pattern.form.kind
    if kind == "activation":
      fn = _activation_fn(m, region, opts.activation)
    elif kind == "scaled_silu":
      fn = _scaled_silu_fn(m, region, opts.activation)
    else:
      fn = _softmax_fn(m, region, target)
    out = found.output(target, m)
    units.append(_graph.Unit(frozenset(m.nodes), list(m.inputs), [out], _single(fn)))
    kept.add(out)
    opts.report.converted.append((m.pattern.form.public, m.pattern.form.name,
                                  target.nodes[m.root].where))
  for m in recomputed:  # keeps its input; XLA fuses the recomputed derivative into the backward
    units.append(_graph.Unit(frozenset(m.nodes), list(m.inputs), [found.output(target, m)],
                             _single(jax.checkpoint(_region(target, m)))))
  if opts.floor:
    units = _fusion.fuse(target, units, norm_units, kept,
                         {r for r in target.outvars if not isinstance(r, Lit)})
  return units


def _single(fn):
  """``fn`` returning its one output as a 1-tuple (a :class:`_graph.Unit`'s convention)."""
  return lambda *vals: (fn(*vals),)


def _contains_candidates(params) -> bool:
  for v in params.values():
    j = getattr(v, "jaxpr", v)
    if hasattr(j, "eqns"):
      for e in j.eqns:
        if e.primitive.name in _CANDIDATES or _contains_candidates(e.params):
          return True
    elif isinstance(v, (tuple, list)) and v and hasattr(getattr(v[0], "jaxpr", None), "eqns"):
      if any(_contains_candidates({"j": b}) for b in v):
        return True
  return False


# Constants of the enclosing program up to this size are seen as constants inside a body (a
# norm's epsilon is a scan constant when the layers are stacked).
_KNOWN_SIZE = 64


def _known(refs, positions) -> dict:
  """``{body input index: Lit}`` for the small constants among ``refs`` at ``positions``."""
  return {k: refs[k] for k in positions
          if isinstance(refs[k], Lit) and np.size(refs[k].val) <= _KNOWN_SIZE
          and not isinstance(refs[k].val, jax.core.Tracer)}


def _convert_closed(closed, opts: _Options, known: dict | None = None):
  """A converted copy of a nested body (same input and output types), or None.  ``known``:
  body input index -> the constant it always receives."""
  structs = _graph.shape_structs(closed.in_avals)
  graph = _graph.flatten(closed)
  if known:
    graph = _graph.substitute(graph, {graph.invars[k]: lit for k, lit in known.items()})
  new = jax.make_jaxpr(lambda *a: _run(graph, a, opts))(*structs)
  same = all(a.shape == b.shape and a.dtype == b.dtype and
             getattr(a, "weak_type", False) == getattr(b, "weak_type", False)
             for a, b in zip(new.out_avals, closed.out_avals))
  return new if same else None


def _nested(opts: _Options):
  def run(node: _graph.Node, invals):
    name, p = node.prim.name, node.params
    if name in ("checkpoint", "remat", "remat2"):
      graph = _graph.flatten(p["jaxpr"])
      body = jax.checkpoint(lambda *a: _run(graph, a, opts), prevent_cse=p["prevent_cse"],
                            policy=p["policy"])
      return list(body(*invals))
    if name == "shard_map" and {"mesh", "in_specs", "out_specs", "jaxpr"} <= set(p):
      graph = _graph.flatten(p["jaxpr"])
      body = jax.shard_map(lambda *a: tuple(_run(graph, a, opts)), mesh=p["mesh"],
                           in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                           axis_names=frozenset(p.get("newly_manual_axes", ())),
                           check_vma=p.get("check_vma", True))
      return list(body(*invals))
    if name == "scan" or name in ("pjit", "jit"):
      consts = range(_graph.scan_counts(p)[0] if name == "scan" else len(node.ins))
      body_opts = dataclasses.replace(opts, in_loop=True) if name == "scan" else opts
      new = _convert_closed(p["jaxpr"], body_opts, _known(node.ins, consts))
      return None if new is None else _graph.bind(
          _graph.Node(node.prim, dict(p, jaxpr=new), node.ins, node.outs, eqn=node.eqn), invals)
    if name == "cond":
      known = {k - 1: lit for k, lit in _known(node.ins, range(1, len(node.ins))).items()}
      branches = [_convert_closed(b, opts, known) for b in p["branches"]]
      if any(b is None for b in branches):
        return None
      return _graph.bind(_graph.Node(node.prim, dict(p, branches=tuple(branches)), node.ins,
                                     node.outs, eqn=node.eqn), invals)
    if _contains_candidates(p):
      opts.report.left_alone.append(
          (name, node.where, "not entered: the conversion does not rewrite inside "
           f"{name} (its own derivative rule or loop)"))
    return None
  return run


def _run(graph: _graph.Graph, args, opts: _Options) -> list:
  return _graph.evaluate(graph, list(args), units=_plan(graph, opts), nested=_nested(opts))


def _names(only, norms: bool) -> frozenset:
  public = tuple(registry.PUBLIC) + _KINDS
  if only is None:
    names = set(registry.PUBLIC) | (set(_KINDS) if norms else set())
  else:
    only = (only,) if isinstance(only, str) else tuple(only)
    unknown = [n for n in only if n not in public]
    if unknown:
      raise ValueError(f"invact_jax.invert: argument `only`: cannot convert {unknown}; choose "
                       f"from {sorted(public)}")
    names = set(only)
  return frozenset(registry.PUBLIC[n][0].public if n in registry.PUBLIC else n for n in names)


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _gradient_temp(closed, graph: _graph.Graph, structs: list, positions,
                   opts: _Options | None) -> int:
  """Compiled temp bytes of the pullback of ``closed`` (``graph``, its flattened form,
  converted with ``opts``; None: as it is) at ``structs`` with respect to its inputs at
  ``positions``, ones as the floating outputs' cotangents."""
  def step(*a):
    def f(*d):
      full = list(a)
      for i, v in zip(positions, d):
        full[i] = v
      outs = (jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *full) if opts is None
              else _run(graph, full, opts))
      return [o for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]
    outs, pull = jax.vjp(f, *[a[i] for i in positions])
    return pull([jnp.ones_like(o) for o in outs])  # the gradients alone, as jax.grad's
  # Measured as one device's program, outside the mesh the caller may be tracing under
  # (explicit shardings): the shardings are not part of the structs, and the equations
  # re-derive them from their inputs.
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    analysis = jax.jit(step).lower(*structs).compile().memory_analysis()
  return int(analysis.temp_size_in_bytes) if analysis is not None else 0


@dataclasses.dataclass(frozen=True)
class _Choice:
  """What ``fallback="temp"`` decided: sites left alone, activation sites recomputed from
  their input (``jax.checkpoint`` of their own equations), and whether the floor pass runs."""
  skip: frozenset = frozenset()
  recompute: frozenset = frozenset()
  floor: bool = True


def _temp_fallback(closed, positions, make_opts: Callable[[_Choice], _Options]) -> _Choice:
  """The sites to change so that the gradient's compiled temp is at most the unconverted
  program's: none if inverting all of them already is; else each site's alternative (an
  activation recomputed from its input, another op left alone), in the order of the temp it
  gives when taken alone, until it is; then the recomputed activations left alone too, in the
  same order; at worst the program as it is (every site left alone, no floor pass)."""
  graph, structs = _graph.flatten(closed), _graph.shape_structs(closed.in_avals)

  def temp(choice: _Choice | None, opts: _Options | None = None) -> int:
    if choice is not None and opts is None:
      opts = make_opts(choice)
    return _gradient_temp(closed, graph, structs, positions, opts)
  original = temp(None)
  everything = make_opts(_Choice())
  if temp(_Choice(), everything) <= original:
    return _Choice()
  recomputable = list(everything.recomputable)  # per site, counted by the measurement above

  def alternative(choice: _Choice, i: int) -> _Choice:
    if recomputable[i]:
      return dataclasses.replace(choice, recompute=choice.recompute | {i})
    return dataclasses.replace(choice, skip=choice.skip | {i})
  alone = {i: temp(alternative(_Choice(), i)) for i in range(len(recomputable))}
  order = sorted(alone, key=lambda i: (alone[i], i))
  choice = _Choice()
  for i in order:
    choice = alternative(choice, i)
    if temp(choice) <= original:
      return choice
  for i in (i for i in order if recomputable[i]):
    choice = dataclasses.replace(choice, skip=choice.skip | {i}, recompute=choice.recompute - {i})
    if temp(choice) <= original:
      return choice
  return _Choice(frozenset(range(len(recomputable))), frozenset(), floor=False)


def invert(fn: Callable[..., Any], *, only=None, norms: bool = True,
           implementation=None, floor: bool = True, fallback: str | None = None,
           argnums: int | tuple[int, ...] = 0) -> Callable[..., Any]:
  """Program transformation: ``fn`` with its activations, norms and softmaxes inverted.

  The recommended way to apply invact_jax to code you did not write (see also
  :func:`invact_jax.inverted`, the attribute swap, for code that looks functions up by name).

  ``fn`` is traced; the activations (every :mod:`invact_jax` activation), LayerNorm/RMSNorm
  and last-axis softmax in the traced program are recognized by their computation (whatever
  Python object computed them: ``jax.nn`` functions, ``functools.partial`` objects, entries of
  a dict built at import, module fields, Flax/Equinox/transformers layers) and run as
  output-saving ``custom_vjp`` s.  The forward output is bit for bit the original one.
  Differentiate the converted function: ``jax.grad(invert(loss))``; array arguments are
  traced, other arguments are passed through as static values.

  Args:
    fn: the function to convert (typically the loss).
    only: public names to convert (``"gelu"``, ``"silu"``, ..., ``"layer_norm"``,
      ``"rms_norm"``, ``"softmax"``); default: all.
    norms: with ``only=None``, also convert norms and softmax (default True).
    implementation: the backward's implementation for activations and norms (None/"xla",
      "pallas", "triton"; see :class:`invact_jax.Implementation`).
    floor: also keep each tensor once (default True): a norm feeding matmuls keeps only
      ``xhat`` and ``rstd`` for both; a matmul whose operand is an elementwise function of
      values kept anyway (a GLU's product, a reshaped attention output, a bfloat16 value
      cast to float32) keeps those values instead.  False converts the ops alone.
    fallback: None (default) converts every site found; ``"temp"`` changes, site by site,
      the conversions that make the gradient's compiled temp larger than the unconverted
      program's (XLA can fuse a converted program worse, e.g. XLA:CPU with exact GELU): at
      each new trace signature it compiles the gradient with respect to ``argnums`` of the
      unconverted and the converted program (as one device's program), and while the
      converted one needs more, changes the sites whose change gives the least temp (each
      measured alone): an activation is recomputed from its input (``jax.checkpoint`` of
      its own equations: it keeps its input where inverting keeps its output and a bit per
      element), a norm or softmax is left alone; then recomputed activations are left
      alone too; at worst the floor pass is dropped (the program as it is).  Costs two
      compilations and up to three more per site, once per signature; the report names
      each site recomputed or left alone.  Inside a
      ``shard_map`` body it measures nothing and converts every site (the report says so):
      apply ``invert`` outside the ``shard_map`` there.
    argnums: the positional arguments the gradient is taken with respect to (their floating
      leaves), for ``fallback="temp"``.

  Returns:
    The converted function; after each call (or trace) its ``last_report``
    (:class:`ProgramReport`) says what was converted and what was left alone, and why.

  Example:
    >>> import functools, jax, jax.numpy as jnp, invact_jax
    >>> act = functools.partial(jax.nn.gelu, approximate=False)   # captured: no attribute swap helps
    >>> def loss(w, x):
    ...   return jnp.sum(act(x @ w) ** 2)
    >>> inv = invact_jax.invert(loss)
    >>> g = jax.grad(inv)(jnp.ones((4, 8)), jnp.ones((2, 4)))
    >>> inv.last_report.replaced
    {'gelu': 1}
  """
  names = _names(only, norms)
  if fallback not in (None, "temp"):
    raise ValueError(f"invact_jax.invert: argument `fallback`: expected None or 'temp', got "
                     f"{fallback!r}")
  argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not argnums or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in argnums):
    raise ValueError(f"invact_jax.invert: argument `argnums`: expected non-negative ints, "
                     f"got {argnums!r}")
  act_impl = _implementation.resolve(implementation, op="invert",
                                     implementations=_act_api.IMPLEMENTATIONS)
  norm_impl = _implementation.resolve(implementation, op="invert",
                                      implementations=_norm_api.IMPLEMENTATIONS)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    out_structure = {}

    def flat(*vals):
      ls = list(leaves)
      for i, v in zip(dyn, vals):
        ls[i] = v
      a, k = jax.tree.unflatten(tree, ls)
      out_leaves, out_tree = jax.tree.flatten(fn(*a, **k))
      # Arrays (traced or not) are the program's outputs; anything else (a string, a Python
      # number, None in has_aux) is returned as the function returned it.
      arrays = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, (jax.Array, np.ndarray))]
      out_structure.update(tree=out_tree, leaves=out_leaves, arrays=arrays)
      return [out_leaves[i] for i in arrays]

    vals = [leaves[i] for i in dyn]
    closed = jax.make_jaxpr(flat)(*vals)
    choice, report = _Choice(), ProgramReport()
    if fallback == "temp":
      if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        # A shard_map body's program is not one that compiles on its own (its values vary
        # over the manual axes): nothing to measure, every site is converted; said.
        report.left_alone.append(("fallback", "", "fallback='temp' does not measure inside a "
                                  "shard_map body: every site converted"))
      else:
        choice = _fallback_sites(closed, args, leaves, dyn)
        if floor and not choice.floor:
          report.left_alone.append(("floor pass", "", "its matmul fusions raised the gradient's "
                                    "compiled temp above the unconverted program's even with "
                                    "every site left alone (fallback='temp')"))
    outs = _run(_graph.flatten(closed), vals, options(report, choice))
    wrapped.last_report = report
    out_leaves = list(out_structure["leaves"])
    for i, v in zip(out_structure["arrays"], outs):
      out_leaves[i] = v
    return jax.tree.unflatten(out_structure["tree"], out_leaves)

  cache: dict = {}

  def options(report: ProgramReport, choice: _Choice) -> _Options:
    return _Options(names, act_impl, norm_impl, report, bool(floor) and choice.floor,
                    choice.skip, choice.recompute)

  def _fallback_sites(closed, args, leaves, dyn) -> _Choice:
    if max(argnums) >= len(args):
      raise ValueError(f"invact_jax.invert: argument `argnums`: {max(argnums)} is out of range "
                       f"for {len(args)} positional arguments")
    ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
    wanted = {j for k in argnums for j in range(ends[k] - len(jax.tree.leaves(args[k])), ends[k])}
    positions = [p for p, i in enumerate(dyn) if i in wanted and jnp.issubdtype(
        closed.in_avals[p].dtype, jnp.inexact)]
    key = (str(closed), tuple(positions))
    if key not in cache:
      cache[key] = _temp_fallback(
          closed, positions, lambda choice: options(ProgramReport(), choice)) \
          if positions else _Choice()
    return cache[key]

  wrapped.last_report = None
  wrapped.invact_jax_original = fn  # what the floor audit measures against
  return wrapped
