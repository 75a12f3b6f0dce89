"""Pallas (and jax-triton) GPU kernels for invact_jax; math-agnostic (see ARCHITECTURE)."""
