"""Pallas implementation of the inverted activations: the generic kernels of
:mod:`pallas_kernels.elementwise` given this op's math, run per shard.

Forward reads x once and writes y and the packed bits; backward reads y, the bits and dy
once and writes dx.  Same bit layout as the XLA path, so residuals are interchangeable.
The binding here (per-shard partitioning, batching, the first-order guard, approximate PTX
instructions for 16-bit outputs) is shared with the Triton implementation
(:class:`invact_jax.ops.activations.triton.TritonActivation`), which only swaps the kernel
module: the raw Triton kernels take the same arguments.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

from invact_jax import bitpack
from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops import _partition


@dataclasses.dataclass(frozen=True)
class PallasActivation(_implementation.ImplementationBase):
  """The Pallas kernels (Triton lowering on a GPU, interpret mode for tests)."""
  name: ClassVar[str] = "pallas"

  def kernels(self):
    """The kernel module: ``forward(f, bit, x, ...)`` and ``backward(g, y, m, dy, ...)``."""
    from pallas_kernels import elementwise  # pylint: disable=import-outside-toplevel
    return elementwise

  def _kw(self) -> dict:
    kw = dict(interpret=self.interpret, block_rows=self.block_rows)
    if self.num_warps is not None:
      kw["num_warps"] = self.num_warps
    return kw

  def _forward_tile(self, op, x):
    if _partition.run_tile_math_directly(self, x):
      y = op.kernel_forward(x)
      return y, bitpack.pack_bits(op.bit(x)) if op.has_bit else None
    bit = op.bit if op.has_bit else None
    return self.kernels().forward(op.kernel_forward, bit, x, **self._kw())

  def _backward_tile(self, op, y, packed, dy):
    """One tile's ``dx``: the derivative from ``y`` (and the unpacked bits) times ``dy``, as
    plain XLA ops where :func:`_partition.run_tile_math_directly` says so, else by the Pallas
    kernel (approximate sqrt/log/divide for compiled 16-bit outputs)."""
    if _partition.run_tile_math_directly(self, y):
      bits = None if packed is None else bitpack.unpack_bits(packed, y.shape)
      g = op.derivative(y, bits)
      return (dy.astype(g.dtype) * g).astype(dy.dtype)
    # Compiled kernels use approximate sqrt/log/divide for 16-bit outputs (not in interpret
    # mode: they are PTX instructions).
    g_fn = op.derivative if self.interpret else functools.partial(
        op.derivative, approx_ops=approx_ops())
    return self.kernels().backward(g_fn, y, packed, dy,
                                   compute_dtype=_common.compute_dtype(y.dtype), **self._kw())

  def forward(self, op, x):
    """``(y, packed bits or None)`` from one kernel pass over x, per shard."""
    shard = _partition.per_shard(self)
    if not op.has_bit:
      y = _common.first_order_only(op.public, lambda x: _partition.elementwise(
          lambda x: self._forward_tile(op, x)[0], "d", "d", x, per_shard=shard), x)
      return y, None
    return _common.first_order_only(op.public, lambda x: _partition.elementwise(
        lambda x: self._forward_tile(op, x), "d", "dm", x, per_shard=shard), x)

  def backward(self, op, y, packed, dy):
    """dx from one kernel pass over y, the bits and dy, per shard."""
    shard = _partition.per_shard(self)
    if packed is None:
      return _common.first_order_only(op.public, lambda y, dy: _partition.elementwise(
          lambda y, dy: self._backward_tile(op, y, None, dy), "dd", "d", y, dy,
          per_shard=shard), y, dy)
    return _common.first_order_only(op.public, lambda y, m, dy: _partition.elementwise(
        lambda y, m, dy: self._backward_tile(op, y, m, dy), "dmd", "d", y, packed, dy,
        per_shard=shard), y, packed, dy)


def approx_ops():
  """The kernels' approximate sqrt/log/divide (PTX instructions; the Triton source generator
  spells them too)."""
  from pallas_kernels import elementwise  # pylint: disable=import-outside-toplevel
  return elementwise.ApproxOps
