"""Triton implementation of the norms: the raw Triton row kernels of
:mod:`pallas_kernels.triton_norms` (through jax-triton), bound as the Pallas ones."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from invact_jax.ops.norms import pallas

__all__ = ["TritonNorm"]


@dataclasses.dataclass(frozen=True)
class TritonNorm(pallas.PallasNorm):
  """Raw Triton row kernels (a CUDA GPU; Triton's interpreter for tests)."""
  name: ClassVar[str] = "triton"

  def kernels(self):
    from pallas_kernels import triton_norms  # pylint: disable=import-outside-toplevel
    return triton_norms
