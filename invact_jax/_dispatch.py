"""``implementation=`` dispatch for the inverted activations (tokamax-style).

A backend turns an :class:`~invact_jax._activations.ActivationSpec` into a forward
``x -> (y, packed_mask)`` and a backward ``(y, packed_mask, dy) -> dx``; every backend
shares the mask layout of :mod:`invact_jax._bitpack`, so residuals are interchangeable.

* ``"xla"``: plain jnp, fused by XLA, every platform; bit-identical forward to ``jax.nn``.
* ``"pallas"``, ``"triton"``: the fused GPU kernels, in progress; asking for them raises a
  ``RuntimeError`` that says so (see :func:`available`).
* ``None``: the fastest backend that runs here — XLA on every platform for now.
"""
from __future__ import annotations

import dataclasses

from invact_jax import _bitpack

__all__ = ["Backend", "IMPLEMENTATIONS", "resolve", "available"]

IMPLEMENTATIONS = (None, "xla", "pallas", "triton")

_UNAVAILABLE = {
    "pallas": "the fused Pallas kernels are not available yet (in progress)",
    "triton": "the jax-triton kernels are not available yet (in progress)",
}


@dataclasses.dataclass(frozen=True)
class Backend:
  """Static (hashable) description of how to run one activation: the XLA path."""
  name: str = "xla"

  def forward(self, spec, x):
    return spec.forward_and_mask(x)

  def backward(self, spec, y, packed, dy, *, guard):
    bits = None if packed is None else _bitpack.unpack_bits(packed, y.shape)
    g = guard(spec.derivative(y, bits))
    return (dy.astype(g.dtype) * g).astype(dy.dtype)


def available(name: str) -> tuple[bool, str]:
  """Whether backend ``name`` can run here, and if not, why."""
  if name == "xla":
    return True, ""
  if name in _UNAVAILABLE:
    return False, _UNAVAILABLE[name] + "; use implementation='xla' (the default)"
  raise ValueError(name)


def resolve(implementation) -> Backend:
  """Backend for ``implementation`` (see module doc); raises on an unusable choice."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"argument `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation is not None:
    ok, why = available(implementation)
    if not ok:
      raise RuntimeError(f"implementation={implementation!r} cannot run here: {why}")
  return Backend("xla")

