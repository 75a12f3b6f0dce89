"""Flax glue: activation and norm modules for ``flax.linen`` and ``flax.nnx``.

``LinenLayerNorm``/``LinenRMSNorm``/``NnxLayerNorm``/``NnxRMSNorm`` subclass Flax's norms
(same fields, parameter names, shapes and initializers, so checkpoints load) and run
``invact_jax.layer_norm``/``rms_norm`` over the last axis; other axes fall back to Flax.

The functions themselves work wherever Flax takes a callable (``activation=``,
``nnx.Sequential``, ``nn.Sequential``).  These modules are for places that want a
Module, and carry the activation's options as attributes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from invact_jax.flax import NnxActivation
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), NnxActivation("gelu"))
  >>> model(jnp.ones((2, 4))).shape
  (2, 8)
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
from flax import nnx

from invact_jax import convert
from invact_jax.ops.activations import api
from invact_jax.ops.activations import registry

__all__ = ["activation", "LinenActivation", "NnxActivation", "LinenLayerNorm", "LinenRMSNorm",
           "NnxLayerNorm", "NnxRMSNorm"]


def activation(name: str, **options: Any):
  """The inverted activation ``name`` (a public name of the registry) with ``options`` bound.

  Example:
    >>> from invact_jax.flax import activation
    >>> activation("gelu", approximate=False).keywords
    {'approximate': False}
  """
  if name not in registry.PUBLIC:
    raise ValueError(f"argument `name`: unknown activation {name!r}; choose from "
                     f"{sorted(registry.PUBLIC)}")
  return functools.partial(getattr(api, name), **options)


class LinenActivation(nn.Module):
  """``flax.linen`` module applying an inverted activation (no parameters)."""
  name_: str = "gelu"
  options: tuple[tuple[str, Any], ...] = ()

  @nn.compact
  def __call__(self, x):
    return activation(self.name_, **dict(self.options))(x)


class NnxActivation(nnx.Module):
  """``flax.nnx`` module applying an inverted activation (no parameters)."""

  def __init__(self, name: str = "gelu", **options: Any):
    self.fn = activation(name, **options)

  def __call__(self, x):
    return self.fn(x)


class LinenLayerNorm(nn.LayerNorm):
  """``nn.LayerNorm`` keeping only xhat + float32 rstd for the backward."""
  __call__ = convert.linen_norm_call(nn.LayerNorm.__call__, False, None)


class LinenRMSNorm(nn.RMSNorm):
  """``nn.RMSNorm`` keeping only xhat + float32 rstd for the backward."""
  __call__ = convert.linen_norm_call(nn.RMSNorm.__call__, True, None)


class NnxLayerNorm(nnx.LayerNorm):
  """``nnx.LayerNorm`` keeping only xhat + float32 rstd for the backward."""
  __call__ = convert.nnx_norm_call(nnx.LayerNorm.__call__, False, None)


class NnxRMSNorm(nnx.RMSNorm):
  """``nnx.RMSNorm`` keeping only xhat + float32 rstd for the backward."""
  __call__ = convert.nnx_norm_call(nnx.RMSNorm.__call__, True, None)
