#!/usr/bin/env python3
"""Training parity, shown statistically: K seeds x {standard, inverted, inverted-all} x
{float32, bfloat16} on the digits ViT and a byte-level GPT on the Python standard library.

  python scripts/parity.py                    # the full study (K = 5), resumable
  python scripts/parity.py --quick            # 2 seeds, a few steps: a test of the script

Writes <out>.json ({"runs": [...], "summary": [...], "gradients": [...], "meta": {...}}),
<out>.md (the tables) and <out>.png (training loss, mean over seeds with a min-max band).
Run directories live under --workdir; a second call reads finished runs back and continues
an interrupted one from its last checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _list(choices):
  def parse(text: str):
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in choices]
    if bad or not items:
      raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), "
                                       f"got {text!r}")
    return items
  return parse


def parse(argv=None):
  from models.experiments import parity  # pylint: disable=import-outside-toplevel
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--seeds", type=int, default=None, help="seeds per cell (K; default 5, --quick: 2)")
  p.add_argument("--tasks", type=_list(tuple(parity.TASKS)), default=list(parity.TASKS))
  p.add_argument("--dtypes", type=_list(parity.DTYPES), default=list(parity.DTYPES))
  p.add_argument("--configurations", type=_list(parity.CONFIGURATIONS),
                 default=list(parity.CONFIGURATIONS))
  p.add_argument("--quick", action="store_true",
                 help="2 seeds, 8 steps, 64 held-out examples (tests the script)")
  p.add_argument("--no-gradients", action="store_true",
                 help="skip the gradient-at-initialisation comparison")
  p.add_argument("--out", type=pathlib.Path, default=None,
                 help="output prefix (default: bench/parity, or runs/parity-quick/parity)")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="run directories (default: runs/parity, or runs/parity-quick)")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  if args.seeds is None:
    args.seeds = 2 if args.quick else 5
  if args.seeds < 1:
    p.error(f"--seeds must be at least 1, got {args.seeds}")
  if "standard" not in args.configurations:
    p.error("--configurations must include standard (the baseline of every paired difference)")
  name = "parity-quick" if args.quick else "parity"
  args.workdir = args.workdir or ROOT / "runs" / name
  args.out = args.out or (ROOT / "runs" / name / "parity" if args.quick else ROOT / "bench" / "parity")
  return args


def _compilation_cache(workdir: pathlib.Path) -> None:
  """JAX's persistent compilation cache in ``<workdir>/xla_cache`` unless one is set (JAX
  reads ``JAX_COMPILATION_CACHE_DIR`` into its config): every seed of a cell compiles the
  same training and evaluation steps, so only the first seed of each cell compiles."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", str(workdir / "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def main(argv=None) -> int:
  args = parse(argv)
  from models.experiments import gpu_report  # pylint: disable=import-outside-toplevel
  from models.experiments import parity  # pylint: disable=import-outside-toplevel
  from models.experiments import training  # pylint: disable=import-outside-toplevel
  _compilation_cache(args.workdir)
  tasks = [parity.TASKS[t] for t in args.tasks]
  if args.quick:
    tasks = [parity.quick(t) for t in tasks]
  t0 = time.perf_counter()
  try:
    result = parity.study(tasks, args.dtypes, args.configurations, args.seeds, args.workdir,
                          progress=not args.no_progress, gradients=not args.no_gradients)
  except training.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  by_name = {t.name: t for t in tasks}
  meta = {**gpu_report.environment(), "command": " ".join(["python scripts/parity.py",
                                                            *(argv if argv is not None else sys.argv[1:])]),
          "seeds": args.seeds, "quick": args.quick,
          "tasks": {t.name: {"description": t.description, "metric": t.metric,
                             "margin": t.margin, "diff_units": t.diff_units,
                             "config": dataclasses.asdict(t.config)} for t in tasks},
          "study_wall_s": time.perf_counter() - t0,
          "runs_wall_s": sum({(r["task"], r["dtype"], r["configuration"], r["seed"]): r["wall_s"]
                              for r in result["runs"]}.values())}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  out_json, out_md, out_png = (args.out.with_suffix(s) for s in (".json", ".md", ".png"))
  out_json.write_text(json.dumps({"runs": result["runs"], "summary": result["summary"],
                                  "gradients": result["gradients"], "meta": meta}, indent=1))
  md = parity.table(result["summary"], by_name)
  if result["gradients"]:
    md += "\n\nGradient at initialisation (seed 0, first batch and dropout key):\n\n"
    md += parity.gradient_table(result["gradients"])
  out_md.write_text(md + "\n")
  parity.plot(result["curves"], out_png)
  print(md)
  print(f"\nstudy: {meta['study_wall_s']:.0f} s here, {meta['runs_wall_s']:.0f} s of training runs "
        f"in all\nwrote {out_json}\nwrote {out_md}\nwrote {out_png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
