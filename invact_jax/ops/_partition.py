"""Running opaque kernels (pallas_call, triton_call) per shard, under vmap and in shard_map.

A kernel call is opaque to XLA's partitioner, which would gather its operands around it.
Every kernel here is independent along its leading axes, so each shard can run it on its
own block.  Two layouts cover all of them:

* :func:`elementwise`: operands are data ``[..., n]`` ("d") and packed masks
  ``[..., ceil(n/8)]`` ("m"; bit k of byte j is element 8j + k).  Every axis can be
  sharded; the last one only in whole mask bytes, i.e. multiples of 8 elements per shard
  (otherwise it is kept whole, which costs a gather that the sharding tests would show).
* :func:`rows`: row kernels (norms): operands ``[..., n]`` with the last axis whole, per-row
  statistics ``[..., 1]`` and per-column parameters ``[n]`` (replicated).
* :func:`tokens`: token kernels (the LM head): operands with a leading token axis (sharded as
  the first's) or replicated (the weight); outputs per token, or sums over the tokens (each
  shard's partial sum, added over the mesh axes the tokens are split on: the weight's
  gradient).

Both add a batching rule (``jax.vmap`` folds the batch axis into the leading axes) and run
the kernel directly inside ``shard_map``, where operands are already per-shard.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

__all__ = ["elementwise", "rows", "tokens", "in_manual_context"]


def in_manual_context() -> bool:
  """Whether tracing is inside ``shard_map`` (operands are already per-shard)."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return False
  return bool(getattr(get(), "manual_axes", ()))


def has_symbolic_dims(*arrays) -> bool:
  """Whether any operand has a symbolic dimension (``jax.export`` with a symbolic batch)."""
  return any(not isinstance(d, int) for a in arrays for d in a.shape)


def run_tile_math_directly(backend, *arrays) -> bool:
  """Whether a kernel backend runs its tile math as plain XLA ops instead of a kernel.

  Two cases, same results as the kernel up to the compiler's rounding of the math:
  interpret mode inside ``shard_map`` (Pallas's interpret mode does not track varying mesh
  axes, a limitation of the CPU testing mode; Triton's runs as a host callback) and symbolic
  shapes (``jax.export``: a compiled Triton kernel, or Triton's interpreter, needs a static
  grid; Pallas's interpret mode does not).  The residual layout is the same.
  """
  if backend.interpret and backend.name != "triton":
    return in_manual_context()
  # Triton's interpreter runs on the host (a callback) with a static grid, like compiled kernels.
  return (backend.interpret and in_manual_context()) or has_symbolic_dims(*arrays)


def per_shard(backend) -> bool:
  """Whether a kernel backend's calls can be partitioned per shard: not Triton's interpreter,
  a host callback, which ``custom_partitioning`` cannot hold (see :func:`elementwise`)."""
  return not (backend.name == "triton" and backend.interpret)


def _batched(call: Callable, data_mask: Sequence[bool]):
  """``call`` with a batching rule: batched operands get the batch axis in front.

  ``data_mask[i]`` says whether operand i has the data's leading axes (then an unbatched
  one is broadcast); other operands (per-column parameters) must stay unbatched, else the
  op runs once per batch element.
  """
  op = jax.custom_batching.custom_vmap(call)

  @op.def_vmap
  def rule(axis_size, in_batched, *args):
    if any(b and not d for b, d in zip(in_batched, data_mask)):  # a batched parameter
      outs = jax.lax.map(lambda a: call(*a), tuple(
          a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)))
      return outs, jax.tree.map(lambda _: True, outs)
    args = [a if b or not d else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b, d in zip(args, in_batched, data_mask)]
    outs = op(*args)
    return outs, jax.tree.map(lambda _: True, outs)
  return op


def _mesh_size(mesh) -> int:
  # Under jit with NamedSharding arguments (no mesh context) the mesh is not known at
  # lowering; then every device may be in it.
  return jax.device_count() if mesh is None or mesh.empty else int(mesh.size)


def _rule_text(operands, results, sizes, replicated, total):
  """A ``custom_partitioning`` sharding rule's text and its factor options: the factors that must
  be replicated (asked for, or not dividing the devices), in the rule's order, and the compound
  factors' sizes."""
  text = ", ".join(operands) + " -> " + ", ".join(results)
  order = list(dict.fromkeys(
      t for t in text.replace("(", " ").replace(")", " ").replace(",", " ").split() if t != "->"))
  need = set(replicated) | {f for f, n in sizes.items() if total > 1 and n is not None and n % total}
  factor_sizes = {f: n for f, n in sizes.items() if f in _compound(operands + results)}
  # Special factors must be listed in the rule's order.
  return text, dict(need_replication_factors=tuple(f for f in order if f in need), **factor_sizes)


def _rule(*candidates):
  """A Shardy sharding rule, decided at lowering time, when the mesh is known.

  Each candidate is ``(operands, results, sizes, replicated, usable)``: space-separated
  factor names per array (``"(m k)"`` for a dimension made of two factors), their sizes,
  the factors never sharded, and ``usable(mesh_size)``.  The first usable one is taken.
  Beyond ``replicated``, any factor whose size is not a multiple of the mesh size is kept
  whole: Shardy would shard it by a sub-axis, which ``custom_partitioning`` cannot express
  (keeping it whole costs a gather, but gives the right result).
  """
  def rule(mesh, value_types, result_types):
    del value_types, result_types
    total = _mesh_size(mesh)
    for operands, results, sizes, replicated, usable in candidates:
      if usable(total):
        return _rule_text(operands, results, sizes, replicated, total)
    raise AssertionError("no usable sharding rule")  # the last candidate is always usable
  return rule


def _size(d):
  """A dimension's size, or None when it is symbolic (jax.export)."""
  return d if isinstance(d, int) else None


def _compound(specs) -> set:
  """Factors that only appear inside compound ``(a b)`` dimensions (their size is needed)."""
  inner, whole = set(), set()
  for spec in specs:
    outside = spec
    for group in spec.split("(")[1:]:
      names = group.split(")")[0]
      inner |= set(names.split())
      outside = outside.replace(f"({names})", " ")
    whole |= set(outside.split())
  return inner - whole


def _partitioned(fn, args, n_out: int, shardings, rule, local=None):
  """``fn`` applied to ``args`` as a ``custom_partitioning`` op: ``shardings(mesh, arg_shapes)``
  gives the outputs' sharding (one for all ``n_out``, or a tuple of one per output) and the
  operands', ``rule`` is its sharding rule; each shard runs ``fn``, or ``local(mesh,
  arg_shapes)`` where given (what a shard computes can depend on the layout)."""
  op = custom_partitioning(fn)

  def out_shardings(out):
    return out if isinstance(out, tuple) or n_out == 1 else (out,) * n_out

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return out_shardings(shardings(mesh, arg_shapes)[0])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    out, ins = shardings(mesh, arg_shapes)
    return (mesh, fn if local is None else local(mesh, arg_shapes), out_shardings(out), ins)

  op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return op(*args)


def _axis_tuple(axes) -> tuple:
  """A partition spec entry (one mesh axis name or a tuple of them) as a tuple."""
  return axes if isinstance(axes, tuple) else (axes,)


def _parts(mesh, axes) -> int:
  """How many shards a partition spec entry ``axes`` splits an axis into on ``mesh``."""
  return int(np.prod([mesh.shape[a] for a in _axis_tuple(axes)]))


def _whole_last(mesh, spec, shape):
  """``spec`` (padded to ``shape``) with the last axis unsharded unless shards hold whole bytes."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  last = spec[-1]
  if last is not None and shape[-1] % (8 * _parts(mesh, last)):
    spec = spec[:-1] + (None,)
  return jax.sharding.PartitionSpec(*spec)


def elementwise(fn: Callable, kinds_in: str, kinds_out: str, *args, per_shard: bool = True):
  """``fn(*args)`` run per shard; ``kinds_*`` are "d" (data) / "m" (mask) per operand.

  ``per_shard=False``: left to XLA's partitioner as it is (a host callback, which
  ``custom_partitioning`` cannot hold: the callback is freed before it runs, jax-ml/jax#23620).
  """
  single = len(kinds_out) == 1

  def call(*a):
    if not per_shard or a[0].ndim == 0 or in_manual_context() or has_symbolic_dims(*a):
      return fn(*a)  # symbolic shapes run plain XLA ops (no kernel): XLA partitions them
    shape = a[0].shape
    lead = [f"b{i}" for i in range(len(shape) - 1)]
    sizes = {f: _size(n) for f, n in zip(lead, shape[:-1])}
    n = _size(shape[-1])
    always = lambda total: True  # noqa: E731

    def spec(pattern):
      return [" ".join(lead + [pattern[k]]) for k in kinds_in], \
             [" ".join(lead + [pattern[k]]) for k in kinds_out]
    if "m" not in kinds_in + kinds_out:
      rule = _rule((*spec({"d": "n"}), {**sizes, "n": n}, (), always))
    else:
      # Shards of the last axis holding whole mask bytes: data "(m k)", mask "m", k = 8.
      bytes_ = (*spec({"d": "(m k)", "m": "m"}), {**sizes, "m": None if n is None else n // 8,
                                                     "k": 8}, ("k",),
                lambda total: n is not None and n % (8 * total) == 0)
      # Otherwise (or with padding bits) the last axis stays whole.
      whole = (*spec({"d": "n", "m": "m"}), {**sizes, "n": n, "m": None}, ("n", "m"), always)
      rule = _rule(bytes_, whole)

    def shardings(mesh, arg_shapes):
      x = arg_shapes[0]
      s = jax.sharding.NamedSharding(mesh, _whole_last(mesh, x.sharding.spec, x.shape))
      return s, (s,) * len(kinds_in)
    return _partitioned(fn, a, 1 if single else len(kinds_out), shardings, rule)

  return _batched(call, [True] * len(args))(*args)


def rows(fn: Callable, n_out: int, *args, per_shard: bool = True):
  """``fn(*args)`` run per shard of the leading axes; ``None`` operands are passed through
  (``per_shard=False``: left to XLA's partitioner, as in :func:`elementwise`).

  Operands: the first is ``[..., n]``; others are ``[..., n]``, ``[..., 1]`` (row
  statistics) or ``[n]`` (parameters, replicated).  Outputs: ``[..., n]`` or ``[..., 1]``.
  """
  present = [a is not None for a in args]
  arrays = [a for a in args if a is not None]
  ndim = arrays[0].ndim

  def unpacked(*arrs):
    it = iter(arrs)
    return fn(*[next(it) if p else None for p in present])

  def call(*a):
    x = a[0]
    if not per_shard or x.ndim < 2 or in_manual_context():
      return unpacked(*a)
    lead = " ".join(f"b{i}" for i in range(x.ndim - 1))
    kinds = [f"{lead} n" if v.ndim == x.ndim and v.shape[-1] == x.shape[-1] else
             (f"{lead} o" if v.ndim == x.ndim else "n") for v in a]
    out_shapes = jax.eval_shape(unpacked, *a)
    out_shapes = out_shapes if isinstance(out_shapes, (tuple, list)) else (out_shapes,)
    outs = [f"{lead} n" if o.shape[-1] == x.shape[-1] and x.shape[-1] != 1 else f"{lead} o"
            for o in out_shapes]
    sizes = {f"b{i}": _size(d) for i, d in enumerate(x.shape[:-1])}
    rule = _rule((kinds, outs, sizes, ("n", "o"), lambda total: True))

    def shardings(mesh, arg_shapes):
      spec = tuple(arg_shapes[0].sharding.spec) + (None,) * x.ndim
      row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[:x.ndim - 1], None))
      rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      return row, tuple(row if len(s.shape) == x.ndim else rep for s in arg_shapes)
    return _partitioned(unpacked, a, n_out, shardings, rule)

  return _batched(call, [a.ndim == ndim for a in arrays])(*arrays)


def _explicit_token_axes(x):
  """``(mesh, axes)`` where ``x``'s leading axis is split in its type over explicit mesh axes
  (``jax.sharding.set_mesh`` with ``AxisType.Explicit``), else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if not spec or spec[0] is None or mesh is None:
    return None
  axes = spec[0]
  types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
  if not all("Explicit" in str(types.get(a)) for a in _axis_tuple(axes)):
    return None
  return mesh, axes


def _summing(fn: Callable, summed: Sequence[bool], axes):
  """``fn`` with its ``summed`` outputs added over the mesh axes ``axes`` (None: as they are)."""
  def run(*a):
    res = fn(*a)
    if axes is None:
      return res
    return tuple(jax.lax.psum(r, axes) if sm else r for r, sm in zip(res, summed))
  return run


def _token_axes(mesh, arg_shapes):
  """The mesh axes the tokens (the first operand's leading axis) are split on: None where
  whole, or where they do not divide the tokens (a padded shard's rows would add into sums)."""
  spec = tuple(arg_shapes[0].sharding.spec)
  axes = spec[0] if spec else None
  if axes is None:
    return None
  return axes if arg_shapes[0].shape[0] % _parts(mesh, axes) == 0 else None


def _tokens_partitioned(unpacked: Callable, arrays, flags, summed):
  """:func:`tokens` through ``custom_partitioning`` (XLA's partitioner gives the layout)."""
  out_shapes = jax.eval_shape(unpacked, *arrays)
  names = iter(f"r{i}" for i in range(10_000))
  operands = [" ".join(["t"] + [next(names) for _ in a.shape[1:]]) if t else
              " ".join(next(names) for _ in a.shape) for a, t in zip(arrays, flags)]
  results = [" ".join(next(names) for _ in o.shape) if sm else
             " ".join(["t"] + [next(names) for _ in o.shape[1:]])
             for o, sm in zip(out_shapes, summed)]
  if any(not o for o in operands + results):  # a scalar operand or output: no factor to write
    return unpacked(*arrays)
  others = tuple(f for f in dict.fromkeys(" ".join(operands + results).split()) if f != "t")
  rule = _rule((operands, results, {"t": _size(arrays[0].shape[0])}, others,
                lambda total: True))

  def shardings(mesh, arg_shapes):
    axes = _token_axes(mesh, arg_shapes)
    split = lambda ndim: jax.sharding.NamedSharding(  # noqa: E731
        mesh, jax.sharding.PartitionSpec(axes, *(None,) * (ndim - 1)))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    outs = tuple(whole if sm else split(len(o.shape)) for o, sm in zip(out_shapes, summed))
    ins = tuple(split(len(a.shape)) if t else whole for a, t in zip(arg_shapes, flags))
    return outs, ins

  return tuple(_partitioned(
      unpacked, arrays, len(summed), shardings, rule,
      local=lambda mesh, arg_shapes: _summing(unpacked, summed, _token_axes(mesh, arg_shapes))))


def tokens(fn: Callable, per_token: Sequence[bool], summed: Sequence[bool], *args,
           per_shard: bool = True):
  """``fn(*args)`` run per shard of the tokens (``None`` operands passed through).

  Operand ``i`` has a leading token axis where ``per_token[i]`` (the first one does; every such
  operand is split as it is), else it is replicated.  ``fn`` returns a tuple of
  ``len(summed)`` arrays; output ``j`` is per token (leading token axis, split as the tokens)
  or, where ``summed[j]``, a sum over the tokens: each shard computes its own tokens' sum and
  the shards' sums are added (``psum`` over the mesh axes the tokens are split on), the result
  replicated.  Every other axis stays whole.  Inside ``shard_map`` (operands already per
  shard) ``fn`` runs as it is: a summed output is then this shard's sum, which
  ``shard_map``'s transpose adds up for a replicated input's gradient.  Tokens split in the
  arrays' types (a mesh with explicit axes) run under ``shard_map`` over those axes;
  otherwise (XLA's partitioner decides) through ``custom_partitioning``.
  ``per_shard=False``: left to XLA's partitioner (a host callback; :func:`elementwise`).
  """
  present = [a is not None for a in args]
  flags = [t for t, p in zip(per_token, present) if p]

  def unpacked(*arrs):
    it = iter(arrs)
    return tuple(fn(*[next(it) if p else None for p in present]))

  arrays = [a for a in args if a is not None]
  if not per_shard or in_manual_context() or has_symbolic_dims(*arrays):
    return unpacked(*arrays)
  explicit = _explicit_token_axes(arrays[0])
  if explicit is None:
    return _tokens_partitioned(unpacked, arrays, flags, summed)
  mesh, axes = explicit  # split in the arrays' types (a mesh with explicit axes)
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  return tuple(jax.shard_map(
      _summing(unpacked, summed, axes), mesh=mesh,
      axis_names=set(_axis_tuple(axes)),
      in_specs=tuple(P(axes) if t else P() for t in flags),
      out_specs=tuple(P() if sm else P(axes) for sm in summed))(*arrays))
