"""How the loss follower follows each primitive: one function per rule, ``rule(h, node,
inputs, output)`` on a :class:`._head_follow.LossFollower` ``h``, and the table
:data:`STEPS` keyed by primitive (as JAX's own interpreters are)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _head_values
from invact_jax.convert import _match
from invact_jax.convert import _polynomial
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit


def _same(h, n, ins, o) -> None:
  """A cast, copy, reshape, broadcast, transpose or sharding constraint: the value it passes
  on.  Logits constrained to shards of the vocabulary (a tensor-parallel head) are
  followed where the head can run per shard (:func:`_vocab_split`)."""
  src = ins[0]
  if isinstance(src, Lit):
    return
  if n.prim.name in _primitives.SHARDING and src in h.elem and _head_values.splits_last(
      n, h.g.avals[o].shape):
    split = _head_values.vocab_split(n, tuple(h.g.avals[o].shape))
    if split is None or (h.vocab_split is not None and h.vocab_split != split):
      h.vocab_sharded = True
      return
    h.vocab_split = split
  if n.prim.name == "transpose":
    perm = tuple(n.params["permutation"])
    if (src in h.elem or src in h.exps) and perm[-1] != len(perm) - 1:
      return  # the vocabulary axis moved: not followed
    h.permuted |= perm != tuple(range(len(perm)))
  for table in h.tables():
    if src in table:
      if table is h.rows and h.along_vocab(o):
        if n.prim.name == "broadcast_in_dim":
          h.elem[o] = dict(table[src])  # a row value spread along the vocabulary
        return
      table[o] = table[src]
      return


def _add_sub(h, n, ins, o) -> None:
  """A sum or difference: of row values, of values along the vocabulary (a row value spread), a
  scalar shift of the logits, or a target weight plus a constant."""
  a, b = ins
  sign = 1.0 if n.prim.name == "add" else -1.0
  lin = lambda r: None if isinstance(r, Lit) else h.elem.get(r, h.rows.get(r))  # noqa: E731
  if all(not isinstance(r, Lit) and r in h.rows for r in (a, b)):
    h.rows[o] = _polynomial.add(h.rows[a], h.rows[b], sign)
  elif lin(a) is not None and lin(b) is not None and h.along_vocab(o):
    h.elem[o] = _polynomial.add(lin(a), lin(b), sign)  # a row value spread along the vocabulary
  elif h.along_vocab(o) and (shifted := _scalar_shift(h, a, b, sign)) is not None:
    # a scalar added to the logits (or subtracted): a row constant, a shift of each row
    h.elem[o] = _polynomial.add(h.elem[shifted], {h._shift(): -1.0})
  elif not isinstance(a, Lit) and a in h.target and h._const(b) is not None:
    t = h.target[a]
    h.target[o] = (t[0], t[1] + sign * h._const(b))
  elif (not isinstance(a, Lit) and a == h.g.nodes[h.dot].outs[0] and sign > 0
        and h.bias is None and not isinstance(b, Lit)):
    # the bias: z + b with b [V] spread over the tokens
    src, chain = _head_values.spread_source(h.g, b)
    if src is not None and tuple(_match.aval(h.g, src).shape) == (h.vocab,):
      h.bias = (src, chain)
      h.elem[o] = {"z": 1.0}


def _scalar_shift(h, a, b, sign: float):
  """The followed logits value of ``a + b`` (``a - b``: ``sign`` -1) whose other operand is a
  scalar constant, else None."""
  for r, c in ((a, b),) if sign < 0 else ((a, b), (b, a)):
    if not isinstance(r, Lit) and r in h.elem and h._const(c) is not None:
      return r
  return None


def _neg(h, n, ins, o) -> None:
  for table in (h.elem, h.rows):
    if ins[0] in table:
      table[o] = _polynomial.scale(table[ins[0]], -1.0)
  if ins[0] in h.masked_rows:
    h.masked_rows.add(o)


def _tanh(h, n, ins, o) -> None:
  """``tanh(z / c)``: the inside of a soft cap ``c * tanh(z / c)`` (Gemma 2)."""
  lin = h.elem.get(ins[0])
  if h.cap is None and lin is not None and set(lin) == {"z"} and lin["z"] > 0:
    h.tanh[o] = 1.0 / lin["z"]
    h.cap_nodes |= {h.g.producer[ins[0]][0], h.g.producer[o][0]}


def _capped(h, o, c: float) -> None:
  """``c * tanh(z / c)``: the capped logits become the cross-entropy's ``z``; the raw ones
  are the cap's inside only."""
  h.cap = c
  h.cap_nodes.add(h.g.producer[o][0])
  h.cap_nodes |= {h.g.producer[r][0] for r in h.elem if r in h.g.producer}
  h.elem = {o: {"z": 1.0}}


def _mul_div(h, n, ins, o) -> None:
  """A product or quotient: a square, a soft cap's ``c * tanh(z / c)``, the logits scaled by a
  constant or a traced temperature, a target weight times a value, a row value times a constant."""
  a, b = ins
  if n.prim.name == "mul" and a == b:
    _square(h, n, ins, o)
    return
  c = h._const(b)
  if c is None and n.prim.name == "mul" and h._const(a) is not None:
    c, a = h._const(a), b
  if (c is not None and n.prim.name == "mul" and not isinstance(a, Lit) and a in h.tanh
      and abs(c - h.tanh[a]) <= _polynomial.TOL * abs(c)):
    _capped(h, o, c)
    return
  if c is not None:  # a constant factor
    c = c if n.prim.name == "mul" else 1.0 / c
    for table in (h.elem, h.rows):
      if not isinstance(a, Lit) and a in table:
        table[o] = _polynomial.scale(table[a], c)
    if not isinstance(a, Lit) and a in h.target:
      t = h.target[a]
      h.target[o] = (t[0] * c, t[1] * c)
    return
  if (n.prim.name == "div" and not isinstance(a, Lit) and not isinstance(b, Lit)
      and a in h.exps and h.sums.get(b) == h.exps[a]):
    h.probs[o] = h.exps[a]  # the softmax: exp(z - k) / sum(exp(z - k))
    return
  if _traced_factor(h, n, a, b, o):
    return
  if n.prim.name == "mul":  # the target weight times a linear value
    for t_ref, l_ref in ((a, b), (b, a)):
      if (not isinstance(t_ref, Lit) and t_ref in h.target and not isinstance(l_ref, Lit)
          and l_ref in h.elem):
        h.weighted[o] = (h.target[t_ref], h.elem[l_ref])


def _traced_factor(h, n, a, b, o) -> bool:
  """``z * s``, ``s * z`` or ``z / s`` with ``s`` a traced scalar (a learnable temperature)
  on the matmul's logits (bias added or not) before anything else reads them: the scaled
  logits become the head's ``z`` (True: handled)."""
  g = h.g
  if h.temperature is not None or any(
      (h.rows, h.exps, h.sums, h.weighted, h.tanh)) or h.cap is not None:
    return False
  for z, t in ((a, b),) if n.prim.name == "div" else ((a, b), (b, a)):
    if isinstance(z, Lit) or isinstance(t, Lit) or h.elem.get(z) != {"z": 1.0}:
      continue
    src, chain = _head_values.spread_source(g, t)
    if (src is None or isinstance(src, Lit) or math.prod(g.avals[src].shape) != 1
        or not jnp.issubdtype(g.avals[src].dtype, jnp.floating)):
      continue
    h.temperature = (src, n.prim.name)
    h.temperature_nodes = {g.producer[o][0], *chain} | {
        g.producer[r][0] for r in h.elem if r in g.producer}
    h.elem = {o: {"z": 1.0}}
    return True
  return False


def _exp(h, n, ins, o) -> None:
  """``exp(a z - k)``, ``k`` a sum of row constants (a max, the program's own shift before
  the loss's, a scalar): its shift ``k``, their names joined by "+"; ``a > 0`` the logits'
  scale (``logits / sqrt(d)``), the same for every log-sum-exp of the head."""
  lin = h.elem.get(ins[0])
  if lin is not None and lin.get("z", 0.0) > 0.0 and all(
      k == "z" or k.startswith("k") for k in lin):
    shifts = sorted(k for k in lin if k.startswith("k"))
    if all(lin[k] == -1.0 for k in shifts) and (
        h.scale is None or abs(lin["z"] - h.scale) <= _polynomial.TOL * h.scale):
      h.scale = lin["z"]
      h.exps[o] = "+".join(shifts)


def _reduce_sum(h, n, ins, o) -> None:
  """A sum over the vocabulary: of exponentials (a softmax's denominator), of a target weight times
  a value (the picked logit, the smoothing's sum), of the logits; a row value summed along the
  vocabulary."""
  src = ins[0]
  if tuple(int(a) for a in n.params["axes"]) != (len(h.g.avals[src].shape) - 1,):
    return
  if src in h.exps:
    h.sums[o] = h.exps[src]
  elif src in h.weighted:
    if src in h.zeroed:
      h.masked_rows.add(o)
    h.rows[o] = _target_sum(h, *h.weighted[src])
  elif src in h.elem:
    row = {}
    for sym, c in h.elem[src].items():
      row = _polynomial.add(row, {"zsum": c} if sym == "z" else {sym: c * h.vocab})
    h.rows[o] = row


def _target_sum(h, target: tuple, lin: dict) -> dict:
  """The row value ``sum over V of (a * onehot + u) * lin``."""
  (a, u), row = target, {}
  for sym, c in lin.items():
    if sym == "z":
      row = _polynomial.add(row, {"pick": a * c, "zsum": u * c})
    else:  # a row constant spread along V: weighted sum is (a + u V) times it (the
      # one-hot's share ``a`` apart: a label outside [0, V) has none)
      row = _polynomial.add(row, {sym: c * u * h.vocab, "hot:" + sym: c * a})
  return row


def _dot(h, n, ins, o) -> None:
  """``einsum("...v,...v->...", target, lin)``: a matmul contracting the vocabulary, batched
  over every other axis, of the target and a followed logits value."""
  (lc, rc), (lb, rb) = n.params["dimension_numbers"]
  if any(isinstance(r, Lit) for r in ins) or len(ins) != 2:
    return
  nd = len(h.g.avals[ins[0]].shape)
  if (tuple(h.g.avals[ins[1]].shape) != tuple(h.g.avals[ins[0]].shape)
      or tuple(lc) != (nd - 1,) or tuple(rc) != (nd - 1,)
      or tuple(lb) != tuple(range(nd - 1)) or tuple(rb) != tuple(range(nd - 1))):
    return
  for t_ref, l_ref in (ins, ins[::-1]):
    if t_ref in h.target and l_ref in h.elem:
      h.rows[o] = _target_sum(h, h.target[t_ref], h.elem[l_ref])
      return


def _log(h, n, ins, o) -> None:
  """A log: of a sum of exponentials (a log-sum-exp), of a softmax (its log-softmax), of a
  softmax's picked probability (the log-likelihood)."""
  if ins[0] in h.sums:
    h.rows[o] = {"ls" + h.sums[ins[0]]: 1.0}
  elif ins[0] in h.probs:  # log(softmax(a z)) = a z - k - log(sum(exp(a z - k)))
    k = h.probs[ins[0]]
    h.elem[o] = {"z": h.scale or 1.0, "ls" + k: -1.0, **{s: -1.0 for s in _head_values.shifts(k)}}
  elif len(h.rows.get(ins[0], {})) == 1 and next(iter(h.rows[ins[0]])).startswith(
      "prob:"):
    # log(softmax(a z)[y]) = a z[y] - k - log(sum(exp(a z - k))): the log-likelihood
    (sym, c), = h.rows[ins[0]].items()
    if c == 1.0:
      k = sym[5:]
      h.rows[o] = {"pick": h.scale or 1.0, "ls" + k: -1.0,
                      **{s: -1.0 for s in _head_values.shifts(k)}}


def _square(h, n, ins, o) -> None:
  """``lse ** 2`` (``square``, ``integer_pow`` 2, or ``lse * lse`` from :meth:`_mul_div`):
  a z-loss's term."""
  if n.prim.name == "integer_pow" and n.params.get("y") != 2:
    return
  row = None if isinstance(ins[0], Lit) else h.rows.get(ins[0])
  if row is not None and h._is_lse(row):
    h.rows[o] = {"zsq": 1.0}


def _gather(h, n, ins, o) -> None:
  """A gather: rows of the identity (a one-hot of the labels), or the label's logit picked from the
  logits or the log-softmax (by ``take_along_axis``, advanced or flat indexing)."""
  src, idx = ins[0], ins[1]
  if not isinstance(src, Lit) and src in h.identity:
    h._identity_rows(n, idx, o)
    return
  rows = None if isinstance(src, Lit) or h.along_vocab(src) else _rows_of_flat(h, src)
  followed = not isinstance(src, Lit) and (src in h.elem or src in h.probs)
  if followed and (h.along_vocab(src) or rows is not None):
    labels, nodes = ((_advanced_index(h, n, idx) or h._labels_of(idx)) if rows is None
                     else _flat_index(h, n, rows, idx) or (None, []))
    if labels is None or (h.labels is not None and h.labels != labels):
      return
    outside = _head_values.gather_outside(n)
    if outside is None or h.pick_outside not in (None, outside):
      return
    h.labels = labels
    h.label_nodes.update(nodes)
    h.picks.add("gather")
    h.pick_outside = outside
    # What the gather drops for a label outside [0, V) besides the one-hot: where the
    # picked value carries the row's log-sum-exp (a log-softmax's, a probability's), the
    # token's whole gradient (the log-sum-exp's share of it comes through the pick)
    h.pick_carries_row = h.pick_carries_row or src in h.probs or any(
        k != "z" for k in h.elem.get(src, {}))
    h.rows[o] = ({"prob:" + h.probs[src]: 1.0} if src in h.probs else
                    {("pick" if k == "z" else k): c for k, c in h.elem[src].items()})
  elif not isinstance(src, Lit) and src in h.rows and all(
      isinstance(r, Lit) or r not in h.elem for r in ins[1:]):
    h.rows[o] = h.rows[src]  # .take(0) of a size-1 axis


def _advanced_index(h, n, idx):
  """``z[arange(n), labels]`` (NumPy's advanced indexing: a gather whose indices are the
  positions along every other axis and the labels along the vocabulary): ``(labels,
  nodes)``, else None."""
  g = h.g
  dn = n.params["dimension_numbers"]
  src_ndim = len(g.avals[n.ins[0]].shape)
  if (isinstance(idx, Lit) or idx not in g.producer or tuple(dn.offset_dims)
      or tuple(dn.start_index_map) != tuple(range(src_ndim))):
    return None
  cat_i = g.producer[idx][0]
  cat = g.nodes[cat_i]
  if cat.prim.name != "concatenate" or len(cat.ins) != src_ndim:
    return None
  nodes = [cat_i]
  for axis, piece in enumerate(cat.ins[:-1]):  # the positions along the other axes
    chain = _head_values.position_along(g, piece, axis)
    if chain is None:
      return None
    nodes += chain
  labels, label_nodes = h._labels_of(cat.ins[-1])
  return None if labels is None else (labels, nodes + label_nodes)


def _rows_of_flat(h, ref) -> int | None:
  """The number of rows when ``ref`` is the logits flattened (a 1-D reshape of a followed
  [..., V] value: row after row), else None."""
  g = h.g
  if isinstance(ref, Lit) or ref not in g.producer or len(g.avals[ref].shape) != 1:
    return None
  n = g.nodes[g.producer[ref][0]]
  src = n.ins[0]
  if (n.prim.name != "reshape" or isinstance(src, Lit) or src not in h.elem
      or not h.along_vocab(src) or n.params.get("dimensions") is not None):
    return None
  return math.prod(g.avals[src].shape[:-1])


def _flat_index(h, n, rows: int, idx):
  """``z.reshape(-1)[arange(rows) * V + labels]`` (or ``jnp.take`` of it, NumPy's wrap of
  negative indices included): ``(labels, nodes)``, else None."""
  g = h.g
  dn = n.params["dimension_numbers"]
  if (tuple(dn.offset_dims) or tuple(dn.collapsed_slice_dims) != (0,)
      or tuple(dn.start_index_map) != (0,) or isinstance(idx, Lit)):
    return None
  producer = lambda r: (None if isinstance(r, Lit) or r not in g.producer  # noqa: E731
                        else g.producer[r][0])
  size = rows * h.vocab
  nodes, r = [], idx
  while (i := producer(r)) is not None and g.nodes[i].prim.name in (
      "broadcast_in_dim", "reshape", "select_n", "convert_element_type"):
    node = g.nodes[i]
    nodes.append(i)
    if node.prim.name == "select_n":  # where(i < 0, i + size, i): NumPy's wrap
      pred, keep, wrapped = node.ins
      lt, add = producer(pred), producer(wrapped)
      if (lt is None or add is None or g.nodes[lt].prim.name != "lt"
          or g.nodes[add].prim.name != "add" or g.nodes[lt].ins[0] is not keep
          or h._const(g.nodes[lt].ins[1]) != 0.0 or g.nodes[add].ins[0] is not keep
          or h._const(g.nodes[add].ins[1]) != size):
        return None
      nodes += [lt, add]
      r = keep
    else:
      r = node.ins[0]
  i = producer(r)
  if i is None or g.nodes[i].prim.name != "add":
    return None
  nodes.append(i)
  for offset, labels in (g.nodes[i].ins, g.nodes[i].ins[::-1]):
    m = producer(offset)
    if m is None or g.nodes[m].prim.name != "mul":
      continue
    a, b = g.nodes[m].ins
    stride = h._const(b) if isinstance(b, Lit) else h._const(a)
    position = a if isinstance(b, Lit) else b
    along = _head_values.position_along(g, position, 0)
    if stride != h.vocab or along is None or tuple(g.avals[position].shape) != (rows,):
      continue
    found, label_nodes = h._labels_of(labels)
    if found is not None:
      return found, nodes + [m] + along + label_nodes
  return None


def _select(h, n, ins, o) -> None:
  """``where(mask, v, c)`` along the vocabulary, ``v`` followed, ``c`` a constant and
  ``mask`` the same for each row's entries (optax's ``where=``, a per-token mask spread over
  the logits: ``jax.nn.logsumexp(z, where=...)``): ``v`` in the rows the mask keeps; the
  per-token loss must drop the other rows by a select of its own (:func:`_masked_away`).
  Otherwise a row value's clamp (:meth:`_shift_step`)."""
  if not h.along_vocab(o):
    _shift_step(h, n, ins, o)
    return
  if len(ins) != 3 or isinstance(ins[2], Lit) or _head_values.constant(h.g, ins[1]) is None:
    return
  if _zero_where_untargeted(h, ins):
    h.weighted[o] = h.weighted[ins[2]]
    return
  if (not isinstance(ins[0], Lit) and h.target.get(ins[0]) == (1.0, 0.0)
      and ins[2] in h.elem and _head_values.zero(h.g, ins[1])):
    # where(one-hot, v, 0): the one-hot's predicate picks v at the label
    h.weighted[o] = ((1.0, 0.0), h.elem[ins[2]])
    _take_zeros(h, ins[1])
    return
  mask = _head_values.mask_root(h.g, ins[0])
  if mask is None or _head_values.mask_size(h.g, mask) * h.vocab != np.prod(h.g.avals[o].shape):
    return  # a mask of single logits (or none): not a per-token one
  if h.mask is not None and not _head_values.same_ref(h.mask, mask):
    return
  for table in (h.elem, h.exps, h.weighted):
    if ins[2] in table:
      if table is h.weighted:
        if not _head_values.zero(h.g, ins[1]):
          return
        h.zeroed.add(o)  # the target's weighted logits, zero in the dropped rows
      h.mask = mask
      table[o] = table[ins[2]]
      return


def _zero_where_untargeted(h, ins) -> bool:
  """Whether ``select_n(t != 0, 0, t * v)`` reads the target weight ``t`` times a followed
  logits value ``v`` (optax's ``safe_softmax_cross_entropy``: ``0 log 0 = 0``): where
  ``t`` is zero so is ``t * v`` for the finite logits a matmul computes, so the select
  passes ``t * v`` on unchanged."""
  pred, zero, value = ins
  if value not in h.weighted or not _head_values.zero(h.g, zero) or isinstance(pred, Lit) or (
      pred not in h.g.producer):
    return False
  ne = h.g.nodes[h.g.producer[pred][0]]
  if ne.prim.name != "ne" or len(ne.ins) != 2:
    return False
  for t, c in (ne.ins, ne.ins[::-1]):
    if (not isinstance(t, Lit) and t in h.target and _head_values.zero(h.g, c)
        and h.target[t] == h.weighted[value][0]):
      h.helpers.add(h.g.producer[pred][0])
      _take_zeros(h, zero)
      return True
  return False


def _take_zeros(h, zero) -> None:
  """The nodes making the zeros a select reads (a literal broadcast and cast to shape)
  become the region's helpers."""
  while not isinstance(zero, Lit):
    i = h.g.producer[zero][0]
    h.helpers.add(i)
    zero = h.g.nodes[i].ins[0]


def _shift_step(h, n, ins, o) -> None:
  """A row constant computed from z (a max and its clamps): a shift."""
  a = h.g.avals[o]
  stop = n.prim.name == "stop_gradient"
  if a.shape and a.shape[-1] == h.vocab and not stop:
    return
  if stop and ins[0] in h.rows:
    h.rows[o] = h.rows[ins[0]]
    return
  if jnp.issubdtype(a.dtype, jnp.floating):
    h.rows[o] = {h._shift(): 1.0}


#: Primitive -> how a value computed by it from followed values is followed.
STEPS = {
    **{p: _same for p in _primitives.HEAD_SAME | _primitives.SHAPE | {"transpose"}
       | _primitives.SHARDING},
    "add": _add_sub, "sub": _add_sub, "neg": _neg,
    "mul": _mul_div, "div": _mul_div, "exp": _exp,
    "reduce_sum": _reduce_sum, "log": _log, "gather": _gather,
    "tanh": _tanh, "square": _square, "integer_pow": _square,
    **{p: _shift_step for p in ("stop_gradient", "reduce_max", "max", "is_finite")},
    "select_n": _select, "dot_general": _dot,
}
