"""Running the frontier: every row in its order (:data:`LM_ORDER`), continuing from the
device's earlier rows, and :func:`run` (the section's JSON, markdown and plot)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Callable

import jax

from models.benchmarks import child
from models.benchmarks.frontier import measurement, model_stack, planning, report
from models.benchmarks.frontier.schema import (JaxRow, PlanRow, ProgramPlanRow, Row, RowKind,
                                               Spec, TorchRow)


#: A language model's rows, the decisive ones first: a deadline cuts the rest.  JAX default
#: (the budgets' reference) and invert's (the inverted program's step, which a plan's
#: predicted step scales; then the same with its layers unrolled: none of the scan's copies),
#: then what decides the open targets at 10 % and 25 % of its bytes (``invact_jax.plan``'s
#: rows and the rows that fit there, with invert and JAX-only with tokamax's head), the
#: profiled rows and PyTorch's, then the rest.  The calibrated plans come
#: after each side's ``default``, ``full`` and ``dots_no_batch``, which they are calibrated on.
LM_ORDER: tuple[RowKind, ...] = (
    JaxRow("none", False, "plain"), JaxRow("none", True, "invact"),
    JaxRow("none", True, "invact", unrolled=True),
    ProgramPlanRow(10), ProgramPlanRow(25),
    JaxRow("full", True, "invact"), JaxRow("save_qkv_proj", True, "invact"),
    JaxRow("full", False, "tokamax"), JaxRow("save_qkv_proj", False, "tokamax"),
    JaxRow("dots_no_batch", False, "plain"),
    TorchRow("eager"), TorchRow("liger"), ProgramPlanRow(50),
    JaxRow("full", False, "plain"), JaxRow("save_qkv_proj", False, "plain"),
    JaxRow("dots_no_batch", True, "invact"), JaxRow("minimal_offloaded", False, "plain"),
    PlanRow(25), PlanRow(50), JaxRow("dots_no_batch", False, "tokamax"),
    *(JaxRow(p, i, "invact" if i else "plain") for p in (
        "minimal", "save_dot_except_mlp", "save_out_proj", "dots") for i in (False, True)),
    JaxRow("minimal_offloaded", True, "invact"), PlanRow(75), ProgramPlanRow(75),
    TorchRow("checkpoint"),
    TorchRow("liger+checkpoint"), TorchRow("compile"))


def torch_head(configuration: str) -> str:
  """A PyTorch language model's head: Liger's fused linear cross-entropy where Liger runs."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  return "liger" if frontier_torch.CONFIGURATIONS[configuration].liger else "plain"


def torch_key(name: str, configuration: str) -> Row:
  """The fields that name PyTorch row ``configuration`` of stack ``name`` (its head "" where
  the stack has no vocabulary)."""
  head = torch_head(configuration) if model_stack.STACKS[name].vocab else ""
  return {"model": name, "framework": "torch", "configuration": configuration, "invact": False,
          "head": head}


def jax_spec(name: str, item: JaxRow, fields: dict, *, dtype: str, repeats: int) -> Spec:
  """The spec of :class:`JaxRow` ``item`` of stack ``name`` at ``fields`` (layers, batch)."""
  return {"stack": name, "policy": item.policy, "invact": item.invact, "dtype": dtype,
          "repeats": repeats, "head": "plain" if item.invact else item.head, **fields,
          **({"unrolled": True} if item.unrolled else {})}


def same_row(a: Row, b: Row) -> bool:
  return all(a.get(k) == b.get(k) for k in ("model", "framework", "configuration", "invact",
                                            "head"))


@dataclasses.dataclass
class _Rows:
  """One :func:`rows` call's settings and the rows so far; its methods measure a row each."""
  dtype: str
  repeats: int
  in_process: bool
  deadline: float
  date: str
  progress: Callable[[str], None]
  out: list[Row] = dataclasses.field(default_factory=list)
  isolated: bool | None = None  #: :meth:`isolate`'s answer (None: not asked yet)

  def one(self, spec: Spec) -> Row:
    """A JAX row: in this process, or a child's; on a device that reports its peak, a
    child that compiles nothing itself (:func:`measurement.isolated_row`)."""
    if self.in_process:
      row = measurement.child_row(spec)
    else:
      env = {**os.environ, **model_stack.ROW_ENV}
      timeout = self.deadline - time.time()
      row = {**model_stack.row_key(spec), **(
          measurement.isolated_row(spec, timeout, env) if self.isolate() else
          child.run_child(measurement.CHILD, spec, timeout, env=env))}
    return {**row, "date": self.date} if self.date else row

  def isolate(self) -> bool:
    """Whether rows compile in a child of their own (:func:`measurement.isolated_row`):
    where the device reports its allocator's peak, which a compile's autotuning raises."""
    if self.isolated is None:
      from invact_jax import memory  # pylint: disable=import-outside-toplevel
      self.isolated = memory.reports_peak()
    return self.isolated

  def torch_row(self, name: str, configuration: str, fields: dict, extra=None) -> Row:
    """A PyTorch row; ``extra``: more of the child's spec (``profile``, ``trace_out``)."""
    spec = {"stack": name, "configuration": configuration, "dtype": self.dtype,
            "repeats": self.repeats, **(extra or {}),
            "shape": dataclasses.asdict(dataclasses.replace(model_stack.STACKS[name], **fields))}
    res = child.run_child("models.benchmarks.frontier_torch", spec, self.deadline - time.time())
    return {**torch_key(name, configuration), "dtype": self.dtype, **fields, **res,
            **({"date": self.date} if self.date else {})}

  def plan_rows(self, name, budgets):
    for spec in planning.plan_specs(self.out, name, dtype=self.dtype, repeats=self.repeats,
                                    budgets=budgets):
      if "error" in spec or time.time() > self.deadline:
        self.out.append({**model_stack.row_key(spec), "error": spec.get("error", "out of time"),
                         **({"budget_bytes": spec["budget_bytes"]} if "budget_bytes" in spec
                            else {})})
        continue
      self.progress(f"frontier {name} {spec['configuration']}")
      row = self.one(spec)
      row.update({k: spec[k] for k in ("budget_bytes", "predicted_bytes", "predicted_step_ms",
                                       "runs")})
      if "error" not in row:
        row["prediction_error"] = row["activation_bytes"] / spec["predicted_bytes"] - 1
      self.out.append(row)

  def program_plan_row(self, name, percent, fields):
    spec = planning.program_plan_spec(self.out, name, percent, dtype=self.dtype,
                                      repeats=self.repeats, fields=fields)
    if "error" in spec:
      self.out.append({**model_stack.row_key(spec), "error": spec["error"]})
      return
    self.progress(f"frontier {name} {spec['configuration']}")
    row = self.one(spec)
    row["budget_bytes"] = spec["budget_bytes"]
    for k, v in fields.items():  # (an error row says which model it is of, too)
      row.setdefault(k, v)
    row.update(planning.program_plan_prediction(row, self.out))
    self.out.append(row)

  def fitted(self, name, field):
    """The stack's ``field`` that fits, from a child process: compiling for the device
    (autotuning) grows this process's allocator, which would keep that memory from the
    rows' own processes."""
    spec = {"fit": name, "dtype": self.dtype, "field": field}
    res = measurement.child_row(spec) if self.in_process else child.run_child(
        "models.benchmarks.frontier", spec, self.deadline - time.time())
    return res.get("fit"), res.get("error")


def rows(stacks, *, dtype: str = "bfloat16", policies=None, repeats: int = 5,
         in_process: bool = False, torch_configurations=None, deadline: float = math.inf,
         plans: bool = True, done=(), date: str = "",
         progress: Callable[[str], None] = lambda _: None) -> list[Row]:
  """Per stack: the torch rows where torch is importable (the baselines first: a deadline
  cuts the JAX rows, not the comparison), every (policy, invact) row, then the planner's plans
  (with ``plans``, where the policies it is calibrated on were measured); per language model
  the rows of :data:`LM_ORDER` (:func:`_lm_rows`), those in ``done`` (an earlier run's rows
  of the same layers and batch) carried over, not measured again.  Stacks in :data:`FIT`
  have as many layers, or the largest batch, as fit (on a GPU; found in a child process).
  Rows measured here carry ``date``."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  policies = [p for p in (policies or model_stack.POLICIES)
              if p != "minimal_offloaded" or model_stack.has_memory_kinds()]

  run = _Rows(dtype, repeats, in_process, deadline, date, progress)
  out, one, torch_row, plan_rows = run.out, run.one, run.torch_row, run.plan_rows
  program_plan_row, fitted = run.program_plan_row, run.fitted
  torch_ok = frontier_torch.importable()
  torch_configurations = ((frontier_torch.CONFIGURATIONS if torch_configurations is None
                           else torch_configurations) if torch_ok else ())
  for name in stacks:
    fields = _fields(name, done, fitted, progress, out)
    if fields is None:
      continue
    if model_stack.STACKS[name].vocab:
      if not _lm_rows(name, fields, out, policies=policies, torch_configurations=torch_configurations,
                      torch_ok=torch_ok, one=one, torch_row=torch_row, plan_rows=plan_rows,
                      program_plan_row=program_plan_row,
                      plans=plans, done=done, deadline=deadline, dtype=dtype,
                      repeats=repeats, progress=progress):
        return out
      continue
    jobs = [(f"torch {c}", functools.partial(torch_row, name, c, fields))
            for c in torch_configurations]
    jobs += [(f"{p}{' +invact' if i else ''}", functools.partial(one, {
        "stack": name, "policy": p, "invact": i, "dtype": dtype, "repeats": repeats, **fields}))
             for p in policies for i in (False, True)]
    for label, job in jobs:
      if time.time() > deadline:
        progress("frontier: out of time")
        return out
      progress(f"frontier {name} {label}")
      out.append(job())
    if plans and set(planning.PLAN_POLICIES) | {"none"} <= set(policies):
      plan_rows(name, model_stack.PLAN_BUDGETS)
  return out


def _fields(name: str, done, fitted: Callable, progress: Callable[[str], None],
            out: list[Row]) -> dict | None:
  """The stack's layers and batch: :data:`FIT`'s field carried over from ``done`` or
  ``fitted`` (None, with an error row in ``out``, where the fit failed)."""
  fit = model_stack.FIT.get(name)
  fields = {"layers": model_stack.STACKS[name].layers, "batch": model_stack.STACKS[name].batch}
  if not fit:
    return fields
  fields[fit], why = carried_fit(done, name, fit), None
  if fields[fit] is not None:
    progress(f"frontier {name}: the {fit} that fits, {fields[fit]}, carried over")
  else:
    progress(f"frontier {name}: the {fit} that fits")
    fields[fit], why = fitted(name, fit)
  if why is None:
    return fields
  out.append({"model": name, "framework": "jax", "configuration": "default", "invact": False,
              "head": "plain" if model_stack.STACKS[name].vocab else "",
              "error": f"the {fit} that fits: {why}"})
  return None


def _lm_rows(name, fields, out, *, policies, torch_configurations, torch_ok, one, torch_row,
             plan_rows, program_plan_row, plans, done, deadline, dtype, repeats,
             progress) -> bool:
  """A language model's rows in :data:`LM_ORDER` appended to ``out`` (rows of ``done`` for
  the same model, configuration, invact, head, layers and batch carried over, an invact row
  only while its head's tiles are today's, :func:`head_tiles`; a row whose bytes bound the
  step's, :func:`report.compile_peak`, measured again, and kept where that fails); False when
  the deadline cut them."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  shape = dataclasses.replace(model_stack.STACKS[name], **fields)
  usable = [r for r in done if r.get("model") == name and "error" not in r
            and all(r.get(k) == v for k, v in fields.items())
            and (not r.get("invact") or r.get("head_tiles") == model_stack.head_tiles(
                shape, (r.get("head_tiles") or {}).get("platform", "")))]
  # a bound (its compile's peak) is measured again, and kept where that measurement fails
  earlier = [r for r in usable if not report.compile_peak(r)]
  bounds = [r for r in usable if report.compile_peak(r)]
  wanted = frontier_torch.CONFIGURATIONS if torch_configurations is None else torch_configurations
  for item in LM_ORDER:
    if isinstance(item, PlanRow):
      configuration = f"plan {item.percent} %"
      carried = next((r for r in earlier if r.get("configuration") == configuration), None)
      if carried is not None:
        out.append(carried)
      elif plans:
        plan_rows(name, (item.percent / 100,))
      continue
    if isinstance(item, ProgramPlanRow):
      configuration = f"program plan {item.percent} %"
      carried = next((r for r in earlier if r.get("configuration") == configuration), None)
      carried = carried or infeasible_before(done, out, name, item.percent, fields,
                                              dtype=dtype, repeats=repeats)
      if carried is not None:
        out.append(carried)
      elif plans and time.time() <= deadline:
        program_plan_row(name, item.percent, fields)
      continue
    if isinstance(item, TorchRow):
      if not torch_ok or item.configuration not in wanted:
        continue
      key = torch_key(name, item.configuration)
    else:
      if item.policy not in policies:
        continue
      spec = jax_spec(name, item, fields, dtype=dtype, repeats=repeats)
      key = model_stack.row_key(spec)
    carried = next((r for r in earlier if same_row(r, key)), None)
    if carried is not None:
      out.append(carried)
      continue
    if time.time() > deadline:
      progress("frontier: out of time")
      return False
    progress(f"frontier {name} {key['configuration']} head={key['head']}"
             f"{' +invact' if key['invact'] else ''}")
    row = torch_row(name, item.configuration, fields) if key["framework"] == "torch" else one(spec)
    bound = next((r for r in bounds if same_row(r, key)), None) if "error" in row else None
    if bound is not None:
      progress(f"  {row['error']}: the earlier bound kept")
    out.append(bound or row)
  return True


def carried_fit(done: list[Row], name: str, field: str) -> int | None:
  """The ``field`` (layers or batch) an earlier run fitted to the device for stack ``name``:
  the one value its measured rows share (None where none was measured or they differ)."""
  values = {r.get(field) for r in done if r.get("model") == name and "error" not in r}
  return values.pop() if len(values) == 1 and None not in values else None


def infeasible_before(done: list[Row], out: list[Row], name: str, percent: int,
                       fields: dict, *, dtype: str, repeats: int) -> Row | None:
  """An earlier run's :class:`ProgramPlanRow` ``percent`` that the planner found infeasible at
  the budget this run gives it (JAX default's row the same): the same answer again, not
  planned again."""
  spec = planning.program_plan_spec(out, name, percent, dtype=dtype, repeats=repeats, fields=fields)
  return next((r for r in done if r.get("model") == name
               and r.get("configuration") == spec["configuration"]
               and str(r.get("error", "")).startswith("InfeasibleBudget")
               and "budget_bytes" in spec and r.get("budget_bytes") == spec["budget_bytes"]
               and all(r.get(k) == v for k, v in fields.items())), None)


#: The stacks a GPU run measures, in order (the language models first).
GPU_STACKS = ("llama3-1b", "llama3-8b", "llama", "gpt2-medium", "vit-l16")


#: The dry run's (CPU, tiny, in this process): a language model (its layers are the stacks').
DRY_STACKS = ("dry-llama3",)


def device_slug(device_kind: str) -> str:
  """A device kind as the benchmarks' file names spell it (``nvidia-h100-80gb-hbm3``)."""
  import re  # pylint: disable=import-outside-toplevel
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


def earlier_rows(out_dir, device: str) -> list[Row]:
  """The rows of the newest non-dry frontier JSON of ``device`` in ``out_dir`` (what a run
  continues from), or []."""
  import pathlib  # pylint: disable=import-outside-toplevel
  for p in sorted(pathlib.Path(out_dir).glob(f"frontier_{device_slug(device)}_????-??-??.json"),
                  reverse=True):
    data = json.loads(p.read_text())
    if not data.get("dry"):
      return data["rows"]
  return []


def run(out_dir, *, device: str, date: str, dry: bool, deadline: float = math.inf,
        stacks=None, progress: Callable[[str], None] = lambda _: None) -> dict:
  """The frontier section: rows for :data:`GPU_STACKS` (``dry``: :data:`DRY_STACKS`, two
  policies, no plans — tests/benchmarks/test_frontier.py runs those —, in this process),
  continuing from the device's newest frontier JSON in
  ``out_dir`` (its rows carried over), their Pareto front, ``frontier_<device>_<date>.json``
  (``device``, ``rows``), ``.md`` and ``.png`` in ``out_dir``."""
  import pathlib  # pylint: disable=import-outside-toplevel
  stacks = stacks or list(DRY_STACKS if dry else GPU_STACKS)
  rs = report.pareto(planning.with_predictions(rows(stacks, dtype="float32" if dry else "bfloat16",
                   policies=["none", "full"] if dry else None,
                   repeats=2 if dry else 7, in_process=dry,
                   torch_configurations=("eager", "checkpoint") if dry else None,
                   deadline=deadline, progress=progress, date=date, plans=not dry,
                   done=() if dry else earlier_rows(out_dir, device))))
  out = pathlib.Path(out_dir) / f"frontier_{device_slug(device)}_{date}"
  out.parent.mkdir(parents=True, exist_ok=True)
  versions = {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None)}
  out.with_suffix(".json").write_text(json.dumps({"device": device, "date": date, "dry": dry,
                                                  "versions": versions, "rows": rs}, indent=1))
  out.with_suffix(".md").write_text(report.markdown(rs) + "\n")
  if any("error" not in r for r in rs):
    report.plot(rs, out.with_suffix(".png"))
  path = out.with_suffix(".json").resolve()
  root = pathlib.Path(__file__).resolve().parents[3]
  # the report names it as the docs link it: from the repository's root where it is inside
  return {"json": str(path.relative_to(root) if path.is_relative_to(root) else path),
          "rows": rs}
