"""Output-saving LayerNorm / RMSNorm and the fused norm -> dense unit."""
from invact_jax.ops.norms.api import *  # noqa: F401,F403
from invact_jax.ops.norms.api import __all__  # noqa: F401
