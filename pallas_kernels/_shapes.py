"""Output shapes for ``pallas_call`` that also work inside ``shard_map``.

Under ``shard_map(check_vma=True)`` a kernel's outputs must say over which manual mesh axes
they vary; an elementwise or row kernel's outputs vary as its inputs do.  JAX spells this
``manual_axis_type=`` (0.10) or ``vma=`` (later lines) on ``jax.ShapeDtypeStruct``.
"""
from __future__ import annotations

import inspect

import jax

_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """``ShapeDtypeStruct(shape, dtype)`` varying over the manual axes ``like`` varies over."""
  aval = jax.typeof(like)
  if "manual_axis_type" in _PARAMS and getattr(aval, "mat", None) is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
  if "vma" in _PARAMS and getattr(aval, "vma", None) is not None:
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
  return jax.ShapeDtypeStruct(shape, dtype)
