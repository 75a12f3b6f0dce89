"""Pallas implementation of the inverted activations: the generic kernels of
:mod:`pallas_kernels.elementwise` given this op's math, run per shard.

Forward reads x once and writes y and the packed bits; backward reads y, the bits and dy
once and writes dx.  Same bit layout as the XLA path, so residuals are interchangeable.
"""
from __future__ import annotations

import functools

from invact_jax import bitpack
from invact_jax.ops import _common
from invact_jax.ops import _partition
from invact_jax.ops._implementation import Backend


def _kernels():
  from pallas_kernels import elementwise  # pylint: disable=import-outside-toplevel
  return elementwise


def _kw(backend: Backend) -> dict:
  kw = dict(interpret=backend.interpret, block_rows=backend.block_rows)
  if backend.num_warps is not None:
    kw["num_warps"] = backend.num_warps
  return kw


def _forward(op, backend, x):
  if _partition.run_tile_math_directly(backend, x):
    y = op.kernel_forward(x)
    return y, (bitpack.pack_bits(op.bit(x.astype(_common.compute_dtype(x.dtype))))
               if op.has_bit else None)
  bit = op.bit if op.has_bit else None
  return _kernels().forward(op.kernel_forward, bit, x, compute_dtype=_common.compute_dtype(x.dtype),
                            **_kw(backend))


def _backward(op, backend, y, packed, dy):
  if _partition.run_tile_math_directly(backend, y):
    bits = None if packed is None else bitpack.unpack_bits(packed, y.shape)
    g = op.derivative(y, bits)
    return (dy.astype(g.dtype) * g).astype(dy.dtype)
  # Compiled kernels use approximate sqrt/log/divide for 16-bit outputs (not in interpret
  # mode: they are PTX instructions).
  g_fn = op.derivative if backend.interpret else functools.partial(
      op.derivative, approx_ops=_kernels().ApproxOps)
  return _kernels().backward(g_fn, y, packed, dy,
                             compute_dtype=_common.compute_dtype(y.dtype), **_kw(backend))


def forward(op, backend: Backend, x):
  if not op.has_bit:
    y = _common.first_order_only(op.public, lambda x: _partition.elementwise(
        lambda x: _forward(op, backend, x)[0], "d", "d", x), x)
    return y, None
  return _common.first_order_only(op.public, lambda x: _partition.elementwise(
      lambda x: _forward(op, backend, x), "d", "dm", x), x)


def backward(op, backend: Backend, y, packed, dy):
  if packed is None:
    return _common.first_order_only(op.public, lambda y, dy: _partition.elementwise(
        lambda y, dy: _backward(op, backend, y, None, dy), "dd", "d", y, dy), y, dy)
  return _common.first_order_only(op.public, lambda y, m, dy: _partition.elementwise(
      lambda y, m, dy: _backward(op, backend, y, m, dy), "dmd", "d", y, packed, dy), y, packed, dy)
