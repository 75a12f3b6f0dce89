"""Inverted activations: the registry, their math, and one module per implementation."""
from invact_jax.ops.activations.api import *  # noqa: F401,F403
from invact_jax.ops.activations.api import __all__  # noqa: F401
