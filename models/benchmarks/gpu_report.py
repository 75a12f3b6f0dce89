"""The GPU report: every GPU figure the docs promise, from one command.

The logic behind ``scripts/gpu_report.py``.  Sections, each bounded in time:

* ``kernels``: :func:`models.benchmarks.op_speed.measure` at >= 2^26 elements, bf16 and f32:
  jax.nn, the XLA path, the Pallas kernels (and Triton when available) against a device copy
  timed in the same process; GB/s and the fraction of the copy's.
* ``models``: ViT-B/16 and GPT-2, forward+backward (``value_and_grad``), per configuration
  the allocator's ``peak_bytes_in_use`` (one child process each: the peak never resets) and
  the step time (one child process, configurations interleaved, medians).
* ``max_batch``: the largest ViT-B/16 batch that runs, default vs inverted-all (bisection,
  one child process per probe, bounded probes).
* ``planner``: :mod:`models.benchmarks.plan_memory` (``invact_jax.plan``) at three budgets.
* ``frontier``: :mod:`models.benchmarks.frontier`: jax.checkpoint policies and MaxText's
  presets with and without invact_jax, and PyTorch (+ Liger-Kernel), on the memory-time plane.

Children are modules, never scripts (:mod:`models.benchmarks.child`): this module's
:func:`measure` run as ``python -m models.benchmarks.gpu_report SPEC_JSON``.  The GPU tests are not a section: they run as
``python -m pytest -m gpu`` (docs/gpu-report.md); reports of earlier runs that hold a
``tests`` section still render it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

from models import benchmarks
from models.benchmarks import child

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "models", "max_batch", "planner", "frontier")
#: The ``models`` section's rows: (configuration of models.options, implementation of the
#: invact_jax ops; None: XLA).
SETUPS: tuple[tuple[str, str | None], ...] = (
    ("standard", None), ("checkpointed", None), ("inverted", None), ("inverted-all", None),
    ("inverted", "pallas"), ("inverted-all", "pallas"))
# Children share the GPU one at a time: grow on demand, up to (almost) all of it.
CHILD_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95",
             "PYTHONUNBUFFERED": "1"}

__all__ = ["SECTIONS", "SETUPS", "label", "newest_per_device", "newest_per_section", "environment", "kernels",
           "models", "max_batch", "planner", "measure", "markdown", "write_docs", "run"]


#: The packages whose versions the JSON records.
VERSIONED = ("jax", "jaxlib", "flax", "optax", "triton", "jax-triton", "numpy")


def environment() -> dict:
  """Device kind, driver, versions, date: the header of every figure."""
  import jax  # pylint: disable=import-outside-toplevel
  driver = None
  try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30, check=True
                            ).stdout.strip().splitlines()[0]
  except (OSError, subprocess.SubprocessError, IndexError):
    pass
  dev = jax.devices()[0]
  return {"date": datetime.date.today().isoformat(), "platform": jax.default_backend(),
          "host": benchmarks.host(), "device": str(dev.device_kind), "device_count": jax.device_count(), "driver": driver,
          "python": platform.python_version(), "versions": benchmarks.versions(*VERSIONED)}


# --------------------------------------------------------------------------- kernels
def kernels(*, activations: Sequence[str], sizes: Sequence[int], dtypes: Sequence[str],
            implementations: Sequence, repeats: int, inner: int,
            progress: Callable[[str], None]) -> list[dict]:
  """op_speed rows plus each row's fraction of the same-size, same-dtype copy's GB/s."""
  from models.benchmarks import op_speed  # pylint: disable=import-outside-toplevel
  rows = []
  for a in activations:
    got = op_speed.measure(activation=a, sizes=sizes, dtypes=dtypes,
                           implementations=implementations, repeats=repeats, inner=inner,
                           progress=progress)
    copy = {(r.dtype, r.elements): r.gbps for r in got if r.implementation == "copy"}
    for r in got:
      d = r.as_dict()
      d["fraction_of_copy"] = r.gbps / copy[(r.dtype, r.elements)]
      rows.append(d)
  return rows


# ---------------------------------------------------------------------------- models
def label(configuration: str, implementation: str | None = None) -> str:
  """A row's name in the report: the configuration, and its implementation where set."""
  return configuration if implementation is None else f"{configuration} ({implementation})"


def _step(model: str, dtype: str, batch: int, configuration: str, seq_len: int, depth,
          implementation: str | None = None):
  from models.benchmarks import model_memory  # pylint: disable=import-outside-toplevel
  _, step, args = model_memory.gradient_step(
      model, dtype, batch, configuration, implementation=implementation, seq_len=seq_len,
      extra=None if depth is None else {"depth": depth})
  return step, args


def _is_oom(err: BaseException) -> bool:
  text = str(err)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def measure(spec: dict) -> dict:
  """One measurement in this process (see the module doc); ``spec["kind"]`` names it."""
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  kind = spec["kind"]
  if kind == "planner":  # the planner's frontier, written where the options say
    from models.benchmarks import plan_memory  # pylint: disable=import-outside-toplevel
    opts = dict(spec["options"])
    opts["out"] = pathlib.Path(opts["out"])
    return {"returncode": plan_memory.run(plan_memory.Options(**opts))}
  common = dict(dtype=spec["dtype"], batch=spec["batch"], seq_len=spec["seq_len"],
                depth=spec.get("depth"))
  if kind == "peak":
    step, args = _step(spec["model"], configuration=spec["configuration"],
                       implementation=spec.get("implementation"), **common)
    if not memory.reports_peak():
      return {"compiled_temp_bytes": memory.compiled(step, *args).temp}
    out = memory.device_peak(step, *args)  # one compile: the temp is its executable's
    out["compiled_temp_bytes"] = out["temp_bytes"]
    return out
  if kind == "fits":
    try:
      step, args = _step(spec["model"], configuration=spec["configuration"], **common)
      for _ in range(2):
        jax.block_until_ready(step(*args))
    except Exception as e:  # pylint: disable=broad-except
      if _is_oom(e):
        return {"fits": False}
      raise
    return {"fits": True}
  if kind == "times":
    steps = {label(c, i): _step(spec["model"], configuration=c, implementation=i, **common)
             for c, i in spec["setups"]}
    exes = {c: (s.lower(*a).compile(), a) for c, (s, a) in steps.items()}
    for exe, a in exes.values():
      jax.block_until_ready(exe(*a))
    times = {c: [] for c in exes}
    for _ in range(spec["rounds"]):
      for c, (exe, a) in exes.items():
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*a))
        times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(v) for c, v in times.items()}
  raise ValueError(f"argument `spec`: unknown kind {kind!r}")


def _run_child(spec: dict, timeout_s: float) -> dict:
  """:func:`measure` of ``spec`` in a child process sharing the GPU (:data:`CHILD_ENV`)."""
  return child.run_child("models.benchmarks.gpu_report", spec, timeout_s,
                         env={**os.environ, **CHILD_ENV})


def models(*, specs: Sequence[dict], rounds: int, deadline: float,
           progress: Callable[[str], None], previous: Sequence[dict] = (),
           setups: Sequence[tuple[str, str | None]] = SETUPS) -> list[dict]:
  """Per (model, dtype, batch): each setup's peak (own process) and interleaved step times
  (one process), keyed by :func:`label`.  ``specs``: dicts with model, dtype, batch,
  seq_len[, depth]; ``setups``: (configuration, implementation) pairs.

  Figures already in ``previous`` (an earlier report's groups for the same spec) are kept
  and not measured again: a report cut short by its time limit resumes where it stopped.
  """
  rows = []
  for s in specs:
    old = next((g for g in previous if all(g.get(k) == v for k, v in s.items())), {})
    group = {**s, "peaks": dict(old.get("peaks", {})),
             "step_time_s": dict(old.get("step_time_s", {}))}
    for c, i in setups:
      if "error" in group["peaks"].get(label(c, i), {"error": None}):
        progress(f"peak {s['model']} {label(c, i)}")
        group["peaks"][label(c, i)] = _run_child(
            {**s, "kind": "peak", "configuration": c, "implementation": i}, deadline - time.time())
    if ("error" in group["step_time_s"]
        or {label(c, i) for c, i in setups} - set(group["step_time_s"])):
      progress(f"times {s['model']}")
      group["step_time_s"] = _run_child({**s, "kind": "times", "rounds": rounds,
                                         "setups": [list(x) for x in setups]},
                                        deadline - time.time())
    rows.append(group)
  return rows


def _round_batch(b: int) -> int:
  return b if b < 16 else b // 8 * 8


def max_batch(*, model: str, dtype: str, configurations: Sequence[str], start: int,
              max_probes: int, deadline: float, depth=None, grow: float = 2.0,
              progress: Callable[[str], None]) -> dict:
  """Largest batch that runs, per configuration: from ``start`` (a prediction, say) step up
  by ``grow`` while probes fit, or down while they fail, then bisect; at most
  ``max_probes`` child processes each (bounded time), batches rounded to multiples of 8.
  Each further step down is squared (/1.08, /1.17, /1.36, ...): a prediction too high by
  25 % (ViT-B/16 inverted-all on an H100) is bracketed in four probes, not six."""
  out = {}
  for c in configurations:
    lo, hi, probes, step = 0, None, [], grow
    b = _round_batch(start)
    while len(probes) < max_probes and time.time() < deadline:
      progress(f"max batch {model} {c} {b}")
      r = _run_child({"kind": "fits", "model": model, "dtype": dtype, "batch": b, "seq_len": 0,
                      "configuration": c, "depth": depth}, deadline - time.time())
      if "error" in r:
        probes.append({"batch": b, "error": r["error"]})
        break
      probes.append({"batch": b, "fits": r["fits"]})
      if r["fits"]:
        lo = b
      else:
        hi = b
      if hi is None:
        b = max(b + 1, _round_batch(int(b * grow)))
      elif lo == 0:
        if b <= 1:
          break
        b = max(1, _round_batch(int(b / step)))
        step *= step
      elif hi - lo <= max(1, lo // 16):  # within ~6 %
        break
      else:
        b = _round_batch((lo + hi) // 2)
        if b in (lo, hi):
          break
    out[c] = {"largest_fitting": lo, "smallest_failing": hi, "probes": probes}
  return out


def newest_per_device(paths) -> list:
  """Of report files ``gpu_<device>_<date>.json``, the newest of each device, sorted."""
  latest = {}
  for p in sorted(paths):
    latest[p.stem.rsplit("_", 1)[0]] = p
  return sorted(latest.values())


def newest_per_section(paths) -> list:
  """Of report files ``gpu_<device>_<date>.json``, per device the newest, then each older one
  that holds a section (the frontier: a model's rows) no newer one of the device holds (a
  report may have run only some sections); newest first per device, devices sorted."""
  import json  # pylint: disable=import-outside-toplevel
  by_device = {}
  for p in sorted(paths):
    by_device.setdefault(p.stem.rsplit("_", 1)[0], []).append(p)
  out = []
  def held(report: dict) -> set:  # the frontier counts per model (a run may hold some stacks)
    # ("tests": a section of reports before the GPU tests became `pytest -m gpu`)
    out = {s for s in (*SECTIONS, "tests") if s != "frontier" and report.get(s)}
    return out | {f"frontier {r.get('model')}" for r in (report.get("frontier") or {}).get(
        "rows", ()) if "error" not in r}
  for device in sorted(by_device):
    covered = set()
    for i, p in enumerate(reversed(by_device[device])):
      have = held(json.loads(p.read_text()))
      if i == 0 or have - covered:
        out.append(p)
      covered |= have
  return out


def _largest(r: dict) -> str:
  tried = ", ".join(str(p["batch"]) for p in r["probes"])
  if not r["largest_fitting"]:
    return f"not found (every probe failed: {tried})"
  if r["smallest_failing"] is None:
    return f">= {r['largest_fitting']} (no probe failed: {tried})"
  return f"{r['largest_fitting']} (fails at {r['smallest_failing']})"


def planner(out_dir: pathlib.Path, *, model: str, batch: int, timeout_s: float,
            seq_len: int | None = None) -> dict:
  """:mod:`models.benchmarks.plan_memory` at three budgets in a child process
  (:func:`measure`'s ``"planner"``)."""
  options = {"models": model, "batch": batch, "points": 3, "out": str(out_dir / "gpu_planner"),
             **({} if seq_len is None else {"seq_len": seq_len})}
  cmd = [sys.executable, "-m", "models.benchmarks.gpu_report",
         json.dumps({"kind": "planner", "options": options})]
  try:
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CHILD_ENV}, capture_output=True,
                          text=True, timeout=max(timeout_s, 1.0), check=False)
  except subprocess.TimeoutExpired as e:  # say where it was: the last progress line
    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    where = err.replace("\r", "\n").strip().splitlines()[-1:] or ["before any progress"]
    return {"error": f"timed out after {timeout_s:.0f} s at: {where[0][-200:]}",
            "command": " ".join(cmd[1:])}
  try:  # the child's row (its last line): plan_memory's exit code, or why it raised
    row = json.loads(done.stdout.strip().splitlines()[-1])
  except (IndexError, ValueError):
    row = {"returncode": done.returncode or 1}
  code = row.get("returncode", 1)
  res = {"command": " ".join(cmd[1:]), "returncode": code,
         "tail": (row.get("error", "") + "\n" + done.stderr[-1500:]).strip() if code else ""}
  path = out_dir / "gpu_planner.json"
  if code == 0 and path.is_file():
    res["results"] = json.loads(path.read_text())["results"]
  return res


# --------------------------------------------------------------------------- report
def _mib(b):
  return "n/a" if b is None else f"{b / 2**20:,.0f}"


def markdown(report: dict) -> str:
  """The report block of docs/gpu-report.md, from a report JSON."""
  env = report["environment"]
  v = env["versions"]
  lines = [f"Measured by `scripts/gpu_report.py` on {env['device']} (driver {env['driver']}), "
           f"JAX {v['jax']}, Triton {v['triton']}, Python {env['python']}, {env['date']}; "
           f"sections took {report['seconds']:.0f} s.", ""]
  k = report.get("kernels")
  if k:
    lines += ["**Kernels** (median of interleaved calls; GB/s counts the least bytes each pass "
              "must move; copy = `-x`, the bandwidth reference):", "",
              "| activation | dtype | elements | implementation | pass | ms | GB/s | of copy |",
              "|---|---|---:|---|---|---:|---:|---:|"]
    for r in k:
      lines.append(f"| {r['activation']} | {r['dtype']} | 2^{r['elements'].bit_length() - 1} | "
                   f"{r['implementation']} | {r['pass']} | {r['seconds'] * 1e3:.3f} | "
                   f"{r['gbps']:,.0f} | {r['fraction_of_copy']:.0%} |")
    lines.append("")
  t = report.get("tests")
  if t:
    lines += [("**GPU tests, cut short by the time limit** " if t.get("incomplete") else
               "**GPU tests** ") + f"(`{t['command']}`): {t.get('passed', '?')} passed, "
              f"{t.get('failed', '?')} failed, {t.get('skipped', '?')} skipped in "
              f"{t['seconds']:.0f} s." + ("" if not t.get("failed_ids") else
                                           " Failing: " + ", ".join(t["failed_ids"][:20]))
              + (f" ({t['note']})" if t.get("note") else ""), ""]
  m = report.get("models")
  if m:
    lines += ["**Models** (forward+backward, `value_and_grad`, layers under `lax.scan`; peak = "
              "`peak_bytes_in_use`, one process per configuration; step time: interleaved "
              "medians):", "",
              "| model | dtype | batch | configuration | peak MiB | vs standard | compiled temp MiB "
              "| step ms | vs standard |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for g in m:
      base_peak = g["peaks"].get("standard", {}).get("peak_bytes_in_use")
      base_t = g["step_time_s"].get("standard")
      for c, p in g["peaks"].items():
        pk = p.get("peak_bytes_in_use")
        st = g["step_time_s"].get(c)
        dp = f"{pk / base_peak - 1:+.1%}" if pk and base_peak else "n/a"
        dt = f"{st / base_t:.3f}x" if st and base_t else "n/a"
        lines.append(f"| {g['model']} | {g['dtype']} | {g['batch']} | {c} | {_mib(pk)} | {dp} | "
                     f"{_mib(p.get('compiled_temp_bytes'))} | "
                     f"{'n/a' if st is None else f'{st * 1e3:.1f}'} | {dt} |"
                     + (f" error: {p['error']}" if "error" in p else ""))
    lines.append("")
  mb = report.get("max_batch")
  if mb:
    lines += ["**Largest batch** (" + mb["model"] + ", " + mb["dtype"] + "): " + "; ".join(
        f"{c}: {_largest(r)}" for c, r in mb["results"].items()), ""]
  pl = report.get("planner")
  if pl and "results" in pl:
    from models.benchmarks import plan_program  # pylint: disable=import-outside-toplevel
    lines += ["**Planner on the device** (`" + pl["command"] + "`; compiled: XLA's temp on the "
              "device):", "",
              plan_program.table([r for rows in pl["results"].values() for r in rows]), ""]
  elif pl:
    lines += [f"**Planner on the device**: not measured: {pl.get('note') or pl.get('error') or pl.get('tail', '')[-300:]}", ""]
  fr = report.get("frontier")
  if fr:
    from models.benchmarks import frontier  # pylint: disable=import-outside-toplevel
    lines += ["**Frontier** (activation bytes and step time; `*`: on the Pareto front; "
              f"`{fr['json']}`):", "", frontier.markdown(fr["rows"]), ""]
  return "\n".join(lines)


# ------------------------------------------------------------------ the report's run
BEGIN, END = "<!-- gpu-report:begin -->", "<!-- gpu-report:end -->"


def write_docs(paths: Sequence[pathlib.Path], doc_path: pathlib.Path) -> int:
  """Regenerate the report block of ``doc_path`` (docs/gpu-report.md) from report JSONs (the
  newest per device and section); the exit code (2: a path that is not a report)."""
  for p in paths:
    if not p.is_file():
      print(f"error: --docs: no such file {str(p)!r}", file=sys.stderr)
      return 2
  try:
    parts = [markdown(json.loads(p.read_text()))
             for p in newest_per_section(paths)]
  except (ValueError, KeyError, TypeError, AttributeError) as e:  # not a GPU report's JSON
    print(f"error: --docs: not a GPU report JSON ({type(e).__name__}: {e})", file=sys.stderr)
    return 2
  text = doc_path.read_text()
  if BEGIN not in text or END not in text:
    print(f"error: {doc_path} has no {BEGIN} ... {END} block", file=sys.stderr)
    return 2
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  doc_path.write_text(head + BEGIN + "\n" + "\n".join(parts) + "\n" + END + tail)
  print(f"updated {doc_path}")
  return 0


def _kernels(report, args, dry, on_gpu, progress, section_deadline, deadline):
  """The report's ``kernels`` section: the activations' op speed per implementation the
  device runs (``dry``: one activation, one small size)."""
  from invact_jax import available  # pylint: disable=import-outside-toplevel
  del args, section_deadline, deadline
  impls = ["xla"] + [i for i in ("pallas", "triton") if on_gpu and available(i)[0]]
  report["kernels"] = kernels(
      activations=("gelu_tanh",) if dry else ("gelu_tanh", "gelu_erf", "silu", "mish"),
      sizes=(1 << 10,) if dry else (1 << 26,), dtypes=("bfloat16", "float32"),
      implementations=impls, repeats=3 if dry else 15, inner=1 if dry else 10,
      progress=progress)


def _models(report, args, dry, on_gpu, progress, section_deadline, deadline):
  """The report's ``models`` section: peak memory and step time of ViT-B/16 and GPT-2 per
  configuration (``dry``: a one-layer ViT-Ti/16), continuing from the earlier report's rows."""
  del args, on_gpu, deadline
  specs = ([{"model": "vit-ti16", "dtype": "bfloat16", "batch": 2, "seq_len": 0, "depth": 1}]
           if dry else
           [{"model": "vit-b16", "dtype": "bfloat16", "batch": 256, "seq_len": 0},
            {"model": "gpt2", "dtype": "bfloat16", "batch": 32, "seq_len": 1024}])
  report["models"] = models(
      specs=specs, rounds=2 if dry else 7, deadline=section_deadline(0.5), progress=progress,
      previous=report.get("models", ()),
      setups=(("standard", None), ("inverted-all", None)) if dry else SETUPS)


def _max_batch(report, args, dry, on_gpu, progress, section_deadline, deadline):
  """The report's ``max_batch`` section: the largest batch of ViT-B/16 that fits, standard
  and inverted, each search started near what the measured peaks predict."""
  import jax  # pylint: disable=import-outside-toplevel
  del args, deadline
  model, start = ("vit-ti16", 2) if dry else ("vit-b16", 256)
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) if on_gpu else 0
  starts = {}
  for g in report.get("models", []):  # start near the prediction from the measured peaks
    if g["model"] == model and limit:
      for c in ("standard", "inverted-all"):
        inc = g["peaks"].get(c, {}).get("peak_increase")
        if inc:
          starts[c] = max(8, int(0.97 * limit * g["batch"] / inc) // 8 * 8)
  res = {}
  for c in ("standard", "inverted-all"):
    res.update(max_batch(
        model=model, dtype="bfloat16", configurations=(c,), start=starts.get(c, start),
        grow=1.08 if c in starts else 2.0,
        max_probes=1 if dry else 5, depth=1 if dry else None,
        deadline=section_deadline(0.5), progress=progress))
  report["max_batch"] = {"model": model, "dtype": "bfloat16", "results": res}


def _planner(report, args, dry, on_gpu, progress, section_deadline, deadline):
  del on_gpu, section_deadline
  progress("planner")
  report["planner"] = planner(
      # ViT-B/16 at batch 8: scripts/plan_memory.py's default model and batch.
      args.out_dir, model="vit-ti16" if dry else "vit-b16", batch=2 if dry else 8,
      timeout_s=deadline - time.time(), seq_len=8 if dry else None)


def _frontier(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from models.benchmarks import frontier  # pylint: disable=import-outside-toplevel
  del on_gpu, deadline
  env = report["environment"]
  report["frontier"] = frontier.run(args.out_dir, device=env["device"], date=env["date"],
                                    dry=dry, deadline=section_deadline(1.0), stacks=args.stacks,
                                    progress=progress)


def run(args: argparse.Namespace) -> int:
  """``scripts/gpu_report.py``'s job for its parsed command line ``args``: the sections named,
  in order, each bounded by its share of the time budget; the report JSON and markdown
  written (sections already in that JSON kept); the exit code."""
  # The parent must not take the GPU's memory: its children measure peaks and batch sizes.
  for k, v in (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
               ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"), ("PYTHONUNBUFFERED", "1")):
    os.environ.setdefault(k, v)
  sections = args.sections.split(",") if args.sections else list(SECTIONS)
  bad = [s for s in sections if s not in SECTIONS]
  if bad:
    print(f"error: --sections: unknown {bad}; choose from {list(SECTIONS)}",
          file=sys.stderr)
    return 2
  from models.benchmarks import frontier  # pylint: disable=import-outside-toplevel
  args.stacks = args.stacks.split(",") if args.stacks else None
  if args.stacks and any(s not in frontier.STACKS for s in args.stacks):
    print(f"error: --stacks: unknown {[s for s in args.stacks if s not in frontier.STACKS]}; "
          f"choose from {list(frontier.STACKS)}", file=sys.stderr)
    return 2
  import jax  # pylint: disable=import-outside-toplevel
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    print(f"error: no GPU (JAX backend {jax.default_backend()!r}); use --dry-run for the CPU "
          "check", file=sys.stderr)
    return 2
  t_start = time.time()
  deadline = t_start + args.budget_s
  env = environment()
  from models.benchmarks.frontier.running import device_slug  # pylint: disable=import-outside-toplevel
  out = args.out_dir / f"gpu_{device_slug(env['device'])}_{env['date']}.json"
  report = json.loads(out.read_text()) if out.is_file() else {}
  report["seconds_earlier"] = report.get("seconds", 0.0)
  report["environment"] = env

  def progress(msg):
    print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)

  def section_deadline(share):  # a share of what is left, so later sections keep time
    return time.time() + share * max(deadline - time.time(), 0.0)

  dry = args.dry_run
  runners = {"kernels": _kernels, "models": _models, "max_batch": _max_batch,
             "planner": _planner, "frontier": _frontier}
  for section in sections:  # in the order given
    runners[section](report, args, dry, on_gpu, progress, section_deadline, deadline)
  report["seconds"] = time.time() - t_start + report.get("seconds_earlier", 0.0)
  args.out_dir.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str))
  md = markdown(report)
  out.with_suffix(".md").write_text(md + "\n")
  print(md)
  print(f"wrote {out} and {out.with_suffix('.md').name} ({datetime.timedelta(seconds=int(report['seconds']))})")
  return 0


if __name__ == "__main__":  # a child: one measurement, one JSON line
  child.child_main(measure)
