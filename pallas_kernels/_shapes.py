"""Output shapes for ``pallas_call`` that also work inside ``shard_map``.

Under ``shard_map(check_vma=True)`` a kernel's outputs must say over which manual mesh axes
they vary; an elementwise or row kernel's outputs vary as its inputs do.  JAX spells this
``manual_axis_type=`` (0.10) or ``vma=`` (later lines) on ``jax.ShapeDtypeStruct``.
"""
from __future__ import annotations

import inspect

import jax

_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def _varying(aval) -> frozenset:
  v = getattr(aval, "vma", None)
  if v is None:
    v = getattr(getattr(aval, "mat", None), "varying", None)
  return frozenset(v or ())


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere)."""
  return _varying(jax.typeof(x))


def varying_like(a, *refs):
  """``a`` made varying over the manual mesh axes ``refs`` vary over (inside ``shard_map``: a
  loop's initial carry, a kernel's accumulator aliased to its output); ``a`` elsewhere."""
  axes = tuple(sorted(frozenset().union(*(varying_axes(r) for r in refs)) - varying_axes(a)))
  if not axes:
    return a
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(a, axes, to="varying")
  return jax.lax.pvary(a, axes)  # JAX before pcast


def out_struct(shape, dtype, *likes) -> jax.ShapeDtypeStruct:
  """``ShapeDtypeStruct(shape, dtype)`` varying over the manual axes ``likes`` vary over (the
  one of them that varies over the most: a kernel's per-token outputs vary as its tokens do,
  not as its replicated weight)."""
  aval = max((jax.typeof(a) for a in likes), key=lambda v: len(_varying(v)))
  if "manual_axis_type" in _PARAMS and getattr(aval, "mat", None) is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
  if "vma" in _PARAMS and getattr(aval, "vma", None) is not None:
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
  return jax.ShapeDtypeStruct(shape, dtype)
