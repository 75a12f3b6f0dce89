"""Raw Triton LayerNorm / RMSNorm row kernels (``jax_triton.triton_call``): the algorithm of
:mod:`.norms` (the Pallas row kernels) written as Triton, with the same arguments.

* :func:`forward`: per row, two passes over x for the statistics (mean, then the centred sum
  of squares, each accumulated in a ``CHUNK`` vector and reduced once) and one writing the
  affine output ``z``, the normalized ``xhat`` and float32 ``rstd``;
* :func:`backward_dx`: per row, ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with
  ``g = dz * scale`` (RMSNorm: no ``mean(g)`` term).  Column sums stay with XLA.

One program per row; columns in power-of-two chunks with masked loads and stores, so any width
works without padding.  Sums reduce with ``tl.standard._sum_combine`` (what ``tl.sum`` uses;
``tl.sum`` and ``tl.zeros`` are jit functions, which Triton's interpreter cannot call when
imported outside its mode).  No FMA contraction, as for the elementwise kernels.  ``interpret=True``
runs them in Triton's interpreter (:mod:`.triton_elementwise`).

Example (GPU):
  >>> import jax.numpy as jnp
  >>> from pallas_kernels import triton_norms
  >>> z, xhat, rstd = triton_norms.forward(jnp.ones((4, 768)), None, None, rms=True,
  ...                                      eps=1e-6, out_dtype=jnp.float32)  # doctest: +SKIP
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton.language as tl  # pylint: disable=unused-import  (the kernels' globals)

from pallas_kernels import norms
from pallas_kernels import triton_elementwise

__all__ = ["forward", "backward_dx"]


def norm_forward_kernel(x_ptr, scale_ptr, bias_ptr, z_ptr, xhat_ptr, rstd_ptr,
                        N: tl.constexpr, CHUNK: tl.constexpr, RMS: tl.constexpr,
                        HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EPS: tl.constexpr):
  row = tl.program_id(0).to(tl.int64) * N
  mean = 0.0
  if not RMS:
    acc = tl.full([CHUNK], 0.0, tl.float32)
    for i in range(0, N, CHUNK):
      c = i + tl.arange(0, CHUNK)
      acc += tl.load(x_ptr + row + c, mask=c < N, other=0).to(tl.float32)
    mean = tl.reduce(acc, 0, tl.standard._sum_combine) / N
  acc2 = tl.full([CHUNK], 0.0, tl.float32)
  for i in range(0, N, CHUNK):
    c = i + tl.arange(0, CHUNK)
    m = c < N
    d = tl.where(m, tl.load(x_ptr + row + c, mask=m, other=0).to(tl.float32) - mean, 0.0)
    acc2 += d * d
  rstd = libdevice.rsqrt(tl.reduce(acc2, 0, tl.standard._sum_combine) / N + EPS)
  tl.store(rstd_ptr + tl.program_id(0), rstd)
  for i in range(0, N, CHUNK):
    c = i + tl.arange(0, CHUNK)
    m = c < N
    xhat = (tl.load(x_ptr + row + c, mask=m, other=0).to(tl.float32) - mean) * rstd
    z = xhat
    if HAS_SCALE:
      z = z * tl.load(scale_ptr + c, mask=m, other=0).to(tl.float32)
    if HAS_BIAS:
      z = z + tl.load(bias_ptr + c, mask=m, other=0).to(tl.float32)
    tl.store(xhat_ptr + row + c, to_dtype(xhat, xhat_ptr.dtype.element_ty), mask=m)
    tl.store(z_ptr + row + c, to_dtype(z, z_ptr.dtype.element_ty), mask=m)


def _chunk_g_xhat(xhat_ptr, dz_ptr, scale_ptr, row, i, N: tl.constexpr, CHUNK: tl.constexpr,
                  HAS_SCALE: tl.constexpr):
  """Columns, mask, g = dz * scale and xhat of one chunk (a helper: jit-compiled with the
  kernel, see ``HELPERS``)."""
  c = i + tl.arange(0, CHUNK)
  m = c < N
  g = tl.load(dz_ptr + row + c, mask=m, other=0).to(tl.float32)
  if HAS_SCALE:
    g = g * tl.load(scale_ptr + c, mask=m, other=0).to(tl.float32)
  return c, m, g, tl.load(xhat_ptr + row + c, mask=m, other=0).to(tl.float32)


#: Functions the kernels call: plain for the interpreter, ``triton.jit`` when compiled.
HELPERS = ("_chunk_g_xhat",)


def norm_backward_kernel(xhat_ptr, rstd_ptr, dz_ptr, scale_ptr, dx_ptr, N: tl.constexpr,
                         CHUNK: tl.constexpr, RMS: tl.constexpr, HAS_SCALE: tl.constexpr):
  row = tl.program_id(0).to(tl.int64) * N
  rstd = tl.load(rstd_ptr + tl.program_id(0))
  s_gx = tl.full([CHUNK], 0.0, tl.float32)
  s_g = tl.full([CHUNK], 0.0, tl.float32)
  for i in range(0, N, CHUNK):
    c, m, g, xh = _chunk_g_xhat(xhat_ptr, dz_ptr, scale_ptr, row, i, N, CHUNK, HAS_SCALE)
    s_gx += g * xh
    s_g += g
  proj = tl.reduce(s_gx, 0, tl.standard._sum_combine) / N
  mean_g = 0.0
  if not RMS:
    mean_g = tl.reduce(s_g, 0, tl.standard._sum_combine) / N
  for i in range(0, N, CHUNK):
    c, m, g, xh = _chunk_g_xhat(xhat_ptr, dz_ptr, scale_ptr, row, i, N, CHUNK, HAS_SCALE)
    dx = rstd * (g - mean_g - xh * proj)
    tl.store(dx_ptr + row + c, to_dtype(dx, dx_ptr.dtype.element_ty), mask=m)


def forward(x, scale, bias, *, rms: bool, eps: float, out_dtype, interpret: bool = False):
  """x [M, n] -> (z [M, n], xhat [M, n], both ``out_dtype``; rstd [M] float32)."""
  m, n = x.shape
  chunk = norms.chunk_for(n)
  outs = triton_elementwise.launch(
      norm_forward_kernel, [x, x if scale is None else scale, x if bias is None else bias],
      [jax.ShapeDtypeStruct((m, n), out_dtype), jax.ShapeDtypeStruct((m, n), out_dtype),
       jax.ShapeDtypeStruct((m,), jnp.float32)],
      grid=(m,), constexprs=dict(N=n, CHUNK=chunk, RMS=rms, HAS_SCALE=scale is not None,
                                 HAS_BIAS=bias is not None, EPS=float(eps)),
      num_warps=norms.warps_for(chunk), interpret=interpret)
  return tuple(outs)


def backward_dx(xhat, rstd, dz, scale, *, rms: bool, dx_dtype, interpret: bool = False):
  """xhat, dz [M, n], rstd [M] -> dx [M, n] in ``dx_dtype``."""
  m, n = xhat.shape
  chunk = norms.chunk_for(n)
  (dx,) = triton_elementwise.launch(
      norm_backward_kernel, [xhat, rstd, dz, xhat if scale is None else scale],
      [jax.ShapeDtypeStruct((m, n), dx_dtype)], grid=(m,),
      constexprs=dict(N=n, CHUNK=chunk, RMS=rms, HAS_SCALE=scale is not None),
      num_warps=norms.warps_for(chunk), interpret=interpret)
  return dx
