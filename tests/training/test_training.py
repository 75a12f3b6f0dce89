"""The training job: resume equivalence, data parallelism, bad input, --compare outputs."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax

from models.training import data as data_lib
from models import training
from models.training import run_dir
from tests.training import SMALL


def test_resume_rejects_changed_options_and_a_broken_config_file(digits, tmp_path):
  training.train(SMALL, digits, tmp_path / "r", progress=False, stop_after=6, devices=1)
  with pytest.raises(training.ConfigError, match="options differ"):
    training.train(dataclasses.replace(SMALL, lr=0.5), digits, tmp_path / "r", resume=True,
                   progress=False, devices=1)
  cfg_file = tmp_path / "r" / "config.json"
  for text, pattern in [("", "is not the JSON this script writes"),
                        ("[1, 2]", "holds no options")]:
    cfg_file.write_text(text)
    with pytest.raises(training.ConfigError, match=re.escape(str(cfg_file)) + ".*" + pattern):
      run_dir.prepare_workdir(SMALL, tmp_path / "r", resume=True)


@pytest.mark.parametrize("moment", ["before the first checkpoint", "between checkpoints",
                                    "during a checkpoint's save", "after the last step"])
def test_a_vanished_run_directory_stops_with_one_line_and_writes_nothing_more(
    digits, tmp_path, monkeypatch, moment):
  """The run directory removed mid-run (rm -rf while training): one RunDirectoryLost naming it
  (an OSError: the command line's exit 2) at the next write, whatever the moment; before, orbax
  recreated the directory for its next save and the run ended with exit 0 and no config.json."""
  import shutil
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  work = tmp_path / "w"
  at = {"before the first checkpoint": 0, "between checkpoints": 7, "after the last step": 11}
  real_step, real_save = training.Trainer.train_step, ocp.CheckpointManager.save

  def remove():  # (orbax's threads may be writing in it meanwhile)
    while work.exists():
      shutil.rmtree(work, ignore_errors=True)

  def step(self, i):
    out = real_step(self, i)
    if i == at.get(moment):
      remove()
    return out

  def save(self, done, *args, **kwargs):
    if moment == "during a checkpoint's save" and done == 10:
      remove()
    return real_save(self, done, *args, **kwargs)
  monkeypatch.setattr(training.Trainer, "train_step", step)
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(training.RunDirectoryLost) as e:
    training.train(SMALL, digits, work, progress=False, devices=1)
  assert isinstance(e.value, OSError) and "\n" not in str(e.value)
  assert f"the run directory {work} was removed" in str(e.value)
  assert not (work / "summary.json").exists() and not (work / "metrics.jsonl").exists()


def test_a_metrics_log_it_cannot_read_is_one_line_naming_it(tmp_path):
  """On resume: a last line cut short by a kill is dropped; any other line that is not UTF-8,
  not JSON or has no integer step stops the resume with the file and the line."""
  path = tmp_path / "metrics.jsonl"
  good = b'{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n'
  path.write_bytes(good + b'{"step": 6, "lo')
  assert [r["step"] for r in run_dir.logged_up_to(path, 4)] == [2, 4]
  for bad, why in [(b"\xff\xfe not text\n", "line 2 is not UTF-8"),
                   (b"{oops\n", "line 2 is not JSON"),
                   (b'{"step": "four"}\n', "line 2 has no integer"),
                   (b"[1, 2]\n", "line 2 has no integer")]:
    lines = good.split(b"\n")
    path.write_bytes(lines[0] + b"\n" + bad + lines[1] + b"\n")
    with pytest.raises(training.ConfigError, match=re.escape(str(path)) + " " + why) as e:
      run_dir.logged_up_to(path, 4)
    assert "\n" not in str(e.value)


def test_files_other_processes_read_are_replaced_at_once(tmp_path):
  """config.json and metrics.jsonl are rewritten by process 0 while the others read them
  (a resumed multi-process run read a truncated config.json: CI, 2026-11-23); a reader running
  beside the writer never sees a partial file (with Path.write_text, most reads fail)."""
  import threading  # pylint: disable=import-outside-toplevel
  path = tmp_path / "config.json"
  text = json.dumps(list(range(2000)))
  run_dir.write_atomic(path, text)
  done, seen = threading.Event(), []
  def read():
    while not done.is_set():
      seen.append(path.read_text())
  reader = threading.Thread(target=read)
  reader.start()
  try:
    for _ in range(300):
      run_dir.write_atomic(path, text)
  finally:
    done.set()
    reader.join()
  assert len(seen) > 10 and all(s == text for s in seen)
  assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left


def test_data_parallel_matches_single_device(digits):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  cfg = dataclasses.replace(SMALL, batch_size=64)
  losses = {}
  for n in (1, 8):
    t = training.Trainer(cfg, digits, devices=n)
    assert t.mesh.size == n
    losses[n] = [float(t.train_step(s)[0]) for s in range(10)]
  np.testing.assert_allclose(losses[8], losses[1], rtol=2e-5, atol=2e-6)


def test_batch_order_and_augmentation_are_deterministic():
  a = data_lib.batch_indices(3, 17, 1000, 64)
  np.testing.assert_array_equal(a, data_lib.batch_indices(3, 17, 1000, 64))
  assert not np.array_equal(a, data_lib.batch_indices(4, 17, 1000, 64))
  x = np.random.default_rng(0).random((5, 8, 8, 1)).astype(np.float32)
  np.testing.assert_array_equal(data_lib.random_shift(x, 1, 0, 3), data_lib.random_shift(x, 1, 0, 3))


# Planned vs unplanned gradients of the digits ViT: the plan runs invert() of the loss, whose
# backward is within 6.5 float32 ulps per element (tests/convert/test_program.py's bound);
# twice that, relative L2.  Measured 2.6e-7 to 2.9e-7 (JAX 0.10.2, CPU).
GRADIENT_RTOL = 2 * 6.5 * 2.0 ** -24


def test_memory_budget_plans_the_model(digits):
  """--memory-budget: the loss planned by invact_jax.plan (the one planner path; its plans are
  checked in tests/planner/test_api.py) at 65 % of the gradient's compiled temp as
  written: within the budget, recomputing, with the unplanned loss and gradients, training;
  a budget nothing fits is one line naming the minimum."""
  scanned = dataclasses.replace(SMALL, scan_layers=True)
  plain = training.Trainer(scanned, digits, devices=1)
  x, y = plain.batch(0)
  mean_loss = plain._mean_loss  # pylint: disable=protected-access
  written = invact_jax.memory.compiled(jax.value_and_grad(mean_loss, has_aux=True), plain.params,
                                       x, y, jax.random.key(0)).temp
  budget = int(0.65 * written)
  trainer = training.Trainer(dataclasses.replace(scanned, memory_budget=budget), digits,
                             devices=1)
  report = trainer.plan
  assert report.depth == scanned.model_config(digits).depth
  assert report.compiled_bytes <= report.budget == budget, report
  assert report.recompute and report.predicted_recompute_flops > 0, report
  (loss, grads), (want, want_grads) = trainer.gradients(0), plain.gradients(0)
  assert float(loss) == float(want)
  flat = [np.concatenate([np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(g)])
          for g in (grads, want_grads)]
  assert np.linalg.norm(flat[0] - flat[1]) <= GRADIENT_RTOL * np.linalg.norm(flat[1])
  assert np.isfinite(float(trainer.train_step(0)[0]))  # the planned model trains
  with pytest.raises(training.ConfigError, match=r"^--memory-budget: memory budget [\d,]+ "
                     r"bytes is infeasible: the minimum feasible budget is [\d,]+ bytes$"):
    training.Trainer(dataclasses.replace(scanned, memory_budget=report.minimum_bytes // 2),
                     digits, devices=1)


def test_optimizer_values_are_checked(digits):
  for field, value, pattern in (("lr", float("nan"), "--lr must be a positive finite"),
                                ("lr", 0.0, "--lr must be a positive finite"),
                                ("weight_decay", float("nan"), "--weight-decay must be a finite"),
                                ("weight_decay", -1.0, "--weight-decay must be a finite")):
    with pytest.raises(training.ConfigError, match=re.escape(pattern)):
      training.validate(dataclasses.replace(SMALL, **{field: value}), digits, 1)


def test_divergence_stops_and_keeps_the_last_finite_checkpoint(digits, tmp_path, monkeypatch):
  """A non-finite loss, or non-finite parameters at a checkpoint step, stop the run with a
  clear error before anything non-finite is saved."""
  real_step = training.Trainer.train_step

  def nan_loss_at_7(self, step):
    loss, acc = real_step(self, step)
    return (jnp.float32(np.nan) if step + 1 == 7 else loss), acc
  monkeypatch.setattr(training.Trainer, "train_step", nan_loss_at_7)
  with pytest.raises(training.TrainingDiverged,
                     match=r"the loss is nan at step 7; .*last checkpoint \(step 5\)"):
    training.train(SMALL, digits, tmp_path / "loss", progress=False, devices=1)

  def nan_params_at_7(self, step):
    out = real_step(self, step)
    if step + 1 == 7:
      self.params = jax.tree.map(lambda p: p * np.nan, self.params)
      return jnp.float32(1.0), out[1]  # the loss still looks fine
    return out
  monkeypatch.setattr(training.Trainer, "train_step", nan_params_at_7)
  with pytest.raises(training.TrainingDiverged, match=r"parameters after step 7 are not finite"):
    training.train(dataclasses.replace(SMALL, checkpoint_every=7), digits, tmp_path / "params",
                   progress=False, devices=1)
  import orbax.checkpoint as ocp
  for run, last in (("loss", 5), ("params", 1)):  # orbax also keeps the first step
    with ocp.CheckpointManager(tmp_path / run / "checkpoints") as mgr:
      assert mgr.latest_step() == last
      state = mgr.restore(last, args=ocp.args.StandardRestore())
      assert all(np.all(np.isfinite(np.asarray(l))) for l in jax.tree.leaves(state["params"]))


def test_resume_refuses_another_run_and_never_renames_it(digits, tmp_path):
  """A run's identity is its options and its data: --resume with other data of the same shape,
  without config.json, or with a config.json that records more, is one line naming what
  differs, and every checkpoint stays as it was."""
  wd = tmp_path / "r"
  training.train(SMALL, digits, wd, progress=False, stop_after=6, devices=1)
  before = sorted(p.name for p in (wd / "checkpoints").iterdir())
  other = dataclasses.replace(digits, x_train=digits.x_train[::-1].copy())
  with pytest.raises(training.ConfigError, match=r"options differ .*the data \(another file"):
    training.train(SMALL, other, wd, resume=True, progress=False, devices=1)
  cfg_file = wd / "config.json"
  saved = json.loads(cfg_file.read_text())
  assert saved["data"] == data_lib.fingerprint(digits) != data_lib.fingerprint(other)
  cfg_file.write_text(json.dumps({**saved, "extra_option": 1}))
  with pytest.raises(training.ConfigError, match=r"extra_option: 1 in the run, '\(absent\)' now"):
    training.train(SMALL, digits, wd, resume=True, progress=False, devices=1)
  with pytest.raises(training.ConfigError, match=r"--dtype: 'float32' in the run, 'bfloat16'"):
    run_dir.prepare_workdir(dataclasses.replace(SMALL, dtype="bfloat16"), wd, resume=True,
                             data=saved["data"])
  cfg_file.unlink()
  with pytest.raises(training.ConfigError, match=r"config.json is missing"):
    training.train(dataclasses.replace(SMALL, dtype="bfloat16"), digits, wd, resume=True,
                   progress=False, devices=1)
  assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == before
  # A config.json without the options added since (at their defaults there) and without
  # the data's fingerprint still resumes; one with another value of them does not.
  old = {k: v for k, v in saved.items() if k not in ("data", "implementation", "head_mode")}
  cfg_file.write_text(json.dumps(old))
  with pytest.raises(training.ConfigError, match=r"--head-mode: None in the run, 'standard' now"):
    run_dir.prepare_workdir(dataclasses.replace(SMALL, head_mode="standard"), wd, resume=True)
  assert training.train(SMALL, digits, wd, resume=True, progress=False, devices=1)["finished"]


def test_one_writer_per_run_directory(digits, tmp_path):
  """A second run on a directory another run is writing to stops at once with one line; a
  lock file left by a run that ended (killed, say) holds nothing."""
  wd = tmp_path / "r"
  wd.mkdir()
  with run_dir.RunLock(wd):
    with pytest.raises(training.ConfigError, match=r"another run \(pid \d+ on .*\) is writing"):
      training.train(SMALL, digits, wd, progress=False, devices=1)
  assert not (wd / "checkpoints").exists() and not (wd / "config.json").exists()
  (wd / ".lock").write_text("pid 1 on a-host-that-is-gone\n")  # stale: nobody holds it
  assert training.train(SMALL, digits, wd, progress=False, devices=1, stop_after=2)["steps"] == 2
