"""Where a language model's step goes, per operation, on the device: JAX's rows under
``jax.profiler`` (every XLA operation's device time, the compiled HLO beside it) and PyTorch +
Liger's under ``torch.profiler`` (every kernel's, the head's forward annotated).

``scripts/profile_step.py`` runs :data:`ROWS` for a frontier model, one process per row as the
frontier measures them (each row also a frontier row: bytes and median step), writes
``profile_<device>_<date>.json`` (every row with its ``profile``) and, in the folder of the
same name beside it, the raw files (``hlo_<row>.txt.gz``, the compiled step's optimized HLO;
``trace_<row>.json.gz``, the profiler's trace), and seeds the device's frontier JSON of the
day with the rows, so that ``scripts/gpu_report.py --sections frontier`` carries them over
(and their batch: no fit).  :func:`from_traces` recomputes the JAX rows' profiles from their
traces (after a change to :func:`models.benchmarks.profile.ops_from_trace`); :func:`markdown`
groups each row's time by kind and by where it runs (:func:`models.benchmarks.profile.groups`)
for docs/profile.md.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import time
from typing import Callable

from models.benchmarks.frontier import model_stack, running
from models.benchmarks.frontier.running import device_slug as slug
from models.benchmarks.frontier.schema import JaxRow, TorchRow

#: The rows profiled, in order: invert's (no remat, its head), the same with its layers
#: unrolled (no scan's copies), JAX's fastest fitting policy (``dots_no_batch``, the plain
#: head), PyTorch + Liger.
ROWS = (JaxRow("none", True, "invact"), JaxRow("none", True, "invact", unrolled=True),
        JaxRow("dots_no_batch", False, "plain"), TorchRow("liger"))

#: Operations kept per row: all of them (the grouping needs every one).
ALL = 1_000_000


def rows(stack: str, fields: dict, raw_dir: pathlib.Path, *, dtype: str = "bfloat16",
         repeats: int = 5, deadline: float = math.inf, date: str = "",
         progress: Callable[[str], None] = lambda _: None) -> list[dict]:
  """:data:`ROWS` of ``stack`` at ``fields`` (layers, batch), each with its ``profile``; the raw
  HLO and traces written to ``raw_dir``."""
  run = running._Rows(dtype, repeats, False, deadline, date, progress)  # pylint: disable=protected-access
  out = []
  for item in ROWS:
    if isinstance(item, TorchRow):
      spec = None
      key = running.torch_key(stack, item.configuration)
    else:
      spec = running.jax_spec(stack, item, fields, dtype=dtype, repeats=repeats)
      key = model_stack.row_key(spec)
    name = slug(f"{key['framework']}-{key['configuration']}{'-invact' if key['invact'] else ''}")
    if time.time() > deadline:
      out.append({**key, "error": "out of time"})
      continue
    progress(f"profile {stack} {name}")
    if spec is None:
      row = run.torch_row(stack, item.configuration, fields, extra={
          "profile": ALL, "trace_out": str(raw_dir / f"trace_{name}.json.gz")})
    else:
      row = run.one({**spec, "profile": ALL, "hlo_out": str(raw_dir / f"hlo_{name}.txt.gz"),
                     "trace_out": str(raw_dir / f"trace_{name}.json.gz")})
    row["raw"] = name
    out.append(row)
    progress(f"  {row.get('step_ms', float('nan')):.1f} ms, "
             f"{row.get('activation_bytes', 0) / 2**30:.2f} GiB {row.get('error', '')}")
  return out


def _same(a: dict, b: dict) -> bool:
  return running.same_row(a, b) and a.get("layers") == b.get("layers") and \
      a.get("batch") == b.get("batch")


def seed_frontier(frontier_dir: pathlib.Path, device: str, date: str, versions: dict,
                  measured: list[dict]) -> pathlib.Path:
  """The profiled rows (without their profiles) in the device's frontier JSON of ``date``,
  which the frontier run continues from (it carries them over, and their batch: no fit):
  that day's file, else a new one holding the rows of the device's newest frontier JSON
  (:func:`~models.benchmarks.frontier.running.earlier_rows`: nothing measured earlier is
  lost), each row of the same model, configuration, head, layers and batch as a profiled one
  replaced by it (the newer measurement)."""
  path = frontier_dir / f"frontier_{slug(device)}_{date}.json"
  data = (json.loads(path.read_text()) if path.exists() else
          {"device": device, "date": date, "dry": False, "versions": versions,
           "rows": running.earlier_rows(frontier_dir, device)})
  keep = [{k: v for k, v in r.items() if k not in ("profile", "raw")} for r in measured
          if "error" not in r]
  data["rows"] = [r for r in data["rows"] if not any(_same(r, k) for k in keep)] + keep
  path.write_text(json.dumps(data, indent=1))
  return path


def batch_predicted(bench_dir: pathlib.Path, device_kind: str, stack: str) -> int | None:
  """The batch the newest committed deviceless frontier for a device of ``device_kind`` ("NVIDIA
  H200") fitted ``stack`` to (``frontier_deviceless_*_<date>.json``): None where there is none."""
  paths = sorted(bench_dir.glob("frontier_deviceless_*_????-??-??.json"),
                 key=lambda p: p.stem[-10:], reverse=True)
  for p in paths:
    data = json.loads(p.read_text())
    if data.get("device_kind") != device_kind:
      continue
    batches = {r.get("batch") for r in data["rows"] if r.get("model") == stack and "error" not in r}
    if len(batches) == 1:
      return batches.pop()
  return None


def run(stack: str, out_dir: pathlib.Path, bench_dir: pathlib.Path, *, batch: int | None,
        repeats: int, budget_s: float, progress: Callable[[str], None] = print) -> int:
  """``scripts/profile_step.py``'s job: the rows, ``out_dir/profile_<device>_<date>.json``
  and the raw files beside it, the frontier JSON seeded in ``bench_dir``; the exit code."""
  for k, v in (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"), ("PYTHONUNBUFFERED", "1")):
    os.environ.setdefault(k, v)  # (this process must not take the device's memory)
  from models.benchmarks import gpu_report  # pylint: disable=import-outside-toplevel
  env = gpu_report.environment()
  s = model_stack.STACKS[stack]
  if batch is None:
    batch = batch_predicted(bench_dir, env["device"], stack) or s.batch
  fields = {"layers": s.layers, "batch": batch}
  path = out_dir / f"profile_{slug(env['device'])}_{env['date']}.json"
  raw = path.with_suffix("")
  raw.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  measured = rows(stack, fields, raw, repeats=repeats, deadline=t0 + budget_s,
                  date=env["date"], progress=lambda m: progress(f"[{time.time() - t0:6.1f} s] {m}"))
  path.write_text(json.dumps({"environment": env, "model": stack, **fields,
                              "command": "python scripts/profile_step.py", "rows": measured},
                             indent=1))
  seeded = seed_frontier(bench_dir, env["device"], env["date"], env["versions"], measured)
  progress(f"wrote {path}; seeded {seeded}")
  return 0 if all("error" not in r for r in measured) else 1


def from_traces(path: pathlib.Path) -> int:
  """Rewrite the profile JSON at ``path``: each JAX row's ``profile`` recomputed from its trace
  in the raw folder beside it (:func:`models.benchmarks.profile.ops_from_trace`, every
  operation); the number of rows recomputed."""
  import gzip  # pylint: disable=import-outside-toplevel
  from models.benchmarks import profile as op_profile  # pylint: disable=import-outside-toplevel
  data = json.loads(path.read_text())
  done = 0
  for r in data["rows"]:
    trace = path.with_suffix("") / f"trace_{r.get('raw')}.json.gz"
    if r.get("framework") == "jax" and trace.is_file():
      with gzip.open(trace) as f:
        r["profile"] = op_profile.ops_from_trace(json.load(f)["traceEvents"], steps=1)
      done += 1
  path.write_text(json.dumps(data, indent=1))
  return done


def _label(r: dict) -> str:
  return "PyTorch + Liger" if r["framework"] == "torch" else (
      f"invert, {r['configuration']}" if r.get("invact") else f"JAX {r['configuration']}")


def markdown(data: dict, source: str) -> str:
  """docs/profile.md's table of one profile JSON: per row its step, device busy time and
  milliseconds per kind of work inside and outside the layers
  (:func:`models.benchmarks.profile.groups`), then each row's largest kernels."""
  from models.benchmarks import profile as op_profile  # pylint: disable=import-outside-toplevel
  env = data["environment"]
  rows = [r for r in data["rows"] if r.get("profile")]
  head = (f"Measured by `python scripts/profile_step.py` on {env['device']} (driver "
          f"{env.get('driver')}), JAX {env['versions'].get('jax')}, torch "
          f"{next((r.get('torch') for r in rows if r.get('torch')), '—')}, {env['date']}: "
          f"{data['model']}, batch {data['batch']}, {data['layers']} layers; one profiled step "
          f"per row (`{source}`).\n")
  cols = [_label(r) for r in rows]
  lines = ["| ms per step | " + " | ".join(cols) + " |", "|---" + "|---:" * len(cols) + "|",
           "| step (median, unprofiled) | " + " | ".join(f"{r['step_ms']:.1f}" for r in rows) + " |",
           "| activation GiB | " + " | ".join(f"{r['activation_bytes'] / 2**30:.2f}" for r in rows)
           + " |",
           "| device busy (kernels summed) | "
           + " | ".join(f"{sum(k['ms'] for k in r['profile']):.1f}" for r in rows) + " |"]
  grouped = [op_profile.groups(r["profile"], data["layers"]) for r in rows]
  for where, label in (("layers", "in the layers"), ("outside", "outside them (head, embedding, loss)")):
    for k in op_profile.KINDS:
      lines.append(f"| {k}, {label} | " + " | ".join(f"{g[k][where]:.1f}" for g in grouped) + " |")
  out = [head, "\n".join(lines)]
  for r, label in zip(rows, cols):
    top = sorted(r["profile"], key=lambda k: -k["ms"])[:12]
    out.append(f"\n**{label}**, largest kernels:\n\n| kernel | kind | ms | calls |\n|---|---|---:|---:|\n"
               + "\n".join(f"| `{(k.get('kernel') or k['op'])[:70]}` | "
                            f"{op_profile.kind(k.get('kernel') or k['op'])} | {k['ms']:.2f} | "
                            f"{k['calls']:g} |" for k in top))
  return "\n".join(out)


def render_docs(text: str, root: pathlib.Path) -> str:
  """``text`` (docs/profile.md) with every ``<!-- profile: PATH -->`` ... ``<!-- end -->``
  block regenerated from the profile JSON at ``PATH`` (relative to ``root``)."""
  def block(m):
    rel = m.group(1)
    data = json.loads((root / rel).read_text())
    return f"<!-- profile: {rel} -->\n{markdown(data, rel)}\n<!-- end -->"
  return re.sub(r"<!-- profile: (\S+) -->.*?<!-- end -->", block, text, flags=re.S)
