"""Facts about single values the head's finder and loss follower read: constants, labels'
positions along an axis, masks, zeros, a gather's out-of-range mode, splits of the
vocabulary."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.convert import graph as _graph
from invact_jax.convert.graph import Lit


def shifts(k: str) -> list:
  """The row constants a log-sum-exp's shift ``k`` sums (:meth:`_Head._exp`)."""
  return k.split("+") if k else []


def gather_outside(n: _graph.Node) -> str | None:
  """What the gather ``n`` that picks a label's logit gives for a label outside ``[0, V)``,
  and its gradient: ``"clip"`` (``mode="clip"``: the nearest entry, its gradient there too),
  ``"nearest"`` (``promise_in_bounds``, jnp indexing's default: XLA's gather reads the
  nearest entry and the scatter of its transpose drops the gradient), ``"nan"`` (``fill``
  with NaN: the head's own value), None (a fill of another value: no head reads it)."""
  mode = str(n.params.get("mode", "")).rsplit(".", 1)[-1].upper()
  if "CLIP" in mode:
    return "clip"
  if "FILL" not in mode:
    return "nearest"
  fill = n.params.get("fill_value")
  return "nan" if fill is None or (isinstance(fill, float) and math.isnan(fill)) else None


def position_along(g: _graph.Graph, ref, axis: int) -> list | None:
  """The nodes computing ``ref`` as each element's own position along ``axis`` (an ``iota``,
  broadcast, with NumPy's negative-index wrap ``select(i < 0, i + n, i)``), else None."""
  nodes, wrap = [], {"lt", "add", "select_n", "convert_element_type"}
  r, trail = ref, []
  while not isinstance(r, Lit) and r in g.producer:
    i = g.producer[r][0]
    n = g.nodes[i]
    nodes.append(i)
    if n.prim.name == "iota":
      dim = n.params["dimension"]
      for b in reversed(trail):  # the broadcasts from the iota to ``ref``, in forward order
        dim = b.params["broadcast_dimensions"][dim]
      return nodes if dim == axis else None
    if n.prim.name == "broadcast_in_dim":
      trail.append(n)
      r = n.ins[0]
    elif n.prim.name in wrap:
      r = next((x for x in n.ins if not isinstance(x, Lit) and
                jnp.issubdtype(g.avals[x].dtype, jnp.integer)), None)
      if r is None:
        return None
    else:
      return None
  return None


def splits_last(n: _graph.Node, shape: tuple) -> bool:
  """Whether the sharding primitive ``n`` places a value of ``shape`` split along its last
  axis over devices (unknown shardings: split)."""
  sharding = n.params.get("sharding", n.params.get("dst_sharding"))
  try:
    return tuple(sharding.shard_shape(tuple(shape)))[-1:] != tuple(shape)[-1:]
  except Exception:  # pylint: disable=broad-except
    return True


def vocab_split(n: _graph.Node, shape: tuple) -> tuple | None:
  """``(sharding, shape)`` where the sharding primitive ``n`` places the logits of ``shape``
  as a ``NamedSharding`` over a mesh of automatic axes (what ``shard_map`` runs the head
  on, per shard), else None."""
  sharding = n.params.get("sharding", n.params.get("dst_sharding"))
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if (not isinstance(sharding, jax.sharding.NamedSharding) or spec is None
      or len(spec) > len(shape) or any("Auto" not in str(t)
                                       for t in getattr(mesh, "axis_types", ()))
      or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)):
    return None
  return sharding, tuple(shape)


def spread_source(g: _graph.Graph, ref):
  """``(source, chain)``: ``ref`` followed back through broadcasts, reshapes and casts to a
  program value or an array constant (a bias closed over); ``(None, [])`` at a scalar."""
  chain = []
  while not isinstance(ref, Lit) and ref in g.producer:
    i = g.producer[ref][0]
    n = g.nodes[i]
    if n.prim.name not in ("broadcast_in_dim", "reshape", "convert_element_type") or \
        len(n.ins) != 1:
      break
    chain.insert(0, i)
    ref = n.ins[0]
  if isinstance(ref, Lit) and not np.ndim(ref.val):
    return None, []
  return ref, chain


def literal_source(g: _graph.Graph, ref) -> Lit | None:
  """The literal ``ref`` is a broadcast or cast of (or is), else None."""
  while not isinstance(ref, Lit) and ref in g.producer:
    n = g.nodes[g.producer[ref][0]]
    if n.prim.name not in ("broadcast_in_dim", "convert_element_type") or len(n.ins) != 1:
      return None
    ref = n.ins[0]
  return ref if isinstance(ref, Lit) and not isinstance(ref.val, jax.core.Tracer) else None


_SCALAR_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
               "neg": np.negative, "max": np.maximum, "min": np.minimum, "sqrt": np.sqrt,
               "rsqrt": lambda v: 1 / np.sqrt(v), "convert_element_type": np.asarray}


def constant(g: _graph.Graph, ref, depth: int = 0) -> float | None:
  """The value of ``ref`` where it is a scalar constant (a literal, a broadcast or cast of
  one, or floating arithmetic on such: Keras's ``label_smoothing / num_classes``, a
  ``jnp.sqrt(d)``), else None."""
  lit = literal_source(g, ref)
  if lit is not None:
    return None if np.size(lit.val) != 1 else float(np.asarray(lit.val).reshape(()))
  if isinstance(ref, Lit) or ref not in g.producer or depth > 8:
    return None
  n = g.nodes[g.producer[ref][0]]
  dtype = g.avals[ref].dtype
  if (n.prim.name not in _SCALAR_OPS or len(n.outs) != 1 or g.avals[ref].shape
      or not jnp.issubdtype(dtype, jnp.floating)):
    return None
  vals = [constant(g, r, depth + 1) for r in n.ins]
  if any(v is None for v in vals):
    return None
  return float(_SCALAR_OPS[n.prim.name](*(np.asarray(v, dtype) for v in vals)))


def mask_root(g: _graph.Graph, ref):
  """A boolean mask ``ref`` followed back through broadcasts, reshapes, casts and reductions
  over axes of size one: the array (or closed-over constant) it spreads, else None."""
  while not isinstance(ref, Lit) and ref in g.producer:
    n = g.nodes[g.producer[ref][0]]
    name = n.prim.name
    if len(n.ins) != 1 or name not in ("broadcast_in_dim", "reshape", "convert_element_type",
                                       "squeeze", "expand_dims", "reduce_or", "reduce_and"):
      break
    if name in ("reduce_or", "reduce_and") and any(
        g.avals[n.ins[0]].shape[a] != 1 for a in n.params["axes"]):
      return None
    ref = n.ins[0]
  if isinstance(ref, Lit):
    return ref if np.asarray(ref.val).dtype == np.bool_ else None
  return ref if jnp.dtype(g.avals[ref].dtype) == jnp.bool_ else None


def mask_size(g: _graph.Graph, mask) -> int:
  return int(np.size(mask.val)) if isinstance(mask, Lit) else int(np.prod(g.avals[mask].shape))


def same_ref(a, b) -> bool:
  if isinstance(a, Lit) or isinstance(b, Lit):
    return isinstance(a, Lit) and isinstance(b, Lit) and a.val is b.val
  return a == b


def masked_away(g: _graph.Graph, o, mask) -> bool:
  """Whether the per-token losses ``o`` are read only by ``where(mask, o, 0)`` (the rows a
  per-token ``mask`` drops set to zero, as optax's ``where=`` does after its masked
  log-sum-exp): then those rows' values, which the head computes otherwise, are never seen."""
  readers = g.consumers.get(o, ())
  if not readers:
    return False
  for i in readers:
    n = g.nodes[i]
    if (n.prim.name != "select_n" or len(n.ins) != 3 or n.ins[2] != o or n.ins[1] == o
        or not zero(g, n.ins[1])):
      return False
    root = mask_root(g, n.ins[0])
    if root is None or not same_ref(root, mask):
      return False
  return True


def zero(g: _graph.Graph, ref) -> bool:
  """Whether ``ref`` is a constant zero (a literal, or a broadcast or cast of one)."""
  lit = literal_source(g, ref)
  return lit is not None and not np.any(np.asarray(lit.val))
