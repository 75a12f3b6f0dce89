"""Pallas implementation of the inverted activations: the generic kernels of
:mod:`pallas_kernels.elementwise` given this op's math, run per shard.

Forward reads x once and writes y and the packed bits; backward reads y, the bits and dy
once and writes dx.  Same bit layout as the XLA path, so residuals are interchangeable.
The Triton implementation (:mod:`.triton`) is this same binding over the raw Triton kernels
of :mod:`pallas_kernels.triton_elementwise`, which take the same arguments.
"""
from __future__ import annotations

import functools

from invact_jax import bitpack
from invact_jax.ops import _common
from invact_jax.ops import _partition
from invact_jax.ops._implementation import Backend


def _kernels(backend: Backend):
  """The kernel module of ``backend``: Pallas, or raw Triton (same functions, same layouts)."""
  if backend.name == "triton":
    from pallas_kernels import triton_elementwise  # pylint: disable=import-outside-toplevel
    return triton_elementwise
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
  return _kernels(backend).forward(op.kernel_forward, bit, x, compute_dtype=_common.compute_dtype(x.dtype),
                            **_kw(backend))


def _backward(op, backend, y, packed, dy):
  if _partition.run_tile_math_directly(backend, y):
    bits = None if packed is None else bitpack.unpack_bits(packed, y.shape)
    g = op.derivative(y, bits)
    return (dy.astype(g.dtype) * g).astype(dy.dtype)
  # Compiled kernels use approximate sqrt/log/divide for 16-bit outputs (not in interpret
  # mode: they are PTX instructions).
  g_fn = op.derivative if backend.interpret else functools.partial(
      op.derivative, approx_ops=_approx_ops())
  return _kernels(backend).backward(g_fn, y, packed, dy,
                             compute_dtype=_common.compute_dtype(y.dtype), **_kw(backend))


def _approx_ops():
  from pallas_kernels import elementwise  # pylint: disable=import-outside-toplevel
  return elementwise.ApproxOps  # PTX instructions: the Triton source generator spells them too


def forward(op, backend: Backend, x):
  shard = _partition.per_shard(backend)
  if not op.has_bit:
    y = _common.first_order_only(op.public, lambda x: _partition.elementwise(
        lambda x: _forward(op, backend, x)[0], "d", "d", x, per_shard=shard), x)
    return y, None
  return _common.first_order_only(op.public, lambda x: _partition.elementwise(
      lambda x: _forward(op, backend, x), "d", "dm", x, per_shard=shard), x)


def backward(op, backend: Backend, y, packed, dy):
  shard = _partition.per_shard(backend)
  if packed is None:
    return _common.first_order_only(op.public, lambda y, dy: _partition.elementwise(
        lambda y, dy: _backward(op, backend, y, None, dy), "dd", "d", y, dy, per_shard=shard),
        y, dy)
  return _common.first_order_only(op.public, lambda y, m, dy: _partition.elementwise(
      lambda y, m, dy: _backward(op, backend, y, m, dy), "dmd", "d", y, packed, dy,
      per_shard=shard), y, packed, dy)
