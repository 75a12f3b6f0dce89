"""Flax NNX transformer models built on invact_jax's public API."""
