"""Recovery as a state machine: while any checkpoint verifies, --resume reaches it, and every
stop's message says what the next command does — each test runs that command."""
import dataclasses
import json
import os
import signal

import pytest

from models import training
from models.training import checkpoints
from models.training import compare
from models.training import config
from models.training import loop
from models.training import run_dir
from tests.training import SMALL


def _signal_at(monkeypatch, at_step: int | None, signum=signal.SIGTERM, runs=None):
  """Send ``signum`` to this process during train step ``at_step`` (None: just before the
  first step, as a signal during compiling lands) of the runs ``runs`` names (None: any; a
  comparison's second run, say)."""
  if at_step is None:
    real_steps = loop._steps  # pylint: disable=protected-access

    def steps(cfg, *args, **kwargs):
      if runs is None or cfg.run_name in runs:
        os.kill(os.getpid(), signum)
      return real_steps(cfg, *args, **kwargs)
    monkeypatch.setattr(loop, "_steps", steps)
    return
  real = training.Trainer.train_step

  def step(self, i):
    if i == at_step and (runs is None or self.cfg.run_name in runs):
      os.kill(os.getpid(), signum)
    return real(self, i)
  monkeypatch.setattr(training.Trainer, "train_step", step)


def test_a_stop_before_the_first_checkpoint_says_to_start_over(digits, tmp_path, monkeypatch):
  """SIGTERM before the first step (while compiling; orbax writes the first checkpoint after
  that step): nothing was saved, and the message says so: the same command again (without
  --resume) trains the run; --resume is refused."""
  _signal_at(monkeypatch, None)
  with pytest.raises(training.Interrupted) as e:
    with training.stop_on_signals():
      training.train(SMALL, digits, tmp_path / "run", progress=False, devices=1)
  assert e.value.code == 143 and not e.value.resumable
  assert "before the first checkpoint" in str(e.value) and "without --resume" in str(e.value)
  monkeypatch.undo()
  with pytest.raises(training.ConfigError, match="no checkpoint"):
    training.train(SMALL, digits, tmp_path / "run", resume=True, progress=False, devices=1)
  done = training.train(SMALL, digits, tmp_path / "run", progress=False, devices=1)
  assert done["finished"]


def test_a_stop_after_a_checkpoint_says_resume_and_it_does(digits, tmp_path, monkeypatch):
  _signal_at(monkeypatch, 7)
  with pytest.raises(training.Interrupted) as e:
    with training.stop_on_signals():
      training.train(SMALL, digits, tmp_path / "run", progress=False, devices=1)
  assert e.value.resumable and "--resume" in str(e.value) and "without" not in str(e.value)
  monkeypatch.undo()
  done = training.train(SMALL, digits, tmp_path / "run", resume=True, progress=False, devices=1)
  assert done["finished"] and done["steps"] == SMALL.steps


#: The comparisons' run: scanned layers (with unrolled ones XLA:CPU, JAX 0.10, recomputes
#: GELU's last multiply from the pre-activation and the tanh in the inverted backward fusion,
#: keeping both alive, and the inverted step compiles 0.2 % above the standard one; scanned,
#: 31 % below).
COMPARED = dataclasses.replace(SMALL, steps=6, scan_layers=True)


def test_an_interrupted_comparison_resumes_whichever_run_is_unfinished(digits, tmp_path,
                                                                       monkeypatch):
  """Stopped in its second run before that run's first checkpoint: the message says
  --resume, and --compare --resume finishes the comparison (the first run resumed at its
  end, the second started) and writes its table, JSON and plot."""
  first, second = (c.run_name for c in compare._runs(COMPARED))  # pylint: disable=protected-access
  _signal_at(monkeypatch, None, runs=(second,))
  with pytest.raises(training.Interrupted) as e:
    with training.stop_on_signals():
      compare.compare(COMPARED, digits, tmp_path, progress=False)
  assert e.value.resumable and "--resume" in str(e.value)
  assert checkpoints.latest_step(tmp_path / first) == COMPARED.steps
  assert checkpoints.latest_step(tmp_path / second) is None
  monkeypatch.undo()
  out = compare.compare(COMPARED, digits, tmp_path, resume=True, progress=False)
  assert {r["steps"] for r in out["runs"].values()} == {COMPARED.steps}
  assert "| final test accuracy |" in out["table"]
  assert out["png"].stat().st_size > 1000
  runs = json.loads(out["json"].read_text())["runs"]
  assert set(runs) == {"standard", "inverted"}
  # Same seed, same data order: the first logged losses agree to float tolerance.
  losses = {k: next(h for h in v["history"] if "loss" in h)["loss"] for k, v in runs.items()}
  assert abs(losses["standard"] - losses["inverted"]) < 1e-3
  assert runs["inverted"]["compiled_temp_bytes"] < runs["standard"]["compiled_temp_bytes"]


def test_a_comparison_stopped_before_any_checkpoint_says_to_start_over(digits, tmp_path,
                                                                       monkeypatch):
  first, _ = (c.run_name for c in compare._runs(COMPARED))  # pylint: disable=protected-access
  _signal_at(monkeypatch, None, runs=(first,))
  with pytest.raises(training.Interrupted) as e:
    with training.stop_on_signals():
      compare.compare(COMPARED, digits, tmp_path, progress=False)
  assert not e.value.resumable and "without --resume" in str(e.value)
  monkeypatch.undo()
  with pytest.raises(training.ConfigError, match="run it again without --resume"):
    compare.compare(COMPARED, digits, tmp_path, resume=True, progress=False)


@pytest.mark.parametrize("stop", ["signal", "full disk"])
def test_a_comparison_run_stopped_while_the_other_holds_checkpoints_says_resume(
    digits, tmp_path, monkeypatch, stop):
  """One run of a comparison stopped before its own first checkpoint (a signal, or a write
  that fails) while the other run holds checkpoints: the line says --resume, which --compare
  --resume continues (the test above runs it), not "the same command again", which --compare
  would refuse on finding the other run's checkpoints."""
  first, second = (c.run_name for c in compare._runs(COMPARED))  # pylint: disable=protected-access
  (tmp_path / second / "checkpoints" / "6").mkdir(parents=True)  # the other run's checkpoint
  monkeypatch.setattr(config, "validate", lambda *a, **k: None)
  monkeypatch.setattr(run_dir, "prepare_workdir", lambda *a, **k: None)

  def train(cfg, *args, **kwargs):  # the first run stops before its first checkpoint
    assert cfg.run_name == first
    if stop == "signal":
      raise training.Interrupted(15, 0, tmp_path / first, resumable=False)
    raise training.CheckpointWriteError("the checkpoint of step 1", tmp_path / first,
                                        "No space left on device", resumable=False)
  monkeypatch.setattr(loop, "train", train)
  with pytest.raises((training.Interrupted, training.CheckpointWriteError)) as e:
    compare.compare(COMPARED, digits, tmp_path, resume=True, progress=False)
  assert e.value.resumable and "--resume" in str(e.value) and "without" not in str(e.value)


def test_a_step_damaged_twice_is_set_aside_again(digits, tmp_path):
  """Step 10 set aside once (``10.corrupt``), the run re-run past it, and step 10 damaged
  again: the resume sets it aside as ``10.corrupt.1`` and reaches step 5 (before: "cannot
  rename ... already exists", exit 2)."""
  run = tmp_path / "run"
  training.train(SMALL, digits, run, progress=False, stop_after=11, devices=1)
  ckpt = run / "checkpoints"

  def damage():
    for f in (ckpt / "10").rglob("*"):
      if f.is_file():
        f.write_bytes(b"torn write")
  damage()
  with pytest.warns(UserWarning, match="moved it to 10.corrupt and"):
    training.train(SMALL, digits, run, resume=True, progress=False, stop_after=11, devices=1)
  damage()
  with pytest.warns(UserWarning, match=r"moved it to 10\.corrupt\.1 and"):
    done = training.train(SMALL, digits, run, resume=True, progress=False, devices=1)
  assert done["finished"] and (ckpt / "10.corrupt").is_dir() and (ckpt / "10.corrupt.1").is_dir()
