"""Float64 oracles for the inverted activations and the storage-floor audit.

The audit answers one question per activation and dtype: how far is the gradient
computed from the stored output ``y`` (and its branch bit) from the true
derivative ``f'(x)``, compared with the *storage floor* — the same error when the
inverse ``f^-1(y)`` is computed exactly in float64 on the correct branch.  The
floor is what storing ``y`` in that dtype makes unavoidable; no method that keeps
only ``y`` can beat it.

Used by ``tests/`` and ``scripts/fit_inverse.py``; needs SciPy (``special``).

Example:
  >>> from invact_jax import accuracy
  >>> row = accuracy.audit("silu", "float32")
  >>> row.error <= 1.2 * row.floor
  True
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from invact_jax.ops.activations import registry as _registry

__all__ = [
    "NONMONOTONE",
    "MONOTONE",
    "forward64",
    "derivative64",
    "inverse64",
    "branch_point64",
    "audit_grid",
    "AuditRow",
    "audit",
]


NONMONOTONE = _registry.nonmonotone()
MONOTONE = _registry.monotone()


def forward64(name: str, x: np.ndarray) -> np.ndarray:
  """The activation in float64 (mathematically exact up to float64 rounding)."""
  with np.errstate(all="ignore"):
    return _registry.get(name).forward64(np.asarray(x, np.float64))


def derivative64(name: str, x: np.ndarray) -> np.ndarray:
  """f'(x) in float64, with the limits at +-inf (finite wherever f' has a limit)."""
  with np.errstate(all="ignore"):
    return _registry.get(name).derivative64(np.asarray(x, np.float64))


def _bisect(fn, y, lo, hi):
  """Vectorized bisection for the increasing function ``fn`` on [lo, hi]."""
  lo = np.broadcast_to(np.asarray(lo, np.float64), y.shape).copy()
  hi = np.broadcast_to(np.asarray(hi, np.float64), y.shape).copy()
  if y.size == 0:
    return lo
  width = float(np.max(hi - lo))
  for _ in range(int(60 + np.ceil(np.log2(max(width, 1.0))))):
    mid = 0.5 * (lo + hi)
    up = fn(mid) < y
    lo = np.where(up, mid, lo)
    hi = np.where(up, hi, mid)
  return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=None)
def branch_point64(name: str) -> tuple[float, float]:
  """(x_min, y_min) of a non-monotone activation, in float64."""
  if name not in NONMONOTONE:
    raise KeyError(f"{name!r} has no branch point; use one of {NONMONOTONE}")
  # f' is increasing through its zero on [-3, -0.1] for all four functions.
  lo, hi = -3.0, -0.1
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if derivative64(name, np.float64(mid)) < 0:
      lo = mid
    else:
      hi = mid
  x_min = 0.5 * (lo + hi)
  return float(x_min), float(forward64(name, np.float64(x_min)))


def inverse64(name: str, y: np.ndarray, left: np.ndarray) -> np.ndarray:
  """Exact float64 inverse of a non-monotone activation on the given branch.

  ``y`` below ``y_min`` (possible after rounding) maps to ``x_min``; on the left
  branch ``y >= 0`` maps to ``-inf``, on the right ``y = +inf`` to ``+inf``.
  """
  y, left = np.broadcast_arrays(np.asarray(y, np.float64), np.asarray(left, bool))
  x_min, y_min = branch_point64(name)
  f = lambda x: forward64(name, x)
  yc = np.maximum(y, y_min)
  x = np.empty(y.shape, np.float64)
  # Right branch: f increasing on [x_min, inf); f(x) ~ x for large x.
  r = ~left
  yr = yc[r]
  fin = np.isfinite(yr)
  hi = np.where(fin, np.maximum(yr, 0.0) * 1.01 + 20.0, 1.0)
  right_x = _bisect(f, np.where(fin, yr, 0.0), x_min, hi)
  x[r] = np.where(np.isposinf(yr), np.inf, right_x)
  # Left branch: f decreasing on (-inf, x_min]; bisect the increasing -f.
  yl = np.minimum(yc[left], 0.0)
  left_x = _bisect(lambda v: -f(v), -yl, -1000.0, x_min)
  x[left] = np.where(yl >= 0, -np.inf, left_x)
  x = np.where(y <= y_min, x_min, x)
  return np.where(np.isnan(y), np.nan, x)


def _float_dtype(dtype) -> np.dtype:
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  if isinstance(dtype, str) and dtype == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(dtype)


def _all_values(dtype: np.dtype, lo: float, hi: float) -> np.ndarray:
  """Every finite value of a 16-bit float dtype in [lo, hi]."""
  bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
  v = bits.view(dtype)
  v64 = v.astype(np.float64)
  return v[np.isfinite(v64) & (v64 >= lo) & (v64 <= hi)]


def audit_grid(dtype, *, name: str | None = None, dense: int = 400_001,
               near: int = 4096) -> np.ndarray:
  """The audit's inputs in ``dtype``.

  A dense grid of x in [-12, 12] (every representable value for 16-bit dtypes),
  +-inf, +-1e30 (and the largest finite value), and — for a non-monotone ``name``
  — every representable value within ``near`` ulps of x_min, which includes the
  inputs whose output rounds to exactly y_min.
  """
  dt = _float_dtype(dtype)
  if dt.itemsize == 2:
    grid = _all_values(dt, -12.0, 12.0)
  else:
    grid = np.linspace(-12.0, 12.0, dense).astype(dt)
  finfo_max = float(np.finfo(dt).max) if dt.itemsize != 2 or dt == np.float16 else 3.3895e38
  extremes = np.array([np.inf, -np.inf, 1e30, -1e30, finfo_max, -finfo_max,
                       0.0, -0.0], np.float64)
  with np.errstate(over="ignore"):
    parts = [grid, extremes.astype(dt)]
  if name in NONMONOTONE:
    x_min = np.asarray(branch_point64(name)[0]).astype(dt)
    if dt.itemsize == 2:
      ints = x_min.view(np.uint16).astype(np.int64) + np.arange(-near, near + 1)
      ints = ints[(ints >= 0) & (ints < 1 << 16)]
      parts.append(ints.astype(np.uint16).view(dt))
    else:
      utype = np.uint32 if dt.itemsize == 4 else np.uint64
      ints = np.asarray(x_min).view(utype).astype(np.int64) + np.arange(-near, near + 1)
      parts.append(ints.astype(utype).view(dt))
  out = np.concatenate([p.astype(dt) for p in parts])
  return out[~np.isnan(out.astype(np.float64))]


def output_is_sound(y_stored: np.ndarray, y_true: np.ndarray) -> np.ndarray:
  """Where the stored output can be read for a gradient: it is finite, or the true output
  (float64) rounded to its dtype is not.  Elsewhere ``jax.nn``'s own forward failed
  (soft_sign(+-inf) = inf / inf = NaN, squareplus's x**2 overflowing at -1e30: y = inf for
  1e-30), and no gradient from that output is right, ``jax.nn``'s own included; the audit
  and the tests leave those inputs out."""
  y_stored = np.asarray(y_stored)
  with np.errstate(all="ignore"):
    rounded = np.asarray(y_true, np.float64).astype(y_stored.dtype).astype(np.float64)
  return np.isfinite(y_stored.astype(np.float64)) | ~np.isfinite(rounded)


@dataclasses.dataclass(frozen=True)
class AuditRow:
  """One line of the accuracy table (max absolute errors over the audit grid)."""
  name: str
  dtype: str
  floor: float       # exact inverse from the stored y: the unavoidable error
  error: float       # the library's f'_approx(y, bit)
  worst_x: float     # input where ``error`` is attained
  points: int
  nonfinite: int     # NaN/Inf gradients where the true one is finite
  unsound: int = 0   # inputs left out: jax.nn's own output off the true one (see audit)

  @property
  def ratio(self) -> float:
    return self.error / self.floor if self.floor > 0 else (0.0 if self.error == 0 else np.inf)


def floor_derivative64(name: str, y_stored: np.ndarray, x: np.ndarray,
                       compute_dtype=np.float32) -> np.ndarray:
  """f'(f^-1(y_stored)) with the exact float64 inverse on x's true branch.

  Rounded to ``compute_dtype``, the dtype the gradient is produced in: no answer in
  that dtype can be closer to f'(x) than the correctly rounded exact one.
  """
  y64 = np.asarray(y_stored, np.float64)
  x64 = np.asarray(x, np.float64)
  if name in NONMONOTONE:
    x_min, _ = branch_point64(name)
    g = derivative64(name, inverse64(name, y64, x64 < x_min))
    g = np.where(np.isnan(y64) & (x64 < x_min), 0.0, g)  # x = -inf: the limit
  else:
    g = _monotone_floor(name, y64, x64, np.asarray(y_stored).dtype)
  return g.astype(compute_dtype).astype(np.float64)


def _monotone_floor(name, y, x, storage_dtype):
  entry = _registry.get(name)
  with np.errstate(all="ignore"):
    if entry.bit_sees_storage:  # its bit: jax.nn's roundings in the storage dtype
      return entry.grad64(y, x, dtype=storage_dtype)
    return entry.grad64(y, x)


def audit(name: str, dtype, *, approx: Callable | None = None,
          grid: np.ndarray | None = None) -> AuditRow:
  """Floor and library error of one activation in one dtype.

  Args:
    name: a registry name (``gelu_erf``/``gelu_tanh`` for GELU).
    dtype: storage dtype of ``y`` ("float32", "bfloat16", "float16", "float64").
    approx: ``approx(y_stored, x) -> f'_approx`` as float64 numpy; defaults to the
      library's XLA implementation (``base.derivative_from_packed``).
    grid: inputs to audit (defaults to ``audit_grid``).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import base  # pylint: disable=import-outside-toplevel

  dt = _float_dtype(dtype)
  x = audit_grid(dt, name=name) if grid is None else np.asarray(grid, dt)
  op = base.Op(_registry.get(name), _registry.get(name).params)
  xj = jnp.asarray(x)
  y, packed = jax.jit(lambda x: base.XLA.forward(op, x))(xj)
  if approx is None:
    g = np.asarray(jax.jit(lambda y, p: base.derivative_from_packed(op, y, p))(y, packed),
                   np.float64)
  else:
    g = np.asarray(approx(np.asarray(y), x), np.float64)
  y_np = np.asarray(y)
  true = derivative64(name, x.astype(np.float64))
  floor_g = floor_derivative64(name, y_np, x,
                               np.float64 if dt == np.float64 else np.float32)
  sound = output_is_sound(y_np, forward64(name, x.astype(np.float64)))
  ok = np.isfinite(true) & sound
  floor_err = np.abs(floor_g - true)[ok]
  err = np.abs(g - true)[ok]
  nonfinite = int(np.sum(~np.isfinite(g[ok])))
  err_nan = np.where(np.isfinite(err), err, np.inf)
  i = int(np.argmax(err_nan))
  return AuditRow(name=name, dtype=str(np.dtype(dt).name), floor=float(np.nanmax(floor_err)),
                  error=float(err_nan[i]), worst_x=float(x.astype(np.float64)[ok][i]),
                  points=int(ok.sum()), nonfinite=nonfinite,
                  unsound=int(np.sum(np.isfinite(true) & ~sound)))
