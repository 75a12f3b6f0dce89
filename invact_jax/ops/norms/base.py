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

Each implementation (:class:`XlaNorm` here, ``pallas.PallasNorm``, ``triton.TritonNorm``)
has ``forward(rms, eps, dtype, x, scale, bias) -> (z, xhat, rstd[..., 1])`` and
``backward_dx(rms, xhat, rstd, dz, scale, x_dtype) -> dx``; :func:`norm` and
:func:`norm_dense` are the ``custom_vjp``s they share.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from invact_jax.ops import _common
from invact_jax.ops import _implementation


def normalize(x, rms: bool, eps: float, axes=-1, mode: str = "var"):
  """(xhat, rstd) in the compute dtype (float32; float64 for float64 x); rstd keeps the
  reduced ``axes`` as size 1 (``[..., 1]`` for the last axis).  ``mode``: where epsilon
  enters, ``rstd`` = "var" ``rsqrt(var + eps)``; "std" ``1 / (sqrt(var) + eps)`` (the
  annotated Transformer's LayerNorm); "floor_var" ``rsqrt(max(var, eps))``; "floor_std"
  ``1 / max(sqrt(var), eps)`` (torch's ``F.normalize``)."""
  return statistics(x, rms, eps, axes, mode)[:2]


def statistics(x, rms: bool, eps: float, axes=-1, mode: str = "var"):
  """``(xhat, rstd, side)``: :func:`normalize`'s, and under a floor ("floor_var",
  "floor_std") the factor per row of the backward's projection term ``xhat * mean(g *
  xhat)``: 1 above the floor, 0 below (the floor is a constant), 1/2 at it (JAX's ``max``
  splits its derivative at a tie); None for the other modes."""
  xf = x.astype(_common.compute_dtype(x.dtype))
  if rms:
    centered, var = xf, jnp.mean(xf * xf, axis=axes, keepdims=True)
  else:
    centered = xf - jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(centered * centered, axis=axes, keepdims=True)
  side = None
  if mode == "std":
    rstd = 1.0 / (jnp.sqrt(var) + eps)
  elif mode.startswith("floor"):
    stat = var if mode == "floor_var" else jnp.sqrt(var)
    floored = jnp.maximum(stat, eps)
    rstd = jax.lax.rsqrt(floored) if mode == "floor_var" else 1.0 / floored
    side = jnp.where(stat > eps, 1.0, jnp.where(stat == eps, 0.5, 0.0)).astype(var.dtype)
  else:
    rstd = jax.lax.rsqrt(var + eps)
  return centered * rstd, rstd, side


def affine(xhat, scale, bias, dtype):
  z = xhat
  if scale is not None:
    z = z * scale.astype(xhat.dtype)
  if bias is not None:
    z = z + bias.astype(xhat.dtype)
  return z.astype(dtype)


def dx_from_xhat(xhat, rstd, g, rms: bool, axes=-1):
  """Input gradient from xhat, rstd and g = dL/dxhat, all in the compute dtype (statistics
  over ``axes``)."""
  proj = jnp.mean(g * xhat, axis=axes, keepdims=True)
  if rms:
    return rstd * (g - xhat * proj)
  return rstd * (g - jnp.mean(g, axis=axes, keepdims=True) - xhat * proj)


def rows_sum(a):
  """Sum over every leading axis (explicit row count: works for zero-size arrays)."""
  return jnp.sum(a.reshape(math.prod(a.shape[:-1]), a.shape[-1]), axis=0)


# --------------------------------------------------------------- the XLA implementation
@dataclasses.dataclass(frozen=True)
class XlaNorm(_implementation.ImplementationBase):
  """Plain jnp, fused by XLA: the reference the row kernels are tested against.

  Every implementation of this family has these two methods."""

  def forward(self, rms: bool, eps: float, dtype, x, scale, bias):
    """``(z, xhat, rstd[..., 1])``: the affine output, xhat in ``dtype``, float32 rstd."""
    xhat, rstd = normalize(x, rms, eps)
    return affine(xhat, scale, bias, dtype), xhat.astype(dtype), rstd

  def backward_dx(self, rms: bool, xhat, rstd, dz, scale, x_dtype):
    """The input gradient from the kept xhat and rstd."""
    st = rstd.dtype
    g = dz.astype(st) if scale is None else dz.astype(st) * scale.astype(st)
    return dx_from_xhat(xhat.astype(st), rstd, g, rms).astype(x_dtype)


#: The XLA implementation (``IMPLEMENTATIONS["xla"]``).
XLA = XlaNorm()


def kernel_or_xla(implementation, x):
  """Zero-size arrays need no kernel (and kernels need at least one element)."""
  return XLA if x.size == 0 else implementation


def _param_grads(dz, xhat, scale, bias):
  dscale = None if scale is None else _common.cotangent_like(
      rows_sum(dz * xhat).astype(scale.dtype), scale)
  dbias = None if bias is None else _common.cotangent_like(rows_sum(dz).astype(bias.dtype), bias)
  return dscale, dbias


# --------------------------------------------------------------------------- the norm
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def norm(implementation, rms: bool, eps: float, dtype, x_dtype, x, scale, bias):
  """The norm's output; the backward keeps xhat (``dtype``) and rstd (float32)."""
  del x_dtype
  return kernel_or_xla(implementation, x).forward(rms, eps, dtype, x, scale, bias)[0]


def _norm_fwd(implementation, rms, eps, dtype, x_dtype, x, scale, bias):
  del x_dtype
  z, xhat, rstd = kernel_or_xla(implementation, x).forward(rms, eps, dtype, x, scale, bias)
  return z, (xhat, rstd, scale, bias)


def backward(implementation, rms: bool, x_dtype, res, dz):
  """``(dx, dscale, dbias)`` from the residuals ``(xhat, rstd, scale, bias)`` of :func:`norm`
  (also the backward of the norms :func:`invact_jax.invert` finds in other code)."""
  xhat, rstd, scale, bias = res
  dx = kernel_or_xla(implementation, xhat).backward_dx(rms, xhat, rstd, dz, scale, x_dtype)
  st = rstd.dtype
  return (dx, *_param_grads(dz.astype(st), xhat.astype(st), scale, bias))


def _norm_bwd(implementation, rms, eps, dtype, x_dtype, res, dz):
  del eps, dtype
  xhat, rstd, scale, bias = res
  xhat, rstd = _common.read_apart((xhat, rstd))
  return backward(implementation, rms, x_dtype, (xhat, rstd, scale, bias), dz)


norm.defvjp(_norm_fwd, _norm_bwd)


# ---------------------------------------------------------------- fused norm -> dense(s)
def dense(z, kernel, bias, dtype):
  y = jnp.dot(z, kernel.astype(dtype))
  return y if bias is None else y + bias.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def norm_dense(implementation, rms: bool, eps: float, dtype, x_dtype, x, scale, bias,
               kernels, biases):
  """``tuple(norm(x) @ W_i + b_i)``; the backward keeps only xhat + rstd."""
  del x_dtype
  z = kernel_or_xla(implementation, x).forward(rms, eps, dtype, x, scale, bias)[0]
  return tuple(dense(z, k, bb, dtype) for k, bb in zip(kernels, biases))


def _norm_dense_fwd(implementation, rms, eps, dtype, x_dtype, x, scale, bias, kernels, biases):
  del x_dtype
  z, xhat, rstd = kernel_or_xla(implementation, x).forward(rms, eps, dtype, x, scale, bias)
  ys = tuple(dense(z, k, bb, dtype) for k, bb in zip(kernels, biases))
  return ys, (xhat, rstd, scale, bias, kernels, biases)


def _norm_dense_bwd(implementation, rms, eps, dtype, x_dtype, res, dys):
  """The fused norm + matmuls' backward: the affine output recomputed from ``xhat`` (as the forward
  rounded it) for the weight gradients, ``dx`` through the norm's backward from ``xhat`` and
  ``rstd``."""
  del eps
  xhat, rstd, scale, bias, kernels, biases = res
  xhat, rstd = _common.read_apart((xhat, rstd))
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
  dx = kernel_or_xla(implementation, xhat).backward_dx(rms, xhat, rstd, dz, scale, x_dtype)
  return (dx, *_param_grads(dz, xhat.astype(st), scale, bias), tuple(dkernels), tuple(dbiases))


norm_dense.defvjp(_norm_dense_fwd, _norm_dense_bwd)
