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
from typing import Any

import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _algebra_follow
from invact_jax.convert import graph as _graph
from invact_jax.convert import _polynomial
from invact_jax.convert import _match
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit

__all__ = ["NormMatch", "SoftmaxMatch", "find_norms", "find_softmaxes", "evaluate_poly",
           "to_x", "from_x"]


# ------------------------------------------------------------------------ polynomials


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
              if _polynomial.syms(p)]
    affine += [_EPS_MODES[self.eps_mode]] if self.eps_mode != "var" else []
    return f"{kind} by its algebra (axes {self.axes}{', ' if affine else ''}{', '.join(affine)})"


# ------------------------------------------------------------------------------ search


def _candidates(g: _graph.Graph) -> list:
  """``(x, axes)`` per statistic: the value a ``reduce_sum`` reads, traced back through
  casts, squares and centring to the tensor it is computed from."""
  out = []
  for n in g.nodes:
    if n.prim.name != "reduce_sum":
      continue
    if not jnp.issubdtype(_algebra_follow.dtype_of(g, n.ins[0]), jnp.floating):
      continue
    ref, shape = n.ins[0], tuple(_algebra_follow.shape_of(g, n.ins[0]))
    for _ in range(6):
      if isinstance(ref, Lit) or ref not in g.producer:
        break
      p = g.nodes[g.producer[ref][0]]
      nxt = p.ins[0]
      if p.prim.name not in _primitives.SQUARES or tuple(_algebra_follow.shape_of(g, nxt)) != shape:
        break
      if p.prim.name == "mul" and p.ins[0] != p.ins[1]:
        break
      if p.prim.name == "convert_element_type" and not (
          jnp.issubdtype(_algebra_follow.dtype_of(g, nxt), jnp.floating)
          and jnp.finfo(_algebra_follow.dtype_of(g, nxt)).nmant
          < jnp.finfo(_algebra_follow.dtype_of(g, ref)).nmant):
        break  # only through an upcast for the statistics: a downcast is where x begins
      ref = nxt
    key = (ref, tuple(sorted(int(a) for a in n.params["axes"])))
    if not any(k[0] is key[0] and k[1] == key[1] for k in out):
      out.append(key)
  return out


def find_norms(g: _graph.Graph, claimed: set, outvars: set) -> tuple[list, list]:
  """The norms of ``g`` not overlapping ``claimed``: ``(matches, left_alone)``, the latter
  ``(radical node indices, why)`` for statistics whose normalized output is not converted."""
  matches, left, taken = [], [], set(claimed)
  pending = []  # (radical node indices, why) per candidate, reported once all are matched
  for x, axes in _candidates(g):
    a = _algebra_follow.Analysis(g, x, axes)
    start = g.producer[x][0] + 1 if not isinstance(x, Lit) and x in g.producer else 0
    for i in range(start, len(g.nodes)):
      a.step(i)
    found = [(o, f) for o, f in ((o, _algebra_follow.norm_of(a, v)) for o, v in a.vals.items()
                                 if _polynomial.X in _polynomial.syms(v))
             if f is not None and jnp.issubdtype(g.avals[o].dtype, jnp.floating)]
    # the radicals of this x's own statistics (not those of later norms computed from it)
    radicals = [i for i in range(start, len(g.nodes))
                if g.nodes[i].prim.name in _primitives.RADICALS
                and g.nodes[i].outs and g.nodes[i].outs[0] in a.vals
                and any(s[0] == "r" for s in _polynomial.syms(a.vals[g.nodes[i].outs[0]]))]
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
      used = _polynomial.syms(scale) | _polynomial.syms(bias)
      if any(params[s[1]] is None for s in used):
        reason = reason or "a parameter is computed inside the normalization"
        continue
      full = [g.avals[o2] for j in nodes for o2 in g.nodes[j].outs
               if o2 in a.vals and _polynomial.X in _polynomial.syms(a.vals[o2])]
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
  src, dst = _algebra_follow.dtype_of(g, node.ins[0]), g.avals[node.outs[0]].dtype
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
