"""The LM head benchmark (issue 40): the plain head against the chunked ones, side by side.

For one head (tokens ``x`` [N, d], weight [d, V], integer labels), each variant's
``value_and_grad`` of the mean loss w.r.t. ``x`` and the weight is compiled and measured:
compiled temp bytes (and whether a [N, V] buffer exists in the compiled program), median wall
time over repeats, and the gradient's relative L2 distance to a float64 reference.

Variants: ``plain`` (``x @ w`` then optax's integer-label cross-entropy: what users write),
``invact_jax`` (:func:`invact_jax.linear_cross_entropy`), ``invact_jax.invert(plain)`` (the
conversion finding the pattern in the plain code), and where installed, tokamax's
``linear_softmax_cross_entropy_loss`` (``chunked_xla`` and ``xla``).  PyTorch + Liger-Kernel's
fused linear cross-entropy runs on a GPU in its own process (``torch_rows``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import invact_jax

__all__ = ["Head", "VARIANTS", "make_head", "measure", "rows", "torch_rows", "tile_variants"]


@dataclasses.dataclass(frozen=True)
class Head:
  """One LM head: ``x`` [N, d], ``w`` [d, V], ``labels`` [N]."""
  x: Any
  w: Any
  labels: Any

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.x.shape[0], self.x.shape[1], self.w.shape[1])


def make_head(tokens: int, d: int, vocab: int, dtype, seed: int = 0) -> Head:
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (tokens, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, vocab), jnp.float32) / np.sqrt(d)).astype(dtype)
  return Head(x, w, jax.random.randint(k[2], (tokens,), 0, vocab, jnp.int32))


def plain(x, w, labels):
  """What users write: logits in the inputs' dtype, the loss in float32 (optax)."""
  logits = (x @ w).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def ours(x, w, labels):
  return invact_jax.linear_cross_entropy(x, w, labels)


def _tokamax(implementation: str) -> Callable | None:
  if importlib.util.find_spec("tokamax") is None:
    return None
  import tokamax  # pylint: disable=import-outside-toplevel
  fn = getattr(tokamax, "linear_softmax_cross_entropy_loss", None)
  if fn is None:
    return None

  def loss(x, w, labels):
    return fn(x, labels, w, reduction="mean", implementation=implementation)
  return loss


def tile_variants(tiles) -> dict[str, Callable]:
  """Per ``(tokens, vocabulary entries)`` in ``tiles``, ``"invact_jax tile TxV"``:
  :func:`invact_jax.linear_cross_entropy` with that tile (the sweep that picks a device's
  default)."""
  return {f"invact_jax tile {t}x{v}": functools.partial(
      invact_jax.linear_cross_entropy, chunk_size=t, vocab_chunk_size=v) for t, v in tiles}


def variants() -> dict[str, Callable]:
  """name -> loss(x, w, labels), those that can run here."""
  out = {"plain": plain, "invact_jax": ours, "invact_jax.invert(plain)": invact_jax.invert(plain)}
  for impl in ("chunked_xla", "xla"):
    fn = _tokamax(impl)
    if fn is not None:
      out[f"tokamax {impl}"] = fn
  return out


VARIANTS = ("plain", "invact_jax", "invact_jax.invert(plain)", "tokamax chunked_xla",
            "tokamax xla")


def _has_logits_buffer(text: str, n: int, v: int) -> bool:
  for m in re.findall(r"\[([\d,]+)\]", text):
    dims = [int(d) for d in m.split(",") if d]
    if n in dims and v in dims:
      return True
  return False


def measure(name: str, loss: Callable, head: Head, repeats: int, g64=None) -> dict:
  """One row: compiled temp, a [N, V] buffer or not, median time, gradient error."""
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  try:
    compiled = step.lower(head.x, head.w, head.labels).compile()
  except Exception as e:  # pylint: disable=broad-except  (a variant that does not lower here)
    return {"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  n, _, v = head.shape
  value, grads = compiled(head.x, head.w, head.labels)
  jax.block_until_ready(grads)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(head.x, head.w, head.labels))
    times.append(time.perf_counter() - t0)
  row = {"variant": name, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
         "logits_buffer": _has_logits_buffer(compiled.as_text(), n, v),
         "time_s": statistics.median(times), "loss": float(value)}
  if g64 is not None:
    num = sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2)) for a, b in zip(grads, g64))
    den = sum(float(np.sum(b ** 2)) for b in g64)
    row["grad_error"] = (num / den) ** 0.5
  return row


def reference_grads(head: Head):
  """float64 gradients of the plain formula (x64)."""
  with jax.enable_x64(True):
    x, w = (np.asarray(a, np.float64) for a in (head.x, head.w))
    g = jax.jit(jax.grad(lambda x, w: invact_jax.linear_cross_entropy_reference(
        x, w, head.labels), argnums=(0, 1)))(x, w)
    return [np.asarray(a, np.float64) for a in g]


def torch_rows(head: Head, dtype: str, repeats: int, timeout_s: float = 600.0,
               variants=None) -> list[dict]:
  """PyTorch's rows on the same head (:mod:`models.experiments.lm_head_torch`), one process
  each; ``[]`` where torch is not importable.

  Args:
    head: the head the JAX rows measured (saved once to a temporary ``.npz``).
    dtype: "float32" or "bfloat16".
    repeats: timed steps per row (the median is reported).
    timeout_s: seconds each row may take.
    variants: names from ``lm_head_torch.VARIANTS`` (``None``: all).

  Returns:
    One row per variant (``framework`` "torch"), or one with ``error``.
  """
  import tempfile  # pylint: disable=import-outside-toplevel
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  from models.experiments import lm_head_torch  # pylint: disable=import-outside-toplevel
  if not lm_head_torch.importable():
    return []
  n, d, v = head.shape
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/head.npz"
    np.savez(path, x=np.asarray(head.x, np.float32), w=np.asarray(head.w, np.float32),
             labels=np.asarray(head.labels))
    for name in variants or lm_head_torch.VARIANTS:
      spec = {"path": path, "variant": name, "dtype": dtype, "repeats": repeats}
      row = cli.run_child("models.experiments.lm_head_torch", spec, timeout_s)
      out.append({"dtype": dtype, "tokens": n, "d": d, "vocab": v, "framework": "torch",
                  **row, "variant": name})
  return out


def rows(tokens: int, d: int, vocab: int, dtypes=("float32",), repeats: int = 5,
         names=None, torch: bool = True, tiles=()) -> list[dict]:
  """Every variant in ``names`` (None: all) and every tile of ``tiles``
  (:func:`tile_variants`) on one head per dtype; with ``torch``,
  PyTorch's rows on the same head where torch is importable.  ``temp_vs_plain`` and
  ``time_vs_plain`` are against the plain head of the same framework and dtype."""
  out = []
  for dtype in dtypes:
    head = make_head(tokens, d, vocab, jnp.dtype(dtype))
    if torch:  # first, while this process holds little of the device's memory
      out += torch_rows(head, jnp.dtype(dtype).name, repeats)
    g64 = reference_grads(head)
    losses = {k: f for k, f in variants().items() if names is None or k in names}
    for name, loss in {**losses, **tile_variants(tiles)}.items():
      row = measure(name, loss, head, repeats, g64)
      out.append({"dtype": jnp.dtype(dtype).name, "tokens": tokens, "d": d, "vocab": vocab,
                  "framework": "jax", **row})
    del g64
  for r in out:
    base = next((b for b in out if b["dtype"] == r["dtype"] and b["framework"] == r["framework"]
                 and b["variant"].endswith("plain") and "error" not in b), None)
    if base is not None and "temp_bytes" in r and "temp_bytes" in base:
      r["temp_vs_plain"] = r["temp_bytes"] / base["temp_bytes"]
    if base is not None and "time_s" in r:
      r["time_vs_plain"] = r["time_s"] / base["time_s"]
  return out


def table(rs: list[dict]) -> str:
  """The rows as a Markdown table ("vs plain": against the same framework's plain head; temp:
  XLA's compiled temp for JAX, the allocator's peak over the resident inputs and gradients for
  torch on a GPU)."""
  lines = ["| dtype | variant | temp MiB | vs plain | [N, V] buffer | time (s) | vs plain | "
           "grad error vs float64 |", "|---|---|---:|---:|---|---:|---:|---:|"]
  nan = float("nan")
  for r in rs:
    if "error" in r:
      lines.append(f"| {r['dtype']} | {r['variant']} | — | — | — | — | — | {r['error']} |")
      continue
    temp = (f"{r['temp_bytes'] / 2**20:.1f} | {100 * r.get('temp_vs_plain', nan):.1f} % | "
            f"{'yes' if r['logits_buffer'] else 'no'}" if "temp_bytes" in r else "— | — | —")
    lines.append(
        f"| {r['dtype']} | {r['variant']} | {temp} | {r['time_s']:.3f} | "
        f"{r.get('time_vs_plain', nan):.2f} | {r.get('grad_error', nan):.1e} |")
  return "\n".join(lines)
