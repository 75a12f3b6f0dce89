"""The LM head's loss without its logits (``linear_cross_entropy``)."""
from invact_jax.ops.cross_entropy.api import (  # noqa: F401
    IMPLEMENTATIONS, linear_cross_entropy, linear_cross_entropy_reference)

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]
