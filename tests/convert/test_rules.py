"""The conversion's rule table: a new recognizer is one Rule subclass and one entry in
``_pass.RULES`` — nothing else changes.  The example is docs/conversion.md's: squared ReLU
(Primer's ``relu(x) ** 2``) keeps its output only, its derivative ``2 sqrt(y)``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from invact_jax.convert import _forms, _match, _pass, _rule
from invact_jax.convert import graph as _graph


class SquaredReluRule(_rule.Rule):
  """``max(x, 0) ** 2`` as a custom_vjp keeping ``y``: ``dy/dx = 2 sqrt(y)``."""
  kind = "squared_relu"
  publics = ("squared_relu",)
  form = _forms.Form("max(x, 0) ** 2", "squared_relu", "squared_relu",
                     lambda dtype: lambda x: jnp.square(jnp.maximum(x, 0.0)))

  def find(self, g, claimed, outvars, opts):
    matches, taken = [], set(claimed)
    for i, n in enumerate(g.nodes):
      aval = g.avals[n.outs[0]] if n.outs else None
      if i in taken or aval is None or not jnp.issubdtype(aval.dtype, jnp.floating):
        continue
      pat = _match.pattern(self.form, tuple(aval.shape), np.dtype(aval.dtype).name)
      m = None if pat is None else _match.match_at(pat, g, i, taken)
      if m is not None and not _match.escapes(g, set(m.nodes), self.output(g, m), outvars):
        matches.append(m)
        taken |= set(m.nodes)
    return matches, []

  def public(self, match):
    return "squared_relu"

  def describe(self, match):
    return self.form.name

  def build(self, g, match, opts):
    region = self.region(g, match)

    @jax.custom_vjp
    def f(x):
      return region(x)

    def fwd(x):
      y = region(x)
      return y, y

    def bwd(y, dy):
      return (dy * 2.0 * jnp.sqrt(y),)
    f.defvjp(fwd, bwd)
    unit = _graph.Unit(frozenset(match.nodes), list(match.inputs), [self.output(g, match)],
                       _rule.single(f))
    return _rule.Built(unit, kept=True)


def _mlp(w1, w2, x):
  return jnp.sum(jnp.square(jnp.maximum(x @ w1, 0.0)) @ w2)


@pytest.fixture
def with_rule(monkeypatch):
  monkeypatch.setattr(_pass, "RULES", _pass.RULES + (SquaredReluRule(),))


def test_a_new_rule_is_found_converted_and_reported(with_rule):
  k = jax.random.split(jax.random.key(0), 3)
  w1, w2 = jax.random.normal(k[0], (16, 64)) / 4, jax.random.normal(k[1], (64, 16)) / 8
  x = jax.random.normal(k[2], (8, 16))
  inv = invact_jax.invert(_mlp)
  g = jax.jit(jax.grad(inv, argnums=(0, 1)))(w1, w2, x)
  assert inv.last_report.replaced == {"squared_relu": 1}, inv.last_report
  assert inv.last_report.forms == {"max(x, 0) ** 2": 1}
  np.testing.assert_array_equal(jax.jit(inv)(w1, w2, x), jax.jit(_mlp)(w1, w2, x))
  g0 = jax.grad(_mlp, argnums=(0, 1))(w1, w2, x)
  for a, b in zip(g, g0):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  kept = lambda f: sum(r.bytes for r in memory.residuals(f, w1, w2, x) if not r.is_argument)  # noqa: E731
  assert kept(inv) == 8 * 64 * 4 < kept(_mlp)  # y alone, shared with the next matmul
  only = invact_jax.invert(_mlp, only="squared_relu")
  jax.jit(only)(w1, w2, x)
  assert only.last_report.replaced == {"squared_relu": 1}


def test_the_floor_audit_sees_a_new_rule_as_its_rule_says(with_rule):
  """The floor audit finds the ops by the same table: the new rule's output is a floor item
  with its role (the rule's default floor: its output, once), and the converted program
  keeps exactly it."""
  args = (jnp.ones((16, 64)), jnp.ones((64, 16)), jnp.ones((8, 16)))
  audit = invact_jax.floor_audit(invact_jax.invert(_mlp), *args)
  assert [(i.what, i.shape) for i in audit.floor] == [("squared_relu output", (8, 64))]
  assert [role for _, role in audit.kept] == ["squared_relu output"] and audit.ratio == 1.0


def test_without_the_entry_the_floor_has_no_such_role():
  """Without the entry the floor walks back through the squared ReLU, elementwise, to the
  matmul output it is computed from: the same bytes, no rule's role."""
  audit = invact_jax.floor_audit(_mlp, jnp.ones((16, 64)), jnp.ones((64, 16)),
                                 jnp.ones((8, 16)))
  assert [(i.what, i.bytes) for i in audit.floor] == [("matmul output", 8 * 64 * 4)], \
      audit.table()


def test_norms_false_leaves_norms_and_softmaxes_not_other_rules(with_rule):
  """``invert(norms=False)`` converts the activations and the rules that are not about norms
  and softmaxes (the new one, the LM head)."""
  def f(w1, w2, s, x):
    h = jnp.square(jnp.maximum(x @ w1, 0.0)) + 1.0  # (+ a residual stream)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-6) * s
    return jnp.sum(h @ w2)
  args = (jnp.ones((16, 64)), jnp.ones((64, 16)), jnp.ones((64,)), jnp.ones((8, 16)))
  inv = invact_jax.invert(f, norms=False)
  jax.jit(inv)(*args)
  # (the norm left as asked, not reported as an unrecognized form)
  assert inv.last_report.replaced == {"squared_relu": 1} and not inv.last_report.left_alone, \
      inv.last_report
  both = invact_jax.invert(f)
  jax.jit(both)(*args)
  assert both.last_report.replaced == {"squared_relu": 1, "rms_norm": 1}, both.last_report


def test_without_the_entry_nothing_finds_it():
  inv = invact_jax.invert(_mlp)
  jax.jit(inv)(jnp.ones((16, 64)), jnp.ones((64, 16)), jnp.ones((8, 16)))
  assert "squared_relu" not in inv.last_report.replaced
  with pytest.raises(ValueError, match="squared_relu"):
    invact_jax.invert(_mlp, only="squared_relu")
