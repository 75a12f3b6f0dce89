#!/usr/bin/env python3
"""GPU report: kernel bandwidth, GPU-only tests, model peaks and step times, largest batch,
the planner's device check, the memory-time frontier against jax.checkpoint policies and
PyTorch + Liger; one command on one NVIDIA GPU.

  python scripts/gpu_report.py                         # everything, ~8 min on an H100
  python scripts/gpu_report.py --sections kernels,tests
  python scripts/gpu_report.py --sections frontier --stacks llama    # one stack's frontier
  python scripts/gpu_report.py --dry-run               # CPU, tiny sizes (the test suite runs this)
  python scripts/gpu_report.py --docs bench/gpu_*.json     # docs/gpu-report.md's block (newest per device)

On the GPU machine (Python 3.12, JAX 0.11.2, nothing to download): ``pip install --no-deps -e .``
or ``PYTHONPATH=.``.  Writes ``<out-dir>/gpu_<device>_<date>.json`` and ``.md``; sections
already in that JSON are kept unless rerun (so the report may be collected over two calls).
Long sections print progress; each is bounded by the time budget.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-report:begin -->", "<!-- gpu-report:end -->"


def _slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write_docs(paths, doc_path: pathlib.Path) -> int:
  """Regenerate the report block of ``doc_path`` (docs/gpu-report.md) from report JSONs."""
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  for p in paths:
    if not p.is_file():
      print(f"error: --docs: no such file {str(p)!r}", file=sys.stderr)
      return 2
  try:
    parts = [gpu_report.markdown(json.loads(p.read_text()))
             for p in gpu_report.newest_per_section(paths)]
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


def main(argv=None) -> int:
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--sections", default=None, help="comma list (default: all)")
  p.add_argument("--stacks", default=None,
                 help="frontier: comma list of stacks (default: llama3-1b,llama3-8b,llama,gpt2-medium,vit-l16)")
  p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise every path")
  p.add_argument("--budget-s", type=cli.positive_float, default=480.0,
                 help="wall-clock budget, seconds")
  p.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench")
  p.add_argument("--docs", type=pathlib.Path, nargs="+", default=None,
                 help="regenerate docs/gpu-report.md's report block from these report JSONs "
                      "and exit")
  args = p.parse_args(argv)
  if args.docs:
    return write_docs(args.docs, ROOT / "docs" / "gpu-report.md")
  # The parent must not take the GPU's memory: its children measure peaks and batch sizes.
  for k, v in (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
               ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"), ("PYTHONUNBUFFERED", "1")):
    os.environ.setdefault(k, v)
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  sections = args.sections.split(",") if args.sections else list(gpu_report.SECTIONS)
  bad = [s for s in sections if s not in gpu_report.SECTIONS]
  if bad:
    print(f"error: --sections: unknown {bad}; choose from {list(gpu_report.SECTIONS)}",
          file=sys.stderr)
    return 2
  from models.experiments import frontier  # pylint: disable=import-outside-toplevel
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
  env = gpu_report.environment()
  out = args.out_dir / f"gpu_{_slug(env['device'])}_{env['date']}.json"
  report = json.loads(out.read_text()) if out.is_file() else {}
  report["seconds_earlier"] = report.get("seconds", 0.0)
  report["environment"] = env

  def progress(msg):
    print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)

  def section_deadline(share):  # a share of what is left, so later sections keep time
    return time.time() + share * max(deadline - time.time(), 0.0)

  dry = args.dry_run
  runners = {"kernels": _kernels, "tests": _tests, "models": _models, "max_batch": _max_batch,
             "planner": _planner, "frontier": _frontier}
  for section in sections:  # in the order given
    runners[section](report, args, dry, on_gpu, progress, section_deadline, deadline)
  report["seconds"] = time.time() - t_start + report.get("seconds_earlier", 0.0)
  args.out_dir.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str))
  md = gpu_report.markdown(report)
  out.with_suffix(".md").write_text(md + "\n")
  print(md)
  print(f"wrote {out} and {out.with_suffix('.md').name} ({datetime.timedelta(seconds=int(report['seconds']))})")
  return 0


def _kernels(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from invact_jax import available  # pylint: disable=import-outside-toplevel
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  del args, section_deadline, deadline
  impls = ["xla"] + [i for i in ("pallas", "triton") if on_gpu and available(i)[0]]
  report["kernels"] = gpu_report.kernels(
      activations=("gelu_tanh",) if dry else ("gelu_tanh", "gelu_erf", "silu", "mish"),
      sizes=(1 << 10,) if dry else (1 << 26,), dtypes=("bfloat16", "float32"),
      implementations=impls, repeats=3 if dry else 15, inner=1 if dry else 10,
      progress=progress)


def _tests(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  del on_gpu, deadline
  progress("tests")
  report["tests"] = t = gpu_report.tests(
      args.out_dir, paths=["tests/ops/test_common.py"] if dry else
      ["tests/ops", "tests/test_memory.py", "tests/models"],
      keyword="not Interpret and not slow", workers=1 if dry else 12,
      timeout_s=section_deadline(0.7) - time.time())
  progress(f"tests: {t.get('passed')} passed, {t.get('failed')} failed, "
           f"{t.get('skipped')} skipped")


def _models(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  del args, on_gpu, deadline
  specs = ([{"model": "vit-ti16", "dtype": "bfloat16", "batch": 2, "seq_len": 0, "depth": 1}]
           if dry else
           [{"model": "vit-b16", "dtype": "bfloat16", "batch": 256, "seq_len": 0},
            {"model": "gpt2", "dtype": "bfloat16", "batch": 32, "seq_len": 1024}])
  report["models"] = gpu_report.models(
      specs=specs, rounds=2 if dry else 7, deadline=section_deadline(0.5), progress=progress,
      previous=report.get("models", ()),
      configurations=("standard", "inverted-all") if dry else gpu_report.CONFIGURATIONS)


def _max_batch(report, args, dry, on_gpu, progress, section_deadline, deadline):
  import jax  # pylint: disable=import-outside-toplevel
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
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
    res.update(gpu_report.max_batch(
        model=model, dtype="bfloat16", configurations=(c,), start=starts.get(c, start),
        grow=1.08 if c in starts else 2.0,
        max_probes=1 if dry else 5, depth=1 if dry else None,
        deadline=section_deadline(0.5), progress=progress))
  report["max_batch"] = {"model": model, "dtype": "bfloat16", "results": res}


def _planner(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  del on_gpu, section_deadline
  progress("planner")
  report["planner"] = gpu_report.planner(
      # ViT-B/16 at batch 8: bench/plan_memory_vit.json's model and batch (the CPU frontier).
      args.out_dir, model="vit-ti16" if dry else "vit-b16", batch=2 if dry else 8,
      timeout_s=deadline - time.time(), extra=["--seq-len", "8"] if dry else [])


def _frontier(report, args, dry, on_gpu, progress, section_deadline, deadline):
  from models.experiments import frontier  # pylint: disable=import-outside-toplevel
  del on_gpu, deadline
  env = report["environment"]
  report["frontier"] = frontier.run(args.out_dir, device=env["device"], date=env["date"],
                                    dry=dry, deadline=section_deadline(1.0), stacks=args.stacks,
                                    progress=progress)


if __name__ == "__main__":
  sys.exit(main())
