"""The memory-budget planner's frontier (``scripts/plan_memory.py``): recompute cost vs memory
against fixed remat policies, per model.

Per model: profile each configuration (:mod:`models.planning`), solve the integer program
(:mod:`invact_jax.planner`, HiGHS) at budgets from the minimum feasible to the unconstrained
peak, compile every plan and every fixed policy with layers scanned, and report predicted vs
compiled bytes and measured recompute FLOPs (JSON, markdown, PNG).  Also the run-shape check
behind ``scripts/plan_run_shapes.py`` (:func:`run_shapes`), and the device-peak child
(``python -m models.benchmarks.plan_memory SPEC_JSON``: :func:`device_peak_row`).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys

from models import cli
from models.benchmarks import child

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _label(configuration: str, head_mode: str | None = None) -> str:
  from models import planning  # pylint: disable=import-outside-toplevel
  return planning.label(configuration, head_mode)


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
      got[(q.get("configuration"), q.get("head_mode"))] = q
    wanted = names(m)
    missing = [_label(*v) for v in wanted if v not in got]
    if missing:
      raise ValueError(f"{str(path)!r} has no profile of model {m!r}, configurations {missing}")
    try:
      out[m] = [planner.LayerProfile(**got[v]) for v in wanted]
    except TypeError as e:
      raise ValueError(f"{str(path)!r} holds a profile this version cannot read ({e})") from None
  return out


def _add_device_peak(row, model, args, overrides):
  """One child process per row: the allocator's peak never resets within a process."""
  spec = {"model": model, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
          "overrides": overrides, "configuration": row["configuration"],
          "head_mode": row.get("head_mode"), "keep": row["keep"] if "budget" in row else [row["keep"]]}
  peak = child.run_child("models.benchmarks.plan_memory", spec, math.inf)
  if "error" in peak:
    raise RuntimeError(f"device-peak child failed for {spec}: {peak['error']}")
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
      lines.append(f"| {m} | {mib(p['budget'])} | {_label(p['configuration'], p.get('head_mode'))} | {keep} | "
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
    name = lambda f: _label(f["configuration"], f.get("head_mode"))  # noqa: E731
    markers = dict(zip(sorted({name(f) for f in fr["fixed"]}), "s^vDPXo"))
    for v, marker in markers.items():
      fs = [f for f in fr["fixed"] if name(f) == v]
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


SETS = {"E": (), "A": ("mlp_out",), "B": ("attn_out", "mlp_pre", "mlp_out"),
        "C": ("key", "value", "attn_out", "mlp_pre", "mlp_out")}


def shapes(depth: int) -> dict[str, list[tuple[str, int]]]:
  """Plan name -> runs [(set name, layers)] in forward order."""
  out = {f"{s}x{depth}": [(s, depth)] for s in "EBC"}
  for lone, rest in (("A", "E"), ("C", "E"), ("C", "B")):
    out[f"{rest}x{depth - 1}+{lone}"] = [(rest, depth - 1), (lone, 1)]
    out[f"{lone}+{rest}x{depth - 1}"] = [(lone, 1), (rest, depth - 1)]
  for rest, two in (("B", "C"), ("E", "C")):
    out[f"{rest}x{depth - 2}+{two}x2"] = [(rest, depth - 2), (two, 2)]
    out[f"{two}x2+{rest}x{depth - 2}"] = [(two, 2), (rest, depth - 2)]
  return out



def run_shapes(args: argparse.Namespace) -> int:
  """``scripts/plan_run_shapes.py``'s job for its parsed command line ``args``; the exit code."""
  if args.depth < 4:
    print("error: --depth must be at least 4 (two runs of two layers)", file=sys.stderr)
    return 2
  import jax  # pylint: disable=import-outside-toplevel
  from models import presets  # pylint: disable=import-outside-toplevel
  from models import planning  # pylint: disable=import-outside-toplevel
  if args.models not in presets.MODELS:
    print(f"error: unknown model {args.models!r}; choose from {sorted(presets.MODELS)}",
          file=sys.stderr)
    return 2
  extra = {k: v for k, v in (("image_size", args.image_size), ("patch_size", args.patch_size))
           if v is not None}
  cfg = presets.model_config(args.models, dtype=args.dtype, depth=args.depth, **extra)
  rows = []
  for name, runs in shapes(args.depth).items():
    keep = [SETS[s] for s, n in runs for _ in range(n)]
    temp = planning.compiled_temp(cfg, 8, "inverted", keep, seq_len=args.seq_len)
    nothing = rows[0]["compiled_temp_bytes"] if rows else temp  # the first plan keeps nothing
    rows.append({"plan": name, "runs": runs, "compiled_temp_bytes": temp,
                 "over_keep_nothing": temp - nothing})
    print(json.dumps(rows[-1]), flush=True)
  out = {"meta": {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
                  "platform": jax.default_backend(), "command": " ".join(sys.argv)},
         "rows": rows}
  if args.out:
    args.out.write_text(json.dumps(out, indent=1))
  return 0


@dataclasses.dataclass(frozen=True)
class Options:
  """What :func:`run` plans, compiles and writes (``scripts/plan_memory.py``'s flags)."""
  models: str = cli.option("vit-b16,gpt2", "comma list of models (models.presets.MODELS)")
  dtype: str = cli.option("bfloat16", "compute dtype", choices=("float32", "bfloat16"))
  batch: int = cli.option(8, "batch size", parse=cli.positive_int)
  seq_len: int = cli.option(512, "text models' sequence length", parse=cli.positive_int)
  points: int = cli.option(6, "budgets between min and max")
  depth: int | None = cli.option(None, "override the preset's depth", parse=cli.positive_int)
  image_size: int | None = cli.option(None, "ViT: override the image size", parse=cli.positive_int)
  patch_size: int | None = cli.option(None, "ViT: override the patch size", parse=cli.positive_int)
  configurations: str = cli.option(
      "standard,inverted,inverted-norms",
      "configurations the planner may choose (models.planning.PLANNED_CONFIGURATIONS)")
  head_modes: str | None = cli.option(
      None, "text models: also choose the LM head's mode, comma list of standard,chunked "
      "(each configuration profiled with each)")
  out: pathlib.Path = cli.option(ROOT / "bench" / "plan_memory", "output prefix (.json, .md, .png)")
  replot: pathlib.Path | None = cli.option(
      None, "redraw the table and PNG from a JSON this script wrote (no compiling)")
  profiles: pathlib.Path | None = cli.option(
      None, "take the profiles from a JSON this script wrote (same models, dtype, batch, sequence "
      "length and overrides) instead of measuring them")
  device_peak: bool = cli.option(
      False, "also run every plan and fixed policy once, each in a child process, and record "
      "the allocator's peak_bytes_in_use (GPU only)")


def device_peak_row(spec: dict) -> dict:
  """The allocator's figures for one plan or policy (run in a child process of its own by
  :func:`_add_device_peak`: the allocator's peak never resets within a process).

  Args:
    spec: model, dtype, batch, seq_len, overrides, configuration, head_mode and keep of the
      row.

  Returns:
    :func:`models.planning.device_peak`'s figures.
  """
  from models import planning, presets  # pylint: disable=import-outside-toplevel
  cfg = presets.model_config(spec["model"], dtype=spec["dtype"], **spec.get("overrides", {}))
  return planning.device_peak(cfg, spec["batch"], spec["configuration"], spec["keep"],
                              seq_len=spec["seq_len"], head_mode=spec.get("head_mode"))


def _cannot_write(paths: list[pathlib.Path]) -> str | None:
  """Why one of ``paths`` cannot be written (its directory made if missing), or None."""
  for path in paths:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      cli.output_file(str(path))
    except (OSError, argparse.ArgumentTypeError) as e:
      return f"cannot write {str(path)!r} ({e})"
  return None


def run(args: Options) -> int:
  """``scripts/plan_memory.py``'s job for its parsed command line ``args``; the exit code."""
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax import memory, planner  # pylint: disable=import-outside-toplevel
  from models import presets  # pylint: disable=import-outside-toplevel
  from models import planning  # pylint: disable=import-outside-toplevel
  from models import options  # pylint: disable=import-outside-toplevel
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
    why = _cannot_write([args.replot.with_suffix(".png")])
    if why:
      print(f"error: --replot: {why} (the PNG is drawn beside the JSON)", file=sys.stderr)
      return 2
    print(table)
    _plot(results, args.replot.with_suffix(".png"))
    print(f"wrote {args.replot.with_suffix('.png')}")
    return 0
  why = _cannot_write([args.out.with_suffix(x) for x in (".json", ".md", ".png")])
  if why:  # before any compiling: nothing measured and then lost
    print(f"error: --out: {why}", file=sys.stderr)
    return 2
  models = args.models.split(",")
  for m in models:
    if m not in presets.MODELS:
      print(f"error: unknown model {m!r}; choose from {sorted(presets.MODELS)}", file=sys.stderr)
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

  def names(m):  # the profiles' (configuration, head mode) of model m
    if head_modes is None or presets.MODELS[m][0] != "text":
      return [(v, None) for v in configurations]
    return [(v, h) for v in configurations for h in head_modes]
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
      cfg = presets.model_config(m, dtype=args.dtype, **overrides)
    except (TypeError, ValueError) as e:
      print(f"error: model {m}: {e}", file=sys.stderr)
      return 2
    if saved is None:
      profiles = planning.profile(
          cfg, args.batch, seq_len=args.seq_len, configurations=configurations,
          head_modes=head_modes if presets.MODELS[m][0] == "text" else None,
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
        progress(f"device peak {row.get('policy') or row['budget']} "
                 f"{_label(row['configuration'], row.get('head_mode'))}")
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


if __name__ == "__main__":
  child.child_main(device_peak_row)
