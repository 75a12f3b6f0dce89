"""Where a step's time goes: XLA's per-operation times from a ``jax.profiler`` trace.

:func:`op_times` runs a compiled step a few times under the profiler and sums, per HLO
operation, the time of the events XLA's runtime tags with that operation (``hlo_op``): the
kernels on a GPU's streams, the thunks of XLA:CPU's threads.  Only innermost events count
(a ``while`` loop's thunk holds its body's), so the figures add up to the device's busy
time on a GPU and to thread time (summed over threads) on a CPU.  The benchmarks print the
largest ones beside a missed target (``scripts/bench_lm_head.py --profile``).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterable

__all__ = ["KINDS", "groups", "kind", "op_times", "ops_from_trace", "table", "torch_kernels"]


def ops_from_trace(events: Iterable[dict], steps: int, top: int | None = None) -> list[dict]:
  """Per-operation times of a Chrome-format trace (``traceEvents`` of a ``.trace.json``): on
  a device every kernel (kernels of a CUDA graph may overlap: their times add up to more than
  the wall-clock), on a host the innermost events (a loop's thunk holds its body's).

  Args:
    events: the trace's events (metadata events name the processes).
    steps: how many steps the trace holds (the figures are per step).
    top: keep the ``top`` largest (None: all).

  Raises:
    ValueError: ``steps`` below 1.

  Returns:
    ``[{"op", "module", "ms", "calls", "share", "kernel"}]``, one per operation and kernel,
    largest ``ms`` (per step) first; ``share`` of all the operations' time; ``kernel`` the
    event's own name where it is not the op's (a GPU kernel's: a cuDNN call runs several, and
    a command buffer — XLA:GPU's CUDA graph of many operations, the ``hlo_op`` its kernels
    carry — one per operation in it).  Events on a
    ``/device:`` process are taken where there are any (a GPU), else every tagged event.
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  events = list(events)
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  tagged = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
  # (a device's kernels nest in nothing, but may overlap: all count; a kernel on a stream that
  # carries no operation — a custom call's own launch, Pallas's Triton kernels — counts too)
  device = [e for e in events if e.get("ph") == "X"
            and names.get(e["pid"], "").startswith("/device:")
            and ("hlo_op" in e.get("args", {})
                 or threads.get((e["pid"], e.get("tid")), "").startswith("Stream"))]
  tagged = device or tagged
  by_thread = collections.defaultdict(list)
  for e in tagged:
    by_thread[(e["pid"], e["tid"])].append(e)
  total = collections.defaultdict(lambda: [0.0, 0])
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    for e, nxt in zip(evs, evs[1:] + [None]):
      if not device and nxt is not None and nxt["ts"] < e["ts"] + e.get("dur", 0):
        continue  # it holds the next one: not innermost
      op = e.get("args", {}).get("hlo_op", "")
      key = (e.get("args", {}).get("hlo_module", ""), op, e["name"] if e["name"] != op else "")
      t = total[key]
      t[0] += e.get("dur", 0) / 1e3
      t[1] += 1
  busy = sum(t[0] for t in total.values()) or 1.0
  rows = [{"op": op, "module": module, "ms": ms / steps, "calls": calls / steps,
           "share": ms / busy, **({"kernel": kernel} if kernel else {})}
          for (module, op, kernel), (ms, calls) in total.items()]
  rows.sort(key=lambda r: -r["ms"])
  return rows[:top] if top else rows


def op_times(step: Callable[..., Any], *args, steps: int = 3, top: int | None = None,
             trace_out: str | None = None) -> list[dict]:
  """Per-operation times of ``step(*args)`` (a jitted or compiled function), run once to warm
  up and ``steps`` times under ``jax.profiler.trace``.

  Args:
    step: the function (compiled beforehand: its compile is not profiled).
    *args: its arguments.
    steps: profiled runs (the figures are per run).
    top: keep the ``top`` largest operations (None: all).
    trace_out: where given, the profiler's ``.trace.json.gz`` is copied there.

  Returns:
    :func:`ops_from_trace`'s rows.

  Raises:
    ValueError: ``steps`` below 1.
    RuntimeError: the profiler wrote no trace.
  """
  import jax  # pylint: disable=import-outside-toplevel  (PyTorch's children import this module)
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        jax.block_until_ready(step(*args))
    paths = glob.glob(os.path.join(tmp, "plugins", "profile", "*", "*.trace.json.gz"))
    if not paths:
      raise RuntimeError(f"jax.profiler wrote no .trace.json.gz under {tmp}")
    newest = max(paths, key=os.path.getmtime)
    if trace_out:
      shutil.copyfile(newest, trace_out)
    with gzip.open(newest) as f:
      events = json.load(f)["traceEvents"]
  return ops_from_trace(events, steps, top)


def torch_kernels(events: Iterable[dict], steps: int, annotation: str = "head",
                  top: int | None = None) -> list[dict]:
  """Per-kernel device times of a ``torch.profiler`` Chrome trace (its ``traceEvents``).

  Args:
    events: the trace's events: ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` events on the
      device, the CPU launches (``cuda_runtime``/``cuda_driver``) they share a
      ``correlation`` with, and ``user_annotation`` ranges (``record_function``).
    steps: how many steps the trace holds (the figures are per step).
    annotation: a ``record_function`` name: a kernel launched inside such a range (on the
      launching thread) counts as in it (``"head": true``).
    top: keep the ``top`` largest (None: all).

  Raises:
    ValueError: ``steps`` below 1.

  Returns:
    ``[{"kernel", "ms", "calls", "share", "head"}]``, largest ``ms`` (per step) first, one
    entry per (kernel name, inside the annotation or not); ``share`` of all the kernels' time.
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  events = [e for e in events if e.get("ph") == "X"]
  ranges = collections.defaultdict(list)
  for e in events:
    if e.get("cat") == "user_annotation" and e.get("name") == annotation:
      ranges[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0)))
  launched = {}
  for e in events:
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
      launched[e["args"]["correlation"]] = any(
          a <= e["ts"] <= b for a, b in ranges.get(e.get("tid"), ()))
  total = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
      key = (e["name"], launched.get(e.get("args", {}).get("correlation"), False))
      total[key][0] += e.get("dur", 0) / 1e3
      total[key][1] += 1
  busy = sum(t[0] for t in total.values()) or 1.0
  rows = [{"kernel": name, "ms": ms / steps, "calls": calls / steps, "share": ms / busy,
           "head": inside} for (name, inside), (ms, calls) in total.items()]
  rows.sort(key=lambda r: -r["ms"])
  return rows[:top] if top else rows


def table(rows: list[dict], label: str = "") -> str:
  """``rows`` (of :func:`op_times`) as Markdown: op, kernel, ms per step, calls per step, share
  of all the operations' time."""
  lines = [f"| {label or 'op'} | kernel | ms / step | calls | share |", "|---|---|---:|---:|---:|"]
  lines += [f"| {r['op']} | {r.get('kernel', '')[:60]} | {r['ms']:.3f} | {r['calls']:g} | "
            f"{r['share']:.0%} |" for r in rows]
  return "\n".join(lines)


#: The kinds of device work a step's profile is grouped into (:func:`kind`).
KINDS = ("matmuls", "attention", "elementwise and norms", "copies and casts")

_MATMUL = ("nvjet", "gemm", "cutlass", "xmma", "cublas", "matmul", "splitk")
_ATTENTION = ("sdpa", "fmha", "flash", "attention", "cudnn")
_MOVES = {"convert", "copy", "transpose", "concatenate", "dynamic", "update", "slice", "broadcast",
          "bitcast", "pad", "reshape", "memcpy", "memset", "memcpy32", "post", "memcpy128",
          "iota", "gather"}


def kind(name: str) -> str:
  """The :data:`KINDS` entry of a kernel (or XLA operation) by its name: a cuBLAS, Triton or
  XLA GEMM; cuDNN's attention (its helper kernels included); a fusion or kernel that only
  moves, casts or fills values (XLA names a fusion after the operations in it:
  ``loop_convert_fusion``, ``wrapped_concatenate``; PyTorch's copy, concatenation and fill
  kernels); else
  elementwise work and norms (every other fusion, Liger's kernels, PyTorch's elementwise and
  reduction kernels)."""
  low = name.lower()
  if any(k in low for k in _ATTENTION):
    return "attention"
  if any(k in low for k in _MATMUL) or re.fullmatch(r"(custom-call|dot|dot_general)[._]?\d*", low):
    return "matmuls"
  if any(k in low for k in ("copy_kernel", "catarray", "fillfunctor")) or low.startswith(
      ("memcpy", "memset")):  # (PyTorch's copies, casts, concatenations and fills)
    return "copies and casts"
  words = [w for w in re.split(r"[^a-z0-9]+", low) if w and not w.isdigit()]
  words = [w for w in words if w not in ("loop", "input", "wrapped", "fusion", "kernel")]
  if words and all(w in _MOVES for w in words):
    return "copies and casts"
  return "elementwise and norms"


def groups(rows: list[dict], layers: int) -> dict[str, dict[str, float]]:
  """A profile's milliseconds per step by :func:`kind` and by where they run: ``"layers"`` or
  ``"outside"`` (the head, the embedding, the final norm, the loss).

  A PyTorch row's kernels (:func:`torch_kernels`) are outside where launched in the head's
  annotated range.  An XLA row's operation runs inside the scanned layers as many times per
  step as there are layers, or a multiple; of an operation (or kernel) run ``k * layers + r``
  times, ``r`` calls' share of its time is taken as outside (a kernel shared by a layer's
  matmul and the head's splits by calls, assuming calls of equal length: an estimate).

  Args:
    rows: :func:`ops_from_trace` or :func:`torch_kernels` rows (every one: ``top=None``).
    layers: the model's layers.

  Returns:
    ``{kind: {"layers": ms, "outside": ms}}`` for every kind in :data:`KINDS`.
  """
  out = {k: {"layers": 0.0, "outside": 0.0} for k in KINDS}
  for r in rows:
    name = r.get("kernel") or r.get("op", "")
    where = out[kind(name)]
    if "head" in r:  # a PyTorch kernel: the annotation says
      where["outside" if r["head"] else "layers"] += r["ms"]
      continue
    calls = round(r["calls"])
    outside = r["ms"] * (calls % layers) / calls if calls else 0.0
    where["outside"] += outside
    where["layers"] += r["ms"] - outside
  return out
