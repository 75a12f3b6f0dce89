"""Public dropout that keeps a packed bit mask, or nothing but the key, for the backward."""
from __future__ import annotations

from typing import Literal, get_args

import jax
from jax.typing import ArrayLike

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.dropout import base

__all__ = ["dropout", "dropout_reference", "MODES"]

#: How this op can run: XLA only (no kernels).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {"xla": _implementation.XLA}
#: What the backward keeps: the key (the mask drawn again) or the mask as bits.
Mode = Literal["regenerate", "bits"]
MODES: tuple[str, ...] = get_args(Mode)

Array = jax.Array
ImplementationLike = _implementation.ImplementationLike


def _rate(fn, rate) -> float:
  r = _common.static_scalar(fn, "rate", rate)
  if not 0.0 <= r < 1.0:
    raise ValueError(f"invact_jax.{fn}: argument `rate` must be in [0, 1), got {r}")
  return r


def _key(fn, key):
  if key is not None and not (hasattr(key, "dtype") and (
      jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == "uint32")):
    raise TypeError(f"invact_jax.{fn}: argument `key` must be a JAX PRNG key or None, got "
                    f"{type(key).__name__}")
  return key


def dropout(x: ArrayLike, rate: float, key: jax.Array | None, *, mode: Mode = "regenerate",
            implementation: ImplementationLike = None) -> Array:
  """Dropout scaled at training time (keep with prob. ``1 - rate``, scale by ``1/(1 - rate)``).

  Same mask as :func:`dropout_reference` for the same key.  ``mode="regenerate"`` keeps
  nothing but the key; ``"bits"`` keeps the mask packed 8 per byte.  ``key=None`` or
  ``rate=0`` is the identity.  ``rate`` must be a static number (the backward is
  specialised on it).

  Args:
    x: floating-point array.
    rate: the probability of dropping an element, in [0, 1) (a static number).
    key: a JAX PRNG key, or None (the identity).
    mode: "regenerate" (keep the key, redraw the mask in the backward) or "bits" (keep the
      mask, 8 elements per byte).
    implementation: None / "xla" (dropout has no kernels).

  Returns:
    ``x`` with the dropped elements zero and the kept ones scaled by ``1 / (1 - rate)``.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> y = invact_jax.dropout(jnp.ones(8), 0.5, jax.random.key(0))
    >>> bool(jnp.all((y == 0) | (y == 2)))
    True
  """
  if mode not in MODES:
    raise ValueError(f"invact_jax.dropout: argument `mode` must be one of {MODES}, got {mode!r}")
  r = _rate("dropout", rate)
  x = _common.float_array("dropout", "x", x)
  key = _key("dropout", key)
  _implementation.resolve(implementation, op="dropout", implementations=IMPLEMENTATIONS,
                         options=())
  if key is None or r == 0.0:
    return x
  return base.dropout(r, mode, x, key)


def dropout_reference(x: ArrayLike, rate: float, key: jax.Array | None) -> Array:
  """``jnp.where(bernoulli(key), x / (1 - rate), 0)`` with JAX's autodiff (keeps a bool mask).

  Args:
    x, rate, key: as for :func:`dropout`.

  Returns:
    What :func:`dropout` returns for the same key.
  """
  r = _rate("dropout_reference", rate)
  if _key("dropout_reference", key) is None or r == 0.0:
    return x
  return base.scale_kept(x, base.keep_mask(key, r, x.shape), r)
