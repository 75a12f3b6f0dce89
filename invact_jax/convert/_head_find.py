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


import jax.numpy as jnp
import numpy as np

from invact_jax.convert import graph as _graph
from invact_jax.convert import _head_fold
from invact_jax.convert import _head_follow
from invact_jax.convert import _head_match
from invact_jax.convert import _head_values
from invact_jax.convert import _match
from invact_jax.convert import _primitives
from invact_jax.convert.graph import Lit


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


def _region(g: _graph.Graph, h: _head_follow.LossFollower, di: int, root: int, outvars: set) -> set:
  """The nodes of the head whose matmul is ``di`` and whose per-token loss ``root`` computes:
  the followed values' producers, their helpers (a clamp's ``is_finite``, the constants it
  selects), the index arithmetic and one-hot nodes only the region reads, and values computed
  in it and never read (``jax.nn.logsumexp``'s sign)."""
  members = {g.producer[r][0] for table in h.tables() for r in table
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


def _per_token(g: _graph.Graph, h: _head_follow.LossFollower, o, xs: tuple) -> tuple | None:
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


_LSE_READ = ("its log-sum-exp is also read outside the loss (the gradient of that read is "
             "known only in the backward)")


def _lse_reads(g: _graph.Graph, h: _head_follow.LossFollower, nodes: set, o, outvars: set,
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
  h = _head_follow.LossFollower(g, zi, vocab, vaxis)
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
    if h.mask is not None and not _head_values.masked_away(g, o, h.mask):
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
    fold, why, head_w, transposed = _head_fold.fold_and_weight(
        g, o, w, nodes, outvars, taken, allow_fold, _LSE_READ if reads else "")
    _without_inputs(g, nodes, (x, head_w, h.labels, mask, h.bias and h.bias[0],
                               h.temperature and h.temperature[0]))
    return _head_match.HeadMatch(sorted(nodes | (fold.nodes if fold else set())), root, x, head_w,
                     None if h.bias is None else h.bias[0], h.labels,
                     1 - vaxis if transposed else vaxis, res[1], res[0], fold, why, h.cap,
                     _rounded_to(g, g.nodes[di]), res[2], mask,
                     res[3] if h.picks == {"one_hot"} else None, h.scale or 1.0,
                     reads, h.temperature, h.vocab_split and h.vocab_split[0],
                     h.clamp_labels or h.pick_outside == "clip",
                     h.pick_outside == "nearest",
                     not (h.pick_outside in ("nearest", "nan") and h.pick_carries_row)), ""
  return None, (_USED_ELSEWHERE if escaped else "" if found else _NOT_READ)
