"""Training parity study: standard vs inverted configurations over seeds, dtypes and tasks.

Behind ``scripts/parity.py``.  Every run is an ordinary :func:`training.train` run in its own
directory (``<workdir>/<task>/<dtype>/<configuration>/seed<k>``), so a study cut short resumes:
finished runs are read back, an interrupted one continues from its last checkpoint.  Runs pair
by seed: the same seed gives the same initial parameters, data order and dropout keys in every
configuration (``training`` derives all three from ``TrainConfig.seed``).

The statistic per task x dtype x configuration is the paired difference to ``standard`` over
seeds, with a Student-t 95 % confidence interval; a configuration is *equivalent* when
``|mean| + half-width`` stays within the task's margin (1 accuracy point on digits, 1 % of
the held-out loss on text).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np

from models import training
from models.training import checkpoints
from models.training import data as data_lib
from models.training import run_dir as run_dir_lib

CONFIGURATIONS = ("standard", "inverted", "inverted-all")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Task:
  """One training job of the study and how its result is scored."""
  name: str
  description: str
  load: Callable[[int], data_lib.Dataset]   # seed -> dataset
  config: training.TrainConfig               # everything but dtype, seed, configuration
  metric: str                                # the metric the margin applies to
  margin: float                              # in the units of ``diff_units``
  diff_units: str                            # "points" (x100 of a fraction) or "percent" (of standard)

  def metrics(self, summary: dict) -> dict[str, tuple[float, bool]]:
    """Final metrics of a run: name -> (value, higher_is_better)."""
    loss = summary["final_test_loss"]
    if self.name == "digits":
      return {"test_accuracy": (summary["final_test_acc"], True), "test_loss": (loss, False)}
    return {"heldout_loss": (loss, False), "heldout_bits_per_byte": (loss / math.log(2), False)}


def _text(seed: int) -> data_lib.Dataset:
  del seed  # one corpus and split for every seed; the seed varies init, order and dropout
  return data_lib.load_text(seq_len=64)


TASKS = {
    "digits": Task(
        "digits", "ViT 'digits' preset on scikit-learn's 8x8 digits (train_vit.py's default job, "
        "50 epochs)", data_lib.load_digits,
        training.TrainConfig(preset="digits", epochs=50, checkpoint_every=250),
        "test_accuracy", 1.0, "points"),
    "text": Task(
        "text", "GPT-2-style byte LM ('gpt2-tiny': 2 layers, width 128) on the Python standard "
        "library's source, held out by file; 300 steps of 16 x 64 bytes", _text,
        training.TrainConfig(preset="gpt2-tiny", batch_size=16, steps=300, warmup_steps=30,
                             checkpoint_every=150),
        "heldout_loss", 1.0, "percent"),
}


#: How a stopped study continues (the words of its one-line stops).
AGAIN = ("run the same command again to continue the study (its finished runs are read back, "
         "the interrupted one resumes from its last checkpoint)")


#: ``--quick``: steps per run and held-out examples kept (the first ones).
QUICK_STEPS, QUICK_HELDOUT = 4, 64


def quick(task: Task) -> Task:
  """The task cut to a few steps and a small held-out set (``--quick``: a test of the script,
  not a result)."""
  def load(seed: int) -> data_lib.Dataset:
    d = task.load(seed)
    return dataclasses.replace(d, x_test=d.x_test[:QUICK_HELDOUT], y_test=d.y_test[:QUICK_HELDOUT])

  return dataclasses.replace(task, load=load, config=dataclasses.replace(
      task.config, epochs=1, steps=QUICK_STEPS, warmup_steps=2, checkpoint_every=QUICK_STEPS // 2,
      log_every=QUICK_STEPS // 2))


def run_dir(workdir: pathlib.Path, task: str, dtype: str, configuration: str, seed: int):
  return pathlib.Path(workdir) / task / dtype / configuration / f"seed{seed}"


def _read_history(path: pathlib.Path) -> list[dict]:
  f = path / "metrics.jsonl"
  return [json.loads(l) for l in f.read_text().splitlines() if l] if f.is_file() else []


def run_one(task: Task, dtype: str, configuration: str, seed: int, workdir: pathlib.Path,
            dataset: data_lib.Dataset | None = None) -> dict[str, Any]:
  """Train one cell of the study, or read it back if it finished before.

  Returns ``{"summary", "history", "wall_s", "cached"}``; raises ``training.ConfigError`` if
  the directory holds a run with other options (e.g. a ``--quick`` study in the same place).
  """
  cfg = dataclasses.replace(task.config, dtype=dtype, seed=seed, configuration=configuration)
  path = run_dir(workdir, task.name, dtype, configuration, seed)
  done = path / "parity_run.json"
  if done.is_file():
    try:
      saved = json.loads(done.read_text())
      options = run_dir_lib.saved_options(saved["config"])
      summary, wall = dict(saved["summary"]), float(saved["wall_s"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise training.ConfigError(f"--workdir: {done} is not the record this script writes "
                                 f"({training.first_line(e)}); remove it and the run is "
                                 "read back from its checkpoints") from None
    if options != dataclasses.asdict(cfg):
      raise training.ConfigError(f"--workdir: {path} holds a run with other options; use "
                                 "another --workdir")
    return {"summary": summary, "history": _read_history(path), "wall_s": wall, "cached": True}
  dataset = task.load(seed) if dataset is None else dataset
  resume = checkpoints.latest_step(path) is not None
  t0 = time.perf_counter()
  summary = training.train(cfg, dataset, path, resume=resume, progress=False, time_steps=False)
  wall = time.perf_counter() - t0
  summary.pop("trainer")
  history = summary.pop("history")
  run_dir_lib.write_atomic(done, json.dumps({"config": dataclasses.asdict(cfg), "summary": summary,
                                              "wall_s": wall, "resumed": resume}, indent=1))
  return {"summary": summary, "history": history, "wall_s": wall, "cached": False}


def _flat(tree) -> np.ndarray:
  import jax  # pylint: disable=import-outside-toplevel
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def init_gradients(task: Task, dtype: str, configurations=CONFIGURATIONS, seed: int = 0
                   ) -> list[dict[str, Any]]:
  """Whole-model gradient at initialisation (first batch and dropout key of ``seed``) of each
  configuration vs ``standard`` in the same dtype; for 16-bit dtypes also ``standard`` vs
  ``standard`` in float32 (the rounding noise of the dtype itself, for scale)."""
  import jax  # pylint: disable=import-outside-toplevel
  dataset = task.load(seed)
  def grads(configuration, dt):
    cfg = dataclasses.replace(task.config, dtype=dt, seed=seed, configuration=configuration)
    _, g = training.Trainer(cfg, dataset, devices=1).gradients(0)
    return g
  ref = grads("standard", dtype)
  ref_flat = _flat(ref)
  others = [(c, dtype) for c in configurations if c != "standard"]
  if dtype != "float32":
    others.append(("standard", "float32"))
  rows = []
  for configuration, dt in others:
    g = grads(configuration, dt)
    if jax.tree.structure(g) != jax.tree.structure(ref):
      raise RuntimeError(f"{configuration} has other parameters than standard")
    v = _flat(g)
    rows.append({"task": task.name, "dtype": dtype, "configuration": configuration,
                 "against": f"standard ({dtype})",
                 "compared_dtype": dt,
                 "rel_l2": float(np.linalg.norm(v - ref_flat) / np.linalg.norm(ref_flat)),
                 "cosine": float(v @ ref_flat / (np.linalg.norm(v) * np.linalg.norm(ref_flat)))})
  return rows


def _t975(dof: int) -> float:
  from scipy import stats  # pylint: disable=import-outside-toplevel
  return float(stats.t.ppf(0.975, dof))


def summarize(runs: list[dict], tasks: dict[str, Task]) -> list[dict[str, Any]]:
  """Per task x dtype x configuration: mean/std of the task's metric, and for non-standard
  configurations the paired difference to standard in the same dtype (by seed) with its 95 %
  CI; standard in a 16-bit dtype is paired with standard in float32 (the control)."""
  cells: dict[tuple, dict[int, float]] = {}
  for r in runs:
    task = tasks[r["task"]]
    if r["metric"] == task.metric:
      cells.setdefault((r["task"], r["dtype"], r["configuration"]), {})[r["seed"]] = r["value"]
  out = []
  for (tname, dtype, configuration), by_seed in sorted(cells.items()):
    task = tasks[tname]
    vals = np.array(list(by_seed.values()))
    row = {"task": tname, "dtype": dtype, "configuration": configuration, "metric": task.metric,
           "seeds": len(vals), "mean": float(vals.mean()),
           "std": float(vals.std(ddof=1)) if len(vals) > 1 else None}
    # Non-standard configurations pair with standard in the same dtype; standard in a 16-bit
    # dtype pairs with standard in float32: the control, how far a change of rounding alone
    # moves the metric seed by seed.
    against = ("standard", dtype) if configuration != "standard" else ("standard", "float32")
    std = cells.get((tname, against[1], against[0]))
    if (configuration, dtype) != against and std:
      row["against"] = f"{against[0]} ({against[1]})"
      seeds = sorted(set(by_seed) & set(std))
      a, b = np.array([by_seed[s] for s in seeds]), np.array([std[s] for s in seeds])
      d = (a - b) * 100.0 if task.diff_units == "points" else (a - b) / b * 100.0
      hw = (_t975(len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
      row.update({"paired_seeds": len(d), "diff_units": task.diff_units,
                  "diff_mean": float(d.mean()), "diff_ci95_half_width": hw,
                  "margin": task.margin,
                  "equivalent": None if hw is None else bool(abs(d.mean()) + hw <= task.margin)})
    out.append(row)
  return out


def table(summary: list[dict], tasks: dict[str, Task]) -> str:
  """Markdown: per cell mean ± std, and the paired difference with its 95 % CI."""
  lines = ["| task | dtype | configuration | metric: mean ± std (seeds) | paired diff [95 % CI] "
           "| against | within margin |", "|---|---|---|---|---|---|---|"]
  for r in summary:
    scale = 100.0 if tasks[r["task"]].diff_units == "points" else 1.0
    unit = " %" if scale == 100.0 else ""
    std = "" if r["std"] is None else f" ± {scale * r['std']:.2f}"
    cell = f"{r['metric']}: {scale * r['mean']:.2f}{unit}{std} ({r['seeds']})"
    if "diff_mean" in r:
      u = " pt" if r["diff_units"] == "points" else " %"
      hw = r["diff_ci95_half_width"]
      lo_hi = "" if hw is None else f" [{r['diff_mean'] - hw:+.2f}, {r['diff_mean'] + hw:+.2f}]"
      diff = f"{r['diff_mean']:+.2f}{u}{lo_hi}"
      ok = {None: "n/a (1 seed)", True: f"yes (≤ {r['margin']:g}{u})",
            False: f"**no** (> {r['margin']:g}{u})"}[r["equivalent"]]
    else:
      diff, ok = "(baseline)", ""
    against = r.get("against", "")
    if against.endswith("(float32)") and r["configuration"] == "standard":
      against += ", control"
    lines.append(f"| {r['task']} | {r['dtype']} | {r['configuration']} | {cell} | {diff} | "
                 f"{against} | {ok} |")
  return "\n".join(lines)


def gradient_table(rows: list[dict]) -> str:
  lines = ["| task | dtype | configuration | against | rel. L2 | cosine |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['task']} | {r['dtype']} | {r['configuration']} ({r['compared_dtype']}) | "
                 f"{r['against']} | {r['rel_l2']:.2e} | {r['cosine']:.6f} |")
  return "\n".join(lines)


def plot(curves: dict[tuple, list[list[dict]]], path: pathlib.Path) -> None:
  """Training loss vs step, one panel per task x dtype, mean over seeds with a min-max band."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  panels = sorted({(t, d) for t, d, _ in curves})
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
  for ax, (tname, dtype) in zip(axes[0], panels):
    for configuration in CONFIGURATIONS:
      hists = curves.get((tname, dtype, configuration))
      if not hists:
        continue
      series = [{h["step"]: h["loss"] for h in hist if "loss" in h} for hist in hists]
      steps = sorted(set.intersection(*(set(s) for s in series)))
      if not steps:
        continue
      y = np.array([[s[k] for k in steps] for s in series])
      line, = ax.plot(steps, y.mean(0), label=f"{configuration} ({len(series)} seeds)")
      ax.fill_between(steps, y.min(0), y.max(0), color=line.get_color(), alpha=0.2)
    ax.set(title=f"{tname}, {dtype}", xlabel="step", ylabel="training loss", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def study(tasks: list[Task], dtypes, configurations, seeds: int, workdir: pathlib.Path, *,
          progress: bool = True, gradients: bool = True) -> dict[str, Any]:
  """Run (or read back) every cell; return ``{"runs", "summary", "gradients", "curves"}``."""
  cells = [(t, d, c, s) for t in tasks for d in dtypes for s in range(seeds) for c in configurations]
  bar = None
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=len(cells), unit="run", desc="parity study", dynamic_ncols=True)
  runs, curves, datasets = [], {}, {}
  for task, dtype, configuration, seed in cells:
    if bar is not None:
      bar.set_postfix_str(f"{task.name} {dtype} {configuration} seed {seed}")
    key = (task.name, seed)
    if key not in datasets:
      datasets = {key: task.load(seed)}  # one dataset in memory at a time
    r = run_one(task, dtype, configuration, seed, workdir, datasets[key])
    s = r["summary"]
    if not s["finished"]:
      raise RuntimeError(f"run {task.name} {dtype} {configuration} seed {seed} did not finish")
    for metric, (value, higher) in task.metrics(s).items():
      runs.append({"task": task.name, "dtype": dtype, "configuration": configuration,
                   "seed": seed, "metric": metric, "value": float(value),
                   "higher_is_better": higher, "steps": s["steps"], "wall_s": r["wall_s"]})
    curves.setdefault((task.name, dtype, configuration), []).append(r["history"])
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  grads = []
  if gradients:
    for task in tasks:
      for dtype in dtypes:
        grads += init_gradients(task, dtype, configurations)
  by_name = {t.name: t for t in tasks}
  return {"runs": runs, "summary": summarize(runs, by_name), "gradients": grads,
          "curves": curves}


def compilation_cache(workdir: pathlib.Path) -> None:
  """JAX's persistent compilation cache in ``<workdir>/xla_cache`` unless one is set (JAX
  reads ``JAX_COMPILATION_CACHE_DIR`` into its config): every seed of a cell compiles the
  same training and evaluation steps, so only the first seed of each cell compiles."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", str(workdir / "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def run(args: argparse.Namespace, argv: list[str]) -> int:
  """``scripts/parity.py``'s job for its parsed command line ``args`` (from ``argv``, recorded in
  the JSON); the exit code."""
  from models.benchmarks import gpu_report  # pylint: disable=import-outside-toplevel
  from models import training  # pylint: disable=import-outside-toplevel
  compilation_cache(args.workdir)
  tasks = [TASKS[t] for t in args.tasks]
  if args.quick:
    tasks = [quick(t) for t in tasks]
  t0 = time.perf_counter()
  try:
    result = study(tasks, args.dtypes, args.configurations, args.seeds, args.workdir,
                          progress=not args.no_progress, gradients=not args.no_gradients)
  except training.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except training.CheckpointWriteError as e:  # (the study resumes its runs by itself)
    print(f"error: {e.said(AGAIN)}", file=sys.stderr)
    return 2
  by_name = {t.name: t for t in tasks}
  meta = {**gpu_report.environment(), "command": " ".join(["python scripts/parity.py",
                                                            *argv]),
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
  md = table(result["summary"], by_name)
  if result["gradients"]:
    md += "\n\nGradient at initialisation (seed 0, first batch and dropout key):\n\n"
    md += gradient_table(result["gradients"])
  out_md.write_text(md + "\n")
  plot(result["curves"], out_png)
  print(md)
  print(f"\nstudy: {meta['study_wall_s']:.0f} s here, {meta['runs_wall_s']:.0f} s of training runs "
        f"in all\nwrote {out_json}\nwrote {out_md}\nwrote {out_png}")
  return 0
