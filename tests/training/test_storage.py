"""Storage faults: a write to the run directory that fails (a full disk) at each place the
run writes — its options, the metrics log, a checkpoint's checksums, the checkpoint itself, the
summary — is one line naming what, where and why and saying the next command; that command
ends in the uninterrupted run's state, a kill's torn checkpoint and log line on top included.
:data:`STORAGE_FAULTS` is the table a new kind of fault joins; the last test fills a real
(tmpfs) disk during text training through the script."""
import errno
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from models import training
from models.training import checkpoints
from models.training import run_dir
from tests.training import SMALL

ROOT = pathlib.Path(__file__).resolve().parents[2]
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_replacing(name: str):
  """The write of the run directory's file ``name`` (replaced at once, run_dir.write_atomic)."""
  def inject(monkeypatch):
    real = run_dir.write_atomic

    def write(path, text):
      if path.name == name:
        raise FULL
      return real(path, text)
    monkeypatch.setattr(run_dir, "write_atomic", write)
  return inject


def _fail_metrics(monkeypatch, record: int = 3):
  """The ``record``-th line appended to metrics.jsonl (step 2 * record: SMALL logs every 2)."""
  real, seen = pathlib.Path.open, []

  def open_(self, mode="r", *args, **kwargs):
    if self.name == "metrics.jsonl" and mode == "a":
      seen.append(1)
      if len(seen) == record:
        raise FULL
    return real(self, mode, *args, **kwargs)
  monkeypatch.setattr(pathlib.Path, "open", open_)


def _fail_checksums(monkeypatch, step: int = 10):
  real = checkpoints.record

  def record(workdir, at, tree, main):
    if at == step:
      raise FULL
    return real(workdir, at, tree, main)
  monkeypatch.setattr(checkpoints, "record", record)


def _fail_checkpoint(monkeypatch, step: int):
  """orbax's save at ``step`` failing as TensorStore reports it (a ValueError, not OSError)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  real = ocp.CheckpointManager.save

  def save(self, at, *args, **kwargs):
    if at == step:
      raise ValueError(f"RESOURCE_EXHAUSTED: Error writing local file \"{self.directory}/{at}."
                       "orbax-checkpoint-tmp/x\": Failed to write 8 bytes to file 5: No space "
                       "left on device [os_error_code='28']")
    return real(self, at, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)


#: The storage faults, in the order one run meets them: (fault, inject(monkeypatch), what the
#: line names, where (relative to the run), whether a checkpoint was saved before it — the
#: next command is then --resume, else the same command again).  Each fault's next command is
#: the run that meets the next fault, so every one is recovered from in turn, and the run that
#: finally finishes ends where an uninterrupted one does.  A new kind of fault joins here.
STORAGE_FAULTS = (
    ("the run's options", _fail_replacing("config.json"), "the run's options", "config.json",
     False),
    # (orbax saves the first step of a run without checkpoints, whatever the interval)
    ("the first checkpoint", lambda m: _fail_checkpoint(m, 1), "the checkpoint of step 1",
     "checkpoints", False),
    ("a metrics line", _fail_metrics, "the metrics of step 6", "metrics.jsonl", True),
    ("a checkpoint's checksums", _fail_checksums, "the checksums of step 10", "checkpoints", True),
    ("a later checkpoint", lambda m: _fail_checkpoint(m, 10), "the checkpoint of step 10",
     "checkpoints", True),
    ("the summary", _fail_replacing("summary.json"), "the summary", "summary.json", True),
)


def test_each_failed_write_is_one_line_and_its_next_command_recovers(digits, tmp_path,
                                                                     monkeypatch):
  work, resume = tmp_path / "run", False
  for fault, inject, what, where, resumable in STORAGE_FAULTS:
    with monkeypatch.context() as m:
      inject(m)
      with pytest.raises(training.CheckpointWriteError) as e:
        training.train(SMALL, digits, work, resume=resume, progress=False, devices=1)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"could not write {what} in "), (fault, line)
    assert str(work.resolve() / where) in line or str(work / where) in line, (fault, line)
    assert "No space left on device" in line and e.value.resumable == resumable, (fault, line)
    assert (checkpoints.latest_step(work) is not None) == resumable, fault
    assert ("continue with --resume" if resumable else "again (without --resume)") in line
    assert not list(work.glob(".*.tmp")), f"{fault}: a failed write left its temporary file"
    resume = resumable  # what the line says the next command is
  # Then a kill's damage on top: the newest checkpoint torn, the log's last line cut short.
  # The resume sets the checkpoint aside (a warning), falls back to the one before, and logs
  # no step twice.
  assert resume
  newest = checkpoints.latest_step(work)
  for f in (work / "checkpoints" / str(newest)).rglob("*"):
    if f.is_file():
      f.write_bytes(b"torn write")
  with (work / "metrics.jsonl").open("a") as f:
    f.write('{"step": 12, "lo')
  with pytest.warns(UserWarning, match=rf"checkpoint step {newest} does not verify: it is "
                                       r"unreadable.*falling back"):
    done = training.train(SMALL, digits, work, resume=True, progress=False, devices=1)
  assert done["finished"] and (work / "checkpoints" / f"{newest}.corrupt").is_dir()
  logged = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]
  assert logged == sorted(set(logged)) and logged[-1] == SMALL.steps
  uninterrupted = training.train(SMALL, digits, tmp_path / "uninterrupted", progress=False,
                                 devices=1)
  for a, b in zip(jax.tree.leaves(uninterrupted["trainer"].params),
                  jax.tree.leaves(done["trainer"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _namespace_tmpfs() -> list[str] | None:
  """A command prefix that runs a shell where a tmpfs can be mounted (a mount namespace of
  its own, as root or as the user's own root in a user namespace), or None."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return None
  probe = subprocess.run([unshare, "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                         capture_output=True, check=False)
  return [unshare, "-rm", "sh", "-c"] if probe.returncode == 0 else None


def test_a_full_disk_during_text_training_is_one_line_and_the_same_command_finishes(tmp_path):
  """scripts/parity.py's byte-level GPT (the text task) on an 8 MiB tmpfs: one checkpoint
  fits, the next does not.  One line (``error: could not write the checkpoint of step N …``,
  or ``the checksums of step N`` where the disk fills while a checkpoint is still being
  written in the background; exit 2, no traceback); with space freed, the same command
  finishes the study, resuming the run from its checkpoint."""
  prefix = _namespace_tmpfs()
  if prefix is None:
    pytest.skip("no mount namespace for a tmpfs here (unshare -rm refused)")
  disk = tmp_path / "disk"
  disk.mkdir()
  args = ["--quick", "--tasks", "text", "--dtypes", "float32", "--configurations", "standard",
          "--seeds", "1", "--no-gradients", "--no-progress",
          "--workdir", f"{disk}/w", "--out", f"{disk}/out/p"]
  run = f"{sys.executable} {ROOT / 'scripts' / 'parity.py'} {' '.join(args)}"
  record = f"{disk}/w/text/float32/standard/seed0/parity_run.json"
  shell = (f"mount -t tmpfs -o size=8m tmpfs {disk} || exit 99; "
           f"{run} 2> {tmp_path}/first.err > /dev/null; echo $? > {tmp_path}/first.rc; "
           f"mount -o remount,size=64m {disk}; "
           f"{run} 2> {tmp_path}/again.err > /dev/null; echo $? > {tmp_path}/again.rc; "
           f"cp {record} {tmp_path}/record.json")
  subprocess.run([*prefix, shell], cwd=ROOT, check=False, timeout=300)
  first = (tmp_path / "first.err").read_text()
  assert (tmp_path / "first.rc").read_text().strip() == "2", first[-3000:]
  lines = [ln for ln in first.splitlines() if not ln.startswith("warning: ")]
  assert len(lines) == 1 and re.match(r"error: could not write the (checkpoint|checksums) of "
                                      r"step \d+", lines[0]), first[-3000:]
  assert "No space left on device" in lines[0] and "run the same command again" in lines[0]
  assert (tmp_path / "again.rc").read_text().strip() == "0", (tmp_path / "again.err").read_text()
  resumed = json.loads((tmp_path / "record.json").read_text())
  # (that a resumed run ends bit-identical to an uninterrupted one: the test above)
  assert resumed["resumed"] is True and resumed["summary"]["finished"]
  assert resumed["summary"]["steps"] == resumed["summary"]["total_steps"]
