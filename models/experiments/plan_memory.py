"""Memory-budget planner: frontier of recompute cost vs memory, against fixed remat policies.

  python scripts/plan_memory.py                               # ViT-B/16 and GPT-2, bf16, batch 8
  python scripts/plan_memory.py --models vit-b16 --points 5 --batch 4
  python scripts/plan_memory.py --replot bench/plan_memory_gpt2.json   # redraw, no compiling
  python scripts/plan_memory.py --models gpt2 --profiles bench/plan_memory_gpt2.json  # re-plan

For each model: profiles each configuration (standard / inverted activations; see
models/experiments/plan_profiles.py), then solves the integer program (invact_jax.planner, HiGHS) at budgets
from the minimum feasible to the unconstrained peak, compiles every plan and every fixed
policy (full, save_qkv_proj, save_dot_except_mlp, minimal, nothing) with layers scanned, and
prints a table with predicted vs compiled bytes and measured recompute FLOPs.  Writes JSON and
a PNG of the frontier (default bench/plan_memory.*; the README's runs are
bench/plan_memory_vit.* and bench/plan_memory_gpt2.*).  CPU figures are XLA's compiled
temp_size_in_bytes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax import memory, planner  # pylint: disable=import-outside-toplevel
  from models.experiments import model_memory as benchmark  # pylint: disable=import-outside-toplevel
  from models.experiments import plan_profiles as planning  # pylint: disable=import-outside-toplevel
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  from models.experiments.cli import positive_int  # pylint: disable=import-outside-toplevel
  from models import options  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--models", default="vit-b16,gpt2")
  p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  p.add_argument("--batch", type=positive_int, default=8)
  p.add_argument("--seq-len", type=positive_int, default=512, help="text models")
  p.add_argument("--points", type=int, default=6, help="budgets between min and max")
  p.add_argument("--depth", type=positive_int, default=None, help="override the preset's depth")
  p.add_argument("--image-size", type=positive_int, default=None, help="ViT: override the image size")
  p.add_argument("--patch-size", type=positive_int, default=None, help="ViT: override the patch size")
  p.add_argument("--configurations", default="standard,inverted,inverted-norms",
                 help="configurations the planner may choose "
                      "(models.experiments.plan_profiles.PLANNED_CONFIGURATIONS)")
  p.add_argument("--head-modes", default=None,
                 help="text models: also choose the LM head's variant, comma list of "
                      "standard,chunked (each configuration profiled with each, named "
                      "'<configuration>+head=<mode>')")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "plan_memory")
  p.add_argument("--replot", type=pathlib.Path, default=None,
                  help="redraw the table and PNG from a JSON this script wrote (no compiling)")
  p.add_argument("--profiles", type=pathlib.Path, default=None,
                 help="take the profiles from a JSON this script wrote (same models, dtype, batch, "
                      "sequence length and overrides) instead of measuring them")
  p.add_argument("--device-peak", action="store_true",
                  help="also run every plan and fixed policy once, each in a child process, "
                       "and record the allocator's peak_bytes_in_use (GPU only)")
  p.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # child: one row, as JSON
  args = p.parse_args(argv)
  if args.peak_of is not None:
    row = json.loads(args.peak_of)
    cfg = benchmark.model_config(row["model"], dtype=row["dtype"], **row.get("overrides", {}))
    print(json.dumps(planning.device_peak(cfg, row["batch"], row["configuration"], row["keep"],
                                          seq_len=row["seq_len"])))
    return 0
  if args.device_peak and not memory.reports_peak():
    print(f"error: --device-peak needs a device that reports memory_stats() (a GPU); this "
          f"run's device is {jax.local_devices()[0].platform}", file=sys.stderr)
    return 2
  if args.replot is not None:
    if not args.replot.is_file():
      print(f"error: --replot: no such file {str(args.replot)!r}", file=sys.stderr)
      return 2
    try:
      results = json.loads(args.replot.read_text())["results"]
      table = _table(results)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
      print(f"error: --replot: {str(args.replot)!r} is not a complete JSON written by this "
            f"script ({type(e).__name__}: {e})", file=sys.stderr)
      return 2
    print(table)
    _plot(results, args.replot.with_suffix(".png"))
    print(f"wrote {args.replot.with_suffix('.png')}")
    return 0
  models = args.models.split(",")
  for m in models:
    if m not in benchmark.MODELS:
      print(f"error: unknown model {m!r}; choose from {sorted(benchmark.MODELS)}", file=sys.stderr)
      return 2
  configurations = args.configurations.split(",")
  bad = [v for v in configurations if v not in planning.PLANNED_CONFIGURATIONS]
  if bad:
    print(f"error: unknown configurations {bad}; choose from "
          f"{list(planning.PLANNED_CONFIGURATIONS)}", file=sys.stderr)
    return 2
  head_modes = args.head_modes.split(",") if args.head_modes else None
  if head_modes is not None and (not head_modes or any(h not in options.HEAD_MODES
                                                       for h in head_modes)):
    print(f"error: --head-modes: expected some of {','.join(options.HEAD_MODES)}, got "
          f"{args.head_modes!r}", file=sys.stderr)
    return 2

  def names(m):  # the profiles' configuration names of model m
    if head_modes is None or benchmark.MODELS[m][0] != "text":
      return configurations
    return [f"{v}+head={h}" for v in configurations for h in head_modes]
  if args.points < 2:
    print("error: --points must be at least 2", file=sys.stderr)
    return 2
  overrides = {k: v for k, v in (("depth", args.depth), ("image_size", args.image_size),
                                  ("patch_size", args.patch_size)) if v is not None}
  saved = None
  if args.profiles is not None:
    try:
      saved = _saved_profiles(args.profiles, models, names, args, overrides)
    except ValueError as e:
      print(f"error: --profiles: {e}", file=sys.stderr)
      return 2
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  results = {}
  bar = tqdm(desc="plan", unit="step")

  def progress(msg):
    bar.set_postfix_str(msg)
    bar.update()

  for m in models:
    try:
      cfg = benchmark.model_config(m, dtype=args.dtype, **overrides)
    except (TypeError, ValueError) as e:
      print(f"error: model {m}: {e}", file=sys.stderr)
      return 2
    if saved is None:
      profiles = planning.profile(
          cfg, args.batch, seq_len=args.seq_len, configurations=configurations,
          head_modes=head_modes if benchmark.MODELS[m][0] == "text" else None,
          progress=progress)
    else:
      profiles = [planning.with_input_bytes(cfg, args.batch, q, seq_len=args.seq_len)
                  for q in saved[m]]
    lo = min(q.base_bytes for q in profiles)
    hi = max(planner.evaluate(q, planning.FIXED_POLICIES["nothing"])[0] for q in profiles)
    budgets = [int(lo + i * (hi - lo) / (args.points - 1)) for i in range(args.points)]
    fr = planning.frontier(cfg, args.batch, budgets, profiles, seq_len=args.seq_len,
                           progress=progress)
    fr["profiles"] = [q.__dict__ for q in profiles]
    if args.device_peak:
      for row in fr["fixed"] + [r for r in fr["plans"] if "infeasible" not in r]:
        progress(f"device peak {row.get('policy') or row['budget']} {row['configuration']}")
        _add_device_peak(row, m, args, overrides)
    results[m] = fr
  bar.close()
  print(_table(results))
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
          "command": " ".join(sys.argv), "dtype": args.dtype, "batch": args.batch,
          "seq_len": args.seq_len, "configurations": configurations, "head_modes": head_modes, "overrides": overrides,
          "profiles_from": None if args.profiles is None else str(args.profiles)}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1, default=list))
  args.out.with_suffix(".md").write_text(_table(results) + "\n")
  _plot(results, args.out.with_suffix(".png"))
  print(f"wrote {args.out.with_suffix('.json')}, .md, .png")
  return 0


def _saved_profiles(path, models, names, args, overrides):
  """{model: [LayerProfile]} from a JSON this script wrote, checked against this run."""
  from invact_jax import planner  # pylint: disable=import-outside-toplevel
  if not path.is_file():
    raise ValueError(f"no such file {str(path)!r}")
  try:
    saved = json.loads(path.read_text())
    meta, results = saved["meta"], saved["results"]
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{str(path)!r} is not a plan_memory.py JSON ({e})") from None
  want = {"dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
          "overrides": overrides}
  for key, value in want.items():
    if meta.get(key, {} if key == "overrides" else None) != value:
      raise ValueError(f"{str(path)!r} was profiled with {key}={meta.get(key)!r}, this run has "
                       f"{value!r}")
  out = {}
  for m in models:
    got = {}
    for q in results.get(m, {}).get("profiles", []):
      q = dict(q)
      if "variant" in q:  # written before 0.3
        q["configuration"] = q.pop("variant")
      got[q["configuration"]] = q
    configurations = names(m)
    missing = [v for v in configurations if v not in got]
    if missing:
      raise ValueError(f"{str(path)!r} has no profile of model {m!r}, configurations {missing}")
    out[m] = [planner.LayerProfile(**got[v]) for v in configurations]
  return out


def _add_device_peak(row, model, args, overrides):
  """One child process per row: the allocator's peak never resets within a process."""
  spec = {"model": model, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
          "overrides": overrides, "configuration": row["configuration"],
          "keep": row["keep"] if "budget" in row else [row["keep"]]}
  done = subprocess.run([sys.executable, "-m", __spec__.name if __spec__ else __name__,
                         "--peak-of", json.dumps(spec)],
                        capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"device-peak child failed for {spec}:\n{done.stderr[-2000:]}")
  peak = json.loads(done.stdout.strip().splitlines()[-1])
  row["device_peak_bytes"] = peak["peak_bytes_in_use"]
  row["device_temp_bytes"] = peak["peak_increase"] - peak["output_bytes"]
  row["device_prediction_error"] = row["predicted_bytes"] / row["device_temp_bytes"] - 1.0


def describe_keep(keep) -> str:
  """'mlp_pre, mlp_out' for a uniform plan; '8× {mlp_out} · 4× {mlp_pre, mlp_out}' per layer."""
  import itertools  # pylint: disable=import-outside-toplevel
  runs = [(tuple(k), len(list(g))) for k, g in itertools.groupby(tuple(k) for k in keep)]
  if len(runs) == 1:
    return ", ".join(runs[0][0]) or "(nothing)"
  return " · ".join(f"{n}× {{{', '.join(k) or 'nothing'}}}" for k, n in runs)


def _table(results) -> str:
  mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
  gf = lambda f: "n/a" if f is None else f"{f / 1e9:,.2f}"  # noqa: E731
  dev = any("device_temp_bytes" in p for fr in results.values() for p in fr["plans"])
  lines = ["| model | budget MiB | configuration | kept per layer | predicted MiB | compiled MiB "
           "| error | recompute GFLOP | best fixed policy that fits | its GFLOP |"
           + (" device temp MiB | device error |" if dev else ""),
           "|---|---:|---|---|---:|---:|---:|---:|---|---:|" + ("---:|---:|" if dev else "")]
  for m, fr in results.items():
    for p in fr["plans"]:
      if "infeasible" in p:
        lines.append(f"| {m} | {mib(p['budget'])} | infeasible{' (per layer)' * p.get('per_layer', False)} | | | | | | | |"
                     + (" | |" if dev else ""))
        continue
      keep = describe_keep(p["keep"])
      lines.append(f"| {m} | {mib(p['budget'])} | {p['configuration']} | {keep} | "
                   f"{mib(p['predicted_bytes'])} | {mib(p['compiled_temp_bytes'])} | "
                   f"{100 * p['prediction_error']:+.1f}% | {gf(p['recompute_flops'])} | "
                   f"{p['best_fixed'] or 'none fits'} | {gf(p['best_fixed_recompute_flops'])} |"
                   + (f" {mib(p['device_temp_bytes'])} | {100 * p['device_prediction_error']:+.1f}% |"
                      if dev else ""))
  return "\n".join(lines)


def _plot(results, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
  for ax, (m, fr) in zip(axes[0], results.items()):
    pts = [p for p in fr["plans"] if "infeasible" not in p and not p.get("per_layer")]
    ax.plot([p["compiled_temp_bytes"] / 2**20 for p in pts],
            [p["recompute_flops"] / 1e9 for p in pts], "o-", label="planner, one set (compiled)")
    per = [p for p in fr["plans"] if "infeasible" not in p and p.get("per_layer")]
    if per:
      ax.scatter([p["compiled_temp_bytes"] / 2**20 for p in per],
                 [p["recompute_flops"] / 1e9 for p in per], marker="*", s=90, zorder=3,
                 label="planner, per layer (compiled)")
    markers = dict(zip(sorted({f["configuration"] for f in fr["fixed"]}), "s^vDP"))
    for v, marker in markers.items():
      fs = [f for f in fr["fixed"] if f["configuration"] == v]
      ax.scatter([f["compiled_temp_bytes"] / 2**20 for f in fs],
                 [f["recompute_flops"] / 1e9 for f in fs], marker=marker, alpha=0.7,
                 label=f"fixed policies ({v})")
    for policy in dict.fromkeys(f["policy"] for f in fr["fixed"]):  # one label per policy
      f = min((f for f in fr["fixed"] if f["policy"] == policy),
              key=lambda f: f["compiled_temp_bytes"])
      ax.annotate(policy, (f["compiled_temp_bytes"] / 2**20, f["recompute_flops"] / 1e9),
                  xytext=(4, 4), textcoords="offset points", fontsize=7)
    ax.set(title=m, xlabel="compiled temp MiB (layers scanned)", ylabel="recompute GFLOP")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
