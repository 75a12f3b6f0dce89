"""The forms rule: activations, scaled SiLU and last-axis softmax found as the traced
equations of one of :data:`._forms.FORMS` (whatever Python object computed them), each run as
a ``custom_vjp`` whose forward is the program's own equations: an activation keeps its output
(+ one bit per element where it is not monotone), a softmax its probabilities.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import _forms
from invact_jax.convert import graph as _graph
from invact_jax.convert import _match
from invact_jax.convert import _rule
from invact_jax.ops import _common
from invact_jax.ops.activations import base as _act_base
from invact_jax.ops.activations import registry
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["FormRule"]

#: Form kinds ``fallback="temp"`` may recompute from their input instead of leaving alone.
_RECOMPUTABLE = frozenset({"activation", "scaled_silu"})
_ESCAPED = "an intermediate value is also used elsewhere"


def _activation_fn(match: _match.FormMatch, region, implementation):
  """The activation keeping its output and, where it is not monotone, its packed branch
  bits; the backward is the registry entry's ``f'(f^-1(y))``."""
  entry = match.pattern.form.entry
  caught = {**dict(match.pattern.form.defaults), **match.caught}
  params = tuple((k, float(caught[k])) for k, _ in entry.params)
  op = _act_base.Op(entry, params)

  @jax.custom_vjp
  def f(x):
    return region(x)

  def fwd(x):
    y = region(x)
    return y, (y, _act_base.packed_bits(op, x))

  def bwd(res, dy):
    y, packed = _common.read_apart(res)
    return (implementation.backward(op, y, packed, dy),)

  f.defvjp(fwd, bwd)
  return f


def _scaled_silu_fn(match: _match.FormMatch, region, implementation):
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
    y, packed = _common.read_apart(res)
    s = (y.astype(_common.compute_dtype(y.dtype)) * c).astype(y.dtype)
    return (implementation.backward(op, s, packed, dy),)

  f.defvjp(fwd, bwd)
  return f


def _softmax_call_fn(match: _match.FormMatch, region, target):
  """A last-axis softmax (``jax.nn.softmax``'s call or by hand) keeping its probabilities."""
  x_dtype = _match.aval(target, match.inputs[0]).dtype

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


_BUILDERS = {
    "activation": lambda m, region, g, opts: _activation_fn(
        m, region, opts.implementations["activation"]),
    "scaled_silu": lambda m, region, g, opts: _scaled_silu_fn(
        m, region, opts.implementations["activation"]),
    "softmax": lambda m, region, g, opts: _softmax_call_fn(m, region, g)}


def _floating_outputs(g: _graph.Graph) -> list:
  """``(node, shape, dtype, signature)`` per node with a floating, non-scalar first output."""
  out = []
  for i, n in enumerate(g.nodes):
    if n.outs:
      aval = g.avals[n.outs[0]]
      if aval.shape and jnp.issubdtype(aval.dtype, jnp.floating):
        out.append((i, tuple(aval.shape), np.dtype(aval.dtype).name, _match.signature(g, i)))
  return out


class FormRule(_rule.Rule):
  """Every form of :data:`._forms.FORMS` whose name is wanted, tried at every floating value
  (latest first: a form that ends in a cast, Flax's ``dtype=``, matches at the cast, not at
  the equation before it)."""
  kind = "form"
  publics = tuple(sorted({f.public for f in _forms.FORMS}))
  candidates = {"erf": "activation", "erfc": "activation", "logistic": "activation",
                "tanh": "activation"}

  def find(self, g, claimed, outvars, opts):
    matches, left, taken = [], [], set(claimed)
    values = _floating_outputs(g)
    for form in (f for f in _forms.FORMS if f.public in opts.names):
      for i, shape, dtype, sig in reversed(values):
        m = None if i in taken else self._match(form, g, i, shape, dtype, sig, taken)
        if m is None:
          continue
        if _match.escapes(g, set(m.nodes), self.output(g, m), outvars):
          left.append(([i], form.name, _ESCAPED))
          continue
        taken.update(m.nodes)
        matches.append(m)
    return matches, left

  @staticmethod
  def _match(form, g, i, shape, dtype, sig, taken):
    """Form ``form`` matched at node ``i`` (its root signature first, a cheap test), or None; a
    scaled SiLU only with ``c > 0``."""
    want = _match.root_signature(form, dtype)
    if want is None or want[0] != sig[0] or not want[1] <= sig[1]:
      return None
    pat = _match.pattern(form, shape, dtype)
    m = None if pat is None else _match.match_at(pat, g, i, taken)
    if m is not None and form.kind == "scaled_silu" and not m.caught["c"] > 0:
      return None  # x * sigmoid(c x) with c <= 0 is not a scaled SiLU's branch structure
    return m

  def public(self, match):
    return match.pattern.form.public

  def describe(self, match):
    return match.pattern.form.name

  def recomputable(self, match):
    return match.pattern.form.kind in _RECOMPUTABLE

  def build(self, g, match, opts):
    fn = _BUILDERS[match.pattern.form.kind](match, self.region(g, match), g, opts)
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), [self.output(g, match)],
                       _rule.single(fn))
    return _rule.Built(unit, kept=True)

  def role(self, match):
    return f"{match.pattern.form.public} output"

  def floor(self, audit, match):
    """Its output; an activation's (a scaled SiLU's) branch bit per element where it is not
    monotone, packed 8 per byte."""
    g, form = audit.g, match.pattern.form
    out = self.output(g, match)
    audit.anchor(out, self.role(match), self.kept_itemsize(match))
    if form.kind == "softmax":
      return
    entry = form.entry if form.kind == "activation" else registry.get("silu")
    params = tuple((k, float(match.caught[k])) for k, _ in entry.params)
    if _act_base.Op(entry, params).has_bit:
      a = g.avals[out]
      packed = (*a.shape[:-1], math.ceil(a.shape[-1] / 8)) if a.shape else (1,)
      audit.record(("bits", out), f"{form.public} bits", packed, "uint8", math.prod(packed),
                   g.nodes[match.root].where)
