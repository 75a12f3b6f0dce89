"""``implementation=`` dispatch for the inverted activations (tokamax-style).

A backend turns an :class:`~invact_jax._activations.ActivationSpec` into a forward
``x -> (y, packed_mask)`` and a backward ``(y, packed_mask, dy) -> dx``.  All
backends share the mask layout of :mod:`invact_jax._bitpack`, so residuals are
interchangeable.

* ``"xla"``: plain jnp (fused by XLA), every platform.
* ``"pallas"``: the fused kernels of :mod:`pallas_kernels` (Triton on GPU; on
  other platforms they run in Pallas interpret mode, for testing).
* ``"triton"``: the jax-triton kernels (GPU with the optional ``jax-triton``).
* ``None``: XLA on every platform for now (see ``available``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp

from invact_jax import _bitpack

__all__ = ["Backend", "IMPLEMENTATIONS", "resolve", "available"]

IMPLEMENTATIONS = (None, "xla", "pallas", "triton")


@dataclasses.dataclass(frozen=True)
class Backend:
  """Static (hashable) description of how to run one activation."""
  name: str = "xla"
  interpret: bool = False
  block_bytes: int | None = None  # packed-mask bytes per kernel program (None: heuristic)

  def forward(self, spec, x):
    if self.name == "xla":
      return spec.forward_and_mask(x)
    return _kernels(self.name).forward(spec, x, interpret=self.interpret,
                                       block_bytes=self.block_bytes)

  def backward(self, spec, y, packed, dy, *, guard):
    if self.name == "xla":
      bits = None if packed is None else _bitpack.unpack_bits(packed, y.shape)
      g = guard(spec.derivative(y, bits))
      return (dy.astype(g.dtype) * g).astype(dy.dtype)
    return _kernels(self.name).backward(spec, y, packed, dy, guard=guard,
                                        interpret=self.interpret, block_bytes=self.block_bytes)


def _kernels(name):
  if name == "pallas":
    from pallas_kernels import activations  # pylint: disable=import-outside-toplevel
    return activations
  if name == "triton":
    from pallas_kernels import triton_activations  # pylint: disable=import-outside-toplevel
    return triton_activations
  raise ValueError(name)


def _platform() -> str:
  return jax.default_backend()


@functools.lru_cache(maxsize=None)
def available(name: str) -> tuple[bool, str]:
  """Whether backend ``name`` can run on this platform, and why not."""
  if name == "xla":
    return True, ""
  if name == "pallas":
    # The fused kernels are in progress (branch wip/pallas-kernels): not offered until they
    # match the XLA path and work under autodiff, rather than half-working.
    return False, ("the Pallas kernels are not available yet (in progress); "
                   "use implementation='xla' (the default)")
  if name == "triton":
    if _platform() != "gpu":
      return False, f"jax-triton needs a CUDA GPU, the default backend is {_platform()!r}"
    if importlib.util.find_spec("jax_triton") is None:
      return False, "jax-triton is not installed (pip install 'invact-jax[triton]')"
    return True, ""
  raise ValueError(name)


def resolve(implementation, spec, x, *, block_bytes: int | None = None) -> Backend:
  """Backend for ``implementation`` (see module doc); raises on an unusable choice."""
  del spec, x
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"argument `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation is None:
    # XLA on every platform until GPU-measured kernels are faster: bit-identical to jax.nn.
    return Backend("xla")
  ok, why = available(implementation)
  if not ok:
    raise RuntimeError(f"implementation={implementation!r} cannot run here: {why}")
  interpret = implementation == "pallas" and _platform() != "gpu"
  return Backend(implementation, interpret=interpret, block_bytes=block_bytes)
