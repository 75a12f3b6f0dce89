"""Memory/time rows for model x dtype x batch x configuration (``scripts/benchmark_memory.py``).

A *configuration* is a named set of config-field overrides (``models.options.CONFIGURATIONS``;
every memory option is a field), e.g. ``"inverted"`` = ``{"activation_mode": "inverted"}``.  Each row reports, for one gradient step
(``value_and_grad`` of the loss w.r.t. all parameters):

* ``residual_bytes_per_layer``: non-argument residuals autodiff keeps, per block (from a
  1- and a 2-block model: the difference);
* ``compiled_temp_bytes``: XLA ``memory_analysis().temp_size_in_bytes`` of the compiled step;
* ``device_peak_bytes``: ``peak_bytes_in_use`` (GPU; None on CPU);
* ``step_time_s``: median wall time of the compiled step (optional).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import jax

from invact_jax import memory
from models import benchmarks, options, presets, vit

def _residual_bytes(cfg, batch, seq_len, depth):
  c = cfg.replace(depth=depth, scan_layers=False, remat="none")
  loss, params, x, y = presets.loss_and_inputs(c, batch, seq_len, jax.random.key(0))
  return sum(r.bytes for r in memory.residuals(loss, params, x, y) if not r.is_argument)


def gradient_step(model: str, dtype: str, batch: int, configuration: str, *,
                  implementation: str | None = None, seq_len: int = 512,
                  scan_layers: bool = True, extra: dict | None = None):
  """``(cfg, jit(value_and_grad(loss)), (params, x, y))`` of a model under a named
  configuration (and the invact_jax ops' ``implementation``)."""
  overrides = {**options.configuration(configuration, implementation=implementation),
               **(extra or {})}
  cfg = presets.model_config(model, dtype=dtype, scan_layers=scan_layers, **overrides)
  loss, params, x, y = presets.loss_and_inputs(cfg, batch, seq_len, jax.random.key(0))
  return cfg, jax.jit(jax.value_and_grad(loss)), (params, x, y)


def measure(model: str, dtype: str, batch: int, configuration: str, *, seq_len: int = 512,
            scan_layers: bool = True, time_steps: int = 0, extra: dict | None = None) -> dict:
  """One row (see module doc)."""
  cfg, step, (params, x, y) = gradient_step(model, dtype, batch, configuration, seq_len=seq_len,
                                            scan_layers=scan_layers, extra=extra)
  per_layer = _residual_bytes(cfg, batch, seq_len, 2) - _residual_bytes(cfg, batch, seq_len, 1)
  comp = memory.compiled(step, params, x, y)
  peak = None
  if memory.reports_peak():
    peak = memory.device_peak(step, params, x, y)["peak_bytes_in_use"]
  times = []
  if time_steps:
    exe = step.lower(params, x, y).compile()
    jax.block_until_ready(exe(params, x, y))
    for _ in range(time_steps):
      t0 = time.perf_counter()
      jax.block_until_ready(exe(params, x, y))
      times.append(time.perf_counter() - t0)
  return {
      "model": model, "activation": cfg.activation, "dropout": cfg.dropout, "dtype": dtype,
      "batch": batch,
      "seq_len": None if isinstance(cfg, vit.ViTConfig) else seq_len,
      "configuration": configuration, "scan_layers": scan_layers,
      "residual_bytes_per_layer": per_layer, "compiled_temp_bytes": comp.temp,
      "device_peak_bytes": peak, "step_time_s": statistics.median(times) if times else None,
      "platform": jax.default_backend(), "host": benchmarks.host(), "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__,
  }


def table(rows: list[dict]) -> str:
  """Markdown table with each row's saving vs the standard (JAX default) row of its group."""
  group = lambda r: (r["model"], r["activation"], r.get("dropout"), r["dtype"], r["batch"],
                     r["scan_layers"])
  base = {group(r): r for r in rows
          if r["configuration"] == "standard"}
  out = ["| model | activation | dropout | dtype | batch | configuration | residual MiB/layer "
         "| compiled temp MiB | vs default | device peak MiB | step time (s) |",
         "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
  mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f}"
  for r in rows:
    b = base.get(group(r))
    rel = "" if b is None else f"{100 * (r['compiled_temp_bytes'] / b['compiled_temp_bytes'] - 1):+.1f}%"
    st = "n/a" if r["step_time_s"] is None else f"{r['step_time_s']:.3f}"
    out.append(f"| {r['model']} | {r['activation']} | {r.get('dropout', 0.0)} | {r['dtype']} | "
               f"{r['batch']} | {r['configuration']} | "
               f"{mib(r['residual_bytes_per_layer'])} | {mib(r['compiled_temp_bytes'])} | {rel} | "
               f"{mib(r['device_peak_bytes'])} | {st} |")
  return "\n".join(out)


ROOT = pathlib.Path(__file__).resolve().parents[2]


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
  """A bar chart of the rows' activation memory per (model, activation, dtype, batch),
  one bar per configuration, written to ``path``."""
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



def run(args: argparse.Namespace) -> int:
  """``scripts/benchmark_memory.py``'s job for its parsed command line ``args``; the exit code."""
  from models import options, presets  # pylint: disable=import-outside-toplevel
  why = _check(args)
  if why:
    print(f"error: {why}", file=sys.stderr)
    return 2
  for m in args.models.split(","):
    if m not in presets.MODELS:
      print(f"error: unknown model {m!r}; choose from {sorted(presets.MODELS)}", file=sys.stderr)
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
    rows.append(measure(m, d, b, c, seq_len=args.seq_len, scan_layers=not args.unrolled,
                                  time_steps=args.time, extra=extra or None))
  md = table(rows)
  print(md)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  meta = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
  args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  args.out.with_suffix(".md").write_text(md + "\n")
  _plot(rows, args.out.with_suffix(".png"))
  print(f"\nwrote {args.out.with_suffix('.json')}, .md, .png")
  return 0
