"""The frontier's memory, predicted on any machine: every JAX row compiled for the device
without it (deviceless, :mod:`invact_jax.targets`).

Per language model (:data:`STACKS`): every policy of :data:`frontier.POLICIES` (JAX's and
MaxText's presets) with the plain head, tokamax's (where installed) and ``invert``'s, and
:func:`invact_jax.plan` of the loss as written at :data:`PLAN_PERCENTS` of JAX default's
predicted bytes (``convert=True``, planned for the device).  Each row is what a device row of
:mod:`models.benchmarks.frontier` measures, less the step time: ``compiled_temp_bytes``, the
device compiler's temp for the step, and ``predicted_activation_bytes``, what the device row's
``activation_bytes`` will read.  The two are equal: a device row's activation bytes are the
allocator's peak increase over the step less its outputs (the gradients, the loss), and the
peak is reached with the temp buffer and the outputs live (the H100 rows of 2026-11-26/27 lie
within 80 KB of the compiled temp: docs/deviceless.md).

Each row also holds ``step_flops``, its gradient step's FLOPs counted on its trace for the
target (:func:`invact_jax.memory.jaxpr_flops`, every loop's body per iteration; cuDNN's
attention from its shapes), and, where the device's committed rows measured its group (model,
head, invact) at two or more FLOP counts, ``predicted_step_ms`` from them
(:func:`step_model`: a line through those rows' step times against their FLOPs).

A model's layers or batch (:data:`frontier.FIT`) are those the device's committed rows
measured, else fitted deviceless.  ``python scripts/frontier_deviceless.py --device h100``
writes ``bench/frontier_deviceless_<device>_<date>.json``; :func:`agreement` sets every
committed device row beside its prediction.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import invact_jax
from invact_jax import memory, targets
from models import benchmarks
from models.benchmarks import child
from models.benchmarks import frontier
from models.benchmarks.frontier.running import device_slug, jax_spec
from models.benchmarks.frontier.schema import DevicelessRow, Row, Spec

__all__ = ["STACKS", "PLAN_PERCENTS", "TOLERANCE", "FSDP", "specs", "predict", "fitted", "rows",
           "step_model", "with_step_times",
           "plan_row", "fsdp_rows", "device_slug", "agreement", "markdown", "fsdp_markdown",
           "lm_head_markdown", "render_docs", "write_docs", "run", "run_fsdp", "newest"]

#: The models predicted by default.
STACKS = ("llama3-1b", "llama3-8b")
#: :func:`invact_jax.plan`'s budgets, in % of JAX default's predicted activation bytes.
PLAN_PERCENTS = (10, 25, 50)
#: How far a device row may lie from its prediction (relative): the docs' and the test's.
TOLERANCE = 0.05


def specs(stack: str, fields: dict, dtype: str = "bfloat16", policies=None) -> list[Spec]:
  """Every JAX row of ``stack`` (:func:`frontier.measure`'s specs): per policy (``policies``;
  None: :data:`frontier.POLICIES`), the plain head, tokamax's and ``invert``'s; and the
  frontier's unrolled rows (:class:`frontier.JaxRow` ``unrolled``)."""
  out = []
  policies = policies or frontier.POLICIES
  for policy in policies:
    for invact, head in ((False, "plain"), (False, "tokamax"), (True, "plain")):
      out.append({"stack": stack, "policy": policy, "invact": invact, "dtype": dtype,
                  "head": head, **fields})
  out += [jax_spec(stack, item, fields, dtype=dtype, repeats=1)
          for item in frontier.LM_ORDER
          if isinstance(item, frontier.JaxRow) and item.unrolled and item.policy in policies]
  return out


def _traced(spec: Spec) -> tuple[Callable, tuple]:
  """``(loss, argument structs)`` of a row: the model built abstractly (no parameters are
  made)."""
  s = frontier.model_stack.shape_of(spec)
  box = {}

  def make():
    box["loss"], args = frontier.build(s, spec["policy"], spec["invact"], jnp.dtype(spec["dtype"]),
                                       spec.get("runs"), spec.get("head", "plain"),
                                       unrolled=spec.get("unrolled", False))
    return args
  args = jax.eval_shape(make)
  return box["loss"], args


def predict(spec: Spec, target: targets.Target) -> DevicelessRow:
  """One row predicted for ``target``: the row's key, its layers and batch,
  ``compiled_temp_bytes`` and ``predicted_activation_bytes`` (the module doc), the
  compile's seconds; an ``error`` where it does not compile (tokamax not installed, ...)."""
  key = frontier.model_stack.row_key(spec)
  s = frontier.model_stack.shape_of(spec)
  row = {**key, "layers": s.layers, "batch": s.batch}
  t0 = time.perf_counter()
  try:
    with targets.compiling_for(target):
      loss, args = _traced(spec)
      temp = memory.compiled(jax.value_and_grad(loss), *args).temp
      flops = memory.jaxpr_flops(jax.make_jaxpr(jax.value_and_grad(loss))(*args),
                                 per_iteration=True)
  except Exception as e:  # pylint: disable=broad-except  # a head not installed, ...
    return child.error_row(e, **row)
  row.update(compiled_temp_bytes=temp, predicted_activation_bytes=temp, step_flops=flops,
             compile_s=round(time.perf_counter() - t0, 2))
  if spec["invact"]:
    row["head_tiles"] = frontier.head_tiles(s, target.platform)
  return row


def plan_row(stack: str, fields: dict, percent: int, default_bytes: int,
             target: targets.Target, dtype: str = "bfloat16") -> DevicelessRow:
  """:func:`invact_jax.plan` of the loss as written (no remat, the plain head;
  ``convert=True``) at ``percent`` % of JAX default's predicted bytes, planned for
  ``target``: the row :class:`frontier.ProgramPlanRow` measures on the device, with the plan
  and its compiled temp as ``predicted_activation_bytes``."""
  spec = {"stack": stack, "policy": "none", "invact": True, "dtype": dtype,
          "configuration": f"program plan {percent} %", **fields}
  s = frontier.model_stack.shape_of(spec)
  budget = int(percent / 100 * default_bytes)
  row = {**frontier.model_stack.row_key(spec), "layers": s.layers, "batch": s.batch,
         "budget_bytes": budget}
  t0 = time.perf_counter()
  try:
    with targets.compiling_for(target):
      loss, args = _traced({**spec, "head": "plain", "invact": False})
      planned = invact_jax.plan(loss, *args, budget=budget, convert=True)
  except Exception as e:  # pylint: disable=broad-except  # infeasible, ...
    return child.error_row(e, **row)
  rep = planned.report
  row.update({"plan_program": rep.configuration, "plan_keeps": list(rep.keep),
              "plan_offloads": list(rep.offload), "plan_policy": rep.policy,
              "plan_as_written": rep.as_written, "predicted_bytes": rep.predicted_bytes,
              "compiled_temp_bytes": rep.compiled_bytes,
              "predicted_activation_bytes": rep.compiled_bytes,
              "plan_step_flops": rep.step_flops, "step_flops": rep.step_flops,
              "plan_recompute_flops": rep.predicted_recompute_flops,
              "planning_s": round(time.perf_counter() - t0, 2)})
  return row


def fitted(stack: str, target: targets.Target, device_rows: list[Row],
           dtype: str = "bfloat16") -> dict:
  """The stack's layers and batch: :data:`frontier.FIT`'s field as the device's committed
  rows measured it (so that predictions and measurements are of one shape), else fitted
  deviceless (:func:`frontier.layers_that_fit` for ``target``)."""
  s = frontier.STACKS[stack]
  fields = {"layers": s.layers, "batch": s.batch}
  field = frontier.FIT.get(stack)
  if field:
    carried = frontier.running.carried_fit(device_rows, stack, field)
    if carried is None:
      with targets.compiling_for(target):
        carried = frontier.layers_that_fit(stack, dtype, field=field)
    fields[field] = carried
  return fields


def rows(stacks, target: targets.Target, *, device_rows=(), dtype: str = "bfloat16",
         percents=PLAN_PERCENTS, plans: bool = True, policies=None,
         progress: Callable[[str], None] = lambda _: None) -> list[DevicelessRow]:
  """Every predicted row of ``stacks`` for ``target`` (:func:`specs` of ``policies``, then
  the plans at ``percents`` of JAX default's predicted bytes)."""
  out = []
  for stack in stacks:
    fields = fitted(stack, target, list(device_rows), dtype)
    progress(f"{stack}: {fields}")
    for spec in specs(stack, fields, dtype, policies):
      row = predict(spec, target)
      progress(f"{stack} {row['configuration']} invact={row['invact']} head={row['head']}: "
               + (f"{row['predicted_activation_bytes'] / 2**30:.3f} GiB" if "error" not in row
                  else row["error"]))
      out.append(row)
    default = next((r for r in out if r["model"] == stack and r["configuration"] == "default"
                    and not r["invact"] and r["head"] == "plain" and "error" not in r), None)
    if plans and default is not None:
      for percent in percents:
        row = plan_row(stack, fields, percent, default["predicted_activation_bytes"], target,
                       dtype)
        progress(f"{stack} {row['configuration']}: "
                 + (f"{row['predicted_activation_bytes'] / 2**30:.3f} GiB" if "error" not in row
                    else row["error"]))
        out.append(row)
  return out


#: The scale-out simulation (:func:`fsdp_rows`): llama3-8b's 32 layers, FSDP over the eight
#: GPUs of one host, one 4096-token sequence per GPU.
FSDP = {"stack": "llama3-8b", "layers": 32, "batch": 8, "device": "h100x8"}


def _fsdp(structs, mesh: jax.sharding.Mesh):
  """``structs`` sharded as FSDP shards them over ``mesh``'s one axis: every parameter along
  its first dimension the axis divides (a stacked layer parameter: after the layers'), the
  tokens along the batch."""
  axis, size = mesh.axis_names[0], mesh.devices.size
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name

  def shard(path, leaf):
    layered = any(getattr(k, "key", None) == "layers" for k in path)
    dims = list(range(1 if layered else 0, len(leaf.shape)))
    spec = [None] * len(leaf.shape)
    for d in dims:
      if leaf.shape[d] % size == 0:
        spec[d] = axis
        break
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                sharding=jax.sharding.NamedSharding(mesh, P(*spec)))
  return jax.tree_util.tree_map_with_path(shard, structs)


def fsdp_rows(device: str = FSDP["device"], stack: str = FSDP["stack"],
              layers: int = FSDP["layers"], batch: int = FSDP["batch"],
              policies=("none", "dots_no_batch", "full"), percents=(25, 50),
              dtype: str = "bfloat16",
              progress: Callable[[str], None] = lambda _: None) -> list[dict]:
  """Per-device memory of ``stack`` trained with FSDP over the devices of ``device`` (its
  parameters, their gradients and the batch sharded over one mesh axis, the gradients by a
  constraint on the parameters; XLA's SPMD partitioner gathers each layer's parameters where
  it is used): per policy, with and
  without ``invert``, then :func:`invact_jax.plan` at ``percents`` of JAX default's per-device
  temp.  Each row: ``temp_bytes``, ``argument_bytes`` and ``output_bytes`` per device."""
  target = targets.resolve(device)
  mesh = target.mesh((len(target.devices),), ("fsdp",))
  out = []

  def row_of(spec, fn, structs, t0, **extra):
    m = memory.compiled(jax.value_and_grad(fn), *structs)
    return {**frontier.model_stack.row_key(spec), "layers": layers, "batch": batch,
            "devices": len(target.devices), "temp_bytes": m.temp, "argument_bytes": m.argument,
            "output_bytes": m.output, "compile_s": round(time.perf_counter() - t0, 2), **extra}

  def sharded(loss, structs):
    """The loss with its parameters constrained to their FSDP shards: the constraint's
    transpose keeps the gradients sharded alike (a training step's update is per shard)."""
    placed = _fsdp(structs, mesh)
    params = jax.tree.map(lambda s: s.sharding, placed[0])
    return (lambda p, *rest: loss(jax.lax.with_sharding_constraint(p, params), *rest)), placed

  for policy in policies:
    for invact in (False, True):
      spec = {"stack": stack, "policy": policy, "invact": invact, "dtype": dtype,
              "layers": layers, "batch": batch}
      t0 = time.perf_counter()
      try:
        with targets.compiling_for(target):
          loss, structs = sharded(*_traced(spec))
          out.append(row_of(spec, loss, structs, t0))
      except Exception as e:  # pylint: disable=broad-except
        out.append(child.error_row(e, **frontier.model_stack.row_key(spec)))
      progress(f"fsdp {stack} x{len(target.devices)} {policy} invact={invact}: "
               + (f"{out[-1]['temp_bytes'] / 2**30:.3f} GiB temp per device"
                  if "error" not in out[-1] else out[-1]["error"]))
  default = next((r for r in out if r["configuration"] == "default" and not r["invact"]
                  and "error" not in r), None)
  for percent in percents if default is not None else ():
    spec = {"stack": stack, "policy": "none", "invact": True, "dtype": dtype, "layers": layers,
            "batch": batch, "configuration": f"program plan {percent} %"}
    budget = int(percent / 100 * default["temp_bytes"])
    t0 = time.perf_counter()
    try:
      with targets.compiling_for(target):
        loss, structs = sharded(*_traced({**spec, "invact": False}))
        planned = invact_jax.plan(loss, *structs, budget=budget, convert=True)
        rep = planned.report
        out.append(row_of(spec, planned, structs, t0, budget_bytes=budget,
                          plan_program=rep.configuration, plan_keeps=list(rep.keep),
                          plan_policy=rep.policy, predicted_bytes=rep.predicted_bytes))
    except Exception as e:  # pylint: disable=broad-except  # infeasible, ...
      out.append(child.error_row(e, **frontier.model_stack.row_key(spec), budget_bytes=budget))
    progress(f"fsdp {stack} {spec['configuration']}: "
             + (f"{out[-1]['temp_bytes'] / 2**30:.3f} GiB" if "error" not in out[-1]
                else out[-1]["error"]))
  return out


def _row_key(r: Row) -> tuple:
  return (r.get("model"), r.get("framework", "jax"), r.get("configuration"), bool(r.get("invact")),
          r.get("head", ""), r.get("dtype"), r.get("layers"), r.get("batch"))


def newest(bench: pathlib.Path, device_kind: str) -> list[Row]:
  """Every measured row of the device's committed frontier JSONs, the newest of each key
  (model, configuration, invact, head, dtype, layers, batch) first found from the newest
  file; a language model's invact row only where it recorded its head's tiles and they are
  today's (:func:`frontier.head_tiles`)."""
  out: dict = {}
  for p in sorted(bench.glob(f"frontier_{device_slug(device_kind)}_????-??-??.json"), reverse=True):
    data = json.loads(p.read_text())
    if data.get("dry"):
      continue
    for r in data["rows"]:
      if "error" in r or "activation_bytes" not in r or r.get("framework") != "jax":
        continue
      if r.get("invact") and frontier.STACKS[r["model"]].vocab:
        # invert's head at today's tiles only (rows before 2026-11-27 recorded none: they ran
        # the CPU's tiles on the GPU)
        s = dataclasses.replace(frontier.STACKS[r["model"]], batch=r.get("batch"),
                                layers=r.get("layers"))
        tiles = r.get("head_tiles")
        if not tiles or tiles != frontier.head_tiles(s, tiles.get("platform", "")):
          continue
      out.setdefault(_row_key(r), {**r, "file": p.name})
  return list(out.values())


def _step_group(r: Row) -> tuple:
  """The rows whose step times one line through their FLOPs predicts: one model, head,
  ``invert`` and layers scanned or unrolled (the same FLOPs, not the same copies; a plan row:
  the program it took, as written with the plain head or inverted)."""
  if "plan_program" in r:
    inverted = r["plan_program"] == "inverted"
    return (r["model"], "invact" if inverted else "plain", inverted, False)
  return (r["model"], r.get("head", ""), bool(r.get("invact")),
          str(r.get("configuration", "")).endswith(frontier.model_stack.UNROLLED))


def step_model(predicted: list[DevicelessRow], measured: list[Row]) -> dict[tuple, tuple]:
  """Per group (:func:`_step_group`), ``(ms, ms per FLOP, rows)``: the least-squares line
  through the device's committed step times against the predicted rows' ``step_flops``, over
  the group's measured rows that have a prediction (offloading rows left out: their
  transfers are no FLOPs); a group measured at fewer than two FLOP counts has none."""
  by = {_row_key(r): r for r in predicted if r.get("step_flops")}
  points: dict = {}
  for m in measured:
    p = by.get(_row_key(m))
    if p is None or not m.get("step_ms") or "offload" in str(m.get("configuration")):
      continue
    points.setdefault(_step_group(p), []).append((p["step_flops"], m["step_ms"]))
  out = {}
  for group, pts in points.items():
    x = np.array([f for f, _ in pts], float)
    y = np.array([ms for _, ms in pts], float)
    if len(pts) < 2 or np.ptp(x) <= 0:
      continue
    slope, intercept = np.polyfit(x, y, 1)
    out[group] = (float(intercept), float(slope), len(pts))
  return out


def with_step_times(predicted: list[DevicelessRow], measured: list[Row]
                    ) -> list[DevicelessRow]:
  """``predicted`` with ``predicted_step_ms`` (and ``step_calibration_rows``) on every row
  whose group :func:`step_model` fitted from ``measured``."""
  model = step_model(predicted, measured)
  for r in predicted:
    fit = model.get(_step_group(r)) if r.get("step_flops") and "error" not in r else None
    if fit is not None:
      r["predicted_step_ms"] = round(fit[0] + fit[1] * r["step_flops"], 2)
      r["step_calibration_rows"] = fit[2]
  return predicted


def agreement(predicted: list[dict], measured: list[dict]) -> list[dict]:
  """Every measured row that has a prediction, beside it: ``{key fields, measured,
  predicted, error, compile_peak}`` (``error``: measured / predicted − 1; ``compile_peak``:
  the measured bytes are the compile's peak, an upper bound of the step's,
  :func:`models.benchmarks.frontier.report.compile_peak`)."""
  from models.benchmarks.frontier import report  # pylint: disable=import-outside-toplevel
  by = {_row_key(r): r for r in predicted if "error" not in r}
  out = []
  for m in measured:
    p = by.get(_row_key(m))
    if p is None:
      continue
    out.append({"model": m["model"], "configuration": m["configuration"], "invact": m["invact"],
                "head": m.get("head", ""), "layers": m.get("layers"), "batch": m.get("batch"),
                "date": m.get("date", ""), "file": m.get("file", ""),
                "measured": m["activation_bytes"], "predicted": p["predicted_activation_bytes"],
                "error": m["activation_bytes"] / p["predicted_activation_bytes"] - 1,
                "compile_peak": report.compile_peak(m)})
  return out


def markdown(predicted: list[dict], measured: list[dict]) -> str:
  """The predictions as a table, each beside its device row where one was measured (bytes,
  ``≤`` where they are the compile's peak; the step time where :func:`with_step_times`
  predicted one)."""
  from models.benchmarks.frontier import report  # pylint: disable=import-outside-toplevel
  seen = {_row_key(m): m for m in measured}
  lines = ["| model | configuration | invact | head | layers × batch | predicted GiB | "
           "measured GiB | measured / predicted − 1 | predicted ms | measured ms |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
  for r in predicted:
    head = r.get("head") or "—"
    shape = f"{r.get('layers')} × {r.get('batch')}"
    if "error" in r:
      lines.append(f"| {r['model']} | {r['configuration']} | {'yes' if r['invact'] else 'no'} | "
                   f"{head} | {shape} | — | — | {r['error'][:80]} | — | — |")
      continue
    a = seen.get(_row_key(r))
    bound = "≤ " if a and report.compile_peak(a) else ""
    measured_cell = f"{bound}{a['activation_bytes'] / 2**30:.3f}" if a else "—"
    error_cell = (f"{a['activation_bytes'] / r['predicted_activation_bytes'] - 1:+.2%}" if a
                  else "")
    ms = f"{r['predicted_step_ms']:.0f}" if r.get("predicted_step_ms") else "—"
    measured_ms = f"{a['step_ms']:.0f}" if a and a.get("step_ms") else "—"
    lines.append(f"| {r['model']} | {r['configuration']} | {'yes' if r['invact'] else 'no'} | "
                 f"{head} | {shape} | {r['predicted_activation_bytes'] / 2**30:.3f} | "
                 f"{measured_cell} | {error_cell} | {ms} | {measured_ms} |")
  return "\n".join(lines)


#: The packages whose versions the JSON records.
VERSIONED = ("jax", "jaxlib", "jax-cuda12-plugin", "tokamax", "flax")


def run(out_dir: pathlib.Path, device: str, *, stacks=STACKS, plans: bool = True,
        date: str | None = None, progress: Callable[[str], None] = lambda _: None) -> pathlib.Path:
  """Predict ``stacks`` for ``device`` and write ``frontier_deviceless_<device>_<date>.json``
  in ``out_dir`` (``device``, ``device_kind``, ``date``, ``versions``, ``options``, ``rows``);
  returns its path."""
  target = targets.resolve(device)
  date = date or datetime.date.today().isoformat()
  measured = newest(pathlib.Path(out_dir), target.device_kind)
  rs = with_step_times(rows(stacks, target, device_rows=measured, plans=plans,
                            progress=progress), measured)
  path = pathlib.Path(out_dir) / f"frontier_deviceless_{device_slug(target.name)}_{date}.json"
  path.write_text(json.dumps({
      "device": target.name, "device_kind": target.device_kind, "date": date, "deviceless": True,
      "versions": benchmarks.versions(*VERSIONED),
      "options": {k: str(v) for k, v in target.compiler_options if k != "xla_gpu_cuda_data_dir"},
      "rows": rs}, indent=1) + "\n")
  return path


def run_fsdp(out_dir: pathlib.Path, device: str = FSDP["device"], *, date: str | None = None,
             progress: Callable[[str], None] = lambda _: None) -> pathlib.Path:
  """:func:`fsdp_rows` for ``device`` written to ``frontier_deviceless_<device>_<date>.json``
  (``fsdp``: the simulation's shape); returns its path."""
  target = targets.resolve(device)
  date = date or datetime.date.today().isoformat()
  rs = fsdp_rows(device, progress=progress)
  path = pathlib.Path(out_dir) / f"frontier_deviceless_{device_slug(target.name)}_{date}.json"
  path.write_text(json.dumps({
      "device": target.name, "device_kind": target.device_kind, "date": date, "deviceless": True,
      "fsdp": {k: v for k, v in FSDP.items() if k != "device"},
      "versions": benchmarks.versions(*VERSIONED),
      "options": {k: str(v) for k, v in target.compiler_options if k != "xla_gpu_cuda_data_dir"},
      "rows": rs}, indent=1) + "\n")
  return path


def fsdp_markdown(predicted: list[dict]) -> str:
  """The scale-out rows: per-device temp, arguments (parameter shards and tokens) and outputs
  (gradient shards)."""
  lines = ["| configuration | invact | temp GiB per device | arguments GiB | outputs GiB | plan |",
           "|---|---|---:|---:|---:|---|"]
  for r in predicted:
    if "error" in r:
      lines.append(f"| {r['configuration']} | {'yes' if r['invact'] else 'no'} | — | — | — | "
                   f"{r['error'][:80]} |")
      continue
    plan = ""
    if "plan_program" in r:
      kept = ", ".join(r["plan_keeps"]) or "nothing"
      plan = (f"{'invert(loss)' if r['plan_program'] == 'inverted' else 'as written'}: "
              + (f"JAX's {r['plan_policy']}" if r.get("plan_policy") else f"keeps [{kept}]")
              + f"; budget {r['budget_bytes'] / 2**30:.2f} GiB")
    lines.append(f"| {r['configuration']} | {'yes' if r['invact'] else 'no'} | "
                 f"{r['temp_bytes'] / 2**30:.3f} | {r['argument_bytes'] / 2**30:.3f} | "
                 f"{r['output_bytes'] / 2**30:.3f} | {plan} |")
  return "\n".join(lines)


def lm_head_markdown(predicted: list[dict], measured: list[dict]) -> str:
  """The LM head benchmark's temp column predicted, beside a device run's where it measured
  the same head."""
  by = {(r["dtype"], r["head"]): r for r in measured if "temp_bytes" in r}
  lines = ["| dtype | head | predicted MiB | measured MiB | measured / predicted − 1 | "
           "[N, V] buffer |", "|---|---|---:|---:|---:|---|"]
  for r in predicted:
    if "error" in r:
      lines.append(f"| {r['dtype']} | {r['head']} | — | — | {r['error'][:80]} | |")
      continue
    m = by.get((r["dtype"], r["head"]))
    lines.append(f"| {r['dtype']} | {r['head']} | {r['temp_bytes'] / 2**20:,.1f} | "
                 + (f"{m['temp_bytes'] / 2**20:,.1f} | {m['temp_bytes'] / r['temp_bytes'] - 1:+.2%}"
                    if m else "— | ")
                 + f" | {'yes' if r['logits_buffer'] else 'no'} |")
  return "\n".join(lines)


DOCS_BLOCK = re.compile(r"(<!-- deviceless (frontier|fsdp|lm-head): (\S+?) -->\n)(.*?)(<!-- end -->)",
                        re.S)


def _measured_lm_head(bench: pathlib.Path, meta: dict) -> list[dict]:
  """The rows of the newest measured LM head run on ``meta``'s device and shape."""
  best = None
  for p in sorted(bench.glob("lm_head_*.json")):
    data = json.loads(p.read_text())
    m = data["meta"]
    if (m.get("deviceless") or m["device"] != meta["device"]
        or (m["tokens"], m["d"], m["vocab"]) != (meta["tokens"], meta["d"], meta["vocab"])):
      continue
    if best is None or m["date"] >= best[0]:
      best = (m["date"], data["rows"])
  return best[1] if best else []


def render_docs(text: str, root: pathlib.Path) -> str:
  """``text`` with every ``<!-- deviceless KIND: bench/FILE.json -->`` ... ``<!-- end -->``
  block rewritten from that committed JSON (KIND ``frontier``: predicted beside the device's
  rows; ``fsdp``: the scale-out rows; ``lm-head``: the head benchmark's temp column beside the
  device's), preceded by the versions and date that produced it."""
  root = pathlib.Path(root)

  def block(m) -> str:
    kind, rel = m.group(2), m.group(3)
    data = json.loads((root / rel).read_text())
    if kind == "lm-head":
      meta = data["meta"]
      command = re.sub(r" --json \S+", "", meta["command"])
      where = (f"`{command}` (`{rel}`): compiled for {meta['target']} ({meta['device']}) on "
               f"{meta['host']}, JAX {meta['jax']}, {meta['date']}; measured: the newest run "
               f"on the device of that shape")
      table = lm_head_markdown(data["rows"], _measured_lm_head(root / "bench", meta))
    else:
      v = data["versions"]
      where = (f"`python scripts/frontier_deviceless.py --device {data['device']}"
               f"{' --fsdp' if kind == 'fsdp' else ''}` (`{rel}`): compiled for "
               f"{data['device']} ({data['device_kind']}) without it, JAX {v['jax']}, "
               f"jax-cuda12-plugin {v.get('jax-cuda12-plugin')}, tokamax {v.get('tokamax')}, "
               f"XLA options {data['options']}, {data['date']}")
      table = (fsdp_markdown(data["rows"]) if kind == "fsdp" else
               markdown(data["rows"], newest(root / "bench", data["device_kind"])))
    return f"{m.group(1)}{where}:\n\n{table}\n{m.group(5)}"
  return DOCS_BLOCK.sub(block, text)


def write_docs(bench: pathlib.Path, page: pathlib.Path) -> int:
  """Rewrite ``page``'s blocks (:func:`render_docs`; ``bench``'s parent is the root)."""
  page.write_text(render_docs(page.read_text(), pathlib.Path(bench).parent))
  return 0
