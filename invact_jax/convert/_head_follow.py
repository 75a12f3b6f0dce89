"""The LM head's loss follower: every value computed from a matmul's output ``z`` as a linear
combination of elementwise values, row values and target weights (the module doc of
:mod:`._head_find`), one equation at a time (:meth:`LossFollower.step`, by the rule table
:data:`._head_rules.STEPS`), and the per-token loss read off a row value
(:meth:`LossFollower.loss`)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import graph as _graph
from invact_jax.convert import _head_rules
from invact_jax.convert import _head_values
from invact_jax.convert import _polynomial
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit


class LossFollower:
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

  def along_vocab(self, ref) -> bool:
    """Whether ``ref``'s last axis is the vocabulary's ([..., V])."""
    a = self.g.avals[ref]
    return bool(a.shape) and a.shape[-1] == self.vocab

  def _const(self, r):
    """The scalar constant ``r`` is (a literal, or a broadcast or cast of one), else None."""
    return _head_values.constant(self.g, r)

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

  def followed(self, r) -> bool:
    """Whether ``r`` is a value followed so far (computed from the logits)."""
    return not isinstance(r, Lit) and any(r in t for t in self.tables())

  def tables(self) -> tuple:
    """The tables of followed values, by kind."""
    return (self.elem, self.rows, self.exps, self.sums, self.target, self.weighted, self.tanh,
            self.probs, self.identity)

  def step(self, i: int) -> None:
    """Follow node ``i`` (in program order) if it computes from values followed so far."""
    n = self.g.nodes[i]
    if len(n.outs) != 1:
      return
    if n.prim.name == "eq" and self._one_hot(i, n):
      return
    if not any(self.followed(r) for r in n.ins):
      return
    handler = _head_rules.STEPS.get(n.prim.name)
    if handler is not None:
      handler(self, n, n.ins, n.outs[0])

  def _one_hot(self, i: int, n) -> bool:
    """``iota == labels`` along the vocabulary: a one-hot of the labels (True: handled)."""
    g = self.g
    # the positions along the vocabulary: an iota, broadcast (as vmap spreads one) or not
    along = lambda r: None if isinstance(r, Lit) else _head_values.position_along(  # noqa: E731
        g, r, len(g.avals[r].shape) - 1)
    iotas = [along(r) for r in n.ins]
    if not (any(c is not None for c in iotas) and self.along_vocab(n.outs[0])):
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
    rows = None if isinstance(other, Lit) else _head_values.position_along(g, other, 0)

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
    want = {lss[0]: a, **{k: a for k in _head_values.shifts(lss[0][2:])}}
    if set(rest) != set(want) or any(abs(rest[k] - c) > _polynomial.TOL * abs(a)
                                     for k, c in want.items()):
      return None
    return a, b

  @staticmethod
  def _is_lse(row: dict) -> bool:
    """Whether ``row`` is one log-sum-exp: its log-sum plus the shift it was taken at."""
    lss = [k for k in row if k.startswith("ls")]
    if len(lss) != 1:
      return False
    want = {lss[0]: 1.0, **{k: 1.0 for k in _head_values.shifts(lss[0][2:])}}
    return set(row) == set(want) and all(abs(row[s] - c) <= _polynomial.TOL
                                         for s, c in want.items())

  def loss(self, row: dict) -> tuple[float, float, float, float | None] | None:
    """``(sign, smoothing, z_loss, outside)`` when ``row`` is (the negation of) a
    cross-entropy (plus ``z_loss`` times the log-sum-exp's square); ``outside``: the share
    of the log-sum-exp a one-hot target does not weight (its loss where a label lies outside
    [0, V) and the one-hot is a row of zeros), None where that is not a log-sum-exp's."""
    z_loss = row.get("zsq", 0.0)
    hot = {s[4:]: c for s, c in row.items() if s.startswith("hot:")}
    cold = {s: c for s, c in row.items() if s != "zsq" and not s.startswith("hot:")}
    row = _polynomial.add(cold, hot)
    lss = {k[2:] for k in row if k.startswith("ls")}
    if len(lss) != 1:
      return None
    (k,) = lss
    sign = row["ls" + k]
    if abs(abs(sign) - 1.0) > _polynomial.TOL:
      return None
    expect = {"ls" + k: sign, **{sym: sign for sym in _head_values.shifts(k)}}
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
    if any(abs(cold.get(sym, 0.0) / sign - outside) > 1e-5 for sym in _head_values.shifts(k)):
      outside = None
    return sign, (0.0 if abs(smoothing) <= 1e-7 else smoothing), z_loss * sign, outside
