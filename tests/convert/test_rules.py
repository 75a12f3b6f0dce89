"""The conversion's rule table: a new recognizer is one Rule subclass and one entry in
``_pass.RULES`` — nothing else changes.  The example is docs/conversion.md's: squared ReLU
(Primer's ``relu(x) ** 2``) keeps its output only, its derivative ``2 sqrt(y)``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from invact_jax.convert import _forms, _graph, _match, _pass, _rule


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


def test_without_the_entry_nothing_finds_it():
  inv = invact_jax.invert(_mlp)
  jax.jit(inv)(jnp.ones((16, 64)), jnp.ones((64, 16)), jnp.ones((8, 16)))
  assert "squared_relu" not in inv.last_report.replaced
  with pytest.raises(ValueError, match="squared_relu"):
    invact_jax.invert(_mlp, only="squared_relu")
