"""Pallas implementation of the norms: the row kernels of :mod:`pallas_kernels.norms`,
run per shard of the leading axes.  The Triton implementation
(:class:`invact_jax.ops.norms.triton.TritonNorm`) inherits this binding and swaps the kernel
module for :mod:`pallas_kernels.triton_norms` (same functions).

Forward writes z, xhat and rstd in one pass over each row; backward computes dx from xhat,
rstd and dz (the column sums for dscale/dbias stay XLA reductions).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops import _partition
from invact_jax.ops.norms import base


def _name(rms: bool) -> str:
  return "rms_norm" if rms else "layer_norm"


@dataclasses.dataclass(frozen=True)
class PallasNorm(_implementation.ImplementationBase):
  """The Pallas row kernels (Triton lowering on a GPU, interpret mode for tests)."""
  name: ClassVar[str] = "pallas"

  def kernels(self):
    """The kernel module: ``forward(x2d, scale, bias, ...)`` and ``backward_dx(...)``."""
    from pallas_kernels import norms  # pylint: disable=import-outside-toplevel
    return norms

  def forward(self, rms, eps, dtype, x, scale, bias):
    """``(z, xhat, rstd[..., 1])`` from one kernel pass per row, per shard."""
    if _partition.run_tile_math_directly(self, x):
      return base.XLA.forward(rms, eps, dtype, x, scale, bias)

    def run(x, scale, bias):
      lead, n = x.shape[:-1], x.shape[-1]
      z, xhat, rstd = self.kernels().forward(x.reshape(-1, n), scale, bias, rms=rms, eps=eps,
                                             out_dtype=dtype, interpret=self.interpret)
      return z.reshape(*lead, n), xhat.reshape(*lead, n), rstd.reshape(*lead, 1)
    return _common.first_order_only(
        _name(rms), lambda *a: _partition.rows(run, 3, *a, per_shard=_partition.per_shard(self)),
        x, scale, bias)

  def backward_dx(self, rms, xhat, rstd, dz, scale, x_dtype):
    """dx from one kernel pass per row over xhat, rstd and dz, per shard."""
    if _partition.run_tile_math_directly(self, xhat):
      return base.XLA.backward_dx(rms, xhat, rstd, dz, scale, x_dtype)

    def run(xhat, rstd, dz, scale):
      lead, n = xhat.shape[:-1], xhat.shape[-1]
      dx = self.kernels().backward_dx(xhat.reshape(-1, n), rstd.reshape(-1), dz.reshape(-1, n),
                                      scale, rms=rms, dx_dtype=x_dtype, interpret=self.interpret)
      return dx.reshape(*lead, n)
    return _common.first_order_only(
        _name(rms), lambda *a: _partition.rows(run, 1, *a, per_shard=_partition.per_shard(self)),
        xhat, rstd, dz, scale)
