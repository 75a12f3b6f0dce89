"""The residuals of a custom_vjp call named where its forward computes them: the same values
and gradients, and a policy of names that keeps them spares re-running the forward."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from invact_jax import _vjp_residuals, memory
from invact_jax.convert import graph as _graph
from models import reference_layers as ref

B, T, H, DH = 2, 16, 2, 8
Q = jax.random.normal(jax.random.key(0), (B, T, H, DH))
K, V = jnp.cos(Q), jnp.sin(2 * Q)


def _call_node(fn, *args):
  graph = _graph.flatten(jax.make_jaxpr(fn)(*args))
  return graph, next(n for n in graph.nodes if n.prim.name.startswith("custom_vjp_call"))


def _named_layer(names):
  """sin(flash attention(sin q, k, v)) with the call's residuals named ``names``."""
  graph, node = _call_node(lambda q, k, v: jnp.sin(ref.flash_attention(jnp.sin(q), k, v, True)),
                           Q, K, V)

  def layer(q, k, v):
    env = dict(zip(graph.invars, [q, k, v]))
    for n in graph.nodes:
      ins = [r.val if isinstance(r, _graph.Lit) else env[r] for r in n.ins]
      outs = (_vjp_residuals.bind_named(n, ins, names, _graph.bind) if n is node
              else _graph.bind(n, ins))
      env.update(zip(n.outs, outs))
    return env[graph.outvars[0]]
  return layer


def test_a_flash_attentions_residuals_are_its_output_and_row_log_sum_exp():
  _, node = _call_node(lambda q, k, v: ref.flash_attention(q, k, v, True), Q, K, V)
  found = _vjp_residuals.residuals(node)
  # q, k and v pass through (not computed); o is the call's output 0, lse is not an output
  assert [(r.index, tuple(r.aval.shape), r.output) for r in found] == [
      (0, (B, T, H, DH), 0), (1, (B, H, T, 1), None)]


def test_same_values_and_gradients_bit_for_bit():
  layer = _named_layer({0: "out", 1: "lse"})
  original = lambda q, k, v: jnp.sin(ref.flash_attention(jnp.sin(q), k, v, True))  # noqa: E731
  np.testing.assert_array_equal(jax.jit(layer)(Q, K, V), jax.jit(original)(Q, K, V))
  def grad(f):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))
  for a, b in zip(grad(layer)(Q, K, V), grad(original)(Q, K, V)):
    np.testing.assert_array_equal(a, b)


def test_keeping_the_names_spares_the_forward_in_the_backward():
  """Three layers under jax.checkpoint: keeping the call's output and its log-sum-exp does
  the FLOPs of no remat; keeping only one of them re-runs the forward's matmuls."""
  layer = _named_layer({0: "out", 1: "lse"})
  names = jax.checkpoint_policies.save_only_these_names

  def flops(policy):
    step = jax.checkpoint(lambda c: layer(c, K, V), policy=policy)
    def loss(q):
      return jnp.sum(jax.lax.scan(lambda c, _: (step(c), None), q, None, length=3)[0])
    return memory.jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(Q), per_iteration=True)
  everything = flops(jax.checkpoint_policies.everything_saveable)
  nothing = flops(jax.checkpoint_policies.nothing_saveable)
  kept = flops(names("out", "lse"))
  # (no remat keeps the sines too; keeping the names recomputes them, 3 x 512 FLOPs)
  assert kept <= everything + 3 * 2 * B * T * H * DH
  # the forward's two matmuls (2 B H T T DH FLOPs each) not re-run, per layer; keeping the
  # output alone re-runs the logits' (for the log-sum-exp), the log-sum-exp alone both
  matmul = 3 * 2 * B * H * T * T * DH
  assert nothing - kept >= 2 * matmul
  assert flops(names("out")) - kept >= matmul
  assert flops(names("lse")) == nothing
  residuals = memory.residuals(
      lambda q: jnp.sum(jax.checkpoint(lambda c: layer(c, K, V), policy=names("out", "lse"))(q)), Q)
  assert {r.source.split("'")[1] for r in residuals if "named" in r.source} == {"out", "lse"}


@pytest.mark.parametrize("case", ["integer input", "symbolic zeros"])
def test_calls_it_cannot_name_are_left_as_they_are(case):
  if case == "integer input":
    @jax.custom_vjp
    def f(x, n):
      return x * n
    f.defvjp(lambda x, n: (x * n, (n,)), lambda res, g: (g * res[0], None))
    args = (Q, jnp.int32(3))
  else:
    @jax.custom_vjp
    def f(x, y):
      return x * y
    f.defvjp(lambda x, y: (x * y, (x.value, y.value)),
             lambda res, g: (g * res[1], g * res[0]), symbolic_zeros=True)
    args = (Q, K)
  _, node = _call_node(f, *args)
  assert _vjp_residuals.residuals(node) is None


def test_this_jax_passes_the_check_that_guards_the_internals_it_reads(monkeypatch):
  """The once-per-process check of JAX's internals passes here, also where first asked inside
  a trace; where it fails, calls are left as they are (no candidates named inside)."""
  _vjp_residuals._works.cache_clear()  # pylint: disable=protected-access
  # asked first inside a trace (the planner asks while tracing), it checks concrete values
  jax.jit(lambda x: x + _vjp_residuals._works())(1.0)  # pylint: disable=protected-access
  assert _vjp_residuals._works()  # pylint: disable=protected-access
  _, node = _call_node(lambda q, k, v: ref.flash_attention(q, k, v, True), Q, K, V)
  monkeypatch.setattr(_vjp_residuals, "_works", lambda: False)
  assert _vjp_residuals.residuals(node) is None
