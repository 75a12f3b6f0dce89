"""invact_jax: inverted activations for JAX — keep the output, not the input.

Drop-in replacements for ``jax.nn`` activations whose backward pass needs only the output
``y`` (plus one bit per element, packed 8 per byte, for GELU/SiLU/Mish), output-saving
LayerNorm/RMSNorm, softmax and dropout, and the tools around them: ``memory`` (what
autodiff keeps, compiled and device figures), ``planner`` (the memory-budget planner:
``plan`` on any program, the integer program), ``accuracy`` (the float64 audit), ``flax``
(modules) and the conversion of unmodified code (``invert``, ``inverted``).
"""
from invact_jax.ops import *  # noqa: F401,F403  (every op: ops.__all__)
from invact_jax.ops import __all__ as _ops
from invact_jax.bitpack import pack_bits as pack_bits
from invact_jax.bitpack import packed_shape as packed_shape
from invact_jax.bitpack import unpack_bits as unpack_bits
from invact_jax.convert import ConversionReport as ConversionReport
from invact_jax.convert import invert as invert
from invact_jax.convert import inverted as inverted
from invact_jax.convert import floor_audit as floor_audit
from invact_jax.convert import FloorAudit as FloorAudit
from invact_jax.planner import Planned as Planned
from invact_jax.planner import PlanReport as PlanReport
from invact_jax.planner import plan as plan
from invact_jax import accuracy as accuracy
from invact_jax import flax as flax
from invact_jax import memory as memory
from invact_jax import planner as planner
from invact_jax.ops.activations import registry as registry

__version__ = "0.2.0"
__all__ = [
    *_ops,
    "pack_bits",
    "packed_shape",
    "unpack_bits",
    "ConversionReport",
    "invert",
    "inverted",
    "floor_audit",
    "FloorAudit",
    "Planned",
    "PlanReport",
    "plan",
    "memory",
    "planner",
    "accuracy",
    "flax",
    "registry",
]
