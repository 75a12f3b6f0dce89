"""The op families, each in the manner of tokamax's ``ops/<op>/``.

``<family>/api.py`` public functions with ``implementation=`` and the family's
``IMPLEMENTATIONS`` map (``NAMES``: every implementation name); ``base.py`` the XLA
``custom_vjp`` (the reference implementation); ``pallas.py`` / ``triton.py`` the kernel
bindings with their per-shard partitioning.  Shared once: ``_common`` (checks, compute
dtype, first-order guard), ``_implementation`` (dispatch), ``_partition`` (per-shard rules).
"""
from invact_jax.ops._implementation import NAMES, Implementation, available  # noqa: F401
from invact_jax.ops.activations import *  # noqa: F401,F403
from invact_jax.ops.activations import __all__ as _activations
from invact_jax.ops.cross_entropy import (  # noqa: F401
    linear_cross_entropy, linear_cross_entropy_reference)
from invact_jax.ops.dropout import dropout, dropout_reference  # noqa: F401
from invact_jax.ops.norms import *  # noqa: F401,F403
from invact_jax.ops.norms import __all__ as _norms
from invact_jax.ops.softmax import softmax, softmax_reference  # noqa: F401

__all__ = [*_activations, *_norms, "softmax", "softmax_reference", "dropout",
           "dropout_reference", "linear_cross_entropy", "linear_cross_entropy_reference",
           "Implementation", "available"]
