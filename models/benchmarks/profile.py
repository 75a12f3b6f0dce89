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
import tempfile
from typing import Any, Callable, Iterable

import jax

__all__ = ["op_times", "ops_from_trace", "table"]


def ops_from_trace(events: Iterable[dict], steps: int, top: int | None = None) -> list[dict]:
  """Per-operation times of a Chrome-format trace (``traceEvents`` of a ``.trace.json``).

  Args:
    events: the trace's events (metadata events name the processes).
    steps: how many steps the trace holds (the figures are per step).
    top: keep the ``top`` largest (None: all).

  Raises:
    ValueError: ``steps`` below 1.

  Returns:
    ``[{"op", "module", "ms", "calls", "share", "kernel"}]``, largest ``ms`` (per step)
    first; ``share`` of all the operations' time; ``kernel`` the event's own name where it is
    not the op's (a GPU kernel's).  Events on a
    ``/device:`` process are taken where there are any (a GPU), else every tagged event.
  """
  if steps < 1:
    raise ValueError(f"steps must be at least 1, got {steps}")
  events = list(events)
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  tagged = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
  device = [e for e in tagged if names.get(e["pid"], "").startswith("/device:")]
  tagged = device or tagged
  by_thread = collections.defaultdict(list)
  for e in tagged:
    by_thread[(e["pid"], e["tid"])].append(e)
  total = collections.defaultdict(lambda: [0.0, 0, ""])
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    for e, nxt in zip(evs, evs[1:] + [None]):
      if nxt is not None and nxt["ts"] < e["ts"] + e.get("dur", 0):
        continue  # it holds the next one: not innermost
      key = (e["args"].get("hlo_module", ""), e["args"]["hlo_op"])
      t = total[key]
      t[0] += e.get("dur", 0) / 1e3
      t[1] += 1
      if e["name"] != key[1]:
        t[2] = e["name"]
  busy = sum(t[0] for t in total.values()) or 1.0
  rows = [{"op": op, "module": module, "ms": ms / steps, "calls": calls / steps,
           "share": ms / busy, **({"kernel": kernel} if kernel else {})}
          for (module, op), (ms, calls, kernel) in total.items()]
  rows.sort(key=lambda r: -r["ms"])
  return rows[:top] if top else rows


def op_times(step: Callable[..., Any], *args, steps: int = 3, top: int | None = None
             ) -> list[dict]:
  """Per-operation times of ``step(*args)`` (a jitted or compiled function), run once to warm
  up and ``steps`` times under ``jax.profiler.trace``.

  Args:
    step: the function (compiled beforehand: its compile is not profiled).
    *args: its arguments.
    steps: profiled runs (the figures are per run).
    top: keep the ``top`` largest operations (None: all).

  Returns:
    :func:`ops_from_trace`'s rows.

  Raises:
    ValueError: ``steps`` below 1.
    RuntimeError: the profiler wrote no trace.
  """
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
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
      events = json.load(f)["traceEvents"]
  return ops_from_trace(events, steps, top)


def table(rows: list[dict], label: str = "") -> str:
  """``rows`` (of :func:`op_times`) as Markdown: op, kernel, ms per step, calls per step, share
  of all the operations' time."""
  lines = [f"| {label or 'op'} | kernel | ms / step | calls | share |", "|---|---|---:|---:|---:|"]
  lines += [f"| {r['op']} | {r.get('kernel', '')[:60]} | {r['ms']:.3f} | {r['calls']:g} | "
            f"{r['share']:.0%} |" for r in rows]
  return "\n".join(lines)
