"""The LM head rule: a matmul whose logits feed only a cross-entropy against integer labels
(:func:`._head_find.find_heads`), with the program's reduction folded in where it is a
weighted sum, runs as :func:`invact_jax.linear_cross_entropy` (no logits buffer).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from invact_jax.convert import _head_find
from invact_jax.convert import _head_match
from invact_jax.convert import graph as _graph
from invact_jax.convert import _match
from invact_jax.convert import _rule
from invact_jax.ops import _common
from invact_jax.ops.cross_entropy import base as _ce_base
from invact_jax.ops.cross_entropy import in_forward as _ce_in_forward

__all__ = ["HeadRule", "head_fn"]


def head_fn(m: _head_match.HeadMatch, target):
  """A matmul + cross-entropy as :func:`invact_jax.linear_cross_entropy`: with the program's
  reduction folded in (the per-token weights are the reduction's derivative; the gradients
  are computed in the forward), or per token (the program's reduction follows; with the
  values the program also reads, ``a * lse + b * lse ** 2``, from the head's log-sum-exp).
  Returns a function of the match's inputs returning its outputs (a tuple)."""
  head = _HeadCall(m, target)
  return head.per_token if m.fold is None else head.folded


class _HeadCall:
  """The unit's function of one :class:`._head_match.HeadMatch` (its inputs: x, w,
  (bias,) labels, (mask,) (temperature,), then the reduction's reads)."""

  def __init__(self, m: _head_match.HeadMatch, target):
    self.m, self.target = m, target
    self.loss_aval = target.avals[target.nodes[m.root].outs[0]]
    self.x_aval = _match.aval(target, m.x)
    self.d, self.n = self.x_aval.shape[-1], math.prod(self.x_aval.shape[:-1])
    vocab = self.vocab = _match.aval(target, m.w).shape[m.vocab_axis]
    mode = "forward" if m.fold else "backward"
    chunk, vocab_chunk = _ce_base.default_tiles(self.n, vocab, mode)
    self.opts = _ce_base.Options(
        m.vocab_axis, "sum" if m.fold else "none", None, float(m.smoothing), float(m.z_loss),
        m.soft_cap, chunk, vocab_chunk, mode, m.logits_dtype, m.outside_lse,
        float(m.logit_scale), outside_nearest=m.pick_nearest,
        outside_gradient=m.outside_gradient)
    self.labels_at = 2 + (m.bias is not None)
    self.temperature_at = self.labels_at + 1 + (m.mask is not None)
    self.reads_at = self.temperature_at + (m.temperature is not None)

  def kept(self, vals):
    """Per token, whether the mask keeps it."""
    return jnp.reshape(vals[self.labels_at + 1], (self.n,)).astype(bool)

  def labels(self, vals):
    """The tokens' labels; a token the mask drops reads label 0 (its loss is zero whatever
    its label: an out-of-range one must not make it NaN)."""
    labels = vals[self.labels_at].reshape(self.n)
    if self.m.clamp_labels:  # XLA's gather (and its gradient) at the nearest entry
      labels = jnp.clip(labels, 0, self.vocab - 1)
    return labels if self.m.mask is None else jnp.where(self.kept(vals), labels, 0)

  def tokens(self, vals):
    """``(x [n, d], w, bias, temperature)``: the temperature the factor the logits are
    multiplied by (``1 / s`` where the program divides them by ``s``), or None."""
    m = self.m
    x, w = vals[0].reshape(self.n, self.d), vals[1]
    b = vals[2] if m.bias is not None else None
    if m.temperature is None:
      return x, w, b, None
    s = vals[self.temperature_at].reshape(())
    return x, w, b, s if m.temperature[1] == "mul" else 1.0 / s

  def run(self, core, kinds, x, w, b, temperature, labels, weights=None):
    """``core(x [k, d], w, b, temperature, labels [k], weights [k] or None, opts)`` over the
    tokens: its outputs, per token (``kinds`` "token") or totals; under a vocabulary split,
    per device in ``shard_map``."""
    if self.m.vocab_sharding is None:
      return core(x, w, b, temperature, labels, weights, self.opts)
    return _per_shard(core, kinds, self.m.vocab_sharding, tuple(self.x_aval.shape[:-1]),
                      self.m.vocab_axis, self.opts, x, w, b, temperature, labels, weights)

  def per_token(self, *vals):
    """The per-token losses (and the log-sum-exp's reads); the program's reduction follows."""
    m = self.m
    x, w, b, temperature = self.tokens(vals)

    def core(x, w, b, temperature, labels, _, opts):
      args = (x, w, b, labels, opts, temperature)
      if m.lse_reads:
        loss, _, lse = _ce_base.with_lse(*args)
        return loss, lse
      return (_ce_base.linear_cross_entropy(*args)[0],)
    loss, *lse = self.run(core, ("token",) * (1 + bool(m.lse_reads)), x, w, b, temperature,
                          self.labels(vals))
    if m.mask is not None:
      loss = jnp.where(self.kept(vals), loss, 0.0)
    avals = self.target.avals
    reads = [(a * lse[0] + c * lse[0] * lse[0]).reshape(avals[r].shape).astype(avals[r].dtype)
             for r, a, c in m.lse_reads]
    return ((m.sign * loss).reshape(self.loss_aval.shape).astype(self.loss_aval.dtype), *reads)

  def folded(self, *vals):
    """The program's weighted sum of the losses, its weights the reduction's derivative."""
    m, target = self.m, self.target
    x, w, b, temperature = self.tokens(vals)
    out_aval = target.avals[m.fold.out]
    reduce = _match.region_of(target, m.fold.nodes,
                              [target.nodes[m.root].outs[0], *m.fold.extras], m.fold.out)
    extras = vals[self.reads_at:]
    # the reduction is linear in the losses: its derivative is each token's weight
    _, pull = jax.vjp(lambda loss: reduce(loss, *extras),
                      jnp.zeros(self.loss_aval.shape, self.loss_aval.dtype))
    (weights,) = pull(jnp.ones(out_aval.shape, out_aval.dtype))
    weights = m.sign * weights.reshape(self.n).astype(_common.compute_dtype(x.dtype))
    if m.mask is not None:
      weights = jnp.where(self.kept(vals), weights, 0.0)
    (total,) = self.run(
        lambda x, w, b, temperature, labels, weights, opts: (_ce_in_forward.weighted(
            x, w, b, labels, weights, opts, temperature)[0],), ("total",), x, w, b,
        temperature, self.labels(vals), weights)
    return (total.reshape(out_aval.shape).astype(out_aval.dtype),)


def _per_shard(core, kinds, sharding, lead: tuple, vocab_axis: int, opts, x, w, b,
               temperature, labels, weights):
  """``core`` (as :func:`head_fn`'s ``run`` calls it) in ``shard_map`` over ``sharding``'s
  mesh: the tokens placed as the logits' constraint places their leading axes, the weight and
  bias split along the vocabulary over its last entry's axes (``vocab_axis_name``); per-token
  outputs come back in the tokens' places, totals summed over the tokens' axes."""
  spec = tuple(sharding.spec)
  tok, vaxes = spec[:-1], spec[-1]
  names = tuple(a for e in tok if e is not None for a in ((e,) if isinstance(e, str) else e))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  d = x.shape[-1]
  args = [x.reshape(*lead, d), w, labels.reshape(lead)]
  specs = [P(*tok, None), P(None, vaxes) if vocab_axis == 1 else P(vaxes, None), P(*tok)]
  if b is not None:
    args.append(b)
    specs.append(P(vaxes))
  if weights is not None:
    args.append(weights.reshape(lead))
    specs.append(P(*tok))
  if temperature is not None:
    args.append(temperature)
    specs.append(P())
  axis_name = vaxes if isinstance(vaxes, str) else tuple(vaxes)

  def local(x, w, labels, *rest):
    rest = list(rest)
    temp = rest.pop() if temperature is not None else None
    b_l = rest[0] if b is not None else None
    wt = rest[-1].reshape(-1) if weights is not None else None
    k = math.prod(x.shape[:-1])
    chunk, vocab_chunk = _ce_base.default_tiles(k, w.shape[vocab_axis], opts.gradients)
    here = dataclasses.replace(opts, chunk_size=chunk, vocab_chunk_size=vocab_chunk,
                               vocab_axis_name=axis_name)
    outs = core(x.reshape(k, d), w, b_l, temp, labels.reshape(k), wt, here)
    return tuple(o.reshape(x.shape[:-1]) if kind == "token" else
                 (jax.lax.psum(o, names) if names else o) for o, kind in zip(outs, kinds))
  outs = jax.shard_map(local, mesh=sharding.mesh, in_specs=tuple(specs),
                       out_specs=tuple(P(*tok) if kind == "token" else P() for kind in kinds))(
                           *args)
  return tuple(o.reshape(-1) if kind == "token" else o for o, kind in zip(outs, kinds))


class HeadRule(_rule.Rule):
  """Matmul + cross-entropy; first in the claim order (its log-softmax is no softmax to
  keep).  Inside a scan body the reduction is not folded (the forward's gradients would be
  kept per step)."""
  kind = "head"
  publics = ("linear_cross_entropy",)

  def prepare(self, g, opts):
    """``g`` with the ``custom_jvp``/``custom_vjp`` calls a head's cross-entropy is computed
    through inlined (optax's ``safe_softmax_cross_entropy``, T5X's and MaxText's
    ``cross_entropy_with_logits``), where the head found through the inlined body takes the
    whole body: the call's derivative rule is replaced with the head's, the derivative of
    the loss the body computes."""
    calls = _head_find.calls_on_logits(g)
    if not calls:
      return g
    trial, bodies = _graph.inline(g, calls)
    outvars = {r for r in trial.outvars if not isinstance(r, _graph.Lit)}
    matches, _ = _head_find.find_heads(trial, set(), outvars, allow_fold=not opts.in_loop)
    covered = {i for m in matches for i in m.nodes}
    taken = [i for i, body in bodies.items() if set(body) <= covered]
    if len(taken) == len(bodies):  # every inlined call taken: the trial graph is the one
      return trial if taken else g
    return _graph.inline(g, taken)[0] if taken else g

  def find(self, g, claimed, outvars, opts):
    matches, left = _head_find.find_heads(g, claimed, outvars, allow_fold=not opts.in_loop)
    return matches, [(nodes, "linear_cross_entropy", why) for nodes, why in left]

  def output(self, g, match):
    return match.output(g)

  def build(self, g, match, opts):
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), match.outputs(g),
                       head_fn(match, g))
    return _rule.Built(unit)

  def floor(self, audit, match):
    """Its input and weight (what the matmul keeps anyway) and a float32 log-sum-exp per
    token."""
    audit.walk(match.x)
    audit.walk(match.w)
    tokens = math.prod(_match.aval(audit.g, match.x).shape[:-1])
    audit.record(("lse", match.root), "linear_cross_entropy row statistic", (tokens,),
                 "float32", 4 * tokens, audit.g.nodes[match.root].where)
