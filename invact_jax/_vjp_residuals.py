"""The residuals of a ``jax.custom_vjp`` call, named where its forward computes them.

``jax.checkpoint`` re-runs a custom derivative's forward in the backward unless everything
its backward reads is saved: its residuals (a flash attention's output and row
log-sum-exp) and its outputs.  No name outside the call reaches the residuals, so no policy
of names can keep them, and JAX's ``dots`` keeps the forward's matmuls instead (a
[T, T] logits buffer per layer).  :func:`bind_named` evaluates the call as a new
``custom_vjp`` whose forward is the call's own with ``checkpoint_name`` on each residual
(an output that is also a residual is returned named once, so keeping it keeps both), and
whose backward is the call's own: the same values and gradients, and a policy of names can
keep the residuals (:mod:`invact_jax.planner`'s candidates).

It reads the call's equation parameters (``fwd_jaxpr_thunk``, ``bwd``, ``out_trees``,
``num_consts``, ``symbolic_zeros``), the same in JAX 0.10 to 0.12; a call they do not
describe as expected is left as it is (:func:`residuals` gives None).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Residual", "residuals", "bind_named"]

# JAX 0.12's backward rules return (cotangents, logs); earlier ones the cotangents.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


@dataclasses.dataclass(frozen=True)
class Residual:
  """One residual the call's forward computes (not one of its inputs passed through).

  Attributes:
    index: its position among the forward's computed residuals.
    aval: its abstract value.
    output: the call's output it is, if one (its index), else None.
  """
  index: int
  aval: Any
  output: int | None


def _forward(node) -> tuple[Any, Any, list, int]:
  """``(jaxpr, consts, fwds, computed)`` of the call's forward with every input perturbed:
  ``fwds[i]`` the input residual ``i`` passes through (None: computed), ``computed`` the
  number of residuals the forward's jaxpr returns before the outputs."""
  p = node.params
  jaxpr, consts = p["fwd_jaxpr_thunk"].call_wrapped(*([True] * (len(node.ins) - p["num_consts"])))
  _, res_tree, fwds = p["out_trees"]()
  return jaxpr, consts, list(fwds), res_tree.num_leaves - sum(f is not None for f in fwds)


def residuals(node) -> list[Residual] | None:
  """The residuals the ``custom_vjp`` call ``node`` (a :class:`~invact_jax.convert._graph.Node`)
  computes, or None where it cannot be named (closed-over constants, symbolic zeros, a
  non-float input, parameters of another form, or a JAX whose internals :func:`bind_named`
  reads differ: :func:`_works`)."""
  p = node.params
  if not _works():
    return None
  try:
    if (p.get("num_consts", 1) or p.get("symbolic_zeros", True)
        or not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in _in_avals(node))):
      return None
    jaxpr, _, _, computed = _forward(node)
  except (KeyError, TypeError, AttributeError, ValueError):
    return None
  outvars = list(jaxpr.outvars)
  out = []
  for j, v in enumerate(outvars[:computed]):
    same = next((i for i, o in enumerate(outvars[computed:]) if o is v), None)
    out.append(Residual(j, v.aval, same))
  return out


def _in_avals(node) -> list:
  call = node.params["call_jaxpr"]
  return list(getattr(call, "in_avals", None) or [v.aval for v in call.invars])


def bind_named(node, invals: list, names: dict[int, str], bind) -> list:
  """The call ``node`` on ``invals`` with its computed residuals ``j`` named ``names[j]``
  under differentiation (``bind(node, invals)``: the call as it is, its value)."""
  @jax.custom_vjp
  def call(primals):
    return bind(node, list(primals))

  def fwd(primals):
    jaxpr, consts, fwds, computed = _forward(node)
    outs = jax.core.eval_jaxpr(jaxpr, consts, *primals)
    res = list(outs[:computed])
    named = [jax.ad_checkpoint.checkpoint_name(r, names[j]) if j in names else r
             for j, r in enumerate(res)]
    result = [next((named[j] for j, r in enumerate(res) if r is o), o) for o in outs[computed:]]
    # only the inputs the backward reads (others would stay live in a linearization)
    return result, ([None if f is None else primals[f] for f in fwds], named)

  def bwd(saved, cts):
    passed, named = saved
    computed = iter(named)
    full = [next(computed) if p is None else p for p in passed]
    got = node.params["bwd"].call_wrapped(*full, *cts)
    got = got[0] if _BWD_RETURNS_LOGS else got
    return (tuple(jnp.zeros(a.shape, a.dtype) if type(g).__name__ in ("Zero", "SymbolicZero")
                  else g for g, a in zip(got, _in_avals(node))),)

  call.defvjp(fwd, bwd)
  return list(call(tuple(invals)))


@functools.cache
def _works() -> bool:
  """Whether :func:`bind_named` gives a small ``custom_vjp``'s value and gradient on this JAX
  (it reads equation parameters that are JAX's internals): checked once per process, on
  concrete values even where first asked inside a trace."""
  try:
    with jax.ensure_compile_time_eval():
      return _named_gradient_is_the_calls()
  except Exception:  # pylint: disable=broad-except  (any failure: leave calls as they are)
    return False


def _named_gradient_is_the_calls() -> bool:
  """Whether this JAX's names on a ``custom_vjp`` call's residuals leave its gradient the call's
  own (checked once on a small call)."""
  from invact_jax.convert import graph as _graph  # pylint: disable=import-outside-toplevel

  @jax.custom_vjp
  def f(x, y):
    return x * jnp.sin(y)
  f.defvjp(lambda x, y: (x * jnp.sin(y), (jnp.sin(y), x * jnp.cos(y))),
           lambda res, g: (g * res[0], g * res[1]))
  x, y = jnp.arange(1.0, 4.0), jnp.arange(2.0, 5.0)
  graph = _graph.flatten(jax.make_jaxpr(f)(x, y))
  node = next(n for n in graph.nodes if n.prim.name.startswith("custom_vjp"))

  def named(x, y):
    return bind_named(node, [x, y], {0: "a", 1: "b"}, _graph.bind)[0]
  got = jax.grad(lambda x, y: jnp.sum(jnp.tanh(named(x, y))), argnums=(0, 1))(x, y)
  want = jax.grad(lambda x, y: jnp.sum(jnp.tanh(f(x, y))), argnums=(0, 1))(x, y)
  return all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
