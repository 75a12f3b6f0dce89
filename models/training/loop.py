"""The training loop for ViT image classifiers and GPT-style byte LMs: checkpoints every
``checkpoint_every`` steps, resume, divergence and signal stops, evaluation and the summary.

The data order of epoch ``e`` is a permutation drawn from ``fold_in(key(seed), e)`` and the
dropout key of step ``s`` is ``fold_in(key(seed + 1), s)``, so a run resumed from a checkpoint
continues exactly as the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import json
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.training import checkpoints
from models.training import config
from models.training import data as data_lib
from models.training import errors
from models.training import run_dir
from models.training import trainer as trainer_lib


@jax.jit
def _finite(tree) -> jax.Array:
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def _all_finite(tree) -> bool:
  """Whether every floating leaf of ``tree`` is finite: one program per tree structure (not
  one per leaf shape) and one value brought to the host."""
  return bool(_finite(tree))


def _stop_diverged(manager, bar, what: str):
  """End a run whose loss or parameters turned non-finite: the saves in flight finish,
  nothing more is saved, one TrainingDiverged line says what the last checkpoint holds."""
  manager.wait_until_finished()
  last = manager.latest_step()
  manager.close()
  if bar is not None:
    bar.close()
  kept = (f"the last checkpoint (step {last}) holds finite parameters" if last is not None
          else "no checkpoint was written")
  raise errors.TrainingDiverged(f"training diverged: {what}; stopped without saving it, {kept} "
                         "(lower --lr, or check the data's scale)")


def train(cfg: config.TrainConfig, dataset: data_lib.Dataset, workdir: str | pathlib.Path, *,
          resume: bool = False, progress: bool = True, stop_after: int | None = None,
          time_steps: bool = True, devices: int | None = None,
          shard_params: bool = False) -> dict[str, Any]:
  """Train (or resume) a run in ``workdir``; returns the summary (also in summary.json).

  ``stop_after``: stop once this step is reached, as if killed (checkpoints as usual).
  ``shard_params``: FSDP (see :meth:`Trainer._state_sharding`); a run may resume with or
  without it (the layout is not part of the config; checkpoints restore into either).
  """
  workdir = pathlib.Path(workdir)
  trainer = trainer_lib.Trainer(cfg, dataset, devices, shard_params)  # validates before anything is written
  data = data_lib.fingerprint(dataset)
  run_dir.prepare_workdir(cfg, workdir, resume=resume, data=data)
  # Multi-process: every process trains and checkpoints (orbax writes collectively); only
  # process 0 writes the logs, shows progress and holds the run directory's lock.
  main = jax.process_index() == 0
  workdir.mkdir(parents=True, exist_ok=True)
  with (run_dir.RunLock(workdir) if main else contextlib.nullcontext()), errors.quiet_libraries():
    if main:  # checked again now that no other run can write here
      run_dir.prepare_workdir(cfg, workdir, resume=resume, data=data)
    return _train(cfg, dataset, workdir, trainer, data, resume=resume, progress=progress,
                  stop_after=stop_after, time_steps=time_steps, main=main)


def _steps(cfg: config.TrainConfig, trainer, manager, workdir: pathlib.Path, steps: range, log, bar,
           step_times: list, *, time_steps: bool, main: bool, per_epoch: int) -> None:
  """Train ``steps``: log, evaluate each epoch, checkpoint (its checksums first)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  t_last, n_last = time.perf_counter(), steps.start
  for step in steps:
    errors.raise_if_stop_requested()
    t0 = time.perf_counter()
    loss, acc = trainer.train_step(step)
    if time_steps:
      jax.block_until_ready(loss)
      step_times.append(time.perf_counter() - t0)
    done = step + 1
    loss = float(loss)  # one host read per step (timing already waits for it)
    saving = manager.should_save(done) or done == trainer.total
    bad = (f"the loss is {loss} at step {done}" if not math.isfinite(loss) else
           f"the parameters after step {done} are not finite"
           if saving and not _all_finite(trainer.params) else None)
    if bad is not None:
      _stop_diverged(manager, bar, bad)
    if done % cfg.log_every == 0 or done == trainer.total:
      now = time.perf_counter()
      ips = (done - n_last) * cfg.batch_size / max(now - t_last, 1e-9)
      t_last, n_last = now, done
      rec = {"step": done, "loss": loss, "acc": float(acc),
             "lr": float(trainer.lr(step)), "images_per_s": ips}
      log(rec)
      if bar is not None:
        bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}", img_s=f"{ips:.0f}")
    if done % per_epoch == 0 or done == trainer.total:
      ev = trainer.evaluate()
      log({"step": done, "epoch": done / per_epoch, **ev})
      if bar is not None:
        bar.write(f"epoch {done / per_epoch:5.1f}  step {done:6d}  test_loss {ev['test_loss']:.4f}"
                  f"  test_acc {ev['test_acc']:.4f}")
    if saving:  # its checksums first: a checkpoint never exists without them
      run_dir.check_present(workdir, f"the checkpoint of step {done}")
      checkpoints.checkpoint_io(manager, f"the checksums of step {done}", lambda: checkpoints.record(
          workdir, done, trainer.state(), main))
      checkpoints.checkpoint_io(manager, f"the checkpoint of step {done}", lambda: manager.save(
          done, args=ocp.args.StandardSave(trainer.state()), force=True))
      if main:
        checkpoints.prune(workdir, set(manager.all_steps()) | {done})
    if bar is not None:
      bar.update(1)


def _write(workdir: pathlib.Path, what: str, path: pathlib.Path, text: str) -> None:
  """``text`` written to ``path`` at once (:func:`run_dir.write_atomic`) before any checkpoint
  save is in flight; a storage failure is one CheckpointWriteError naming it."""
  try:
    run_dir.write_atomic(path, text)
  except OSError as e:
    raise checkpoints.CheckpointWriteError(
        what, path, e.strerror or errors.first_line(e),
        resumable=checkpoints.latest_step(workdir) is not None) from None


def _train(cfg: config.TrainConfig, dataset: data_lib.Dataset, workdir: pathlib.Path, trainer,
           data: str, *, resume: bool, progress: bool, stop_after: int | None,
           time_steps: bool, main: bool) -> dict[str, Any]:
  """The run in ``workdir`` (its lock held): restore or start, train the steps, checkpoint,
  log, and the summary."""
  if main:  # the other processes read it in prepare_workdir: replaced at once
    _write(workdir, "the run's options", workdir / "config.json",
           json.dumps(run_dir.run_identity(cfg, data), indent=1))
  manager = checkpoints.manager(workdir, cfg.checkpoint_every)
  start = trainer.restore(manager, workdir) if resume else 0
  metrics_path = workdir / "metrics.jsonl"
  history = run_dir.logged_up_to(metrics_path, start) if resume and metrics_path.is_file() else []
  if main:  # the lines log() wrote, as it wrote them
    _write(workdir, "the metrics log", metrics_path,
           "".join(json.dumps(r) + "\n" for r in history))
  n = dataset.x_train.shape[0]
  per_epoch = n // cfg.batch_size
  step_times = []

  bar = None
  if progress and main:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=trainer.total, initial=start, unit="step", dynamic_ncols=True,
               desc=f"{cfg.preset} {cfg.run_name}")
  def log(record):
    history.append(record)
    if main:
      run_dir.check_present(workdir, f"the metrics of step {record['step']}")

      def append():
        with metrics_path.open("a") as f:
          f.write(json.dumps(record) + "\n")
      checkpoints.checkpoint_io(manager, f"the metrics of step {record['step']}", append,
                                where=metrics_path)

  end = trainer.total if stop_after is None else min(trainer.total, stop_after)
  try:
    _steps(cfg, trainer, manager, workdir, range(start, end), log, bar, step_times,
           time_steps=time_steps, main=main, per_epoch=per_epoch)
  except errors.StopRequested as e:  # the saves in flight complete: what was saved stays intact
    errors.clear_stop()
    try:
      manager.wait_until_finished()
    finally:
      manager.close()
      if bar is not None:
        bar.close()
    raise errors.Interrupted(
        e.signum, trainer.step, workdir.parent if workdir.name == cfg.run_name else workdir,
        resumable=checkpoints.latest_step(workdir) is not None) from None
  checkpoints.checkpoint_io(manager, "the last checkpoint", manager.wait_until_finished)
  manager.close()
  if bar is not None:
    bar.close()
  evals = [h for h in history if "test_acc" in h]
  trains = [h for h in history if "loss" in h]
  summary = {
      "preset": cfg.preset, "configuration": cfg.configuration,
      "implementation": cfg.implementation, "head_mode": cfg.head_mode, "dtype": cfg.dtype,
      "steps": trainer.step, "total_steps": trainer.total, "finished": trainer.step == trainer.total,
      "final_test_acc": evals[-1]["test_acc"] if evals else None,
      "final_test_loss": evals[-1]["test_loss"] if evals else None,
      "final_train_loss": trains[-1]["loss"] if trains else None,
      "step_time_s_median": float(np.median(step_times[len(step_times) // 5:])) if step_times else None,
      "devices": trainer.mesh.size, "processes": jax.process_count(),
      "shard_params": trainer.shard_params,
      "state_bytes_per_device": trainer.state_bytes_per_device(),
      "platform": jax.default_backend(),
      "memory_plan": None if trainer.plan is None else {
          k: getattr(trainer.plan, k) for k in (
              "budget", "configuration", "keep", "offload", "recompute", "policy",
              "as_written", "predicted_bytes", "compiled_bytes", "predicted_recompute_flops")},
  }
  run_dir.check_present(workdir, "the summary")  # (the last save may have recreated it)
  if main:
    checkpoints.checkpoint_io(manager, "the summary", lambda: run_dir.write_atomic(
        workdir / "summary.json", json.dumps(summary, indent=1)), where=workdir / "summary.json")
  summary["history"] = history
  summary["trainer"] = trainer
  return summary
