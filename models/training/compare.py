"""Side-by-side training of standard vs inverted activations from the same seed."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax

from invact_jax import memory
from models.training import checkpoints
from models.training import data as data_lib
from models.training import config
from models.training import errors
from models.training import loop
from models.training import run_dir
from models.training import trainer as trainer_lib


def _runs(cfg: config.TrainConfig) -> tuple[config.TrainConfig, config.TrainConfig]:
  """JAX's default ("standard", no implementation or head mode set) and the configured run
  ("inverted" where that is "standard")."""
  baseline = dataclasses.replace(cfg, configuration="standard", implementation=None,
                                 head_mode=None)
  if cfg.configuration == "standard":
    cfg = dataclasses.replace(cfg, configuration="inverted")
  return baseline, cfg


def _device_peak(trainer: trainer_lib.Trainer) -> int | None:
  if not memory.reports_peak():
    return None
  return trainer.device_peak()["peak_bytes_in_use"]


def against_standard(trainer: trainer_lib.Trainer) -> dict[str, Any]:
  """One step's activation memory beside the same step with standard activations: the bytes
  autodiff keeps for the loss's backward and the train step's compiled temp (the device's own
  on a GPU: XLA:GPU compiled it; as the planner measures it) for this run and for the same
  model with JAX's standard ops (``configuration="standard"``, no memory budget), and this
  run's device peak where the device reports one.

  Args:
    trainer: the run's trainer (its config, data and mesh).

  Returns:
    ``{"activation_bytes", "standard_activation_bytes", "compiled_temp_bytes",
    "standard_compiled_temp_bytes", "device_peak_bytes"}`` (activations: what autodiff keeps
    for the loss's backward; the device peak None off a GPU).
  """
  baseline = dataclasses.replace(trainer.cfg, configuration="standard", implementation=None,
                                 head_mode=None, memory_budget=None)
  standard = trainer if baseline == trainer.cfg else trainer_lib.Trainer(
      baseline, trainer.dataset, trainer.devices, trainer.shard_params)
  # (compiled as the planner measures: 3.6 s for both at the default run's size on 2 CPU
  # cores, 5.5 s at XLA:CPU's default emitters)
  return {"activation_bytes": trainer.activation_bytes(),
          "standard_activation_bytes": standard.activation_bytes(),
          "compiled_temp_bytes": trainer.compiled_memory(measuring=True).temp,
          "standard_compiled_temp_bytes": standard.compiled_memory(measuring=True).temp,
          "device_peak_bytes": _device_peak(trainer)}


def memory_line(cfg: config.TrainConfig, figures: dict[str, Any]) -> str:
  """The line ``make train`` ends with: what the run's activations cost against standard.

  Args:
    cfg: the run's config.
    figures: :func:`against_standard`'s.

  Returns:
    One line, e.g. ``activations kept for the backward: 2.52 MiB with the inverted
    configuration vs 5.10 MiB standard (0.49x); the train step's compiled temp 13.9 vs
    13.8 MiB``.
  """
  mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
  ours, standard = figures["activation_bytes"], figures["standard_activation_bytes"]
  line = f"activations kept for the backward: {mib(ours)} with the {cfg.configuration} " \
         "configuration"
  temp = f"the train step's compiled temp {mib(figures['compiled_temp_bytes'])}"
  if cfg.configuration != "standard" or cfg.memory_budget is not None:
    ratio = f" ({ours / standard:.2f}x)" if standard else ""
    line += f" vs {mib(standard)} standard{ratio}"
    temp += f" vs {mib(figures['standard_compiled_temp_bytes'])}"
  line += f"; {temp}"
  if figures["device_peak_bytes"] is not None:
    line += f"; device peak of this run {mib(figures['device_peak_bytes'])}"
  return line


def compare(cfg: config.TrainConfig, dataset: data_lib.Dataset, workdir: pathlib.Path, *,
            resume: bool = False, progress: bool = True,
            shard_params: bool = False) -> dict[str, Any]:
  """Train both implementations; write compare.json and compare.png; return the table."""
  workdir = pathlib.Path(workdir)
  pair = _runs(cfg)
  names = [c.run_name for c in pair]
  # A resumed comparison continues each run from its checkpoints, and starts a run an
  # interrupted comparison never checkpointed (the second one, or the first stopped before
  # its first checkpoint): whichever is unfinished.
  started = {c.run_name: checkpoints.latest_step(workdir / c.run_name) is not None
             for c in pair}
  if resume and not any(started.values()):
    raise errors.ConfigError(f"--resume: no checkpoint of either run in {workdir} (the "
                             "comparison was stopped before its first): run it again "
                             "without --resume")
  for c in pair:  # check both run directories before training either
    config.validate(c, dataset, len(jax.devices()))
    run_dir.prepare_workdir(c, workdir / c.run_name, resume=resume and started[c.run_name],
                            data=data_lib.fingerprint(dataset))
  runs = {}
  for c in pair:
    try:
      s = loop.train(c, dataset, workdir / c.run_name, resume=resume and started[c.run_name],
                     progress=progress, shard_params=shard_params)
    except (errors.Interrupted, checkpoints.CheckpointWriteError) as e:
      # --compare --resume continues where either run has a checkpoint
      if e.resumable or not any(checkpoints.latest_step(workdir / r) is not None
                                for r in started):
        raise
      raise e.resumable_in(workdir) from None
    started[c.run_name] = True
    trainer = s.pop("trainer")
    s["compiled_temp_bytes"] = trainer.compiled_memory().temp
    s["device_peak_bytes"] = _device_peak(trainer)
    runs[c.run_name] = s
  rows = [("final test accuracy", "final_test_acc", "{:.4f}"),
          ("final test loss", "final_test_loss", "{:.4f}"),
          ("final train loss", "final_train_loss", "{:.4f}"),
          ("compiled temp bytes (train step)", "compiled_temp_bytes", "{:,}"),
          ("device peak bytes", "device_peak_bytes", "{:,}"),
          ("median step time (s)", "step_time_s_median", "{:.4f}")]
  lines = [f"| {cfg.preset} ({cfg.dtype}, {runs['standard']['platform']}, "
           f"{runs['standard']['devices']} device(s)) | standard | {names[1]} |", "|---|---:|---:|"]
  for label, key, fmt in rows:
    vals = [runs[i][key] for i in names]
    lines.append(f"| {label} | " + " | ".join("n/a" if v is None else fmt.format(v) for v in vals) + " |")
  acc_gap = abs(runs["standard"]["final_test_acc"] - runs[names[1]]["final_test_acc"])
  table = "\n".join(lines) + f"\n\naccuracy gap: {100 * acc_gap:.2f} percentage points"
  out_json = workdir / "compare.json"
  out_json.write_text(json.dumps({"table": table, "accuracy_gap": acc_gap,
                                  "runs": runs, "config": dataclasses.asdict(cfg)}, indent=1))
  out_png = workdir / "compare.png"
  _plot(runs, out_png)
  return {"table": table, "json": out_json, "png": out_png, "runs": runs, "accuracy_gap": acc_gap}


def _plot(runs, path):
  """The comparison's plot: training and test loss, and test accuracy, per run."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  for impl, s in runs.items():
    tr = [h for h in s["history"] if "loss" in h]
    ev = [h for h in s["history"] if "test_acc" in h]
    ax1.plot([h["step"] for h in tr], [h["loss"] for h in tr], label=f"{impl} (train)")
    ax1.plot([h["step"] for h in ev], [h["test_loss"] for h in ev], "--", label=f"{impl} (test)")
    ax2.plot([h["step"] for h in ev], [h["test_acc"] for h in ev], label=impl)
  ax1.set(xlabel="step", ylabel="loss", yscale="log", title="loss")
  ax2.set(xlabel="step", ylabel="test accuracy", title="test accuracy", ylim=(0.5, 1.0))
  for ax in (ax1, ax2):
    ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
