"""Triton implementation of the norms: the raw Triton row kernels of
:mod:`pallas_kernels.triton_norms`, bound as the Pallas ones (:mod:`.pallas` picks the kernel
module by ``backend.name``)."""
from __future__ import annotations

from invact_jax.ops.norms.pallas import backward_dx, forward

__all__ = ["forward", "backward_dx"]
