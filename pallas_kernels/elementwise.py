"""Generic fused elementwise kernels: forward + bit packing, and backward from output + bits.

Math-agnostic: callers pass plain-jnp functions on tiles.  Arrays are viewed as
``[M, 8]`` (each row one byte of the packed mask: bit ``k`` of byte ``j`` is element
``8j + k`` of the last axis, the layout of ``invact_jax._bitpack``), so there is no
in-kernel reshape and every block is ``[block_rows, 8]`` (power-of-two sizes).

* :func:`forward`:  reads x once, writes y and the packed mask (bf16: 4.125 bytes/element);
* :func:`backward`: reads y, the mask and dy once, writes dx (bf16: ~6.1 bytes/element).

Ragged sizes are handled explicitly, never by relying on partial-block masking (GPU
Pallas does not mask partial blocks): a last axis that is not a multiple of 8, or a row
count that is not a multiple of the block, is padded outside the kernel (a copy; the
common transformer shapes need none) and the result sliced back.

Every ``pallas_call`` passes ``compiler_params`` explicitly (Triton), since the default
GPU backend differs between JAX 0.10 (Mosaic GPU) and 0.11+ (Triton).
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._shapes import out_struct

__all__ = ["forward", "backward", "block_rows_for", "compiler_params"]

TileFn = Callable[[jax.Array], jax.Array]


def compiler_params(num_warps: int = 4, num_stages: int = 1):
  """Explicit Triton compiler parameters (both JAX lines)."""
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block_rows_for(dtype, rows, *, target_elements: int = 1024) -> int:
  """Block height: ``target_elements`` per program (8 per thread at 4 warps), a power of two
  (no more than the rows, when their number is known at trace time; a symbolic count gets
  the target).  Measured on an H100 (2026-11-23, ``scripts/kernel_blocks.py``): 1024
  elements per program beat the earlier 32 KiB blocks (8-16 K elements, 212-255 registers
  per thread) in every pass measured, by 1.02-1.61x (gelu_erf's forward 4.5-6.7x), and was
  within 16 % of the fastest block/warps pair of each (no pair was best everywhere)."""
  del dtype  # the same count of elements: the math, not the bytes, sets the registers
  b = 1 << max(0, int(math.log2(max(1, target_elements // 8))))
  if not isinstance(rows, int):  # a symbolic dimension (jax.export)
    return b
  return max(1, min(b, 1 << max(0, (rows - 1).bit_length())))


def _as_rows(x):
  """[..., n] -> ([M, 8] view, original shape, padded n)."""
  shape = x.shape
  flat = x.reshape(1) if x.ndim == 0 else x
  n = flat.shape[-1]
  n8 = -(-n // 8) * 8
  if n8 != n:
    flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, n8 - n)])
  return flat.reshape(-1, 8), shape, n8


def _from_rows(rows, shape, n8):
  lead = (1,) if len(shape) == 0 else shape[:-1]
  out = rows.reshape(*lead, n8)
  if len(shape) == 0:
    return out[..., 0].reshape(())
  return out[..., : shape[-1]]


def _mask_shape(shape, n8):
  return (1,) if len(shape) == 0 else (*shape[:-1], n8 // 8)


def _pad_rows(a, m_pad):
  return a if a.shape[0] == m_pad else jnp.pad(a, [(0, m_pad - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _grid(m, block_rows):
  block_rows = block_rows or 1
  m_pad = -(-m // block_rows) * block_rows
  return m_pad, m_pad // block_rows


def _ptx_f32(asm: str, *args):
  """One float32 PTX instruction per element (``$0`` the result, ``$1``... the arguments)."""
  return pltriton.elementwise_inline_asm(
      asm, args=list(args), constraints="=f" + ",f" * len(args), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


class ApproxOps:
  """sqrt, log and divide as single approximate PTX instructions (MUFU based; relative error
  ~2^-22, subnormals flushed to zero), for math whose output is rounded to 16 bits anyway:
  IEEE-exact float32 sqrt, log and division cost ~8-20 instructions each in a kernel."""

  @staticmethod
  def sqrt(x):
    return _ptx_f32("sqrt.approx.ftz.f32 $0, $1;", x)

  @staticmethod
  def log(x):
    return _ptx_f32("lg2.approx.ftz.f32 $0, $1;", x) * math.log(2.0)

  @staticmethod
  def divide(a, b):
    return _ptx_f32("div.approx.ftz.f32 $0, $1, $2;", a, b)


def _fwd_kernel(f, bit_fn, n, n8, x_ref, *out_refs):
  """One block of rows: the activation's output and, for a non-monotone one, the packed
  branch bits."""
  x = x_ref[...]
  y_ref = out_refs[0]
  y_ref[...] = f(x).astype(y_ref.dtype)
  if bit_fn is not None:
    m_ref = out_refs[1]
    bits = bit_fn(x).astype(jnp.int32)
    shifts = jax.lax.broadcasted_iota(jnp.int32, bits.shape, 1)
    if n != n8:  # a ragged last axis was padded: padding bits are 0, as in the XLA layout
      rows = pl.program_id(0) * bits.shape[0] + jax.lax.broadcasted_iota(jnp.int32, bits.shape, 0)
      col = (rows % (n8 // 8)) * 8 + shifts
      bits = jnp.where(col < n, bits, 0)
    m_ref[...] = jnp.sum(jnp.left_shift(bits, shifts), axis=1).astype(jnp.uint8)


def forward(f: TileFn, bit_fn: TileFn | None, x: jax.Array, *, block_rows: int | None = None,
            interpret: bool = False, num_warps: int = 4):
  """``(f(x), packed bit_fn(x))`` in one pass (the mask is None when ``bit_fn`` is None); both
  get the tile in x's dtype."""
  rows, shape, n8 = _as_rows(x)
  m = rows.shape[0]
  if isinstance(m, int) and m == 0:
    y = f(x)
    return y, (None if bit_fn is None else jnp.zeros(_mask_shape(shape, n8), jnp.uint8))
  block_rows = block_rows or block_rows_for(x.dtype, m)
  m_pad, steps = _grid(m, block_rows)
  rows = _pad_rows(rows, m_pad)
  out_shape = [out_struct((m_pad, 8), x.dtype, rows)]
  out_specs = [pl.BlockSpec((block_rows, 8), lambda i: (i, 0))]
  if bit_fn is not None:
    out_shape.append(out_struct((m_pad,), jnp.uint8, rows))
    out_specs.append(pl.BlockSpec((block_rows,), lambda i: (i,)))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, f, bit_fn,
                        1 if len(shape) == 0 else shape[-1], n8),
      out_shape=out_shape, grid=(steps,),
      in_specs=[pl.BlockSpec((block_rows, 8), lambda i: (i, 0))], out_specs=out_specs,
      compiler_params=compiler_params(num_warps), interpret=interpret,
      name="invact_forward")(rows)
  y = _from_rows(outs[0][:m], shape, n8)
  if bit_fn is None:
    return y, None
  return y, outs[1][:m].reshape(_mask_shape(shape, n8))


def _bwd_kernel(g_fn, compute_dtype, has_bits, *refs):
  """One block of rows: the input gradient from the output (and branch bits) and the
  output's cotangent."""
  if has_bits:
    y_ref, m_ref, dy_ref, dx_ref = refs
  else:
    y_ref, dy_ref, dx_ref = refs
  y = y_ref[...]  # in its storage dtype: g_fn computes in compute_dtype, and the storage
  bits = None     # dtype picks its fit (16-bit outputs get cheaper ones)
  if has_bits:
    packed = m_ref[...].astype(jnp.int32)
    shifts = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1)
    bits = jnp.bitwise_and(jnp.right_shift(packed[:, None], shifts), 1) == 1
  g = g_fn(y, bits)
  dx_ref[...] = (dy_ref[...].astype(compute_dtype) * g).astype(dx_ref.dtype)


def backward(g_fn: Callable, y: jax.Array, packed: jax.Array | None, dy: jax.Array, *,
             compute_dtype=jnp.float32, block_rows: int | None = None, interpret: bool = False,
             num_warps: int = 4):
  """``dy * g_fn(y, bits)`` in one pass, bits unpacked from ``packed`` in-kernel; ``g_fn`` gets
  the tile of y in its storage dtype and returns f'(x) in ``compute_dtype``."""
  rows, shape, n8 = _as_rows(y)
  m = rows.shape[0]
  if isinstance(m, int) and m == 0:
    return jnp.zeros_like(dy)
  dy_rows, _, _ = _as_rows(dy)
  block_rows = block_rows or block_rows_for(y.dtype, m)
  m_pad, steps = _grid(m, block_rows)
  args = [_pad_rows(rows, m_pad)]
  in_specs = [pl.BlockSpec((block_rows, 8), lambda i: (i, 0))]
  if packed is not None:
    args.append(_pad_rows(packed.reshape(-1), m_pad))
    in_specs.append(pl.BlockSpec((block_rows,), lambda i: (i,)))
  args.append(_pad_rows(dy_rows, m_pad))
  in_specs.append(pl.BlockSpec((block_rows, 8), lambda i: (i, 0)))
  dx = pl.pallas_call(
      functools.partial(_bwd_kernel, g_fn, compute_dtype, packed is not None),
      out_shape=out_struct((m_pad, 8), dy.dtype, args[0]), grid=(steps,), in_specs=in_specs,
      out_specs=pl.BlockSpec((block_rows, 8), lambda i: (i, 0)),
      compiler_params=compiler_params(num_warps), interpret=interpret,
      name="invact_backward")(*args)
  return _from_rows(dx[:m], shape, n8)
