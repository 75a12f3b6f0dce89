"""Softmax that keeps only its output."""
from invact_jax.ops.softmax.api import softmax, softmax_reference  # noqa: F401

__all__ = ["softmax", "softmax_reference"]
