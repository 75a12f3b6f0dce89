"""The XLA implementation of the output-saving norms, and the custom_vjps every
implementation shares.

A norm's backward needs only the normalized, pre-affine tensor ``xhat`` and the per-row
``rstd = 1/sqrt(var + eps)`` (float32): with ``g = dz * scale``,

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))        (LayerNorm)
    dx = rstd * (g - xhat * mean(g * xhat))                  (RMSNorm)
    dscale = sum_rows(dz * xhat),  dbias = sum_rows(dz).

The residuals are ``xhat`` (in the output dtype) and ``rstd``, never the input and never a
division by ``scale``, so every scale value (0 and denormals included) has exact gradients.

The fused norm -> dense unit (:func:`norm_dense`) keeps only ``xhat`` + ``rstd`` for the
norm and the projections that read it, recomputing the affine output for the weight
gradients: one tensor where norm + matmul keep two.

An implementation provides ``forward(backend, rms, eps, dtype, x, scale, bias) -> (z, xhat,
rstd[..., 1])`` and ``backward_dx(backend, rms, xhat, rstd, dz, scale, x_dtype) -> dx``;
this module's are plain jnp (the reference for the kernels).
"""
from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp

from invact_jax.ops import _common
from invact_jax.ops._implementation import Backend


def normalize(x, rms: bool, eps: float):
  """(xhat, rstd) in the compute dtype (float32; float64 for float64 x); rstd is [..., 1]."""
  xf = x.astype(_common.compute_dtype(x.dtype))
  if rms:
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    centered = xf
  else:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(var + eps)
  return centered * rstd, rstd


def affine(xhat, scale, bias, dtype):
  z = xhat
  if scale is not None:
    z = z * scale.astype(xhat.dtype)
  if bias is not None:
    z = z + bias.astype(xhat.dtype)
  return z.astype(dtype)


def dx_from_xhat(xhat, rstd, g, rms: bool):
  """Input gradient from xhat, rstd and g = dL/dxhat, all in the compute dtype."""
  proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
  if rms:
    return rstd * (g - xhat * proj)
  return rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * proj)


def rows_sum(a):
  """Sum over every leading axis (explicit row count: works for zero-size arrays)."""
  return jnp.sum(a.reshape(math.prod(a.shape[:-1]), a.shape[-1]), axis=0)


# ----------------------------------------------------------------------- the XLA backend
def forward(backend, rms, eps, dtype, x, scale, bias):
  del backend
  xhat, rstd = normalize(x, rms, eps)
  return affine(xhat, scale, bias, dtype), xhat.astype(dtype), rstd


def backward_dx(backend, rms, xhat, rstd, dz, scale, x_dtype):
  del backend
  st = rstd.dtype
  g = dz.astype(st) if scale is None else dz.astype(st) * scale.astype(st)
  return dx_from_xhat(xhat.astype(st), rstd, g, rms).astype(x_dtype)


_MODULES = {"xla": __name__, "pallas": "invact_jax.ops.norms.pallas",
            "triton": "invact_jax.ops.norms.triton"}


def _impl(backend: Backend):
  return importlib.import_module(_MODULES[backend.name])


def _kernel_backend(backend: Backend, x) -> Backend:
  """Zero-size arrays need no kernel (and kernels need at least one element)."""
  return Backend("xla") if x.size == 0 else backend


def _param_grads(dz, xhat, scale, bias):
  dscale = None if scale is None else _common.cotangent_like(
      rows_sum(dz * xhat).astype(scale.dtype), scale)
  dbias = None if bias is None else _common.cotangent_like(rows_sum(dz).astype(bias.dtype), bias)
  return dscale, dbias


# --------------------------------------------------------------------------- the norm
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def norm(backend: Backend, rms: bool, eps: float, dtype, x_dtype, x, scale, bias):
  """The norm's output; the backward keeps xhat (``dtype``) and rstd (float32)."""
  del x_dtype
  b = _kernel_backend(backend, x)
  return _impl(b).forward(b, rms, eps, dtype, x, scale, bias)[0]


def _norm_fwd(backend, rms, eps, dtype, x_dtype, x, scale, bias):
  del x_dtype
  b = _kernel_backend(backend, x)
  z, xhat, rstd = _impl(b).forward(b, rms, eps, dtype, x, scale, bias)
  return z, (xhat, rstd, scale, bias)


def _norm_bwd(backend, rms, eps, dtype, x_dtype, res, dz):
  del eps, dtype
  xhat, rstd, scale, bias = res
  b = _kernel_backend(backend, xhat)
  dx = _impl(b).backward_dx(b, rms, xhat, rstd, dz, scale, x_dtype)
  st = rstd.dtype
  return (dx, *_param_grads(dz.astype(st), xhat.astype(st), scale, bias))


norm.defvjp(_norm_fwd, _norm_bwd)


# ---------------------------------------------------------------- fused norm -> dense(s)
def dense(z, kernel, bias, dtype):
  y = jnp.dot(z, kernel.astype(dtype))
  return y if bias is None else y + bias.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def norm_dense(backend: Backend, rms: bool, eps: float, dtype, x_dtype, x, scale, bias,
               kernels, biases):
  """``tuple(norm(x) @ W_i + b_i)``; the backward keeps only xhat + rstd."""
  del x_dtype
  b = _kernel_backend(backend, x)
  z = _impl(b).forward(b, rms, eps, dtype, x, scale, bias)[0]
  return tuple(dense(z, k, bb, dtype) for k, bb in zip(kernels, biases))


def _norm_dense_fwd(backend, rms, eps, dtype, x_dtype, x, scale, bias, kernels, biases):
  del x_dtype
  b = _kernel_backend(backend, x)
  z, xhat, rstd = _impl(b).forward(b, rms, eps, dtype, x, scale, bias)
  ys = tuple(dense(z, k, bb, dtype) for k, bb in zip(kernels, biases))
  return ys, (xhat, rstd, scale, bias, kernels, biases)


def _norm_dense_bwd(backend, rms, eps, dtype, x_dtype, res, dys):
  del eps
  xhat, rstd, scale, bias, kernels, biases = res
  st = rstd.dtype
  # The affine output, recomputed (as the forward rounded it) for the weight gradients.
  z = affine(xhat.astype(st), scale, bias, dtype)
  rows = math.prod(z.shape[:-1])
  z2 = z.reshape(rows, z.shape[-1])
  dkernels, dbiases, dz = [], [], None
  for k, bb, dy in zip(kernels, biases, dys):
    dy2 = dy.reshape(rows, dy.shape[-1]).astype(dtype)
    dkernels.append(_common.cotangent_like(
        jnp.dot(z2.T, dy2, preferred_element_type=st).astype(k.dtype), k))
    dbiases.append(None if bb is None else _common.cotangent_like(
        jnp.sum(dy2.astype(st), axis=0).astype(bb.dtype), bb))
    part = jnp.dot(dy2, k.astype(dtype).T, preferred_element_type=st)
    dz = part if dz is None else dz + part
  dz = dz.reshape(z.shape)
  b = _kernel_backend(backend, xhat)
  dx = _impl(b).backward_dx(b, rms, xhat, rstd, dz, scale, x_dtype)
  return (dx, *_param_grads(dz, xhat.astype(st), scale, bias), tuple(dkernels), tuple(dbiases))


norm_dense.defvjp(_norm_dense_fwd, _norm_dense_bwd)
