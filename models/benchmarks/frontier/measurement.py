"""Measuring one frontier row: :func:`measure` in this process, :func:`child_row` as
the child process runs it, and :func:`layers_that_fit` (a stack sized to what the JAX
default step fits)."""
from __future__ import annotations

import dataclasses
import gzip
import statistics
import time

import jax
import jax.numpy as jnp

import invact_jax
from invact_jax import memory, targets
from models.benchmarks import child
from models.benchmarks import profile as op_profile
from models.benchmarks.frontier import model_stack
from models.benchmarks.frontier.schema import Row, Spec


def measure(spec: Spec) -> Row:
  """One row: ``spec`` = {stack, policy, invact, dtype, repeats[, layers][, batch][, head]
  [, runs, configuration][, profile[, trace_out]][, hlo_out]}; with ``profile`` (K), the row's
  ``profile``: the step's K largest XLA operations (:func:`models.benchmarks.profile.op_times`;
  the profiler's trace copied to ``trace_out`` where given); with
  ``hlo_out`` (a path), the compiled step's optimized HLO written there, gzipped (each
  profiled kernel's operation, its shapes and the computation it runs in, to read the
  profile by); every row records its compiled temp and, where the persistent compilation
  cache answered, ``compile_cache`` (:func:`isolated_row`).  One row with its
  profile, as a later GPU session asks for it: ``python -m models.benchmarks.frontier
  '{"stack": "llama3-1b", "policy": "none", "invact": true, "dtype": "bfloat16",
  "repeats": 3, "batch": 2, "profile": 15}'``."""
  s = model_stack.shape_of(spec)
  before = dict(_cache_events())
  planned = None
  if "program_budget" in spec:  # invact_jax.plan of the model as written (no remat, plain head)
    loss, args = model_stack.build(s, "none", False, jnp.dtype(spec["dtype"]), None, "plain")
    t0 = time.perf_counter()
    loss = planned = invact_jax.plan(loss, *args, budget=spec["program_budget"], convert=True)
    planning_s = time.perf_counter() - t0
  else:
    loss, args = model_stack.build(s, spec["policy"], spec["invact"], jnp.dtype(spec["dtype"]),
                                   spec.get("runs"), spec.get("head", "plain"),
                                   unrolled=spec.get("unrolled", False))
  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(*args).compile()
  if spec.get("compile_only"):  # (the first of two processes: :func:`isolated_row`)
    return {"compiled": True, **({"planning_s": round(planning_s, 2)} if planned else {})}
  row = {**model_stack.row_key(spec), "layers": s.layers, "batch": s.batch}
  hits, misses = (_cache_events()[k] - before[k] for k in (CACHE_HIT, CACHE_MISS))
  if hits or misses:
    row["compile_cache"] = {"hits": hits, "misses": misses}
  if planned is not None:
    rep = planned.report
    row.update({"plan_program": rep.configuration, "plan_keeps": list(rep.keep),
                "plan_offloads": list(rep.offload), "plan_policy": rep.policy,
                "plan_as_written": rep.as_written, "predicted_bytes": rep.predicted_bytes,
                "plan_compiled_bytes": rep.compiled_bytes, "plan_step_flops": rep.step_flops,
                "plan_recompute_flops": rep.predicted_recompute_flops,
                "planning_s": round(planning_s, 2)})
  if spec["invact"] and s.vocab:
    row["head_tiles"] = model_stack.head_tiles(s, targets.platform())
  row["compiled_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
  if memory.reports_peak():
    peak = memory.device_peak(step, *args)
    # activations: the step's peak increase minus what it returns (the gradients: params'
    # size) — the inputs were resident before
    row["activation_bytes"] = peak["peak_increase"] - peak["output_bytes"]
    row["memory"] = "device peak"
  else:
    row["activation_bytes"] = row["compiled_temp_bytes"]
    row["memory"] = "compiled temp"
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(spec.get("repeats", 5)):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  row["step_ms"] = 1e3 * statistics.median(times)
  if spec.get("profile"):
    try:
      row["profile"] = op_profile.op_times(compiled, *args, steps=1, top=spec["profile"],
                                           trace_out=spec.get("trace_out"))
    except Exception as e:  # pylint: disable=broad-except  (the row's figures stand without it)
      row["profile_error"] = child.error_row(e)["error"]
  if spec.get("hlo_out"):
    with gzip.open(spec["hlo_out"], "wt") as f:
      f.write(compiled.as_text())
  return row


#: The events JAX records when a compile is answered from its persistent cache, or not.
CACHE_HIT, CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

#: This process's counts of :data:`CACHE_HIT` and :data:`CACHE_MISS` (None: not listening yet).
_CACHE_EVENTS: dict | None = None


def _cache_events() -> dict:
  """The process's cache-event counts so far, its one listener registered on the first call."""
  global _CACHE_EVENTS  # pylint: disable=global-statement
  if _CACHE_EVENTS is None:
    _CACHE_EVENTS = {CACHE_HIT: 0, CACHE_MISS: 0}

    def count(event, **_):
      if event in _CACHE_EVENTS:
        _CACHE_EVENTS[event] += 1
    jax.monitoring.register_event_listener(count)
  return _CACHE_EVENTS


#: The module whose ``__main__`` measures one row in a child process (:func:`child_row`).
CHILD = "models.benchmarks.frontier"


def cache_env(directory: str) -> dict[str, str]:
  """The environment that gives a child process JAX's persistent compilation cache in
  ``directory``, every executable cached."""
  return {"JAX_COMPILATION_CACHE_DIR": directory,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def isolated_row(spec: Spec, timeout_s: float, env: dict) -> Row | dict:
  """A row measured in a child process that compiles nothing itself: a first child compiles
  the row's step (and plans it, for a program plan) into a fresh persistent compilation
  cache, and the measuring child loads every executable from it.

  A device allocator's peak never resets, and compiling for a GPU autotunes: the autotuner's
  buffers (a candidate's operands and outputs, several of a large matmul's) count in the
  process's peak, so a step whose own peak lies under its compile's would report the
  compile's (2026-11-29, H200: three invert rows of llama3-1b, predicted 4.4-6.8 GiB, all
  measured 7.83 GiB to the byte).  The planning time is the first child's (the second
  plans from the cache)."""
  import shutil  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  deadline = time.time() + timeout_s
  cache = tempfile.mkdtemp(prefix="frontier_compile_cache_")
  try:
    env = {**env, **cache_env(cache)}
    first = child.run_child(CHILD, {**spec, "compile_only": True}, timeout_s, env=env)
    if "error" in first:
      return first
    row = child.run_child(CHILD, spec, deadline - time.time(), env=env)
    if "planning_s" in first and "error" not in row:
      row["planning_s"] = first["planning_s"]
    return row
  finally:
    shutil.rmtree(cache, ignore_errors=True)


def child_row(spec: Spec) -> Row | dict:
  """A row measured in this process (``python -m models.benchmarks.frontier``); a spec with
  ``fit`` (a stack's name) gives ``{"fit": n}``, :func:`layers_that_fit` of that stack."""
  try:
    if "fit" in spec:
      return {"fit": layers_that_fit(spec["fit"], spec["dtype"], field=spec["field"])}
    return measure(spec)
  except Exception as e:  # pylint: disable=broad-except  # out of memory, unsupported, ...
    return child.error_row(e, **({} if "fit" in spec else model_stack.row_key(spec)))


#: The fraction of a device's memory JAX's allocator takes by default: a deviceless target's
#: limit, as :func:`layers_that_fit` reads the allocator's on the device.
ALLOCATOR_FRACTION = 0.75


def layers_that_fit(stack: str, dtype: str, *, limit_bytes: int | None = None,
                    fraction: float = 0.85, most: int = 32, field: str = "layers") -> int:
  """As many layers of ``stack`` (``field="batch"``: the largest batch) as JAX default's step
  fits in ``fraction`` of the device's memory (``limit_bytes``, default: the allocator's
  ``bytes_limit``; compiling for a device without it, :data:`ALLOCATOR_FRACTION` of its
  memory), at most ``most``: the step's compiled temp at 2 and 4 extrapolated (a scanned
  stack's temp is linear in its depth and its batch), plus the parameters and their
  gradients.  Compiles only (nothing is allocated on the device), for the current target.
  Without ``limit_bytes`` on a device that reports none (a CPU), the stack's own ``field``."""
  s = model_stack.STACKS[stack]
  if limit_bytes is None:
    target = targets.current()
    if target.deviceless and target.memory_bytes:
      limit_bytes = int(ALLOCATOR_FRACTION * target.memory_bytes)
    else:
      stats = jax.local_devices()[0].memory_stats() or {}
      if "bytes_limit" not in stats:
        return getattr(s, field)
      limit_bytes = int(stats["bytes_limit"])

  def temp_and_params(n: int) -> tuple[int, int]:
    box = {}

    def make():
      box["loss"], args = model_stack.build(dataclasses.replace(s, **{field: n}), "none", False,
                                jnp.dtype(dtype))
      return args
    args = jax.eval_shape(make)
    temp = memory.compiled(jax.value_and_grad(box["loss"]), *args).temp
    params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args[0]))
    return temp, params
  (t2, p2), (t4, p4) = temp_and_params(2), temp_and_params(4)
  per_unit = (t4 - t2) / 2 + 2 * (p4 - p2) / 2
  fixed = t2 + 2 * p2 - 2 * per_unit
  least = 1 if field == "batch" else 2
  n = int(max(least, min(most, (fraction * limit_bytes - fixed) // per_unit)))
  if field == "layers":
    return n  # a scanned stack's temp is linear in its depth: the extrapolation is exact
  # a batch's temp is nearly linear: the extrapolation checked, a step at a time

  def fits(m: int) -> bool:
    t, p = temp_and_params(m)
    return t + 2 * p <= fraction * limit_bytes
  while n > least and not fits(n):
    n -= 1
  while n < most and fits(n + 1):
    n += 1
  return n
