"""Applying a plan: the program run again with its heaviest layer loop's body under the plan's
policy (or one ``lax.scan`` per run of layers), traced per call."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from invact_jax.convert import graph as _graph
from invact_jax.planner import layer_loop

def _rescan_runs(node: _graph.Node, bodies: Sequence[tuple[Callable, int]], invals) -> list:
  """The outputs of scan ``node`` on ``invals`` as one ``lax.scan`` per run of layers
  (``bodies``: (body, layers) in layer order), each over its slice of the stacked inputs, the
  carry passed on in the scan's direction and the stacked outputs joined."""
  p = node.params
  n_consts, n_carry = _graph.scan_counts(p)
  consts, carry = invals[:n_consts], list(invals[n_consts:n_consts + n_carry])
  xs = invals[n_consts + n_carry:]
  sizes = [n for _, n in bodies]
  # (split, not slices: its transpose joins the runs' gradients into one buffer; slices' pads
  # would add a stack-sized buffer per run)
  pieces = [jax.lax.split(x, sizes, axis=0) for x in xs]
  parts: list = [None] * len(bodies)
  for i in (reversed(range(len(bodies))) if p["reverse"] else range(len(bodies))):
    body, n = bodies[i]

    def step(c, x, body=body):
      outs = body(*consts, *c, *x)
      return list(outs[:n_carry]), list(outs[n_carry:])
    carry, parts[i] = jax.lax.scan(step, carry, [p_[i] for p_ in pieces],
                                   length=n, reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *(jnp.concatenate([part[j] for part in parts]) for j in range(len(parts[0])))]


def _run(closed, args_flat, keep, offload, fixed=None, runs=()) -> list:
  """The program of ``closed`` on ``args_flat`` with its heaviest layer loop planned (``runs``:
  ``(keep, offload, layers)`` per run of layers, each its own scan)."""
  graph, loops, _ = layer_loop.find_loops(closed)
  if not loops:
    return _graph.evaluate(graph, list(args_flat))
  target = loops[0]
  if runs:
    bodies = [(layer_loop.layer_body(target, k, o, None), n) for k, o, n in runs]
    at_loop = lambda node, invals: _rescan_runs(node, bodies, invals)  # noqa: E731
  elif target.within:  # its values vary over the mesh's axes: the body is traced where it is
    body = layer_loop.layer_body(target, keep, offload, fixed)
    at_loop = lambda node, invals: _graph.rescan(node, body, invals)  # noqa: E731
  else:
    new = layer_loop.planned_layer_body(target, keep, offload, fixed)
    at_loop = lambda node, invals: _graph.bind(_graph.Node(  # noqa: E731
        node.prim, dict(node.params, jaxpr=new), node.ins, node.outs, eqn=node.eqn), invals)

  def hook(node, invals):
    if node is target.node:
      return at_loop(node, invals)
    for shard_map, body in target.within:
      if node is shard_map:
        return _graph.rewrap_shard_map(
            node, lambda *a, body=body: _graph.evaluate(body, list(a), nested=hook), invals)
    return None
  return _graph.evaluate(graph, list(args_flat), nested=hook)


def apply_plan(fn: Callable, keep, offload, fixed: str | None = None, runs=()) -> Callable:
  """``fn`` with the plan (or the JAX policy ``fixed``; ``runs``: per run of layers) applied
  to its heaviest layer loop (traced again per call; positional and keyword arguments as
  ``fn`` takes them)."""
  def planned(*args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))

    def flat(*vals):
      a, k = jax.tree.unflatten(tree, vals)
      return fn(*a, **k)
    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    outs = _run(closed, leaves, keep, offload, fixed, runs)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)
  return planned
