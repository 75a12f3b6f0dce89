"""Pallas backend of the inverted activations: adapts an activation spec to the kernels.

The spec is duck-typed (this package never imports ``invact_jax``): it provides
``kernel_forward(x, **kwargs)`` (the forward on a tile), ``bit(x_f32, **kwargs)`` or None,
``grad_from_output(y, bits, **kwargs)``, ``kwargs`` and ``compute_dtype(dtype)``.
"""
from __future__ import annotations

import functools

from pallas_kernels import elementwise

__all__ = ["forward", "backward"]


def forward(spec, x, *, interpret: bool = False, block_rows: int | None = None):
  kw = spec.kwargs
  f = functools.partial(spec.kernel_forward, **kw)
  bit = None if spec.bit is None else functools.partial(spec.bit, **kw)
  return elementwise.forward(f, bit, x, compute_dtype=spec.compute_dtype(x.dtype),
                             block_rows=block_rows, interpret=interpret)


def backward(spec, y, packed, dy, *, interpret: bool = False, block_rows: int | None = None):
  g = functools.partial(spec.grad_from_output, **spec.kwargs)
  return elementwise.backward(g, y, packed, dy, compute_dtype=spec.compute_dtype(y.dtype),
                              block_rows=block_rows, interpret=interpret)
