"""The LM head's loss found by its algebra, whatever library wrote it.

A matmul ``z = x @ w (+ b)`` whose output feeds, and only feeds, a cross-entropy against
integer labels — ``log_softmax`` or ``logsumexp``, the label's logit picked by
``take_along_axis`` or summed against a one-hot (optax's ``softmax_cross_entropy`` and
``softmax_cross_entropy_with_integer_labels``, hand-written forms, label smoothing) — is
found by following every value computed from ``z`` as a linear combination of

* elementwise ``[..., V]`` values: ``z`` itself and row constants broadcast along the
  vocabulary: a shift ``k`` (a max, behind ``stop_gradient`` or not: any shift cancels) and
  ``ls_k = log(sum(exp(z - k)))``;
* per-token (row) values: ``k``, ``ls_k``, the label's logit ``pick``, ``zsum = sum(z)``;
* a target weight ``a * onehot(label) + u`` (a one-hot of the labels, smoothed or not) and
  its product with an elementwise value.

A row value equal to ``ls_k + k - (1 - s) * pick - (s / V) * zsum`` is the per-token loss
with label smoothing ``s``.  Then the program's reduction of the per-token losses is
followed (:func:`fold_reduction`): where it is a weighted sum — a mean, a masked mean, a
sum of losses times weights, any chain of casts, reshapes, products and quotients with values
not computed from the losses, selects against zero and sums that ends in a scalar — it is
folded into the head, whose gradients are then computed in the forward
(``invact_jax.ops.cross_entropy.in_forward``) with per-token weights that are the chain's
derivative.  Otherwise the region (the matmul, the loss, the labels' one-hot and index
arithmetic) becomes :func:`invact_jax.linear_cross_entropy` with ``reduction="none"`` and
the program's own reduction follows.  Either way no [tokens, V] buffer remains.  A weight
that is a 16-bit cast of a float32 one is read as the float32 weight (the head casts it one
chunk at a time), so that its float32 gradient accumulator is its gradient.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _graph
from invact_jax.convert import _match
from invact_jax.convert import _primitives
from invact_jax.convert._graph import Lit

__all__ = ["HeadMatch", "Fold", "find_heads", "fold_reduction", "calls_on_logits"]

_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Fold:
  """The program's reduction of the per-token losses as a weighted sum.

  Attributes:
    nodes: the reduction's node indices (from the per-token losses to ``out``).
    out: the scalar it computes.
    extras: the values it reads that are not computed from the losses (masks, weights,
      counts), the unit's further inputs.
  """
  nodes: frozenset
  out: int
  extras: tuple


@dataclasses.dataclass
class HeadMatch:
  """A matmul + cross-entropy found in a program.

  Attributes:
    nodes: the region's node indices; ``root``: the node computing the per-token loss.
    x, w, bias, labels: the region's inputs (``bias`` None when there is none).
    vocab_axis: ``w``'s vocabulary axis (1: [d, V], 0: [V, d]).
    smoothing: the label smoothing.
    sign: +1 (the loss) or -1 (its negation, the log-likelihood).
    fold: the program's reduction folded into the head, or None.
    why_not_folded: why the reduction was not folded ("" when it was).
    soft_cap: ``c`` of the logits' ``c * tanh(z / c)``, or None.
    logits_dtype: the 16-bit dtype the program's matmul rounds the logits to, or None.
    z_loss: the weight of the log-sum-exp's square added to each token's loss (PaLM's and
      MaxText's z-loss), 0 for none.
    logit_scale: the factor the cross-entropy reads the logits at (``logits / sqrt(d)``).
    lse_reads: ``(value, a, b)`` per value of the region the program also reads elsewhere,
      each ``a * lse + b * lse ** 2`` per token (a z-loss reduced on its own, or returned as a
      metric): the unit computes them from the head's log-sum-exp, with their gradients.
    temperature: ``(s, "mul")`` or ``(s, "div")`` where the logits (bias added) are multiplied
      or divided by ``s``, a traced scalar (a learnable temperature), an input of the region;
      the head reads the tokens (and the bias) scaled by it instead.
    vocab_sharding: the ``NamedSharding`` the program constrains the logits to where it splits
      the vocabulary over mesh axes (a tensor-parallel head): the head runs per shard in
      ``shard_map`` (``vocab_axis_name``), the tokens as the constraint places them; None.
    mask: a per-token boolean mask whose dropped tokens' loss is zero (optax's ``where=`` of
      a one-hot cross-entropy), an input of the region; None for none.
    outside_lse: a token's loss where its label lies outside ``[0, V)``, as the program reads
      the label's logit: through a one-hot (a row of zeros), that share of its log-sum-exp
      (``linear_cross_entropy``'s ``Options.outside_lse``); through a gather, None (NaN).
    clamp_labels: the program reads the label's logit (or its one-hot row, ``jnp.eye(V)
      [labels]``) through a gather that takes the nearest entry, and its gradient there,
      for a label outside ``[0, V)`` (``clip``; ``promise_in_bounds`` for the one-hot): the
      head reads the labels clamped to ``[0, V - 1]`` likewise.
    pick_nearest: the program picks the label's logit through a gather that reads the
      nearest entry for a label outside ``[0, V)`` and drops its gradient (jnp indexing's
      ``promise_in_bounds`` on XLA): ``Options.outside_nearest``.
    outside_gradient: for a label outside ``[0, V)`` the program's gradient keeps the
      softmax (its log-sum-exp read apart from the pick), or none (False: the picked value
      carries the log-sum-exp, a log-softmax's pick, whose gradient the gather drops whole):
      ``Options.outside_gradient``.
  """
  nodes: list
  root: int
  x: object
  w: object
  bias: object
  labels: object
  vocab_axis: int
  smoothing: float
  sign: float
  fold: Fold | None = None
  why_not_folded: str = ""
  soft_cap: float | None = None
  logits_dtype: str | None = None
  z_loss: float = 0.0
  mask: object = None
  outside_lse: float | None = None
  logit_scale: float = 1.0
  lse_reads: tuple = ()
  temperature: tuple | None = None
  vocab_sharding: object = None
  clamp_labels: bool = False
  pick_nearest: bool = False
  outside_gradient: bool = True

  public = "linear_cross_entropy"

  @property
  def inputs(self) -> list:
    return [r for r in (self.x, self.w, self.bias, self.labels, self.mask,
                        self.temperature and self.temperature[0]) if r is not None] + (
                            list(self.fold.extras) if self.fold else [])

  def output(self, g: _graph.Graph):
    """The program value the region computes: the folded scalar or the per-token losses."""
    return self.fold.out if self.fold else g.nodes[self.root].outs[0]

  def outputs(self, g: _graph.Graph) -> list:
    """Every value of the region the program reads: :meth:`output`, then :attr:`lse_reads`'."""
    return [self.output(g)] + [r for r, _, _ in self.lse_reads]

  @property
  def name(self) -> str:
    extra = f", label smoothing {self.smoothing:g}" if self.smoothing else ""
    if self.z_loss:
      extra += f", z-loss {self.z_loss:g}"
    if self.soft_cap is not None:
      extra += f", logits soft-capped at {self.soft_cap:g}"
    if self.logit_scale != 1.0:
      extra += f", logits scaled by {self.logit_scale:.6g}"
    if self.temperature is not None:
      extra += (", logits " + ("times" if self.temperature[1] == "mul" else "divided by")
                + " a traced scalar")
    if self.vocab_sharding is not None:
      extra += f", vocabulary split over mesh axes {self.vocab_sharding.spec[-1]!r}"
    if self.fold:
      how = "its weighted sum folded in, gradients in the forward"
    else:
      how = f"per token, gradients by recomputing the logits: {self.why_not_folded}"
    return f"matmul + cross-entropy by its algebra{extra} ({how})"


def _add(a: dict, b: dict, sign: float = 1.0) -> dict:
  out = dict(a)
  for k, v in b.items():
    out[k] = out.get(k, 0.0) + sign * v
    if abs(out[k]) <= _TOL:
      del out[k]
  return out


def _scale(a: dict, c: float) -> dict:
  return {k: v * c for k, v in a.items()} if c else {}


class _Head:
  """Values computed from one matmul's output ``z``, followed forward."""

  def __init__(self, g: _graph.Graph, dot: int, vocab: int, vaxis: int):
    self.g, self.dot, self.vocab, self.vaxis = g, dot, vocab, vaxis
    z = g.nodes[dot].outs[0]
    self.elem = {z: {"z": 1.0}}      # [..., V] linear values
    self.rows = {}                   # [...] (or [..., 1]) row values
    self.exps = {}                   # exp(z - k): ref -> k symbol
    self.sums = {}                   # sum over V of exp(z - k): ref -> k symbol
    self.probs = {}                  # exp(z - k) / sum(exp(z - k)), the softmax: ref -> k
    self.target = {}                 # a * onehot + u: ref -> (a, u)
    self.identity = {}               # jnp.eye(V): ref -> the nodes computing it
    self.weighted = {}               # target * linear: ref -> ((a, u), linear)
    self.bias = None
    self.labels = None
    self.label_nodes: set = set()
    self.nshift = 0
    self.tanh = {}                   # tanh(z / c): ref -> c (a soft cap's inside)
    self.cap = None                  # c of c * tanh(z / c), once found
    self.cap_nodes: set = set()      # the cap's division, tanh and product
    self.permuted = False            # a transpose moved the token axes (reshapes keep order)
    self.mask = None                 # a per-token mask the log-sum-exp was taken under
    self.zeroed: set = set()         # [..., V] values the mask sets to zero in its dropped rows
    self.masked_rows: set = set()    # row values zero in the rows the mask drops
    self.helpers: set = set()        # nodes of [..., V] predicates and constants it selects by
    self.picks: set = set()          # how the label's logit is read: "one_hot", "gather"
    self.clamp_labels = False        # the one-hot is jnp.eye(V)[labels]
    self.pick_outside = None         # a gather pick's label outside [0, V): _gather_outside
    self.pick_carries_row = False    # the picked value holds the log-sum-exp too
    self.scale = None                # the logits' factor where the log-sum-exp reads them
    self.temperature = None          # (traced scalar, "mul" or "div") applied to the logits
    self.vocab_sharded = False       # ... to shards of the vocabulary the head cannot run on
    self.vocab_split = None          # (sharding, shape): the logits constrained to shards of
    #                                  the vocabulary, over a mesh the head runs per shard on
    self.temperature_nodes: set = set()

  def _is_v(self, ref) -> bool:
    a = self.g.avals[ref]
    return bool(a.shape) and a.shape[-1] == self.vocab

  def _const(self, r):
    """The scalar constant ``r`` is (a literal, or a broadcast or cast of one), else None."""
    return _constant(self.g, r)

  def _shift(self) -> str:
    self.nshift += 1
    return f"k{self.nshift}"

  def _labels_of(self, ref):
    """``(labels, nodes)``: the integer labels ``ref`` equals, followed back through
    ``nodes`` — shape changes, copies, integer casts — to a program input, a constant or a
    value computed otherwise (``y + 1``, a clamp, or NumPy's wrap of negative indices
    ``where(i < 0, i + V, i)`` that an index's pick applies, which is then the labels,
    computed outside the head); ``(None, [])`` where ``ref`` is no integer array."""
    g, nodes, r = self.g, [], ref
    while not isinstance(r, Lit) and r in g.producer:
      i = g.producer[r][0]
      nxt = self._label_step(g.nodes[i])
      if nxt is None:
        break
      nodes.append(i)
      r = nxt
    if isinstance(r, Lit):  # labels closed over: a constant array of the program
      ok = (np.ndim(r.val) and not isinstance(r.val, jax.core.Tracer)
            and jnp.issubdtype(np.asarray(r.val).dtype, jnp.integer))
    else:
      ok = jnp.issubdtype(g.avals[r].dtype, jnp.integer)
    return (r, nodes) if ok else (None, [])

  def _label_step(self, n):
    """The input node ``n``'s integer output equals, whatever its value (a shape change, a
    copy, an integer cast), or None where it computes something else."""
    name, ins = n.prim.name, n.ins
    integer = lambda r: (not isinstance(r, Lit)  # noqa: E731
                         and jnp.issubdtype(self.g.avals[r].dtype, jnp.integer))
    if len(n.outs) != 1 or not integer(n.outs[0]):
      return None
    if name in _primitives.SHAPE | _primitives.IDENTITY:
      return ins[0] if integer(ins[0]) or isinstance(ins[0], Lit) else None
    return None  # (a clamp too: it moves a label outside [0, V), -100 say, into the vocabulary)

  def _known(self, r) -> bool:
    return not isinstance(r, Lit) and any(r in t for t in self._tables())

  def _tables(self) -> tuple:
    return (self.elem, self.rows, self.exps, self.sums, self.target, self.weighted, self.tanh,
            self.probs, self.identity)

  def step(self, i: int) -> None:
    """Follow node ``i`` (in program order) if it computes from values followed so far."""
    n = self.g.nodes[i]
    if len(n.outs) != 1:
      return
    if n.prim.name == "eq" and self._one_hot(i, n):
      return
    if not any(self._known(r) for r in n.ins):
      return
    handler = _STEPS.get(n.prim.name)
    if handler is not None:
      handler(self, n, n.ins, n.outs[0])

  def _one_hot(self, i: int, n) -> bool:
    """``iota == labels`` along the vocabulary: a one-hot of the labels (True: handled)."""
    g = self.g
    # the positions along the vocabulary: an iota, broadcast (as vmap spreads one) or not
    along = lambda r: None if isinstance(r, Lit) else _position_along(  # noqa: E731
        g, r, len(g.avals[r].shape) - 1)
    iotas = [along(r) for r in n.ins]
    if not (any(c is not None for c in iotas) and self._is_v(n.outs[0])):
      return False
    k = next(k for k, c in enumerate(iotas) if c is not None)
    if self._identity(i, n, iotas[k], n.ins[1 - k]):
      return True
    labels, nodes = self._labels_of(n.ins[1 - k])
    if labels is not None and (self.labels is None or self.labels == labels):
      self.labels = labels
      self.label_nodes.update(nodes)
      self.label_nodes.update(iotas[k])
      self.label_nodes.add(i)
      self.picks.add("one_hot")
      self.target[n.outs[0]] = (1.0, 0.0)
    return True

  def _identity(self, i: int, n, columns: list, other) -> bool:
    """``iota(0) == iota(1)`` over [V, V], ``jnp.eye(V)``: recorded (True), its rows picked
    by the labels their one-hot (:meth:`_identity_rows`); ``columns``: the nodes computing
    the positions along its last axis."""
    g = self.g
    rows = None if isinstance(other, Lit) else _position_along(g, other, 0)

    def plain(j: int) -> bool:  # (an offset diagonal, jnp.eye(V, k=1), is no identity)
      m = g.nodes[j]
      return m.prim.name in ("iota", "broadcast_in_dim", "convert_element_type") or (
          m.prim.name == "add" and any(self._const(r) == 0 for r in m.ins))
    if (tuple(g.avals[n.outs[0]].shape) != (self.vocab, self.vocab) or rows is None
        or not all(plain(j) for j in [*rows, *columns])):
      return False
    self.identity[n.outs[0]] = [i, *columns, *rows]
    return True

  def _identity_rows(self, n, idx, o) -> None:
    """``jnp.eye(V)[labels]``: the identity's rows at the labels, their one-hot."""
    g, dn = self.g, n.params["dimension_numbers"]
    out = tuple(g.avals[o].shape)
    if (tuple(dn.offset_dims) != (len(out) - 1,) or tuple(dn.collapsed_slice_dims) != (0,)
        or tuple(dn.start_index_map) != (0,) or isinstance(idx, Lit)
        or tuple(n.params["slice_sizes"]) != (1, self.vocab)
        or tuple(g.avals[idx].shape) != out[:-1] + (1,)):
      return
    labels, nodes = self._labels_of(idx)
    if labels is None or (self.labels is not None and self.labels != labels):
      return
    self.labels = labels
    self.label_nodes.update(nodes)
    self.label_nodes.update(self.identity[n.ins[0]])
    self.picks.add("one_hot")
    self.clamp_labels = True
    self.target[o] = (1.0, 0.0)

  def _same(self, n, ins, o) -> None:
    """A cast, copy, reshape, broadcast, transpose or sharding constraint: the value it passes
    on.  Logits constrained to shards of the vocabulary (a tensor-parallel head) are
    followed where the head can run per shard (:func:`_vocab_split`)."""
    src = ins[0]
    if isinstance(src, Lit):
      return
    if n.prim.name in _primitives.SHARDING and src in self.elem and _splits_last(
        n, self.g.avals[o].shape):
      split = _vocab_split(n, tuple(self.g.avals[o].shape))
      if split is None or (self.vocab_split is not None and self.vocab_split != split):
        self.vocab_sharded = True
        return
      self.vocab_split = split
    if n.prim.name == "transpose":
      perm = tuple(n.params["permutation"])
      if (src in self.elem or src in self.exps) and perm[-1] != len(perm) - 1:
        return  # the vocabulary axis moved: not followed
      self.permuted |= perm != tuple(range(len(perm)))
    for table in self._tables():
      if src in table:
        if table is self.rows and self._is_v(o):
          if n.prim.name == "broadcast_in_dim":
            self.elem[o] = dict(table[src])  # a row value spread along the vocabulary
          return
        table[o] = table[src]
        return

  def _add_sub(self, n, ins, o) -> None:
    a, b = ins
    sign = 1.0 if n.prim.name == "add" else -1.0
    lin = lambda r: None if isinstance(r, Lit) else self.elem.get(r, self.rows.get(r))  # noqa: E731
    if all(not isinstance(r, Lit) and r in self.rows for r in (a, b)):
      self.rows[o] = _add(self.rows[a], self.rows[b], sign)
    elif lin(a) is not None and lin(b) is not None and self._is_v(o):
      self.elem[o] = _add(lin(a), lin(b), sign)  # a row value spread along the vocabulary
    elif self._is_v(o) and (shifted := self._scalar_shift(a, b, sign)) is not None:
      # a scalar added to the logits (or subtracted): a row constant, a shift of each row
      self.elem[o] = _add(self.elem[shifted], {self._shift(): -1.0})
    elif not isinstance(a, Lit) and a in self.target and self._const(b) is not None:
      t = self.target[a]
      self.target[o] = (t[0], t[1] + sign * self._const(b))
    elif (not isinstance(a, Lit) and a == self.g.nodes[self.dot].outs[0] and sign > 0
          and self.bias is None and not isinstance(b, Lit)):
      # the bias: z + b with b [V] spread over the tokens
      src, chain = _spread_source(self.g, b)
      if src is not None and tuple(_match.aval(self.g, src).shape) == (self.vocab,):
        self.bias = (src, chain)
        self.elem[o] = {"z": 1.0}

  def _scalar_shift(self, a, b, sign: float):
    """The followed logits value of ``a + b`` (``a - b``: ``sign`` -1) whose other operand is a
    scalar constant, else None."""
    for r, c in ((a, b),) if sign < 0 else ((a, b), (b, a)):
      if not isinstance(r, Lit) and r in self.elem and self._const(c) is not None:
        return r
    return None

  def _neg(self, n, ins, o) -> None:
    for table in (self.elem, self.rows):
      if ins[0] in table:
        table[o] = _scale(table[ins[0]], -1.0)
    if ins[0] in self.masked_rows:
      self.masked_rows.add(o)

  def _tanh(self, n, ins, o) -> None:
    """``tanh(z / c)``: the inside of a soft cap ``c * tanh(z / c)`` (Gemma 2)."""
    lin = self.elem.get(ins[0])
    if self.cap is None and lin is not None and set(lin) == {"z"} and lin["z"] > 0:
      self.tanh[o] = 1.0 / lin["z"]
      self.cap_nodes |= {self.g.producer[ins[0]][0], self.g.producer[o][0]}

  def _capped(self, o, c: float) -> None:
    """``c * tanh(z / c)``: the capped logits become the cross-entropy's ``z``; the raw ones
    are the cap's inside only."""
    self.cap = c
    self.cap_nodes.add(self.g.producer[o][0])
    self.cap_nodes |= {self.g.producer[r][0] for r in self.elem if r in self.g.producer}
    self.elem = {o: {"z": 1.0}}

  def _mul_div(self, n, ins, o) -> None:
    a, b = ins
    if n.prim.name == "mul" and a == b:
      self._square(n, ins, o)
      return
    c = self._const(b)
    if c is None and n.prim.name == "mul" and self._const(a) is not None:
      c, a = self._const(a), b
    if (c is not None and n.prim.name == "mul" and not isinstance(a, Lit) and a in self.tanh
        and abs(c - self.tanh[a]) <= _TOL * abs(c)):
      self._capped(o, c)
      return
    if c is not None:  # a constant factor
      c = c if n.prim.name == "mul" else 1.0 / c
      for table in (self.elem, self.rows):
        if not isinstance(a, Lit) and a in table:
          table[o] = _scale(table[a], c)
      if not isinstance(a, Lit) and a in self.target:
        t = self.target[a]
        self.target[o] = (t[0] * c, t[1] * c)
      return
    if (n.prim.name == "div" and not isinstance(a, Lit) and not isinstance(b, Lit)
        and a in self.exps and self.sums.get(b) == self.exps[a]):
      self.probs[o] = self.exps[a]  # the softmax: exp(z - k) / sum(exp(z - k))
      return
    if self._traced_factor(n, a, b, o):
      return
    if n.prim.name == "mul":  # the target weight times a linear value
      for t_ref, l_ref in ((a, b), (b, a)):
        if (not isinstance(t_ref, Lit) and t_ref in self.target and not isinstance(l_ref, Lit)
            and l_ref in self.elem):
          self.weighted[o] = (self.target[t_ref], self.elem[l_ref])

  def _traced_factor(self, n, a, b, o) -> bool:
    """``z * s``, ``s * z`` or ``z / s`` with ``s`` a traced scalar (a learnable temperature)
    on the matmul's logits (bias added or not) before anything else reads them: the scaled
    logits become the head's ``z`` (True: handled)."""
    g = self.g
    if self.temperature is not None or any(
        (self.rows, self.exps, self.sums, self.weighted, self.tanh)) or self.cap is not None:
      return False
    for z, t in ((a, b),) if n.prim.name == "div" else ((a, b), (b, a)):
      if isinstance(z, Lit) or isinstance(t, Lit) or self.elem.get(z) != {"z": 1.0}:
        continue
      src, chain = _spread_source(g, t)
      if (src is None or isinstance(src, Lit) or math.prod(g.avals[src].shape) != 1
          or not jnp.issubdtype(g.avals[src].dtype, jnp.floating)):
        continue
      self.temperature = (src, n.prim.name)
      self.temperature_nodes = {g.producer[o][0], *chain} | {
          g.producer[r][0] for r in self.elem if r in g.producer}
      self.elem = {o: {"z": 1.0}}
      return True
    return False

  def _exp(self, n, ins, o) -> None:
    """``exp(a z - k)``, ``k`` a sum of row constants (a max, the program's own shift before
    the loss's, a scalar): its shift ``k``, their names joined by "+"; ``a > 0`` the logits'
    scale (``logits / sqrt(d)``), the same for every log-sum-exp of the head."""
    lin = self.elem.get(ins[0])
    if lin is not None and lin.get("z", 0.0) > 0.0 and all(
        k == "z" or k.startswith("k") for k in lin):
      shifts = sorted(k for k in lin if k.startswith("k"))
      if all(lin[k] == -1.0 for k in shifts) and (
          self.scale is None or abs(lin["z"] - self.scale) <= _TOL * self.scale):
        self.scale = lin["z"]
        self.exps[o] = "+".join(shifts)

  def _reduce_sum(self, n, ins, o) -> None:
    src = ins[0]
    if tuple(int(a) for a in n.params["axes"]) != (len(self.g.avals[src].shape) - 1,):
      return
    if src in self.exps:
      self.sums[o] = self.exps[src]
    elif src in self.weighted:
      if src in self.zeroed:
        self.masked_rows.add(o)
      self.rows[o] = self._target_sum(*self.weighted[src])
    elif src in self.elem:
      row = {}
      for sym, c in self.elem[src].items():
        row = _add(row, {"zsum": c} if sym == "z" else {sym: c * self.vocab})
      self.rows[o] = row

  def _target_sum(self, target: tuple, lin: dict) -> dict:
    """The row value ``sum over V of (a * onehot + u) * lin``."""
    (a, u), row = target, {}
    for sym, c in lin.items():
      if sym == "z":
        row = _add(row, {"pick": a * c, "zsum": u * c})
      else:  # a row constant spread along V: weighted sum is (a + u V) times it (the
        # one-hot's share ``a`` apart: a label outside [0, V) has none)
        row = _add(row, {sym: c * u * self.vocab, "hot:" + sym: c * a})
    return row

  def _dot(self, n, ins, o) -> None:
    """``einsum("...v,...v->...", target, lin)``: a matmul contracting the vocabulary, batched
    over every other axis, of the target and a followed logits value."""
    (lc, rc), (lb, rb) = n.params["dimension_numbers"]
    if any(isinstance(r, Lit) for r in ins) or len(ins) != 2:
      return
    nd = len(self.g.avals[ins[0]].shape)
    if (tuple(self.g.avals[ins[1]].shape) != tuple(self.g.avals[ins[0]].shape)
        or tuple(lc) != (nd - 1,) or tuple(rc) != (nd - 1,)
        or tuple(lb) != tuple(range(nd - 1)) or tuple(rb) != tuple(range(nd - 1))):
      return
    for t_ref, l_ref in (ins, ins[::-1]):
      if t_ref in self.target and l_ref in self.elem:
        self.rows[o] = self._target_sum(self.target[t_ref], self.elem[l_ref])
        return

  def _log(self, n, ins, o) -> None:
    if ins[0] in self.sums:
      self.rows[o] = {"ls" + self.sums[ins[0]]: 1.0}
    elif ins[0] in self.probs:  # log(softmax(a z)) = a z - k - log(sum(exp(a z - k)))
      k = self.probs[ins[0]]
      self.elem[o] = {"z": self.scale or 1.0, "ls" + k: -1.0, **{s: -1.0 for s in _shifts(k)}}
    elif len(self.rows.get(ins[0], {})) == 1 and next(iter(self.rows[ins[0]])).startswith(
        "prob:"):
      # log(softmax(a z)[y]) = a z[y] - k - log(sum(exp(a z - k))): the log-likelihood
      (sym, c), = self.rows[ins[0]].items()
      if c == 1.0:
        k = sym[5:]
        self.rows[o] = {"pick": self.scale or 1.0, "ls" + k: -1.0,
                        **{s: -1.0 for s in _shifts(k)}}

  def _square(self, n, ins, o) -> None:
    """``lse ** 2`` (``square``, ``integer_pow`` 2, or ``lse * lse`` from :meth:`_mul_div`):
    a z-loss's term."""
    if n.prim.name == "integer_pow" and n.params.get("y") != 2:
      return
    row = None if isinstance(ins[0], Lit) else self.rows.get(ins[0])
    if row is not None and self._is_lse(row):
      self.rows[o] = {"zsq": 1.0}

  def lse_form(self, ref) -> tuple[float, float] | None:
    """``(a, b)`` where the value ``ref`` is ``a * lse + b * lse ** 2`` per token, ``lse``
    the log-sum-exp of the head's logits (at any shift), else None."""
    row = None if isinstance(ref, Lit) else self.rows.get(ref)
    if row is None or ref in self.masked_rows:
      return None
    b = row.get("zsq", 0.0)
    rest = {k: c for k, c in row.items() if k != "zsq"}
    lss = [k for k in rest if k.startswith("ls")]
    if not rest:
      return 0.0, b
    if len(lss) != 1:
      return None
    a = rest[lss[0]]
    want = {lss[0]: a, **{k: a for k in _shifts(lss[0][2:])}}
    if set(rest) != set(want) or any(abs(rest[k] - c) > _TOL * abs(a) for k, c in want.items()):
      return None
    return a, b

  @staticmethod
  def _is_lse(row: dict) -> bool:
    """Whether ``row`` is one log-sum-exp: its log-sum plus the shift it was taken at."""
    lss = [k for k in row if k.startswith("ls")]
    if len(lss) != 1:
      return False
    want = {lss[0]: 1.0, **{k: 1.0 for k in _shifts(lss[0][2:])}}
    return set(row) == set(want) and all(abs(row[s] - c) <= _TOL for s, c in want.items())

  def _gather(self, n, ins, o) -> None:
    src, idx = ins[0], ins[1]
    if not isinstance(src, Lit) and src in self.identity:
      self._identity_rows(n, idx, o)
      return
    rows = None if isinstance(src, Lit) or self._is_v(src) else self._rows_of_flat(src)
    followed = not isinstance(src, Lit) and (src in self.elem or src in self.probs)
    if followed and (self._is_v(src) or rows is not None):
      labels, nodes = ((self._advanced_index(n, idx) or self._labels_of(idx)) if rows is None
                       else self._flat_index(n, rows, idx) or (None, []))
      if labels is None or (self.labels is not None and self.labels != labels):
        return
      outside = _gather_outside(n)
      if outside is None or self.pick_outside not in (None, outside):
        return
      self.labels = labels
      self.label_nodes.update(nodes)
      self.picks.add("gather")
      self.pick_outside = outside
      # What the gather drops for a label outside [0, V) besides the one-hot: where the
      # picked value carries the row's log-sum-exp (a log-softmax's, a probability's), the
      # token's whole gradient (the log-sum-exp's share of it comes through the pick)
      self.pick_carries_row = self.pick_carries_row or src in self.probs or any(
          k != "z" for k in self.elem.get(src, {}))
      self.rows[o] = ({"prob:" + self.probs[src]: 1.0} if src in self.probs else
                      {("pick" if k == "z" else k): c for k, c in self.elem[src].items()})
    elif not isinstance(src, Lit) and src in self.rows and all(
        isinstance(r, Lit) or r not in self.elem for r in ins[1:]):
      self.rows[o] = self.rows[src]  # .take(0) of a size-1 axis

  def _advanced_index(self, n, idx):
    """``z[arange(n), labels]`` (NumPy's advanced indexing: a gather whose indices are the
    positions along every other axis and the labels along the vocabulary): ``(labels,
    nodes)``, else None."""
    g = self.g
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
      chain = _position_along(g, piece, axis)
      if chain is None:
        return None
      nodes += chain
    labels, label_nodes = self._labels_of(cat.ins[-1])
    return None if labels is None else (labels, nodes + label_nodes)

  def _rows_of_flat(self, ref) -> int | None:
    """The number of rows when ``ref`` is the logits flattened (a 1-D reshape of a followed
    [..., V] value: row after row), else None."""
    g = self.g
    if isinstance(ref, Lit) or ref not in g.producer or len(g.avals[ref].shape) != 1:
      return None
    n = g.nodes[g.producer[ref][0]]
    src = n.ins[0]
    if (n.prim.name != "reshape" or isinstance(src, Lit) or src not in self.elem
        or not self._is_v(src) or n.params.get("dimensions") is not None):
      return None
    return math.prod(g.avals[src].shape[:-1])

  def _flat_index(self, n, rows: int, idx):
    """``z.reshape(-1)[arange(rows) * V + labels]`` (or ``jnp.take`` of it, NumPy's wrap of
    negative indices included): ``(labels, nodes)``, else None."""
    g = self.g
    dn = n.params["dimension_numbers"]
    if (tuple(dn.offset_dims) or tuple(dn.collapsed_slice_dims) != (0,)
        or tuple(dn.start_index_map) != (0,) or isinstance(idx, Lit)):
      return None
    producer = lambda r: (None if isinstance(r, Lit) or r not in g.producer  # noqa: E731
                          else g.producer[r][0])
    size = rows * self.vocab
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
            or self._const(g.nodes[lt].ins[1]) != 0.0 or g.nodes[add].ins[0] is not keep
            or self._const(g.nodes[add].ins[1]) != size):
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
      stride = self._const(b) if isinstance(b, Lit) else self._const(a)
      position = a if isinstance(b, Lit) else b
      along = _position_along(g, position, 0)
      if stride != self.vocab or along is None or tuple(g.avals[position].shape) != (rows,):
        continue
      found, label_nodes = self._labels_of(labels)
      if found is not None:
        return found, nodes + [m] + along + label_nodes
    return None

  def _select(self, n, ins, o) -> None:
    """``where(mask, v, c)`` along the vocabulary, ``v`` followed, ``c`` a constant and
    ``mask`` the same for each row's entries (optax's ``where=``, a per-token mask spread over
    the logits: ``jax.nn.logsumexp(z, where=...)``): ``v`` in the rows the mask keeps; the
    per-token loss must drop the other rows by a select of its own (:func:`_masked_away`).
    Otherwise a row value's clamp (:meth:`_shift_step`)."""
    if not self._is_v(o):
      self._shift_step(n, ins, o)
      return
    if len(ins) != 3 or isinstance(ins[2], Lit) or _constant(self.g, ins[1]) is None:
      return
    if self._zero_where_untargeted(ins):
      self.weighted[o] = self.weighted[ins[2]]
      return
    if (not isinstance(ins[0], Lit) and self.target.get(ins[0]) == (1.0, 0.0)
        and ins[2] in self.elem and _zero(self.g, ins[1])):
      # where(one-hot, v, 0): the one-hot's predicate picks v at the label
      self.weighted[o] = ((1.0, 0.0), self.elem[ins[2]])
      self._take_zeros(ins[1])
      return
    mask = _mask_root(self.g, ins[0])
    if mask is None or _mask_size(self.g, mask) * self.vocab != np.prod(self.g.avals[o].shape):
      return  # a mask of single logits (or none): not a per-token one
    if self.mask is not None and not _same_ref(self.mask, mask):
      return
    for table in (self.elem, self.exps, self.weighted):
      if ins[2] in table:
        if table is self.weighted:
          if not _zero(self.g, ins[1]):
            return
          self.zeroed.add(o)  # the target's weighted logits, zero in the dropped rows
        self.mask = mask
        table[o] = table[ins[2]]
        return

  def _zero_where_untargeted(self, ins) -> bool:
    """Whether ``select_n(t != 0, 0, t * v)`` reads the target weight ``t`` times a followed
    logits value ``v`` (optax's ``safe_softmax_cross_entropy``: ``0 log 0 = 0``): where
    ``t`` is zero so is ``t * v`` for the finite logits a matmul computes, so the select
    passes ``t * v`` on unchanged."""
    pred, zero, value = ins
    if value not in self.weighted or not _zero(self.g, zero) or isinstance(pred, Lit) or (
        pred not in self.g.producer):
      return False
    ne = self.g.nodes[self.g.producer[pred][0]]
    if ne.prim.name != "ne" or len(ne.ins) != 2:
      return False
    for t, c in (ne.ins, ne.ins[::-1]):
      if (not isinstance(t, Lit) and t in self.target and _zero(self.g, c)
          and self.target[t] == self.weighted[value][0]):
        self.helpers.add(self.g.producer[pred][0])
        self._take_zeros(zero)
        return True
    return False

  def _take_zeros(self, zero) -> None:
    """The nodes making the zeros a select reads (a literal broadcast and cast to shape)
    become the region's helpers."""
    while not isinstance(zero, Lit):
      i = self.g.producer[zero][0]
      self.helpers.add(i)
      zero = self.g.nodes[i].ins[0]

  def _shift_step(self, n, ins, o) -> None:
    """A row constant computed from z (a max and its clamps): a shift."""
    a = self.g.avals[o]
    stop = n.prim.name == "stop_gradient"
    if a.shape and a.shape[-1] == self.vocab and not stop:
      return
    if stop and ins[0] in self.rows:
      self.rows[o] = self.rows[ins[0]]
      return
    if jnp.issubdtype(a.dtype, jnp.floating):
      self.rows[o] = {self._shift(): 1.0}

  def loss(self, row: dict) -> tuple[float, float, float, float | None] | None:
    """``(sign, smoothing, z_loss, outside)`` when ``row`` is (the negation of) a
    cross-entropy (plus ``z_loss`` times the log-sum-exp's square); ``outside``: the share
    of the log-sum-exp a one-hot target does not weight (its loss where a label lies outside
    [0, V) and the one-hot is a row of zeros), None where that is not a log-sum-exp's."""
    z_loss = row.get("zsq", 0.0)
    hot = {s[4:]: c for s, c in row.items() if s.startswith("hot:")}
    cold = {s: c for s, c in row.items() if s != "zsq" and not s.startswith("hot:")}
    row = _add(cold, hot)
    lss = {k[2:] for k in row if k.startswith("ls")}
    if len(lss) != 1:
      return None
    (k,) = lss
    sign = row["ls" + k]
    if abs(abs(sign) - 1.0) > _TOL:
      return None
    expect = {"ls" + k: sign, **{sym: sign for sym in _shifts(k)}}
    scale = self.scale or 1.0  # (the pick and the mean read the logits at that scale too)
    pick, zsum = row.get("pick", 0.0) / scale, row.get("zsum", 0.0) / scale
    smoothing = -zsum * self.vocab / sign
    if abs(-pick / sign - (1.0 - smoothing)) > 1e-5 or not 0.0 <= smoothing < 1.0:
      return None
    rest = {s: c for s, c in row.items() if s not in ("pick", "zsum")}
    if set(rest) != set(expect) or any(abs(rest[s] - expect[s]) > 1e-5 for s in rest):
      return None
    if z_loss * sign < 0.0:
      return None
    outside = cold.get("ls" + k, 0.0) / sign
    if any(abs(cold.get(sym, 0.0) / sign - outside) > 1e-5 for sym in _shifts(k)):
      outside = None
    return sign, (0.0 if abs(smoothing) <= 1e-7 else smoothing), z_loss * sign, outside


def _shifts(k: str) -> list:
  """The row constants a log-sum-exp's shift ``k`` sums (:meth:`_Head._exp`)."""
  return k.split("+") if k else []


#: Primitive -> how a value computed by it from followed values is followed.
_STEPS = {
    **{p: _Head._same for p in _primitives.HEAD_SAME | _primitives.SHAPE | {"transpose"}
       | _primitives.SHARDING},
    "add": _Head._add_sub, "sub": _Head._add_sub, "neg": _Head._neg,
    "mul": _Head._mul_div, "div": _Head._mul_div, "exp": _Head._exp,
    "reduce_sum": _Head._reduce_sum, "log": _Head._log, "gather": _Head._gather,
    "tanh": _Head._tanh, "square": _Head._square, "integer_pow": _Head._square,
    **{p: _Head._shift_step for p in ("stop_gradient", "reduce_max", "max", "is_finite")},
    "select_n": _Head._select, "dot_general": _Head._dot,
}


def _gather_outside(n: _graph.Node) -> str | None:
  """What the gather ``n`` that picks a label's logit gives for a label outside ``[0, V)``,
  and its gradient: ``"clip"`` (``mode="clip"``: the nearest entry, its gradient there too),
  ``"nearest"`` (``promise_in_bounds``, jnp indexing's default: XLA's gather reads the
  nearest entry and the scatter of its transpose drops the gradient), ``"nan"`` (``fill``
  with NaN: the head's own value), None (a fill of another value: no head reads it)."""
  mode = str(n.params.get("mode", "")).rsplit(".", 1)[-1].upper()
  if "CLIP" in mode:
    return "clip"
  if "FILL" not in mode:
    return "nearest"
  fill = n.params.get("fill_value")
  return "nan" if fill is None or (isinstance(fill, float) and math.isnan(fill)) else None


def _position_along(g: _graph.Graph, ref, axis: int) -> list | None:
  """The nodes computing ``ref`` as each element's own position along ``axis`` (an ``iota``,
  broadcast, with NumPy's negative-index wrap ``select(i < 0, i + n, i)``), else None."""
  nodes, wrap = [], {"lt", "add", "select_n", "convert_element_type"}
  r, trail = ref, []
  while not isinstance(r, Lit) and r in g.producer:
    i = g.producer[r][0]
    n = g.nodes[i]
    nodes.append(i)
    if n.prim.name == "iota":
      dim = n.params["dimension"]
      for b in reversed(trail):  # the broadcasts from the iota to ``ref``, in forward order
        dim = b.params["broadcast_dimensions"][dim]
      return nodes if dim == axis else None
    if n.prim.name == "broadcast_in_dim":
      trail.append(n)
      r = n.ins[0]
    elif n.prim.name in wrap:
      r = next((x for x in n.ins if not isinstance(x, Lit) and
                jnp.issubdtype(g.avals[x].dtype, jnp.integer)), None)
      if r is None:
        return None
    else:
      return None
  return None


def _splits_last(n: _graph.Node, shape: tuple) -> bool:
  """Whether the sharding primitive ``n`` places a value of ``shape`` split along its last
  axis over devices (unknown shardings: split)."""
  sharding = n.params.get("sharding", n.params.get("dst_sharding"))
  try:
    return tuple(sharding.shard_shape(tuple(shape)))[-1:] != tuple(shape)[-1:]
  except Exception:  # pylint: disable=broad-except
    return True


def _vocab_split(n: _graph.Node, shape: tuple) -> tuple | None:
  """``(sharding, shape)`` where the sharding primitive ``n`` places the logits of ``shape``
  as a ``NamedSharding`` over a mesh of automatic axes (what ``shard_map`` runs the head
  on, per shard), else None."""
  sharding = n.params.get("sharding", n.params.get("dst_sharding"))
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if (not isinstance(sharding, jax.sharding.NamedSharding) or spec is None
      or len(spec) > len(shape) or any("Auto" not in str(t)
                                       for t in getattr(mesh, "axis_types", ()))
      or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)):
    return None
  return sharding, tuple(shape)


def _spread_source(g: _graph.Graph, ref):
  """``(source, chain)``: ``ref`` followed back through broadcasts, reshapes and casts to a
  program value or an array constant (a bias closed over); ``(None, [])`` at a scalar."""
  chain = []
  while not isinstance(ref, Lit) and ref in g.producer:
    i = g.producer[ref][0]
    n = g.nodes[i]
    if n.prim.name not in ("broadcast_in_dim", "reshape", "convert_element_type") or \
        len(n.ins) != 1:
      break
    chain.insert(0, i)
    ref = n.ins[0]
  if isinstance(ref, Lit) and not np.ndim(ref.val):
    return None, []
  return ref, chain


def _literal_source(g: _graph.Graph, ref) -> Lit | None:
  """The literal ``ref`` is a broadcast or cast of (or is), else None."""
  while not isinstance(ref, Lit) and ref in g.producer:
    n = g.nodes[g.producer[ref][0]]
    if n.prim.name not in ("broadcast_in_dim", "convert_element_type") or len(n.ins) != 1:
      return None
    ref = n.ins[0]
  return ref if isinstance(ref, Lit) and not isinstance(ref.val, jax.core.Tracer) else None


_SCALAR_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
               "neg": np.negative, "max": np.maximum, "min": np.minimum, "sqrt": np.sqrt,
               "rsqrt": lambda v: 1 / np.sqrt(v), "convert_element_type": np.asarray}


def _constant(g: _graph.Graph, ref, depth: int = 0) -> float | None:
  """The value of ``ref`` where it is a scalar constant (a literal, a broadcast or cast of
  one, or floating arithmetic on such: Keras's ``label_smoothing / num_classes``, a
  ``jnp.sqrt(d)``), else None."""
  lit = _literal_source(g, ref)
  if lit is not None:
    return None if np.size(lit.val) != 1 else float(np.asarray(lit.val).reshape(()))
  if isinstance(ref, Lit) or ref not in g.producer or depth > 8:
    return None
  n = g.nodes[g.producer[ref][0]]
  dtype = g.avals[ref].dtype
  if (n.prim.name not in _SCALAR_OPS or len(n.outs) != 1 or g.avals[ref].shape
      or not jnp.issubdtype(dtype, jnp.floating)):
    return None
  vals = [_constant(g, r, depth + 1) for r in n.ins]
  if any(v is None for v in vals):
    return None
  return float(_SCALAR_OPS[n.prim.name](*(np.asarray(v, dtype) for v in vals)))


def _mask_root(g: _graph.Graph, ref):
  """A boolean mask ``ref`` followed back through broadcasts, reshapes, casts and reductions
  over axes of size one: the array (or closed-over constant) it spreads, else None."""
  while not isinstance(ref, Lit) and ref in g.producer:
    n = g.nodes[g.producer[ref][0]]
    name = n.prim.name
    if len(n.ins) != 1 or name not in ("broadcast_in_dim", "reshape", "convert_element_type",
                                       "squeeze", "expand_dims", "reduce_or", "reduce_and"):
      break
    if name in ("reduce_or", "reduce_and") and any(
        g.avals[n.ins[0]].shape[a] != 1 for a in n.params["axes"]):
      return None
    ref = n.ins[0]
  if isinstance(ref, Lit):
    return ref if np.asarray(ref.val).dtype == np.bool_ else None
  return ref if jnp.dtype(g.avals[ref].dtype) == jnp.bool_ else None


def _mask_size(g: _graph.Graph, mask) -> int:
  return int(np.size(mask.val)) if isinstance(mask, Lit) else int(np.prod(g.avals[mask].shape))


def _same_ref(a, b) -> bool:
  if isinstance(a, Lit) or isinstance(b, Lit):
    return isinstance(a, Lit) and isinstance(b, Lit) and a.val is b.val
  return a == b


def _masked_away(g: _graph.Graph, o, mask) -> bool:
  """Whether the per-token losses ``o`` are read only by ``where(mask, o, 0)`` (the rows a
  per-token ``mask`` drops set to zero, as optax's ``where=`` does after its masked
  log-sum-exp): then those rows' values, which the head computes otherwise, are never seen."""
  readers = g.consumers.get(o, ())
  if not readers:
    return False
  for i in readers:
    n = g.nodes[i]
    if (n.prim.name != "select_n" or len(n.ins) != 3 or n.ins[2] != o or n.ins[1] == o
        or not _zero(g, n.ins[1])):
      return False
    root = _mask_root(g, n.ins[0])
    if root is None or not _same_ref(root, mask):
      return False
  return True


def _zero(g: _graph.Graph, ref) -> bool:
  """Whether ``ref`` is a constant zero (a literal, or a broadcast or cast of one)."""
  lit = _literal_source(g, ref)
  return lit is not None and not np.any(np.asarray(lit.val))


def _linear_step(g: _graph.Graph, n, inside) -> str:
  """"" when node ``n`` is linear in the values ``inside`` (what it reads of them), else
  why not."""
  name = n.prim.name
  reads = [not isinstance(r, Lit) and r in inside for r in n.ins]
  out = g.avals[n.outs[0]]
  if len(n.outs) != 1 or not jnp.issubdtype(out.dtype, jnp.floating):
    return f"{name} of the per-token losses"
  if name in _primitives.LINEAR_UNARY and reads == [True]:
    return ""
  if name == "mul" and sum(reads) == 1:
    return ""
  if name == "div" and reads == [True, False]:
    return ""
  if name in ("add", "sub") and all(reads):
    return ""
  if name == "select_n" and not reads[0] and sum(reads) == 1 and all(
      reads[k] or _zero(g, n.ins[k]) for k in range(1, len(n.ins))):
    return ""
  return f"{name} of the per-token losses"


def fold_reduction(g: _graph.Graph, loss, outvars: set) -> tuple[Fold | None, str]:
  """The program's reduction of the per-token losses ``loss`` as a :class:`Fold`, or
  ``(None, why)`` where it is not a weighted sum that ends in one scalar."""
  inside, nodes = {loss}, set()
  for i in range(g.producer[loss][0] + 1, len(g.nodes)):
    n = g.nodes[i]
    if not any(not isinstance(r, Lit) and r in inside for r in n.ins):
      continue
    why = _linear_step(g, n, inside)
    if why:
      return None, f"the program's reduction reads {why}"
    nodes.add(i)
    inside.update(n.outs)
  ends = [r for r in inside if r in outvars or not g.consumers.get(r) or any(
      c not in nodes for c in g.consumers[r])]
  if loss in ends:
    return None, "the per-token losses are also used as they are"
  if len(ends) != 1 or math.prod(g.avals[ends[0]].shape) != 1:
    return None, "the program's reduction does not end in one scalar"
  extras = []
  for i in sorted(nodes):
    for r in g.nodes[i].ins:
      if not isinstance(r, Lit) and r not in inside and r not in extras:
        extras.append(r)
  return Fold(frozenset(nodes), ends[0], tuple(extras)), ""


def _wide_source(g: _graph.Graph, w, region: set) -> tuple:
  """``(source, absorbed nodes, transposed)``: where ``w`` is a 16-bit cast of a float32 or
  float64 value, possibly transposed before or after the cast (a tied embedding's
  ``table.astype(bf16).T``), each step read only by ``region`` and the steps after it, the
  wide value, those steps' nodes and whether one of them transposes; else ``(w, [], False)``."""
  steps, ref, readers = {}, w, set(region)  # "transpose"/"cast" -> its node
  while len(steps) < 2:
    if isinstance(ref, Lit) or ref not in g.producer or ref in g.outvars or any(
        c not in readers for c in g.consumers.get(ref, ())):
      break
    i = g.producer[ref][0]
    n = g.nodes[i]
    src = n.ins[0]
    if isinstance(src, Lit):
      break
    if n.prim.name == "transpose" and tuple(n.params["permutation"]) == (1, 0):
      kind = "transpose"
    elif (n.prim.name == "convert_element_type" and jnp.dtype(g.avals[ref].dtype).itemsize < 4
          and jnp.issubdtype(g.avals[src].dtype, jnp.floating)
          and jnp.dtype(g.avals[src].dtype).itemsize >= 4):
      kind = "cast"
    else:
      break
    if kind in steps:
      break
    steps[kind] = i
    readers.add(i)
    ref = src
  if "cast" not in steps:
    return w, [], False
  return ref, list(steps.values()), "transpose" in steps


def _head_dots(g: _graph.Graph, n) -> list:
  """``[(x, w, vocabulary axis of w, vocab, logits)]``: the ways node ``n`` can be an LM head's
  matmul (none unless a matmul): tokens [..., d] times a 2-D weight, the logits [..., V] its
  output; or the weight times the tokens (``jax.vmap`` of Equinox's ``Linear``, ``w @ x`` per
  token), [V, ...] transposed to [..., V] by the one node reading it, whose output is the
  logits.  (Two 2-D operands may be read either way.)"""
  if n.prim.name != "dot_general":
    return []
  (lc, rc), (lb, rb) = n.params["dimension_numbers"]
  if lb or rb or len(lc) != 1 or len(rc) != 1 or any(isinstance(r, Lit) for r in n.ins):
    return []
  out, found = n.outs[0], []
  for (x, w), (xc, wc), first in ((n.ins, (lc, rc), False), (n.ins[::-1], (rc, lc), True)):
    xs, ws = tuple(g.avals[x].shape), tuple(g.avals[w].shape)
    if len(ws) != 2 or int(xc[0]) != len(xs) - 1 or not jnp.issubdtype(g.avals[x].dtype,
                                                                         jnp.floating):
      continue
    vaxis = 1 - int(wc[0])
    vocab = ws[vaxis]
    if vocab < 2:
      continue
    if not first and tuple(g.avals[out].shape) == xs[:-1] + (vocab,):
      found.append((x, w, vaxis, vocab, out))
    readers = g.consumers.get(out, ())
    if first and len(xs) > 1 and tuple(g.avals[out].shape) == (vocab,) + xs[:-1] and len(
        readers) == 1 and out not in g.outvars:
      t = g.nodes[readers[0]]
      if t.prim.name == "transpose" and tuple(t.params["permutation"]) == tuple(
          range(1, len(xs))) + (0,):
        found.append((x, w, vaxis, vocab, t.outs[0]))
  return found


def calls_on_logits(g: _graph.Graph) -> list[int]:
  """The ``custom_jvp`` and ``custom_vjp`` calls that read a value shaped as an LM head's
  logits (a matmul's [..., V] output, or a value of its shape): where a cross-entropy may be
  computed inside a call with a derivative rule of its own."""
  shapes = set()
  for n in g.nodes:
    shapes.update(tuple(g.avals[dot[4]].shape) for dot in _head_dots(g, n))
  return [i for i, n in enumerate(g.nodes) if n.prim.name in _primitives.CUSTOM_CALLS and any(
      not isinstance(r, Lit) and tuple(g.avals[r].shape) in shapes
      and jnp.issubdtype(g.avals[r].dtype, jnp.floating) for r in n.ins)] if shapes else []


def _region(g: _graph.Graph, h: _Head, di: int, root: int, outvars: set) -> set:
  """The nodes of the head whose matmul is ``di`` and whose per-token loss ``root`` computes:
  the followed values' producers, their helpers (a clamp's ``is_finite``, the constants it
  selects), the index arithmetic and one-hot nodes only the region reads, and values computed
  in it and never read (``jax.nn.logsumexp``'s sign)."""
  members = {g.producer[r][0] for table in h._tables() for r in table  # pylint: disable=protected-access
             if r in g.producer} | h.label_nodes | h.cap_nodes | h.helpers | {di}
  members |= h.temperature_nodes
  if h.bias is not None:
    members.update(h.bias[1])
  changed = True
  while changed:
    changed = False
    for i in range(di + 1, root):
      m = g.nodes[i]
      if i in members or any(
          tuple(g.avals[r].shape)[-1:] == (h.vocab,) for r in m.outs if g.avals[r].shape):
        continue
      reads = [r for r in m.ins if not isinstance(r, Lit)]
      if all(r in g.producer and g.producer[r][0] in members for r in reads) and all(
          c in members for r in m.outs for c in g.consumers.get(r, ())) and any(
              g.consumers.get(r) for r in m.outs):
        members.add(i)
        changed = True
  nodes = set(_graph.ancestors(g, root, lambda r: g.producer[r][0] in members))
  nodes |= {i for i in h.label_nodes if i in members}
  if h.temperature is not None:  # (its scalar spread to the logits' shape, too)
    nodes |= h.temperature_nodes
  if h.bias is not None:
    nodes.update(h.bias[1])
  for i in sorted(h.label_nodes, reverse=True):
    if all(c in nodes for o2 in g.nodes[i].outs for c in g.consumers.get(o2, ())):
      nodes.add(i)
    else:
      nodes.discard(i)
  produced = {r for i in nodes for r in g.nodes[i].outs}
  for i in range(di, root):
    m = g.nodes[i]
    if i not in nodes and all(
        not g.consumers.get(r) and r not in outvars for r in m.outs) and all(
            isinstance(r, Lit) or r in produced for r in m.ins):
      nodes.add(i)
  return nodes


def _per_token(g: _graph.Graph, h: _Head, o, xs: tuple) -> tuple | None:
  """``(sign, smoothing, z_loss)`` when the row value ``o`` is (the negation of) a cross-entropy per
  token of ``x``'s leading shape against labels of that shape, else None."""
  res = h.loss(h.rows[o])
  squeeze = lambda shape: tuple(d for d in shape if d != 1)  # noqa: E731
  if res is None or np.prod(g.avals[o].shape) != np.prod(xs[:-1]):
    return None
  if h.permuted and squeeze(g.avals[o].shape) != squeeze(xs[:-1]):
    return None  # token axes moved: the losses are not in the tokens' order
  labels = h.labels
  shape = tuple(np.shape(labels.val) if isinstance(labels, Lit) else g.avals[labels].shape)
  if shape != xs[:-1] and not (np.prod(shape) == np.prod(xs[:-1]) and not h.permuted
                               and _keeps_order(g, h.label_nodes)):
    return None  # (labels reshaped on their way, as the logits are: both in the tokens' order)
  return res


def _keeps_order(g: _graph.Graph, nodes) -> bool:
  """Whether the labels' path (``nodes``) keeps their row-major order: no broadcast that
  spreads or permutes them."""
  for i in nodes:
    n = g.nodes[i]
    if n.prim.name == "broadcast_in_dim" and n.ins and not isinstance(n.ins[0], Lit):
      dims = tuple(n.params["broadcast_dimensions"])
      if (np.prod(g.avals[n.ins[0]].shape) != np.prod(g.avals[n.outs[0]].shape)
          or dims != tuple(sorted(dims))):
        return False
  return True


def _fold(g: _graph.Graph, o, w, nodes: set, outvars: set, taken: set,
          allow_fold: bool, unfoldable: str = "") -> tuple:
  """``(fold or None, why not, the head's weight, whether it is the matmul's weight
  transposed)``; a 16-bit cast of a float32 weight read only by the head (transposed before
  or after the cast or not) is taken into ``nodes`` and its source is the head's weight.
  ``unfoldable``: why the reduction may not be folded whatever it is ("": it may)."""
  fold, why = (None, unfoldable) if unfoldable else fold_reduction(g, o, outvars) \
      if allow_fold else (None, "inside a loop body (its forward's gradients would be kept per "
                                "step)")
  if fold is not None and fold.nodes & taken:
    fold, why = None, "the program's reduction overlaps another conversion"
  head_w, absorbed, transposed = _wide_source(g, w, nodes)
  nodes.update(absorbed)
  if fold is not None and jnp.dtype(g.avals[head_w].dtype).itemsize < 4:
    fold, why = None, ("a 16-bit weight (its float32 gradient accumulator would double the "
                       "gradient's memory)")
  return fold, why, head_w, transposed


_LSE_READ = ("its log-sum-exp is also read outside the loss (the gradient of that read is "
             "known only in the backward)")


def _lse_reads(g: _graph.Graph, h: _Head, nodes: set, o, outvars: set,
               xs: tuple) -> tuple | None:
  """``(value, a, b)`` per value of the head's ``nodes`` (other than the loss ``o``) the
  program reads elsewhere, each ``a * lse + b * lse ** 2`` per token of ``x``'s leading shape
  ``xs``; ``()`` where none is read; None where one is anything else (the logits, a
  probability: the head is left alone)."""
  squeeze = lambda shape: tuple(d for d in shape if d != 1)  # noqa: E731
  reads = []
  for r in _match.escaping(g, nodes, o, outvars):
    form, shape = h.lse_form(r), tuple(g.avals[r].shape)
    if (form is None or np.prod(shape) != np.prod(xs[:-1]) or h.mask is not None
        or not jnp.issubdtype(g.avals[r].dtype, jnp.floating)
        or (h.permuted and squeeze(shape) != squeeze(xs[:-1]))):
      return None
    reads.append((r, *form))
  return tuple(reads)


def _without_inputs(g: _graph.Graph, nodes: set, inputs) -> None:
  """Take out of ``nodes`` what computes the head's ``inputs`` and what that reads (labels
  computed from constants alone, say, which the region's helpers take in): the unit reads
  them, so they are computed before it."""
  inputs = {r for r in inputs if r is not None and not isinstance(r, Lit)}
  stack = [i for i in nodes if any(r in inputs for r in g.nodes[i].outs)]
  while stack:
    i = stack.pop()
    if i in nodes:
      nodes.discard(i)
      stack += [g.producer[r][0] for r in g.nodes[i].ins
                if not isinstance(r, Lit) and r in g.producer]


def _rounded_to(g: _graph.Graph, dot) -> str | None:
  """The 16-bit dtype the matmul's logits come out in (the program rounds them), or None."""
  dtype = jnp.dtype(g.avals[dot.outs[0]].dtype)
  return dtype.name if dtype.itemsize < 4 else None


_USED_ELSEWHERE = "its logits are also used elsewhere (a cross-entropy found, not replaced)"
_VOCAB_SHARDED = ("its logits are constrained to shards of the vocabulary (a tensor-parallel "
                  "head) in a layout the head cannot run per shard on (not a NamedSharding "
                  "of automatic mesh axes of the tokens' shape: the chunked head's "
                  "vocabulary tiles would gather the weight)")
_NOT_READ = ("its logits are read at integer labels, but no cross-entropy of them was found "
             "(a log-sum-exp masked along the vocabulary or weighted, as logsumexp's where= "
             "and b= take it, is none, nor is the log of a probability clipped or offset; a "
             "bias of -inf is)")


def find_heads(g: _graph.Graph, claimed: set, outvars: set,
               allow_fold: bool = True) -> tuple[list, list]:
  """The matmul + cross-entropy regions of ``g``: ``(matches, left_alone)``, the latter
  ``([dot node], why)`` for a head whose logits are also used elsewhere.  ``allow_fold``:
  whether the program's reduction may be folded into a head (not in a loop body, whose
  residuals — the forward's gradients — would be kept per step)."""
  matches, left, taken = [], [], set(claimed)
  compares = [i for i, n in enumerate(g.nodes) if n.prim.name == "eq"]
  for di, n in enumerate(g.nodes):
    if di in taken:
      continue
    whys = []
    for dot in _head_dots(g, n):
      match, why = _head_at(g, di, dot, compares, taken, outvars, allow_fold)
      if match is not None:
        matches.append(match)
        taken.update(match.nodes)
        break
      whys += [why] if why else []
    else:
      if whys:
        left.append(([di], whys[0]))
  return matches, left


def _head_at(g: _graph.Graph, di: int, dot: tuple, compares: list, taken: set, outvars: set,
             allow_fold: bool) -> tuple:
  """``(HeadMatch, "")`` of the matmul ``di`` read as ``dot`` (:func:`_head_dots`), or
  ``(None, why)``: why not where its logits are read at labels ("" where they are not)."""
  x, w, vaxis, vocab, z = dot
  zi = g.producer[z][0]  # the logits' node: the matmul, or its transpose
  h = _Head(g, zi, vocab, vaxis)
  # a one-hot of the labels may be made before the matmul (Keras): its comparisons and the
  # target's arithmetic there, then everything after the matmul
  for i in range(next((e for e in compares if e < di), di), di):
    before = g.nodes[i]
    if before.prim.name == "eq" or any(not isinstance(r, Lit) and (r in h.target or r in h.identity)
                                       for r in before.ins):
      h.step(i)
  for i in range(zi + 1, len(g.nodes)):
    h.step(i)
  if h.vocab_sharded or (h.vocab_split is not None and (
      h.permuted or h.vocab_split[1] != tuple(g.avals[x].shape[:-1]) + (vocab,))):
    return None, _VOCAB_SHARDED
  if h.labels is None:
    return None, ""
  escaped = found = False  # found: a per-token cross-entropy, taken or not
  for o in sorted(h.rows, key=lambda r: -g.producer[r][0]):
    res = _per_token(g, h, o, tuple(g.avals[x].shape))
    if res is None:
      continue
    found = True
    # under a per-token mask: the masked rows dropped after the loss (no mask for the
    # head), or zero in the loss itself (the head applies the mask)
    mask = None
    if h.mask is not None and not _masked_away(g, o, h.mask):
      if o not in h.masked_rows or h.permuted:
        continue
      mask = h.mask
    root = g.producer[o][0]
    nodes = _region(g, h, zi, root, outvars) | {di}
    if nodes & taken:
      continue
    reads = _lse_reads(g, h, nodes, o, outvars, tuple(g.avals[x].shape))
    if reads is None:
      escaped = True
      continue
    fold, why, head_w, transposed = _fold(g, o, w, nodes, outvars, taken, allow_fold,
                                          _LSE_READ if reads else "")
    _without_inputs(g, nodes, (x, head_w, h.labels, mask, h.bias and h.bias[0],
                               h.temperature and h.temperature[0]))
    return HeadMatch(sorted(nodes | (fold.nodes if fold else set())), root, x, head_w,
                     None if h.bias is None else h.bias[0], h.labels,
                     1 - vaxis if transposed else vaxis, res[1], res[0], fold, why, h.cap,
                     _rounded_to(g, g.nodes[di]), res[2], mask,
                     res[3] if h.picks == {"one_hot"} else None, h.scale or 1.0,
                     reads, h.temperature, h.vocab_split and h.vocab_split[0],
                     h.clamp_labels or h.pick_outside == "clip",
                     h.pick_outside == "nearest",
                     not (h.pick_outside in ("nearest", "nan") and h.pick_carries_row)), ""
  return None, (_USED_ELSEWHERE if escaped else "" if found else _NOT_READ)
