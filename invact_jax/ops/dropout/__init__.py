"""Dropout that keeps a packed mask or only its key."""
from invact_jax.ops.dropout.api import dropout, dropout_reference  # noqa: F401

__all__ = ["dropout", "dropout_reference"]
