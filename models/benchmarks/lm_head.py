"""The LM head benchmark: the plain head against the chunked ones, side by side.

For one head (tokens ``x`` [N, d], weight [d, V], integer labels), each head's
``value_and_grad`` of the mean loss w.r.t. ``x`` and the weight is compiled and measured:
compiled temp bytes (and whether a [N, V] buffer exists in the compiled program), the median
wall time over repeats (every head's steps interleaved, round after round, so that a
slower or faster stretch of the machine falls on all of them), and the gradient's relative L2
distance to a float64 reference.

Variants: ``plain`` (``x @ w`` then optax's integer-label cross-entropy: what users write),
``invact_jax`` (:func:`invact_jax.linear_cross_entropy`, gradients in the forward),
``invact_jax gradients=backward`` (the backward recomputes the logits),
``invact_jax.invert(plain)`` (the conversion finding the pattern in the plain code), and
where installed, tokamax's ``linear_softmax_cross_entropy_loss`` (``chunked_xla`` and
``xla``).  PyTorch + Liger-Kernel's fused linear cross-entropy runs on a GPU in its own
process (``torch_rows``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import re
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import invact_jax
from models import benchmarks
from models.benchmarks import profile as op_profile

__all__ = ["Head", "HEADS", "make_head", "compile_step", "rows", "predicted_rows", "torch_rows",
           "tile_heads", "parse_tile", "too_large", "device_bytes"]


@dataclasses.dataclass(frozen=True)
class Head:
  """One LM head: ``x`` [N, d], ``w`` [d, V], ``labels`` [N]."""
  x: Any
  w: Any
  labels: Any

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.x.shape[0], self.x.shape[1], self.w.shape[1])


#: The heads' dtypes: one for ``x`` and ``w``, or ``"bfloat16/float32"``: bfloat16 hidden
#: states with the float32 master weight (mixed precision, as Flax's ``dtype=bfloat16`` with
#: ``param_dtype=float32`` computes).
DTYPES = ("float32", "bfloat16", "bfloat16/float32")


def split_dtype(spec: str) -> tuple[Any, Any]:
  """``(x dtype, w dtype)`` of a :data:`DTYPES` entry."""
  x, _, w = spec.partition("/")
  return jnp.dtype(x), jnp.dtype(w or x)


def make_head(tokens: int, d: int, vocab: int, dtype, seed: int = 0, w_dtype=None) -> Head:
  """A head of random hidden states (``dtype``), weight (``w_dtype``, default ``dtype``) and
  labels."""
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (tokens, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, vocab), jnp.float32) / np.sqrt(d)).astype(
      dtype if w_dtype is None else w_dtype)
  return Head(x, w, jax.random.randint(k[2], (tokens,), 0, vocab, jnp.int32))


def plain(x, w, labels):
  """What users write: logits in the hidden states' dtype (a float32 master weight cast to
  it), the loss in float32 (optax)."""
  logits = (x @ w.astype(x.dtype)).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def ours(x, w, labels):
  return invact_jax.linear_cross_entropy(x, w, labels)


def ours_backward(x, w, labels):
  return invact_jax.linear_cross_entropy(x, w, labels, gradients="backward")


def ours_pallas(x, w, labels):
  """The fused Pallas kernels: no tile of logits leaves the chip."""
  return invact_jax.linear_cross_entropy(x, w, labels, implementation="pallas")


def _tokamax(implementation: str) -> Callable | None:
  """tokamax's head with ``implementation``; None where tokamax is not installed; where it
  is but its import fails (a dependency missing), a loss that raises that error (the row
  says why)."""
  if importlib.util.find_spec("tokamax") is None:
    return None
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except  # e.g. tokamax's xprof missing
    failed = e

    def broken(x, w, labels):
      raise failed
    return broken
  fn = getattr(tokamax, "linear_softmax_cross_entropy_loss", None)
  if fn is None:
    return None

  def loss(x, w, labels):
    return fn(x, labels, w, reduction="mean", implementation=implementation)
  return loss


def device_bytes() -> int:
  """The memory the benchmark's device has: the allocator's limit on a GPU, the machine's
  RAM on a CPU."""
  import os  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def too_large(tokens: int, d: int, vocab: int) -> str | None:
  """Why a head of this shape cannot be benchmarked here (each axis below 2**31; the plain
  head's float32 logits, their gradient and the float64 reference's gradients within the
  device's memory), else None."""
  if max(tokens, d, vocab) >= 2**31:
    return f"each must be below 2**31, got {tokens} x {d} x {vocab}"
  need = 3 * 4 * tokens * vocab + 8 * (tokens + vocab) * d
  have = device_bytes()
  if need > have:
    return (f"the plain head at {tokens} x {d} x {vocab} needs about {need / 2**30:,.1f} GiB "
            f"(float32 logits and their gradient); this device has {have / 2**30:,.1f} GiB")
  return None


def parse_tile(text: str) -> tuple[str, int, int]:
  """``"TxV"`` (gradients in the forward) or ``"backward:TxV"`` -> ``(mode, T, V)``.

  Raises:
    ValueError: not of that form, or a size that is not a positive integer.
  """
  mode, _, size = text.rpartition(":")
  mode = mode or "forward"
  parts = size.lower().split("x")
  if mode not in ("forward", "backward") or len(parts) != 2 or not all(
      p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"a tile is TOKENSxVOCAB or backward:TOKENSxVOCAB, got {text!r}")
  return mode, int(parts[0]), int(parts[1])


def skip_heads(thresholds) -> dict[str, Callable]:
  """Per threshold, ``"invact_jax pallas skip_below=T"``: the fused kernels dropping backward
  tiles whose gradient entries are all below ``T`` (the gradient error it costs)."""
  return {f"invact_jax pallas skip_below={t:g}": functools.partial(
      invact_jax.linear_cross_entropy,
      implementation=invact_jax.Implementation(name="pallas", skip_below=float(t)))
          for t in thresholds}


def pallas_heads(blocks) -> dict[str, Callable]:
  """Per ``(block_rows, num_warps)`` in ``blocks``, ``"invact_jax pallas RxW"``: the fused
  kernels at that token block and warps (the GPU sweep that picks their defaults)."""
  return {f"invact_jax pallas {r}x{w}": functools.partial(
      invact_jax.linear_cross_entropy,
      implementation=invact_jax.Implementation(name="pallas", block_rows=r, num_warps=w))
          for r, w in blocks}


def parse_block(text: str) -> tuple[int, int]:
  """``"RxW"`` (token block, warps: powers of two) -> ``(R, W)``.

  Raises:
    ValueError: not of that form.
  """
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 and not int(p) & (int(p) - 1)
                                for p in parts):
    raise ValueError(f"a block is ROWSxWARPS, each a power of two, got {text!r}")
  return int(parts[0]), int(parts[1])


def tile_heads(tiles) -> dict[str, Callable]:
  """Per ``(mode, tokens, vocabulary entries)`` in ``tiles``, ``"invact_jax MODE TxV"``:
  :func:`invact_jax.linear_cross_entropy` with that gradient mode and tile (the sweep that
  picks a device's default)."""
  return {f"invact_jax {m} {t}x{v}": functools.partial(
      invact_jax.linear_cross_entropy, chunk_size=t, vocab_chunk_size=v, gradients=m)
          for m, t, v in tiles}


def heads() -> dict[str, Callable]:
  """name -> loss(x, w, labels), those that can run here."""
  out = {"plain": plain, "invact_jax": ours, "invact_jax gradients=backward": ours_backward,
         "invact_jax.invert(plain)": invact_jax.invert(plain)}
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  if targets.platform() == "gpu":  # (compiled for a GPU, or for one without it; interpret
    out["invact_jax pallas"] = ours_pallas  # mode elsewhere is a test, not a benchmark)
  for impl in ("chunked_xla", "xla"):
    fn = _tokamax(impl)
    if fn is not None:
      out[f"tokamax {impl}"] = fn
  return out


HEADS = ("plain", "invact_jax", "invact_jax gradients=backward", "invact_jax.invert(plain)",
         "invact_jax pallas", "tokamax chunked_xla", "tokamax xla")


def _has_logits_buffer(text: str, n: int, v: int) -> bool:
  for m in re.findall(r"\[([\d,]+)\]", text):
    dims = [int(d) for d in m.split(",") if d]
    if n in dims and v in dims:
      return True
  return False


def compile_step(name: str, loss: Callable, head: Head, g64=None) -> tuple[dict, Any]:
  """One row's compiled facts and the compiled step: compiled temp, a [N, V] buffer or not,
  the loss and the gradient error; ``(row with "error", None)`` where it does not lower."""
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  try:
    compiled = step.lower(head.x, head.w, head.labels).compile()
  except Exception as e:  # pylint: disable=broad-except  (a head that does not lower here)
    return {"head": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
  n, _, v = head.shape
  value, grads = compiled(head.x, head.w, head.labels)
  jax.block_until_ready(grads)
  row = {"head": name, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
         "logits_buffer": _has_logits_buffer(compiled.as_text(), n, v), "loss": float(value)}
  if g64 is not None:
    num = sum(float(np.sum((np.asarray(a, np.float64) - b) ** 2)) for a, b in zip(grads, g64))
    den = sum(float(np.sum(b ** 2)) for b in g64)
    # (relative; where the reference gradient is zero, as a one-entry vocabulary's is: 0 if
    # this one is too, else infinite)
    row["grad_error"] = (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))
  return row, compiled


def predicted_rows(tokens: int, d: int, vocab: int, dtypes=("float32",), names=None, tiles=(),
                   device: str = "h100", pallas_blocks=()) -> list[dict]:
  """:func:`rows`' memory columns predicted for ``device`` without it (deviceless,
  :mod:`invact_jax.targets`): per dtype and head (``names``; None: all) and tile, the
  compiled temp of the head's step and whether it holds an [N, V] buffer; no time, no
  gradient error (nothing runs).  ``temp_vs_plain`` as in :func:`rows`."""
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  target = targets.resolve(device)
  out = []
  for dtype in dtypes:
    x_dtype, w_dtype = split_dtype(dtype)
    structs = (jax.ShapeDtypeStruct((tokens, d), x_dtype), jax.ShapeDtypeStruct((d, vocab), w_dtype),
               jax.ShapeDtypeStruct((tokens,), jnp.int32))
    with targets.compiling_for(target):
      losses = {k: f for k, f in heads().items() if names is None or k in names}
    for name, loss in {**losses, **tile_heads(tiles), **pallas_heads(pallas_blocks)}.items():
      row = {"dtype": dtype, "tokens": tokens, "d": d, "vocab": vocab, "framework": "jax",
             "head": name}
      try:
        compiled = target.compile(target.lower(jax.value_and_grad(loss, argnums=(0, 1)),
                                               *structs))
      except Exception as e:  # pylint: disable=broad-except  (a head that does not lower)
        out.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        continue
      out.append({**row, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                  "logits_buffer": _has_logits_buffer(compiled.as_text(), tokens, vocab)})
  for r in out:
    base = next((b for b in out if b["dtype"] == r["dtype"] and b["head"] == "plain"
                 and "error" not in b), None)
    if base is not None and "temp_bytes" in r:
      r["temp_vs_plain"] = r["temp_bytes"] / base["temp_bytes"]
  return out


def _time_interleaved(steps: dict, head: Head, repeats: int) -> dict[str, float]:
  """Median seconds per step of each compiled step, the steps run round-robin."""
  times: dict = {k: [] for k in steps}
  for _ in range(repeats):
    for name, compiled in steps.items():
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(head.x, head.w, head.labels))
      times[name].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def reference_grads(head: Head):
  """float64 gradients of the plain formula (x64)."""
  with jax.enable_x64(True):
    x, w = (np.asarray(a, np.float64) for a in (head.x, head.w))
    g = jax.jit(jax.grad(lambda x, w: invact_jax.linear_cross_entropy_reference(
        x, w, head.labels), argnums=(0, 1)))(x, w)
    return [np.asarray(a, np.float64) for a in g]


def torch_rows(head: Head, dtype: str, repeats: int, timeout_s: float = 600.0,
               heads=None) -> list[dict]:
  """PyTorch's rows on the same head (:mod:`models.benchmarks.lm_head_torch`), one process
  each; ``[]`` where torch is not importable.

  Args:
    head: the head the JAX rows measured (saved once to a temporary ``.npz``).
    dtype: "float32" or "bfloat16".
    repeats: timed steps per row (the median is reported).
    timeout_s: seconds each row may take.
    heads: names from ``lm_head_torch.HEADS`` (``None``: all).

  Returns:
    One row per head (``framework`` "torch"), or one with ``error``.
  """
  import tempfile  # pylint: disable=import-outside-toplevel
  from models.benchmarks import child  # pylint: disable=import-outside-toplevel
  from models.benchmarks import lm_head_torch  # pylint: disable=import-outside-toplevel
  if not lm_head_torch.importable():
    return []
  n, d, v = head.shape
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/head.npz"
    np.savez(path, x=np.asarray(head.x, np.float32), w=np.asarray(head.w, np.float32),
             labels=np.asarray(head.labels))
    for name in heads or lm_head_torch.HEADS:
      spec = {"path": path, "head": name, "dtype": dtype, "repeats": repeats}
      row = child.run_child("models.benchmarks.lm_head_torch", spec, timeout_s)
      out.append({"dtype": dtype, "tokens": n, "d": d, "vocab": v, "framework": "torch",
                  **row, "head": name})
  return out


def rows(tokens: int, d: int, vocab: int, dtypes=("float32",), repeats: int = 5,
         names=None, torch: bool = True, tiles=(), profile: int = 0,
         skip_below=(), pallas_blocks=()) -> list[dict]:
  """Every head in ``names`` (None: all) and every ``(mode, tokens, entries)`` tile of
  ``tiles`` (:func:`tile_heads`) and ``pallas_blocks`` (:func:`pallas_heads`) on one head per dtype, timed interleaved; with ``torch``,
  PyTorch's rows on the same head where torch is importable.  ``temp_vs_plain`` and
  ``time_vs_plain`` are against the plain head of the same framework and dtype
  (:data:`DTYPES`; PyTorch's rows for one-dtype heads only).  With ``profile``, each JAX row's
  ``profile``: its ``profile`` largest XLA operations per step
  (:func:`models.benchmarks.profile.op_times`, after the timing)."""
  out = []
  for dtype in dtypes:
    x_dtype, w_dtype = split_dtype(dtype)
    head = make_head(tokens, d, vocab, x_dtype, w_dtype=w_dtype)
    if torch and x_dtype == w_dtype:  # first, while this process holds little memory
      out += torch_rows(head, x_dtype.name, repeats)
    g64 = reference_grads(head)
    losses = {k: f for k, f in heads().items() if names is None or k in names}
    measured, steps = [], {}
    for name, loss in {**losses, **tile_heads(tiles), **skip_heads(skip_below),
                       **pallas_heads(pallas_blocks)}.items():
      row, compiled = compile_step(name, loss, head, g64)
      measured.append(row)
      if compiled is not None:
        steps[name] = compiled
    del g64
    seconds = _time_interleaved(steps, head, repeats)
    for row in measured:
      if row["head"] in seconds:
        row["time_s"] = seconds[row["head"]]
        if profile:
          row["profile"] = op_profile.op_times(steps[row["head"]], head.x, head.w, head.labels,
                                               steps=2, top=profile)
      out.append({"dtype": dtype, "tokens": tokens, "d": d, "vocab": vocab,
                  "framework": "jax", **row})
    del steps
  for r in out:
    base = next((b for b in out if b["dtype"] == r["dtype"] and b["framework"] == r["framework"]
                 and b["head"].endswith("plain") and "error" not in b), None)
    if base is not None and "temp_bytes" in r and "temp_bytes" in base:
      r["temp_vs_plain"] = r["temp_bytes"] / base["temp_bytes"]
    if base is not None and "time_s" in r:
      r["time_vs_plain"] = r["time_s"] / base["time_s"]
  return out


def table(rs: list[dict]) -> str:
  """The rows as a Markdown table ("vs plain": against the same framework's plain head; temp:
  XLA's compiled temp for JAX, the allocator's peak over the resident inputs and gradients for
  torch on a GPU)."""
  lines = ["| dtype | head | temp MiB | vs plain | [N, V] buffer | time (s) | vs plain | "
           "grad error vs float64 |", "|---|---|---:|---:|---|---:|---:|---:|"]
  nan = float("nan")
  for r in rs:
    if "error" in r:
      lines.append(f"| {r['dtype']} | {r['head']} | — | — | — | — | — | {r['error']} |")
      continue
    temp = (f"{r['temp_bytes'] / 2**20:.1f} | {100 * r.get('temp_vs_plain', nan):.1f} % | "
            f"{'yes' if r['logits_buffer'] else 'no'}" if "temp_bytes" in r else "— | — | —")
    time_cells = (f"{r['time_s']:.3f} | {r.get('time_vs_plain', nan):.2f}" if "time_s" in r
                  else "— | —")
    lines.append(f"| {r['dtype']} | {r['head']} | {temp} | {time_cells} | "
                 f"{r.get('grad_error', nan):.1e} |")
  return "\n".join(lines)


# ------------------------------------------------------------- docs and headline from the JSONs
DOCS_BLOCK = re.compile(r"(<!-- lm-head table: (\S+?)(?: dtype=(\w+))? -->\n)(.*?)(<!-- end -->)",
                        re.S)


def render_docs(text: str, root) -> str:
  """``text`` with every ``<!-- lm-head table: bench/FILE.json [dtype=D] -->`` ...
  ``<!-- end -->`` block rewritten as :func:`table` of that committed JSON's rows (of dtype D
  where given), preceded by the command, device, versions and date that produced them."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  def block(m) -> str:
    data = json.loads((pathlib.Path(root) / m.group(2)).read_text())
    meta = data["meta"]
    rows = [r for r in data["rows"] if m.group(3) is None or r["dtype"] == m.group(3)]
    command = re.sub(r" --json \S+", "", meta["command"])
    device = meta["device"] + (f" ({meta['host']})" if meta.get("host") and
                               meta["device"] == "cpu" else "")
    where = (f"`{command}` (`{m.group(2)}`) — {device}, JAX "
             f"{meta['jax']}, Python {meta['python']}, {meta['date']}; N = {meta['tokens']}, "
             f"d = {meta['d']}, V = {meta['vocab']}, median of {meta['repeats']}")
    return f"{m.group(1)}{where}:\n\n{table(rows)}\n{m.group(5)}"
  return DOCS_BLOCK.sub(block, text)


def _newest_per_device(paths) -> list:
  """Of ``lm_head_*.json`` files, per device the newest measured run (by date, then JAX
  version; predictions, ``meta["deviceless"]``, left out)."""
  import json  # pylint: disable=import-outside-toplevel
  best: dict = {}
  for p in sorted(paths):
    meta = json.loads(p.read_text())["meta"]
    if meta.get("deviceless"):
      continue
    key = (meta["date"], tuple(int(v) for v in re.findall(r"\d+", meta["jax"])))
    if meta["device"] not in best or key > best[meta["device"]][0]:
      best[meta["device"]] = (key, p, meta)
  return [(p, meta) for _, p, meta in sorted(best.values(), key=lambda b: str(b[1]))]


def _at_default_tiles(by: dict, meta: dict, dtype: str) -> tuple[dict | None, str]:
  """``(row, label)``: the run's sweep row at today's default mode and tiles
  (:func:`invact_jax.ops.cross_entropy.base.default_tiles`; the label names it), else its
  ``invact_jax`` row (the defaults when it ran)."""
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  mode = base.default_mode("mean", split_dtype(dtype)[1])
  t, v = base.default_tiles(meta["tokens"], meta["vocab"], mode,
                            "cpu" if meta["device"] == "cpu" else "gpu")
  row = by.get(f"invact_jax {mode} {t}x{v}")
  return (row, f", {mode} {t}×{v}") if row else (by.get("invact_jax"), "")


def headline_rows(root) -> list[str]:
  """README headline rows: per device, the newest LM head run's plain head against
  :func:`invact_jax.linear_cross_entropy` with today's defaults (the run's first dtype): its
  sweep row at the default tiles where it has one."""
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  out = []
  for p, meta in _newest_per_device(pathlib.Path(root, "bench").glob("lm_head_*.json")):
    rows = json.loads(p.read_text())["rows"]
    dtype = next(r["dtype"] for r in rows if r["framework"] == "jax")
    by = {r["head"]: r for r in rows if r["framework"] == "jax" and r["dtype"] == dtype}
    plain, (ours, tile) = by.get("plain"), _at_default_tiles(by, meta, dtype)
    if not plain or not ours or "error" in plain or "error" in ours:
      continue
    what = f"LM head, {meta['tokens']}×{meta['d']}×{meta['vocab']}, {dtype}"
    src = f"[{p.name}](bench/{p.name}) · [docs](docs/lm-head.md)"
    on = f"{meta['device']}, JAX {meta['jax']}, {meta['date']}"
    out.append(f"| memory: compiled temp, {what} | {plain['temp_bytes'] / 2**20:,.1f} MiB | "
               f"{ours['temp_bytes'] / 2**20:,.1f} MiB ({ours['temp_vs_plain']:.1%}{tile}) | "
               f"{on} | {src} |")
    out.append(f"| speed: step, {what} | {plain['time_s'] * 1e3:,.1f} ms | "
               f"{ours['time_s'] * 1e3:,.1f} ms ({ours['time_vs_plain']:.2f}×) | same run | "
               f"{src} |")
  return out


def run(a: argparse.Namespace, argv: list[str]) -> int:
  """``scripts/bench_lm_head.py``'s job for its parsed command line ``a`` (from ``argv``,
  recorded in the JSON); the exit code."""
  if getattr(a, "device", None):
    return _run_deviceless(a, argv)
  # PyTorch's rows (where torch is importable) run in child processes on the same device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  why = too_large(a.tokens, a.d, a.vocab)
  if why:
    print(f"error: --tokens/--d/--vocab: {why}", file=sys.stderr)
    return 2
  meta = {"jax": jax.__version__, "host": benchmarks.host(), "device": jax.devices()[0].device_kind,
          "tokens": a.tokens, "d": a.d, "vocab": a.vocab, "repeats": a.repeats,
          "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
          "command": "python scripts/bench_lm_head.py " + shlex.join(argv)}
  print(f"JAX {meta['jax']}, {meta['device']}, Python {meta['python']}, N={a.tokens} "
        f"d={a.d} V={a.vocab}, median of {a.repeats}, {meta['date']}")
  measured = []
  for i, dtype in enumerate(a.dtypes):  # each dtype's rows written as they are done: a run
    measured += rows(a.tokens, a.d, a.vocab, (dtype,), a.repeats, tiles=a.tiles,  # cut
                     profile=a.profile, skip_below=getattr(a, "skip_below", ()) or (),  # short
                     names=getattr(a, "heads", None),  # keeps them
                     pallas_blocks=getattr(a, "pallas_blocks", ()) or ())
    print(table([r for r in measured if r["dtype"] == dtype]), flush=True)
    for r in measured:
      if r["dtype"] == dtype and r.get("profile"):
        print(f"\n{dtype}, {r['head']}: {r['time_s'] * 1e3:.1f} ms a step\n"
              + op_profile.table(r["profile"]), flush=True)
    if a.json:
      unfinished = {"unfinished": list(a.dtypes[i + 1:])} if i + 1 < len(a.dtypes) else {}
      with open(a.json, "w") as f:
        json.dump({"meta": {**meta, **unfinished}, "rows": measured}, f, indent=1)
  return 0


def _run_deviceless(a: argparse.Namespace, argv: list[str]) -> int:
  """``--device``: :func:`predicted_rows` printed (and written to ``--json``)."""
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  target = targets.resolve(a.device)
  meta = {"jax": jax.__version__, "host": benchmarks.host(), "device": target.device_kind,
          "target": target.name, "deviceless": True, "tokens": a.tokens, "d": a.d,
          "vocab": a.vocab, "date": datetime.date.today().isoformat(),
          "python": sys.version.split()[0],
          "command": "python scripts/bench_lm_head.py " + shlex.join(argv)}
  print(f"JAX {meta['jax']}, compiled for {target.name} ({target.device_kind}) without it, "
        f"N={a.tokens} d={a.d} V={a.vocab}, {meta['date']}")
  predicted = predicted_rows(a.tokens, a.d, a.vocab, a.dtypes, tiles=a.tiles, device=target,
                             names=getattr(a, "heads", None),
                             pallas_blocks=getattr(a, "pallas_blocks", ()) or ())
  print(table(predicted), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": meta, "rows": predicted}, f, indent=1)
  return 0


if __name__ == "__main__":  # python -m models.benchmarks.lm_head: rewrite docs/lm-head.md
  import pathlib as _pathlib
  _root = _pathlib.Path(__file__).resolve().parents[2]
  _page = _root / "docs" / "lm-head.md"
  _page.write_text(render_docs(_page.read_text(), _root))
