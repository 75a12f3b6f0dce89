"""Row-wise LayerNorm / RMSNorm kernels that write what the output-saving backward keeps.

* :func:`forward`: per row, reads x once for the statistics (two passes over the row, which
  stays in cache) and writes the affine output ``z``, the normalized ``xhat`` and float32
  ``rstd``;
* :func:`backward_dx`: per row, from ``xhat``, ``rstd``, ``dz`` (and ``scale``) computes
  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dz * scale`` (RMSNorm:
  no ``mean(g)`` term).  The column sums ``dscale``/``dbias`` are plain reductions over
  rows, left to XLA by the caller.

One program per row (``jax.vmap`` over a grid-less ``pallas_call``, as JAX's own Pallas GPU
layer norm does); the row is walked in power-of-two chunks with masked loads and stores,
so any width works without padding copies.  ``compiler_params`` are explicit (Triton).
Math-agnostic of ``invact_jax`` (nothing imported from it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shapes import out_struct

__all__ = ["forward", "backward_dx", "chunk_for", "warps_for"]


def chunk_for(n: int) -> int:
  """Power-of-two chunk of a row: the whole row up to 4096 elements, at least 128."""
  return min(max(pl.next_power_of_2(n), 128), 4096)


def warps_for(chunk: int) -> int:
  """Warps per row program: one per 256 elements of a chunk, 1 to 8."""
  return min(max(chunk // 256, 1), 8)


def _params(chunk: int):
  return plgpu.CompilerParams(num_warps=warps_for(chunk), num_stages=1)


def _load(ref, cols, mask):
  return plgpu.load(ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)


def _fwd_kernel(*refs, rms, eps, chunk, has_scale, has_bias):
  """One row: its statistics, the normalized row (kept for the backward) and the scaled,
  shifted output."""
  it = iter(refs)
  x_ref = next(it)
  scale_ref = next(it) if has_scale else None
  bias_ref = next(it) if has_bias else None
  z_ref, xhat_ref, rstd_ref = next(it), next(it), next(it)
  n = x_ref.shape[0]
  steps = pl.cdiv(n, chunk)

  def cols(i):
    c = i * chunk + jnp.arange(chunk)
    return c, c < n

  if rms:
    mean = jnp.float32(0.0)
  else:
    def sum_body(i, acc):
      c, m = cols(i)
      return acc + _load(x_ref, c, m)
    mean = lax.fori_loop(0, steps, sum_body, jnp.zeros(chunk, jnp.float32)).sum() / n

  def var_body(i, acc):
    c, m = cols(i)
    d = jnp.where(m, _load(x_ref, c, m) - mean, 0.0)
    return acc + d * d
  var = lax.fori_loop(0, steps, var_body, jnp.zeros(chunk, jnp.float32)).sum() / n
  rstd = lax.rsqrt(var + eps)
  rstd_ref[...] = rstd

  @pl.loop(0, steps)
  def _(i):
    c, m = cols(i)
    xhat = (_load(x_ref, c, m) - mean) * rstd
    z = xhat
    if has_scale:
      z = z * _load(scale_ref, c, m)
    if has_bias:
      z = z + _load(bias_ref, c, m)
    plgpu.store(xhat_ref.at[c], xhat.astype(xhat_ref.dtype), mask=m)
    plgpu.store(z_ref.at[c], z.astype(z_ref.dtype), mask=m)


def forward(x, scale, bias, *, rms: bool, eps: float, out_dtype, interpret: bool = False):
  """x [M, n] -> (z [M, n], xhat [M, n], both ``out_dtype``; rstd [M] float32)."""
  m, n = x.shape
  chunk = chunk_for(n)
  kernel = functools.partial(_fwd_kernel, rms=rms, eps=float(eps), chunk=chunk,
                             has_scale=scale is not None, has_bias=bias is not None)
  call = pl.pallas_call(
      kernel, grid=(),
      out_shape=[out_struct((n,), out_dtype, x), out_struct((n,), out_dtype, x),
                 out_struct((), jnp.float32, x)],
      compiler_params=_params(chunk), interpret=interpret, name="invact_norm_forward")
  params = [p for p in (scale, bias) if p is not None]
  z, xhat, rstd = jax.vmap(call, in_axes=(0,) + (None,) * len(params))(x, *params)
  del m
  return z, xhat, rstd


def _bwd_kernel(*refs, rms, chunk, has_scale):
  """One row: the input gradient from the kept normalized row, its reciprocal standard
  deviation and the output's cotangent."""
  it = iter(refs)
  xhat_ref, rstd_ref, dz_ref = next(it), next(it), next(it)
  scale_ref = next(it) if has_scale else None
  dx_ref = next(it)
  n = xhat_ref.shape[0]
  steps = pl.cdiv(n, chunk)
  rstd = rstd_ref[...]

  def g_and_xhat(i):
    c = i * chunk + jnp.arange(chunk)
    m = c < n
    g = _load(dz_ref, c, m)
    if has_scale:
      g = g * _load(scale_ref, c, m)
    return c, m, g, _load(xhat_ref, c, m)

  def sums(i, acc):
    _, _, g, xh = g_and_xhat(i)
    return acc[0] + g * xh, acc[1] + g
  zero = jnp.zeros(chunk, jnp.float32)
  s_gx, s_g = lax.fori_loop(0, steps, sums, (zero, zero))
  proj = s_gx.sum() / n
  mean_g = jnp.float32(0.0) if rms else s_g.sum() / n

  @pl.loop(0, steps)
  def _(i):
    c, m, g, xh = g_and_xhat(i)
    dx = rstd * (g - mean_g - xh * proj)
    plgpu.store(dx_ref.at[c], dx.astype(dx_ref.dtype), mask=m)


def backward_dx(xhat, rstd, dz, scale, *, rms: bool, dx_dtype, interpret: bool = False):
  """xhat, dz [M, n], rstd [M] -> dx [M, n] in ``dx_dtype``."""
  n = xhat.shape[1]
  chunk = chunk_for(n)
  kernel = functools.partial(_bwd_kernel, rms=rms, chunk=chunk, has_scale=scale is not None)
  call = pl.pallas_call(
      kernel, grid=(), out_shape=out_struct((n,), dx_dtype, xhat),
      compiler_params=_params(chunk), interpret=interpret, name="invact_norm_backward")
  args = [xhat, rstd, dz] + ([] if scale is None else [scale])
  in_axes = (0, 0, 0) + (() if scale is None else (None,))
  return jax.vmap(call, in_axes=in_axes)(*args)
