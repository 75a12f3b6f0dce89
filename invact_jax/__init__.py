"""invact_jax: inverted activations for JAX — keep the output, not the input.

Drop-in replacements for ``jax.nn`` activations whose backward pass needs only the output
``y`` (plus one bit per element, packed 8 per byte, for GELU/SiLU/Mish), output-saving
LayerNorm/RMSNorm, softmax and dropout, and the tools around them: ``memory`` (what
autodiff keeps, compiled and device figures), ``planner`` (a memory-budget plan),
``accuracy`` (the float64 audit), ``flax`` (modules) and the conversion of unmodified code
(``invert``, ``inverted``) and the planner on any program (``plan``).
"""
import importlib as _importlib

from invact_jax.ops import *  # noqa: F401,F403
from invact_jax.ops import __all__ as _ops
from invact_jax.bitpack import pack_bits, packed_shape, unpack_bits  # noqa: F401
from invact_jax.convert import ConversionReport, invert, inverted  # noqa: F401
from invact_jax.program_planner import Planned, PlanReport, plan  # noqa: F401

__version__ = "0.2.0"
__all__ = [*_ops, "pack_bits", "packed_shape", "unpack_bits", "ConversionReport", "invert",
           "inverted", "plan", "Planned", "PlanReport", "memory", "planner", "accuracy", "flax", "registry"]

# Submodules reachable as attributes after ``import invact_jax``, imported on first use.
_LAZY = {"memory": "invact_jax.memory", "planner": "invact_jax.planner",
         "accuracy": "invact_jax.accuracy", "flax": "invact_jax.flax",
         "registry": "invact_jax.ops.activations.registry"}


def __getattr__(name):
  if name in _LAZY:
    module = _importlib.import_module(_LAZY[name])
    globals()[name] = module
    return module
  raise AttributeError(f"module 'invact_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
