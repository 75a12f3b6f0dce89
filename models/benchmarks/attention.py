"""Grouped-query attention two ways, forward and backward, timed side by side: the key/value
heads passed as they are (JAX's ``dot_product_attention``, cuDNN's grouped-query kernels on a
GPU) or repeated to the query heads first (multi-head attention, as Hugging Face's Llama and
the frontier's PyTorch model do before ``scaled_dot_product_attention``), and PyTorch's SDPA
both ways where torch is importable (each in a process of its own).

docs/profile.md: on an H200, llama3-1b's attention took 7.1 ms more per step in JAX (which
passes its 8 key/value heads) than in PyTorch (which repeats them to 32), the same cuDNN
kernels by name.  ``scripts/bench_attention.py`` measures whether the repeat is the
difference, at the model's shape, before any model changes.

Each row: the median time of a jitted forward + backward (``grad`` of ``sum(o * do)``), the
variants' calls interleaved round-robin so that drift hits them alike; the step's compiled
temp bytes (what the repeat costs in memory); the largest difference of the output and the
gradients from the first row's (the variants compute the same function).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

__all__ = ["Shape", "VARIANTS", "TORCH_VARIANTS", "jax_rows", "torch_rows", "markdown", "run"]

#: The JAX variants: how the key/value heads reach the attention call.
VARIANTS = ("grouped", "repeated")

#: PyTorch's: SDPA with ``enable_gqa=True`` or on ``repeat_interleave`` d heads.
TORCH_VARIANTS = ("torch grouped", "torch repeated")


@dataclasses.dataclass(frozen=True)
class Shape:
  """The attention's shape: [batch, seq, heads, head_dim] queries, ``kv_heads`` keys and
  values (a divisor of ``heads``)."""
  batch: int
  seq: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = True

  def __post_init__(self):
    if self.heads % self.kv_heads:
      raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


def _attention(variant: str, implementation: str | None) -> Callable:
  """``(q, k, v) -> o`` over [batch, seq, heads, head_dim], k and v with ``kv_heads``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def attend(q, k, v, causal):
    if variant == "repeated":
      k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation=implementation)
  return attend


def _inputs(shape: Shape, dtype):
  """Random queries, keys, values and the output's cotangent of ``shape`` in ``dtype``."""
  import jax  # pylint: disable=import-outside-toplevel
  b, t, h, kv, dh = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, dh), dtype)
  k = jax.random.normal(keys[1], (b, t, kv, dh), dtype)
  v = jax.random.normal(keys[2], (b, t, kv, dh), dtype)
  do = jax.random.normal(keys[3], (b, t, h, dh), dtype)
  return q, k, v, do


def jax_rows(shape: Shape, dtype: str, repeats: int, implementation: str | None) -> list[dict]:
  """One row per :data:`VARIANTS` entry, timed interleaved in this process.

  Args:
    shape: the attention's shape.
    dtype: the inputs' dtype name.
    repeats: timed calls per variant (the median is the row's).
    implementation: ``jax.nn.dot_product_attention``'s (``"cudnn"``, ``"xla"``, None: JAX's
      choice).

  Returns:
    ``[{"framework", "variant", "implementation", "ms", "temp_bytes", "max_diff"}]``, or a
    row with ``error`` where a variant does not compile.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  q, k, v, do = _inputs(shape, jnp.dtype(dtype))
  steps, rows = {}, []
  for variant in VARIANTS:
    attend = _attention(variant, implementation)

    def step(q, k, v, attend=attend):
      o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, shape.causal), q, k, v)
      return (o, *vjp(do))
    row = {"framework": "jax", "variant": variant, "implementation": implementation or "auto"}
    try:
      compiled = jax.jit(step).lower(q, k, v).compile()
      row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
      jax.block_until_ready(compiled(q, k, v))
      steps[variant] = compiled
    except Exception as e:  # pylint: disable=broad-except  # (cuDNN absent, a shape it refuses)
      from models.benchmarks import child  # pylint: disable=import-outside-toplevel
      row = child.error_row(e, **row)
    rows.append(row)
  from models.benchmarks import op_speed  # pylint: disable=import-outside-toplevel
  seconds = op_speed.interleaved(steps, (q, k, v), rounds=repeats, inner=1) if steps else {}
  first = None
  for row in rows:
    if row["variant"] not in steps:
      continue
    row["ms"] = 1e3 * seconds[row["variant"]]
    out = [np.asarray(a, np.float32) for a in steps[row["variant"]](q, k, v)]
    first = first or out
    row["max_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(out, first))
  return rows


def torch_measure(spec: dict) -> dict:
  """One PyTorch row (``spec``: ``shape``, ``dtype``, ``variant``, ``repeats``) on CUDA, SDPA
  held to cuDNN's kernels (what the frontier's PyTorch rows ran on the H200; an error row
  where cuDNN's SDPA does not take the variant)."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=import-outside-toplevel
  shape, variant = spec["shape"], spec["variant"]
  dev, dtype = "cuda", getattr(torch, spec["dtype"])
  b, t, h, kv, dh = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
  g = torch.Generator(device=dev).manual_seed(0)
  q, do = (torch.randn(b, h, t, dh, device=dev, dtype=dtype, generator=g) for _ in range(2))
  k, v = (torch.randn(b, kv, t, dh, device=dev, dtype=dtype, generator=g) for _ in range(2))
  for a in (q, k, v):
    a.requires_grad_(True)

  def step():
    kk, vv = k, v
    if variant == "torch repeated":
      kk, vv = (a.repeat_interleave(h // kv, dim=1) for a in (k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
      o = F.scaled_dot_product_attention(q, kk, vv, is_causal=shape["causal"],
                                         enable_gqa=variant == "torch grouped")
    o.backward(do)
  step()
  torch.cuda.synchronize()
  times = []
  for _ in range(spec["repeats"]):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
  return {"framework": "torch", "variant": variant, "implementation": "sdpa cudnn",
          "ms": 1e3 * statistics.median(times), "torch": torch.__version__}


def torch_rows(shape: Shape, dtype: str, repeats: int, timeout_s: float = 300.0) -> list[dict]:
  """:data:`TORCH_VARIANTS`, each in a process of its own; ``[]`` where torch or CUDA is not
  available."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  if not torch.cuda.is_available():
    return []
  from models.benchmarks import child  # pylint: disable=import-outside-toplevel
  # (a child that died before its row, or timed out, gives only an error: the row's key kept)
  return [{"framework": "torch", "variant": variant, "implementation": "sdpa cudnn",
           **child.run_child("models.benchmarks.attention",
                             {"shape": dataclasses.asdict(shape), "dtype": dtype,
                              "variant": variant, "repeats": repeats}, timeout_s)}
          for variant in TORCH_VARIANTS]


def markdown(data: dict) -> str:
  """The rows as a table, each row's time beside the first's."""
  meta, rows = data["meta"], data["rows"]
  s = meta["shape"]
  head = (f"`{meta['command']}` — {meta['device']}, JAX {meta['versions'].get('jax')}, "
          f"{meta['date']}; batch {s['batch']}, {s['seq']} tokens, {s['heads']} query and "
          f"{s['kv_heads']} key/value heads of {s['head_dim']}, "
          f"{'causal' if s['causal'] else 'not causal'}, {meta['dtype']}, forward + backward, "
          f"median of {meta['repeats']}:\n")
  base = next((r["ms"] for r in rows if "ms" in r), None)
  lines = ["| framework | variant | implementation | ms | vs first | temp MiB | max diff |",
           "|---|---|---|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['framework']} | {r['variant']} | {r['implementation']} | "
                   f"{r['error'][:80]} | | | |")
      continue
    temp = f"{r['temp_bytes'] / 2**20:.1f}" if "temp_bytes" in r else "—"
    diff = f"{r['max_diff']:.1e}" if "max_diff" in r else "—"
    lines.append(f"| {r['framework']} | {r['variant']} | {r['implementation']} | "
                 f"{r['ms']:.3f} | {r['ms'] / base:.2f} | {temp} | {diff} |")
  return head + "\n" + "\n".join(lines)


def run(shape: Shape, dtype: str, repeats: int, implementation: str | None, torch: bool,
        command: str) -> dict:
  """The benchmark's JSON: ``{"meta", "rows"}`` (JAX's rows, then PyTorch's where it runs;
  ``meta`` the GPU report's environment, :func:`models.benchmarks.gpu_report.environment`)."""
  from models.benchmarks import gpu_report  # pylint: disable=import-outside-toplevel
  rows = jax_rows(shape, dtype, repeats, implementation)
  if torch:
    rows += torch_rows(shape, dtype, repeats)
  meta = {**gpu_report.environment(), "shape": dataclasses.asdict(shape), "dtype": dtype,
          "repeats": repeats, "command": command}
  return {"meta": meta, "rows": rows}


if __name__ == "__main__":
  from models.benchmarks import child as _child  # pylint: disable=import-outside-toplevel
  _child.child_main(torch_measure, lambda spec: {"framework": "torch",
                                                 "variant": spec.get("variant"),
                                                 "implementation": "sdpa cudnn"})
