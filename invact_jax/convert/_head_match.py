"""What the LM head rule found: :class:`HeadMatch` (the matmul, the loss, the labels, its
options) and :class:`Fold` (the program's reduction folded into the head)."""
from __future__ import annotations

import dataclasses


from invact_jax.convert import graph as _graph


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
