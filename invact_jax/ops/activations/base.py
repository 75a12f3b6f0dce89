"""The XLA implementation of the inverted activations: a ``jax.custom_vjp`` per op.

The forward is ``jax.nn``'s function, bit for bit; the residuals are the output ``y`` and,
where the registry says the activation keeps a branch bit, the bit mask packed 8 per byte
(:mod:`invact_jax.bitpack`).  The backward computes ``dy * f'(f^-1(y))`` from them
(:mod:`.math`).  This is also the reference the kernels are tested against; the
``<name>_reference`` functions are ``jax.nn``'s with JAX's own autodiff.

Each implementation (:class:`XlaActivation` here, ``pallas.PallasActivation``,
``triton.TritonActivation``) has the same two methods, ``forward(op, x) -> (y, packed)`` and
``backward(op, y, packed, dy) -> dx``, with the same mask layout, so residuals are
interchangeable; :func:`apply` is the ``custom_vjp`` they share.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from invact_jax import bitpack
from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.activations.registry import Activation


@dataclasses.dataclass(frozen=True)
class Op:
  """An activation with its parameters bound: what the custom_vjp and kernels run."""
  activation: Activation
  params: tuple[tuple[str, float], ...] = ()

  @property
  def name(self) -> str:
    return self.activation.name

  @property
  def public(self) -> str:
    return self.activation.public

  @property
  def kwargs(self) -> dict[str, float]:
    return dict(self.params)

  @property
  def has_bit(self) -> bool:
    return self.activation.keeps_bit(**self.kwargs)

  def forward(self, x):
    """``jax.nn``'s forward."""
    a = self.activation
    return a.original(x, **dict(a.selector), **self.kwargs)

  def kernel_forward(self, x):
    """The forward on a kernel tile: 16-bit inputs computed in float32 and rounded once
    (Triton lacks several bf16/f16 elementwise lowerings; XLA on GPU fuses the same way)."""
    a = self.activation
    f = self.forward if a.kernel_forward is None else functools.partial(a.kernel_forward,
                                                                         **self.kwargs)
    if x.dtype in (jnp.bfloat16, jnp.float16):
      return f(x.astype(jnp.float32)).astype(x.dtype)
    return f(x)

  def bit(self, x):
    """The branch bit of ``x`` in its storage dtype: compared in the compute dtype (exact),
    or, for an activation whose bit depends on jax.nn's roundings, in the storage dtype."""
    a = self.activation
    if a.bit_sees_storage:
      return a.bit(x, **self.kwargs)
    xc = x.astype(_common.compute_dtype(x.dtype))
    if a.nonmonotone:
      return xc < jnp.asarray(a.threshold(xc.dtype), xc.dtype)
    return a.bit(xc, **self.kwargs)

  def derivative(self, y, bits, *, approx_ops=None):
    """f'(x) in the compute dtype from the stored output and the unpacked bits.

    ``approx_ops``: a kernel's approximate sqrt/log/divide, for fits of 16-bit outputs."""
    yc = y.astype(_common.compute_dtype(y.dtype))
    if self.activation.nonmonotone:  # the fit depends on the storage dtype
      return self.activation.grad(yc, bits, storage_dtype=y.dtype, approx_ops=approx_ops,
                                  **self.kwargs)
    return self.activation.grad(yc, bits, **self.kwargs)


# --------------------------------------------------------------- the XLA implementation
def packed_bits(op: Op, x):
  """The branch bits of ``x`` packed 8 per byte, or None where ``op`` keeps none."""
  if not op.has_bit:
    return None
  return bitpack.pack_bits(op.bit(x))


def derivative_from_packed(op: Op, y, packed):
  """f'(x) in the compute dtype from ``y`` and the packed bits (the XLA backward's math)."""
  bits = None if packed is None else bitpack.unpack_bits(packed, y.shape)
  return op.derivative(y, bits)


@dataclasses.dataclass(frozen=True)
class XlaActivation(_implementation.ImplementationBase):
  """Plain jnp, fused by XLA: the reference the kernels are tested against.

  Every implementation of this family has these two methods, with the same mask layout."""

  def forward(self, op: Op, x):
    """``(y, packed bits or None)``: jax.nn's forward and the bit mask, fused by XLA."""
    return op.forward(x), packed_bits(op, x)

  def backward(self, op: Op, y, packed, dy):
    """``dx = dy * f'(f^-1(y))`` from the kept output and bits."""
    bits = None if packed is None else bitpack.unpack_bits(packed, y.shape)
    if op.activation.piecewise_linear:  # exact to every order: f'' = 0 a.e.
      g = op.derivative(y, bits)
    else:
      g = _common.first_order_only(op.public, op.derivative, y, bits)
    return (dy.astype(g.dtype) * g).astype(dy.dtype)


#: The XLA implementation (``IMPLEMENTATIONS["xla"]``).
XLA = XlaActivation()


# -------------------------------------------------------------------- the custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def apply(op: Op, implementation: _implementation.ImplementationBase, x):
  """``op``'s forward, keeping y (+ bits) for a backward computed by ``implementation``.

  The primal and the fwd rule run the same implementation's forward, so ``f(x)`` and
  ``jax.vjp(f, x)[0]`` agree bit for bit on every implementation (the kernels compute
  16-bit inputs in float32 and round once, which can differ from ``jax.nn``'s per-op
  rounding by an ulp).
  """
  if implementation.name == "xla":
    return op.forward(x)
  return implementation.forward(op, x)[0]


def _apply_fwd(op, implementation, x):
  y, packed = implementation.forward(op, x)
  return y, (y, packed)


def _apply_bwd(op, implementation, res, dy):
  # (read as they are, not through _common.read_apart: in the project's models on XLA:CPU
  # that raised the step's temp, ViT-Ti/16 by 2.3 % and Llama-small by 1.2 %; the norms'
  # and invert's units keep it, where it lowers the temp: _common.read_apart)
  y, packed = res
  return (implementation.backward(op, y, packed, dy),)


apply.defvjp(_apply_fwd, _apply_bwd)
