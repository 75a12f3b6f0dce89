"""Pallas implementation of the norms: the row kernels of :mod:`pallas_kernels.norms`,
run per shard of the leading axes.  The Triton implementation (:mod:`.triton`) is this binding
over :mod:`pallas_kernels.triton_norms` (same functions).

Forward writes z, xhat and rstd in one pass over each row; backward computes dx from xhat,
rstd and dz (the column sums for dscale/dbias stay XLA reductions).
"""
from __future__ import annotations

from invact_jax.ops import _common
from invact_jax.ops import _partition
from invact_jax.ops.norms import base


def _kernels(backend):
  if backend.name == "triton":
    from pallas_kernels import triton_norms  # pylint: disable=import-outside-toplevel
    return triton_norms
  from pallas_kernels import norms  # pylint: disable=import-outside-toplevel
  return norms


def _name(rms: bool) -> str:
  return "rms_norm" if rms else "layer_norm"


def forward(backend, rms, eps, dtype, x, scale, bias):
  if _partition.run_tile_math_directly(backend, x):
    return base.forward(backend, rms, eps, dtype, x, scale, bias)

  def run(x, scale, bias):
    lead, n = x.shape[:-1], x.shape[-1]
    z, xhat, rstd = _kernels(backend).forward(x.reshape(-1, n), scale, bias, rms=rms, eps=eps,
                                       out_dtype=dtype, interpret=backend.interpret)
    return z.reshape(*lead, n), xhat.reshape(*lead, n), rstd.reshape(*lead, 1)
  return _common.first_order_only(
      _name(rms), lambda *a: _partition.rows(run, 3, *a, per_shard=_partition.per_shard(backend)),
      x, scale, bias)


def backward_dx(backend, rms, xhat, rstd, dz, scale, x_dtype):
  if _partition.run_tile_math_directly(backend, xhat):
    return base.backward_dx(backend, rms, xhat, rstd, dz, scale, x_dtype)

  def run(xhat, rstd, dz, scale):
    lead, n = xhat.shape[:-1], xhat.shape[-1]
    dx = _kernels(backend).backward_dx(xhat.reshape(-1, n), rstd.reshape(-1), dz.reshape(-1, n), scale,
                                rms=rms, dx_dtype=x_dtype, interpret=backend.interpret)
    return dx.reshape(*lead, n)
  return _common.first_order_only(
      _name(rms), lambda *a: _partition.rows(run, 1, *a, per_shard=_partition.per_shard(backend)),
      xhat, rstd, dz, scale)
