"""Triton implementation of the inverted activations: the raw Triton kernels of
:mod:`pallas_kernels.triton_elementwise` (called through ``jax_triton.triton_call``), whose
bodies are generated from the same tile math as the XLA path and the Pallas kernels.

The binding (per-shard partitioning, batching, the first-order guard, approximate PTX
instructions for 16-bit outputs, symbolic shapes) is the Pallas one, inherited: only the
kernel module differs.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from invact_jax.ops.activations import pallas

__all__ = ["TritonActivation", "kernel_sources"]


@dataclasses.dataclass(frozen=True)
class TritonActivation(pallas.PallasActivation):
  """Raw Triton kernels through jax-triton (a CUDA GPU; Triton's interpreter for tests)."""
  name: ClassVar[str] = "triton"

  def kernels(self):
    from pallas_kernels import triton_elementwise  # pylint: disable=import-outside-toplevel
    return triton_elementwise


def kernel_sources(op, dtype, *, rows: int = 4096, cols: int = 1024) -> dict:
  """The generated forward and backward kernels of ``op`` for a ``[rows, cols]`` array of
  ``dtype`` as compiled on a GPU (approximate PTX ops for 16-bit outputs):
  ``{"forward"|"backward": (name, source, signature, constexprs, bytes per element)}``, for
  :func:`pallas_kernels.triton_elementwise.compile_for` (tests, ``scripts/sass_roofline.py``)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pallas_kernels import elementwise  # pylint: disable=import-outside-toplevel
  from pallas_kernels import triton_elementwise as te  # pylint: disable=import-outside-toplevel
  from pallas_kernels import triton_source  # pylint: disable=import-outside-toplevel
  from invact_jax.ops import _common  # pylint: disable=import-outside-toplevel
  dt = jnp.dtype(dtype)
  cdt = _common.compute_dtype(dt)
  m = rows * (-(-cols // 8))
  bit = op.bit if op.has_bit else None
  fwd = te.forward_source(op.kernel_forward, bit, dt, m=m, n=cols, n8=-(-cols // 8) * 8)

  def g(y, b=None):
    return op.derivative(y, b, approx_ops=elementwise.ApproxOps)
  bwd = te.backward_source(g if op.has_bit else (lambda y: g(y)), dt, dt, cdt, op.has_bit, m=m)
  ptr = triton_source.pointer_type(dt)
  mask = {"m_ptr": triton_source.pointer_type(jnp.uint8)} if op.has_bit else {}
  const = {"M": m, "BR": elementwise.block_rows_for(dt, m)}
  sizes = {"M": "constexpr", "BR": "constexpr"}
  return {"forward": (*fwd, {"x_ptr": ptr, "y_ptr": ptr, **mask, **sizes}, const,
                      2 * dt.itemsize + (1 / 8 if op.has_bit else 0)),
          "backward": (*bwd, {"y_ptr": ptr, **mask, "dy_ptr": ptr, "dx_ptr": ptr, **sizes}, const,
                       3 * dt.itemsize + (1 / 8 if op.has_bit else 0))}
