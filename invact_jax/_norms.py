"""Output-saving LayerNorm / RMSNorm, and the fused norm -> dense unit.

A norm's backward needs only the normalized, pre-affine tensor ``xhat`` and the per-row
``rstd = 1/sqrt(var + eps)`` (float32): with ``g = dz * scale``,

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))        (LayerNorm)
    dx = rstd * (g - xhat * mean(g * xhat))                  (RMSNorm)
    dscale = sum_rows(dz * xhat),  dbias = sum_rows(dz).

The residuals are ``xhat`` (in the compute dtype) and ``rstd``, never the input and never
a division by ``scale`` — libraries that recover ``xhat = (z - bias) / scale`` from the
affine output produce NaN or wrong ``dscale`` where ``scale`` is 0; here every scale value,
0 and denormals included, has exact gradients.

:func:`layer_norm_dense` / :func:`rms_norm_dense` go one step further: the norm and the
dense layer(s) that read it form one ``custom_vjp`` that keeps only ``xhat`` + ``rstd``
and recomputes the affine output ``z = xhat * scale + bias`` for the weight gradients, so
the block keeps one tensor where norm + matmul keep two.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from invact_jax import _dispatch

__all__ = ["layer_norm", "rms_norm", "layer_norm_reference", "rms_norm_reference",
           "layer_norm_dense", "rms_norm_dense", "norm_dense_reference"]

_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _check(fn: str, x, scale, bias, dtype):
  if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOATS]:
    raise TypeError(f"invact_jax.{fn}: argument `x` must be a floating-point array, got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
  if x.ndim < 1:
    raise ValueError(f"invact_jax.{fn}: argument `x` must have at least 1 dimension")
  n = x.shape[-1]
  for arg, v in (("scale", scale), ("bias", bias)):
    if v is not None and tuple(v.shape) != (n,):
      raise ValueError(f"invact_jax.{fn}: argument `{arg}` must have shape ({n},) (the last "
                       f"axis of x), got {tuple(v.shape)}")
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  if out not in [jnp.dtype(d) for d in _FLOATS]:
    raise TypeError(f"invact_jax.{fn}: argument `dtype` must be a floating-point dtype, got {out}")
  return out


def _stats_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _normalize(x, rms: bool, eps: float):
  """(xhat, rstd) in float32 (float64 for float64 x); rstd has a trailing axis of 1."""
  xf = x.astype(_stats_dtype(x.dtype))
  if rms:
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    centered = xf
  else:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(var + eps)
  return centered * rstd, rstd


def _affine(xhat, scale, bias, dtype):
  z = xhat
  if scale is not None:
    z = z * scale.astype(xhat.dtype)
  if bias is not None:
    z = z + bias.astype(xhat.dtype)
  return z.astype(dtype)


def _dx(xhat, rstd, g, rms: bool):
  """Input gradient from xhat, rstd and g = dL/dxhat, all in the stats dtype."""
  proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
  if rms:
    return rstd * (g - xhat * proj)
  return rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * proj)


def _rows_sum(a):
  return jnp.sum(a.reshape(-1, a.shape[-1]), axis=0)


# --------------------------------------------------------------------------- the norm alone
def _kernel_fwd(backend, rms, eps, dtype, x, scale, bias):
  """(z, xhat, rstd[..., 1]) from the Pallas kernels, run per shard of the leading axes."""
  from pallas_kernels import norms as kernels  # pylint: disable=import-outside-toplevel

  def run(x, scale, bias):
    lead, n = x.shape[:-1], x.shape[-1]
    z, xhat, rstd = kernels.forward(x.reshape(-1, n), scale, bias, rms=rms, eps=eps,
                                    out_dtype=dtype, interpret=backend.interpret)
    return z.reshape(*lead, n), xhat.reshape(*lead, n), rstd.reshape(*lead, 1)
  return _rows_partitioned(run, 3, x, scale, bias)


def _kernel_dx(backend, rms, xhat, rstd, dz, scale, x_dtype):
  from pallas_kernels import norms as kernels  # pylint: disable=import-outside-toplevel

  def run(xhat, rstd, dz, scale):
    lead, n = xhat.shape[:-1], xhat.shape[-1]
    dx = kernels.backward_dx(xhat.reshape(-1, n), rstd.reshape(-1), dz.reshape(-1, n), scale,
                             rms=rms, dx_dtype=x_dtype, interpret=backend.interpret)
    return dx.reshape(*lead, n)
  return _rows_partitioned(run, 1, xhat, rstd, dz, scale)


def _rows_partitioned(run, n_out: int, *args):
  """``run(*args)`` per shard of the leading axes (the last axis whole; [n] args replicated).

  A pallas_call is opaque to XLA's partitioner; this says that rows are independent, so a
  batch- or sequence-sharded input runs locally with no gather (tested).
  """
  present = [a is not None for a in args]
  arrays = [a for a in args if a is not None]
  x = arrays[0]
  if x.ndim < 2:
    return run(*args)

  def call(*arrs):
    it = iter(arrs)
    out = run(*[next(it) if p else None for p in present])
    return out

  op = custom_partitioning(call)

  def shardings(mesh, arg_shapes):
    spec = tuple(arg_shapes[0].sharding.spec) + (None,) * x.ndim
    rows = jax.sharding.PartitionSpec(*spec[:x.ndim - 1], None)
    row = jax.sharding.NamedSharding(mesh, rows)
    ins = tuple(row if len(a.shape) == x.ndim else
                jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                for a in arg_shapes)
    return row, ins

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    row, _ = shardings(mesh, arg_shapes)
    return row if n_out == 1 else (row,) * n_out

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    row, ins = shardings(mesh, arg_shapes)
    return mesh, call, (row if n_out == 1 else (row,) * n_out), ins

  lead = " ".join(f"b{i}" for i in range(x.ndim - 1))
  kinds = [f"{lead} n" if a.ndim == x.ndim and a.shape[-1] == x.shape[-1] else
           (f"{lead} o" if a.ndim == x.ndim else "n") for a in arrays]
  outs = [f"{lead} n"] * min(n_out, 2) + [f"{lead} o"] * (n_out - 2)
  rule = ", ".join(kinds) + " -> " + ", ".join(outs)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule, need_replication_factors=("n",))
  return op(*arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _norm(backend, rms, eps, dtype, x, scale, bias):
  if backend.name == "pallas":
    return _kernel_fwd(backend, rms, eps, dtype, x, scale, bias)[0]
  xhat, _ = _normalize(x, rms, eps)
  return _affine(xhat, scale, bias, dtype)


def _norm_fwd(backend, rms, eps, dtype, x, scale, bias):
  if backend.name == "pallas":
    z, xhat_s, rstd = _kernel_fwd(backend, rms, eps, dtype, x, scale, bias)
  else:
    xhat, rstd = _normalize(x, rms, eps)
    z, xhat_s = _affine(xhat, scale, bias, dtype), xhat.astype(dtype)
  # Residuals: xhat in the output dtype (the size of z) and the float32 row statistic.
  return z, (xhat_s, rstd, scale, bias, jnp.zeros((0,), x.dtype))


def _norm_bwd(backend, rms, eps, dtype, res, dz):
  del eps, dtype
  xhat_s, rstd, scale, bias, x_like = res
  x_dtype = x_like.dtype
  st = rstd.dtype
  xhat = xhat_s.astype(st)
  dzf = dz.astype(st)
  if backend.name == "pallas":
    dx = _kernel_dx(backend, rms, xhat_s, rstd, dz, scale, x_dtype)
  else:
    g = dzf if scale is None else dzf * scale.astype(st)
    dx = _dx(xhat, rstd, g, rms).astype(x_dtype)
  dscale = None if scale is None else _rows_sum(dzf * xhat).astype(scale.dtype)
  dbias = None if bias is None else _rows_sum(dzf).astype(bias.dtype)
  return dx, dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


def _backend(fn, implementation):
  backend = _dispatch.resolve(implementation)
  if backend.name == "triton":  # pragma: no cover - resolve() refuses it today
    raise RuntimeError(f"invact_jax.{fn}: implementation='triton' has no norm kernels")
  return backend


def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-6, dtype=None,
               implementation=None):
  """LayerNorm over the last axis that keeps only ``xhat`` (output dtype) and float32 ``rstd``.

  Forward matches ``flax.nnx.LayerNorm`` (statistics in float32); gradients are exact for
  every ``scale`` (no division by it).

  Args:
    x: floating-point array [..., n].
    scale, bias: [n] arrays or None.
    epsilon: added to the variance.
    dtype: output dtype (default: ``x.dtype``); also the dtype ``xhat`` is kept in.
    implementation: None / "xla" (jnp, fused by XLA) or "pallas" (the row kernels of
      ``pallas_kernels.norms``; interpret mode without a GPU), or an
      :class:`invact_jax.Implementation`.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x = jnp.arange(12.0).reshape(3, 4)
    >>> y = invact_jax.layer_norm(x, jnp.ones(4), jnp.zeros(4))
    >>> bool(jnp.allclose(y, invact_jax.layer_norm_reference(x, jnp.ones(4), jnp.zeros(4))))
    True
  """
  out = _check("layer_norm", x, scale, bias, dtype)
  return _norm(_backend("layer_norm", implementation), False, float(epsilon), out, x, scale, bias)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, dtype=None, implementation=None):
  """RMSNorm over the last axis keeping only ``xhat`` and float32 ``rstd`` (see layer_norm)."""
  out = _check("rms_norm", x, scale, None, dtype)
  return _norm(_backend("rms_norm", implementation), True, float(epsilon), out, x, scale, None)


def layer_norm_reference(x, scale=None, bias=None, *, epsilon: float = 1e-6, dtype=None):
  """Plain-jnp LayerNorm with JAX's own autodiff (Flax's formulation): the baseline."""
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  xhat, _ = _normalize(x, False, epsilon)
  return _affine(xhat, scale, bias, out)


def rms_norm_reference(x, scale=None, *, epsilon: float = 1e-6, dtype=None):
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  xhat, _ = _normalize(x, True, epsilon)
  return _affine(xhat, scale, None, out)


# ---------------------------------------------------------------- fused norm -> dense(s)
def _dense(z, kernel, bias, dtype):
  y = jnp.dot(z, kernel.astype(dtype))
  return y if bias is None else y + bias.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm_dense(rms, eps, dtype, x, scale, bias, kernels, biases):
  xhat, _ = _normalize(x, rms, eps)
  z = _affine(xhat, scale, bias, dtype)
  return tuple(_dense(z, k, b, dtype) for k, b in zip(kernels, biases))


def _norm_dense_fwd(rms, eps, dtype, x, scale, bias, kernels, biases):
  xhat, rstd = _normalize(x, rms, eps)
  z = _affine(xhat, scale, bias, dtype)
  ys = tuple(_dense(z, k, b, dtype) for k, b in zip(kernels, biases))
  return ys, (xhat.astype(dtype), rstd, scale, bias, kernels, biases, jnp.zeros((0,), x.dtype))


def _norm_dense_bwd(rms, eps, dtype, res, dys):
  del eps
  xhat_s, rstd, scale, bias, kernels, biases, x_like = res
  x_dtype = x_like.dtype
  st = rstd.dtype
  # The affine output, recomputed (as the forward rounded it) for the weight gradients.
  z = _affine(xhat_s.astype(st), scale, bias, dtype)
  lead = z.shape[:-1]
  z2 = z.reshape(-1, z.shape[-1])
  dkernels, dbiases, dz = [], [], None
  for k, b, dy in zip(kernels, biases, dys):
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(dtype)
    dkernels.append(jnp.dot(z2.T, dy2, preferred_element_type=st).astype(k.dtype))
    dbiases.append(None if b is None else jnp.sum(dy2.astype(st), axis=0).astype(b.dtype))
    part = jnp.dot(dy2, k.astype(dtype).T, preferred_element_type=st)
    dz = part if dz is None else dz + part
  dz = dz.reshape(*lead, -1)
  xhat = xhat_s.astype(st)
  g = dz if scale is None else dz * scale.astype(st)
  dx = _dx(xhat, rstd, g, rms).astype(x_dtype)
  dscale = None if scale is None else _rows_sum(dz * xhat).astype(scale.dtype)
  dbias = None if bias is None else _rows_sum(dz).astype(bias.dtype)
  return dx, dscale, dbias, tuple(dkernels), tuple(dbiases)


_norm_dense.defvjp(_norm_dense_fwd, _norm_dense_bwd)


def _check_dense(fn, x, kernels, biases):
  kernels = tuple(kernels)
  biases = (None,) * len(kernels) if biases is None else tuple(biases)
  if not kernels:
    raise ValueError(f"invact_jax.{fn}: argument `kernels` must hold at least one [n, m] array")
  if len(biases) != len(kernels):
    raise ValueError(f"invact_jax.{fn}: argument `biases` must have one entry per kernel "
                     f"({len(kernels)}), got {len(biases)}")
  for i, (k, b) in enumerate(zip(kernels, biases)):
    if k.ndim != 2 or k.shape[0] != x.shape[-1]:
      raise ValueError(f"invact_jax.{fn}: argument `kernels[{i}]` must have shape "
                       f"({x.shape[-1]}, m), got {tuple(k.shape)}")
    if b is not None and tuple(b.shape) != (k.shape[1],):
      raise ValueError(f"invact_jax.{fn}: argument `biases[{i}]` must have shape "
                       f"({k.shape[1]},), got {tuple(b.shape)}")
  return kernels, biases


def layer_norm_dense(x, scale, bias, kernels: Sequence, biases: Sequence | None = None, *,
                     epsilon: float = 1e-6, dtype=None):
  """``tuple(LN(x) @ W_i + b_i)`` keeping only ``xhat`` + ``rstd`` for the backward.

  The affine output is recomputed in the backward for the weight gradients, so norm and
  matmul(s) together keep one [..., n] tensor (in ``dtype``) plus a float32 per row.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> x, w = jnp.ones((2, 8)), jnp.ones((8, 3))
    >>> (y,) = invact_jax.layer_norm_dense(x, jnp.ones(8), jnp.zeros(8), [w])
    >>> y.shape
    (2, 3)
  """
  out = _check("layer_norm_dense", x, scale, bias, dtype)
  kernels, biases = _check_dense("layer_norm_dense", x, kernels, biases)
  return _norm_dense(False, float(epsilon), out, x, scale, bias, kernels, biases)


def rms_norm_dense(x, scale, kernels: Sequence, biases: Sequence | None = None, *,
                   epsilon: float = 1e-6, dtype=None):
  """``tuple(RMSNorm(x) @ W_i + b_i)`` keeping only ``xhat`` + ``rstd`` (see layer_norm_dense)."""
  out = _check("rms_norm_dense", x, scale, None, dtype)
  kernels, biases = _check_dense("rms_norm_dense", x, kernels, biases)
  return _norm_dense(True, float(epsilon), out, x, scale, None, kernels, biases)


def norm_dense_reference(x, scale, bias, kernels, biases=None, *, rms: bool = False,
                         epsilon: float = 1e-6, dtype=None):
  """The unfused baseline of :func:`layer_norm_dense` / :func:`rms_norm_dense`."""
  out = jnp.dtype(x.dtype if dtype is None else dtype)
  biases = (None,) * len(kernels) if biases is None else biases
  xhat, _ = _normalize(x, rms, epsilon)
  z = _affine(xhat, scale, None if rms else bias, out)
  return tuple(_dense(z, k, b, out) for k, b in zip(kernels, biases))
