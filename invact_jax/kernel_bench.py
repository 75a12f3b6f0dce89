"""Timing of the activation backends: forward, backward, forward+backward and achieved GB/s.

The logic behind ``scripts/bench_kernels.py``.  For each size and dtype it times, with
jitted functions and ``block_until_ready``, the median over ``repeats`` runs of

* ``jax.nn``: forward, and forward+backward via :func:`jax.vjp` (keeps x);
* each available ``invact_jax`` implementation ("xla", "pallas", ...): forward (y and the
  packed mask), backward from (y, mask, dy), and forward+backward;
* a device copy (``-x``), the bandwidth reference: the issue's target is kernels at
  >= 85 % of it for >= 2^24 elements.

Bytes moved are the minimum each pass must touch (bf16 forward: 2 + 2 + 1/8 bytes per
element; backward: 2 + 1/8 + 2 + 2), so GB/s is comparable with the copy's.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from invact_jax import _activations
from invact_jax import _dispatch

__all__ = ["Row", "measure", "table", "ACTIVATIONS"]

ACTIVATIONS = {
    "gelu_tanh": (_activations.GELU_TANH, lambda x: jax.nn.gelu(x, approximate=True)),
    "gelu_erf": (_activations.GELU_ERF, lambda x: jax.nn.gelu(x, approximate=False)),
    "silu": (_activations.SILU, jax.nn.silu),
    "tanh": (_activations.TANH, jnp.tanh),
}


@dataclasses.dataclass(frozen=True)
class Row:
  activation: str
  implementation: str  # "jax.nn", "xla", "pallas", "copy"
  dtype: str
  elements: int
  pass_: str  # "fwd", "bwd", "fwd+bwd"
  seconds: float
  bytes: int

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["pass"] = d.pop("pass_")
    d["gbps"] = self.gbps
    return d


def _time(fn: Callable, args, repeats: int) -> float:
  out = fn(*args)
  jax.block_until_ready(out)  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure(*, activation: str = "gelu_tanh", sizes: Sequence[int] = (1 << 20,),
            dtypes: Sequence[str] = ("float32", "bfloat16"),
            implementations: Sequence[str] = ("xla", "pallas"), repeats: int = 20,
            progress: Callable[[str], None] | None = None) -> list[Row]:
  """Rows for every (size, dtype, implementation, pass); unavailable backends are skipped."""
  if activation not in ACTIVATIONS:
    raise ValueError(f"argument `activation` must be one of {sorted(ACTIVATIONS)}, "
                     f"got {activation!r}")
  spec, nn_fn = ACTIVATIONS[activation]
  rows = []
  for n in sizes:
    if n < 8 or n % 8:
      raise ValueError(f"argument `sizes`: every size must be a positive multiple of 8, got {n}")
    for dt in dtypes:
      dtype = jnp.dtype(dt)
      item = dtype.itemsize
      mask = n // 8 if spec.bit is not None else 0
      x = jax.random.normal(jax.random.key(0), (n // 1024 or 1, min(n, 1024)), dtype)
      dy = jax.random.normal(jax.random.key(1), x.shape, dtype)

      def add(impl, pass_, fn, args, nbytes):
        if progress:
          progress(f"{activation} {impl:7s} {dt:8s} 2^{n.bit_length() - 1} {pass_}")
        rows.append(Row(activation, impl, dt, n, pass_, _time(fn, args, repeats), nbytes))

      add("copy", "fwd", jax.jit(lambda x: -x), (x,), 2 * n * item)
      add("jax.nn", "fwd", jax.jit(nn_fn), (x,), 2 * n * item)
      add("jax.nn", "fwd+bwd", jax.jit(lambda x, dy: jax.vjp(nn_fn, x)[1](dy)), (x, dy),
          4 * n * item)  # x, dy in; y, dx out: the least any fused pair can move
      for impl in implementations:
        if not _dispatch.available(impl)[0]:
          continue
        backend = _dispatch.resolve(impl)
        fwd = jax.jit(lambda x, b=backend: b.forward(spec, x))
        y, m = fwd(x)
        bwd = jax.jit(lambda y, m, dy, b=backend: b.backward(spec, y, m, dy, guard=lambda g: g))
        op = _activations._Bound(spec, backend)  # pylint: disable=protected-access
        both = jax.jit(lambda x, dy, op=op: jax.vjp(
            lambda x: _activations._inverted(op, x), x)[1](dy))  # pylint: disable=protected-access
        add(impl, "fwd", fwd, (x,), 2 * n * item + mask)
        add(impl, "bwd", bwd, (y, m, dy), 3 * n * item + mask)
        add(impl, "fwd+bwd", both, (x, dy), 4 * n * item + 2 * mask)
  return rows


def table(rows: Sequence[Row]) -> str:
  """Markdown table: time (ms) and GB/s per row, with the copy and jax.nn side by side."""
  lines = ["| activation | dtype | elements | implementation | pass | ms | GB/s |",
           "|---|---|---:|---|---|---:|---:|"]
  for r in rows:
    lines.append(f"| {r.activation} | {r.dtype} | 2^{r.elements.bit_length() - 1} | "
                 f"{r.implementation} | {r.pass_} | {r.seconds * 1e3:.3f} | {r.gbps:.1f} |")
  return "\n".join(lines)
