#!/usr/bin/env python3
"""Memory comparison: residual bytes, compiled temp bytes, device peak and step time.

  python scripts/benchmark_memory.py                           # ViT-B/16, BERT-base, GPT-2, Llama
  python scripts/benchmark_memory.py --models vit-b16 --dtypes bfloat16 --batches 8 --time 3

Prints a markdown table, writes JSON and a bar chart PNG (default: bench/memory.*).
Compiled figures are XLA's static analysis with layers under ``lax.scan`` (``--unrolled``
for unrolled layers, which XLA:CPU fuses and reorders, so those can mislead on CPU).
"""
from __future__ import annotations

import datetime
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  from models import options  # pylint: disable=import-outside-toplevel
  from models.experiments import model_memory as benchmark  # pylint: disable=import-outside-toplevel
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--models", default="vit-b16,bert-base,gpt2,llama-small")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--batches", default="8")
  p.add_argument("--seq-len", type=cli.positive_int, default=512, help="text models")
  p.add_argument("--activations", default="preset",
                 help="comma list of registry activations to sweep (e.g. gelu_tanh,gelu_erf,silu) or "
                      "'preset'")
  p.add_argument("--configurations", default="standard,checkpointed,inverted,inverted-all",
                 help=f"comma list of {', '.join(options.CONFIGURATIONS)}")
  p.add_argument("--dropout", type=float, default=None,
                 help="override the presets' dropout rate (e.g. 0.1)")
  p.add_argument("--unrolled", action="store_true", help="unrolled layers instead of lax.scan")
  p.add_argument("--time", type=cli.nonnegative_int, default=0,
                 help="timed steps per row (0: no timing)")
  p.add_argument("--out", type=cli.output_file, default=ROOT / "bench" / "memory",
                 help="path prefix of the .json, .md and .png written")
  args = p.parse_args(argv)
  why = _check(args)
  if why:
    print(f"error: {why}", file=sys.stderr)
    return 2
  for m in args.models.split(","):
    if m not in benchmark.MODELS:
      print(f"error: unknown model {m!r}; choose from {sorted(benchmark.MODELS)}", file=sys.stderr)
      return 2
  for c in args.configurations.split(","):
    try:
      options.configuration(c)
    except ValueError as e:
      print(f"error: --configurations: {e}", file=sys.stderr)
      return 2
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  acts = args.activations.split(",")
  jobs = [(m, a, d, int(b), c) for m in args.models.split(",") for a in acts
          for d in args.dtypes.split(",") for b in args.batches.split(",")
          for c in args.configurations.split(",")]
  rows = []
  for m, a, d, b, c in tqdm(jobs, desc="benchmark", unit="row"):
    extra = {} if a == "preset" else {"activation": a}
    if args.dropout is not None:
      extra["dropout"] = args.dropout
    rows.append(benchmark.measure(m, d, b, c, seq_len=args.seq_len, scan_layers=not args.unrolled,
                                  time_steps=args.time, extra=extra or None))
  md = benchmark.table(rows)
  print(md)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  meta = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
  args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  args.out.with_suffix(".md").write_text(md + "\n")
  _plot(rows, args.out.with_suffix(".png"))
  print(f"\nwrote {args.out.with_suffix('.json')}, .md, .png")
  return 0


def _check(args) -> str | None:
  """Why the options cannot run (one line), before any work; None if they can."""
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import registry  # pylint: disable=import-outside-toplevel
  for d in args.dtypes.split(","):
    if d not in ("bfloat16", "float16", "float32", "float64"):
      return f"--dtypes: unknown dtype {d!r}; choose from bfloat16, float16, float32, float64"
    if d == "float64" and not jax.config.jax_enable_x64:
      return "--dtypes: float64 needs JAX_ENABLE_X64=1 (without it JAX computes in float32)"
  for b in args.batches.split(","):
    if not b.isdigit() or int(b) < 1:
      return f"--batches: {b!r} is not a positive integer"
  for a in args.activations.split(","):
    if a != "preset" and a not in registry.ACTIVATIONS:
      return f"--activations: unknown activation {a!r}; choose from {sorted(registry.ACTIVATIONS)}"
  if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
    return f"--dropout must be in [0, 1), got {args.dropout}"
  return None


def _plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  key = lambda r: (r["model"], r["activation"], r["dtype"], r["batch"])
  groups = sorted({key(r) for r in rows}, key=str)
  confs = list(dict.fromkeys(r["configuration"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
  width = 0.8 / len(confs)
  for i, c in enumerate(confs):
    vals = []
    for g in groups:
      r = next((r for r in rows if key(r) == g and r["configuration"] == c), None)
      vals.append(0 if r is None else r["compiled_temp_bytes"] / 2**20)
    ax.bar([j + i * width for j in range(len(groups))], vals, width, label=c)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
  ax.set_xticklabels([f"{m}\n{a}\n{d} b{b}" for m, a, d, b in groups], fontsize=7)
  ax.set_ylabel("compiled temp (MiB)")
  ax.set_title(f"gradient-step temp memory ({rows[0]['platform']}, layers scanned)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
