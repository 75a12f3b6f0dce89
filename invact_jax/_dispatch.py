"""``implementation=`` dispatch for the inverted activations (tokamax-style).

A backend turns an :class:`~invact_jax._activations.ActivationSpec` into a forward
``x -> (y, packed_mask)`` and a backward ``(y, packed_mask, dy) -> dx``.  All
backends share the mask layout of :mod:`invact_jax._bitpack`, so residuals are
interchangeable.

* ``"xla"``: plain jnp (fused by XLA), every platform.
* ``"pallas"``: the fused kernels of :mod:`pallas_kernels` (Triton on GPU; on
  other platforms they run in Pallas interpret mode, for testing).
* ``"triton"``: the jax-triton kernels (GPU with the optional ``jax-triton``).
* ``None``: XLA for now on every platform (bit-identical to ``jax.nn``); it will pick the
  kernels on GPU once measurements there show them faster.
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
  block_rows: int | None = None  # kernel block height = mask bytes per program (None: heuristic)

  def forward(self, spec, x):
    if self.name == "xla":
      return spec.forward_and_mask(x)
    return _kernel_forward(self, spec, x)

  def backward(self, spec, y, packed, dy, *, guard):
    if self.name == "xla":
      bits = None if packed is None else _bitpack.unpack_bits(packed, y.shape)
      g = guard(spec.derivative(y, bits))
      return (dy.astype(g.dtype) * g).astype(dy.dtype)
    return _kernel_backward(self, spec, y, packed, dy)


def first_order_message(name: str) -> str:
  return (f"invact_jax.{name}: higher-order derivatives are not supported. Its backward pass "
          "reconstructs f'(x) from the stored output y (that is what saves the memory), and "
          "the derivative of that reconstruction is not the second derivative of the "
          f"activation. Use invact_jax.{name}_reference (jax.nn) where you need "
          "second derivatives (e.g. Hessians); forward-mode jax.jvp is not supported either.")


# Kernels are not differentiable; only higher-order differentiation reaches them (the
# custom_vjp never differentiates its fwd/bwd at first order), so say why it is refused.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_forward(backend, spec, x):
  return _kernels(backend.name).forward(spec, x, interpret=backend.interpret,
                                        block_rows=backend.block_rows)


@_kernel_forward.defjvp
def _kernel_forward_jvp(backend, spec, primals, tangents):
  del backend, primals, tangents
  raise NotImplementedError(first_order_message(spec.name))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_backward(backend, spec, y, packed, dy):
  return _kernels(backend.name).backward(spec, y, packed, dy, interpret=backend.interpret,
                                         block_rows=backend.block_rows)


@_kernel_backward.defjvp
def _kernel_backward_jvp(backend, spec, primals, tangents):
  del backend, primals, tangents
  raise NotImplementedError(first_order_message(spec.name))


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
    if importlib.util.find_spec("pallas_kernels") is None:
      return False, "the pallas_kernels package is not installed"
    return True, "" if _platform() == "gpu" else "interpret mode (no GPU)"
  if name == "triton":
    if _platform() != "gpu":
      return False, f"jax-triton needs a CUDA GPU, the default backend is {_platform()!r}"
    if importlib.util.find_spec("jax_triton") is None:
      return False, "jax-triton is not installed (pip install 'invact-jax[triton]')"
    return True, ""
  raise ValueError(name)


def resolve(implementation, spec, x, *, block_rows: int | None = None) -> Backend:
  """Backend for ``implementation`` (see module doc); raises on an unusable choice."""
  del spec, x
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"argument `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation is None:
    # XLA everywhere until GPU measurements show the kernels faster (README, issue 8): the
    # XLA path is bit-identical to jax.nn, and XLA already fuses both passes.
    return Backend("xla")
  ok, why = available(implementation)
  if not ok:
    raise RuntimeError(f"implementation={implementation!r} cannot run here: {why}")
  interpret = implementation == "pallas" and _platform() != "gpu"
  return Backend(implementation, interpret=interpret, block_rows=block_rows)
