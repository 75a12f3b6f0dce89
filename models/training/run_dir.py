"""A run's directory: its lock (one writer), its config (a resume must match it), its metrics
log (cut back to the checkpoint resumed from) and atomic writes."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from models import cli
from models.training import checkpoints
from models.training import config
from models.training import errors


def check_writable(workdir: pathlib.Path) -> None:
  """ConfigError unless ``workdir`` (or the nearest existing parent) can be written."""
  probe = cli.nearest_existing(workdir)
  if not probe.is_dir():
    raise errors.ConfigError(f"--workdir {workdir}: {probe} exists and is not a directory")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise errors.ConfigError(f"--workdir {workdir}: {probe} is not writable")


def saved_options(saved: dict) -> dict:
  """A saved ``TrainConfig`` dict with each field it does not record at its default: an
  option added after the run was written had no other value in that run."""
  defaults = {f.name: f.default for f in dataclasses.fields(config.TrainConfig)}
  return {**defaults, **saved}


def run_identity(cfg: config.TrainConfig, data: str | None) -> dict[str, Any]:
  """What config.json records: every option that shapes the result, and the data's
  fingerprint (``data.fingerprint``)."""
  return {**dataclasses.asdict(cfg), "data": data}


def prepare_workdir(cfg: config.TrainConfig, workdir: pathlib.Path, *, resume: bool,
                    data: str | None = None) -> None:
  """Check the run directory before anything is written to it.

  ``--resume`` continues only the same run: config.json must be there and record the same
  options and the same data (``data``: its fingerprint); anything else is one line naming
  what differs, and nothing is renamed or written."""
  check_writable(workdir)
  existing = checkpoints.latest_step(workdir)
  cfg_file = workdir / "config.json"
  if resume:
    if existing is None:
      raise errors.ConfigError(f"--resume: no checkpoint in {workdir / 'checkpoints'}")
    if not cfg_file.is_file():
      raise errors.ConfigError(f"--resume: {cfg_file} is missing, so the checkpoints' options (dtype, "
                        "configuration, data) cannot be checked; restore it or start a new "
                        "--workdir")
    try:
      saved = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
      raise errors.ConfigError(f"--resume: {cfg_file} is not the JSON this script writes ({e}); "
                        "restore it or start a new --workdir") from None
    if not isinstance(saved, dict):
      raise errors.ConfigError(f"--resume: {cfg_file} holds no options (a JSON object was expected)")
    saved = saved_options(saved)
    now = run_identity(cfg, data)
    if "data" not in saved or data is None:  # no fingerprint recorded, or no data to compare
      saved["data"] = now["data"]
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k, "(absent)") != now.get(k, "(absent)")]
    if differ:
      what = "; ".join("the data (another file, or other contents)" if k == "data" else
                       f"{cli.flag(k) if k in now else k}: {saved.get(k, '(absent)')!r} in the "
                       f"run, {now.get(k, '(absent)')!r} now" for k in differ)
      raise errors.ConfigError(f"--resume: options differ from the checkpointed run ({cfg_file}): "
                        f"{what}")
  elif existing is not None:
    raise errors.ConfigError(f"{workdir} already holds checkpoints (step {existing}); pass --resume to "
                      "continue that run or --workdir to start a new one")


def write_atomic(path: pathlib.Path, text: str) -> None:
  """Replace ``path``'s content at once: a reader (another process of the run, on a shared file
  system) sees the old file or the new one, never a truncated one."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    tmp.write_text(text)
    os.replace(tmp, path)
  except BaseException:  # (a full disk): no partial file left behind, the old one untouched
    tmp.unlink(missing_ok=True)
    raise


def logged_up_to(metrics_path: pathlib.Path, step: int) -> list[dict[str, Any]]:
  """The records of ``metrics.jsonl`` up to ``step`` (a resumed run drops what the interrupted
  one logged past its checkpoint); a last line cut short by the kill is dropped too.  Any other
  line that is not a record this script writes (not UTF-8, not JSON, no integer step) is a
  ConfigError naming the file and the line: nothing resumes over a log it cannot read."""
  lines = metrics_path.read_bytes().split(b"\n")
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  kept = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      if i == last:  # the write a kill interrupted
        continue
      why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "not JSON"
      raise errors.ConfigError(f"--resume: {metrics_path} line {i + 1} is {why}; restore the file or "
                        "delete that line") from None
    step_of = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step_of, int) or isinstance(step_of, bool):
      raise errors.ConfigError(f"--resume: {metrics_path} line {i + 1} has no integer \"step\" "
                        f"(got {step_of!r}); restore the file or delete that line")
    if step_of <= step:
      kept.append(record)
  return kept


class RunLock:
  """One writer per run directory: an advisory lock (``fcntl.flock``) on ``<workdir>/.lock``,
  held while a run writes there.  The kernel drops it when its process ends, however it
  ends, so a lock left by a killed run is no lock; the file names the holder for the error."""

  def __init__(self, workdir: pathlib.Path):
    self.path, self.file = workdir / ".lock", None

  def __enter__(self):
    import fcntl  # pylint: disable=import-outside-toplevel
    import socket  # pylint: disable=import-outside-toplevel
    f = open(self.path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise errors.ConfigError(f"--workdir {self.path.parent}: another run ({holder}) is writing to "
                        "it; wait for it to end or use another --workdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    self.file = f
    return self

  def __exit__(self, *exc):
    import fcntl  # pylint: disable=import-outside-toplevel
    fcntl.flock(self.file, fcntl.LOCK_UN)
    self.file.close()
    return False


def check_present(workdir: pathlib.Path, what: str) -> None:
  """Raise :class:`errors.RunDirectoryLost` if ``workdir``'s config.json is gone (the directory
  was removed, or removed and recreated by a writer), before writing ``what`` there.

  Args:
    workdir: the run directory.
    what: what is about to be written (for the message).
  """
  if not (workdir / "config.json").is_file():
    raise errors.RunDirectoryLost(workdir, what)
