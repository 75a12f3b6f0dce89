"""Permission faults as a user who is not root (root may read and write anywhere: where the
suite runs as root, the training script runs as ``nobody`` through ``setpriv``).  Each ends in
one line and nothing lost: a run directory in a folder the user may not write, a checkpoint
folder made read-only mid-run, a checkpoint file the user may not read (not set aside as
damaged: its bytes are fine), a damaged checkpoint that cannot be set aside."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import env_with_devices

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOBODY = 65534


def _as_user() -> list[str]:
  """The prefix that runs a command as a user who is not root."""
  if os.geteuid() != 0:
    return []
  if shutil.which("setpriv") is None:
    pytest.skip("runs as root without setpriv: no user to drop to")
  return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


@pytest.fixture(scope="module")
def area():
  """A folder the user owns (pytest's tmp_path is root's alone), its caches inside."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="invact-permissions-"))
  if os.geteuid() == 0:
    os.chown(path, NOBODY, NOBODY)
  probe = subprocess.run([*_as_user(), sys.executable, "-c", "import invact_jax"],
                         capture_output=True, text=True, check=False, cwd=path)
  if probe.returncode:
    shutil.rmtree(path)
    pytest.skip(f"this interpreter does not run as another user: {probe.stderr[-200:]}")
  yield path
  subprocess.run(["chmod", "-R", "u+rwX", str(path)], check=False)
  shutil.rmtree(path, ignore_errors=True)


def _train(area: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  env = env_with_devices(1, JAX_PLATFORMS="cpu", HOME=str(area),
                         XDG_CACHE_HOME=str(area / ".cache"), MPLCONFIGDIR=str(area / ".mpl"),
                         JAX_COMPILATION_CACHE_DIR=str(area / ".jax"))
  return subprocess.run([*_as_user(), sys.executable, str(ROOT / "scripts" / "train_vit.py"),
                         "--no-progress", "--batch-size", "32", "--steps", "9",
                         "--checkpoint-every", "3", *args],
                        capture_output=True, text=True, cwd=area, env=env, timeout=300,
                        check=False)


def _one_line(out: subprocess.CompletedProcess, *parts: str) -> str:
  lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
  assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
  assert all(p in lines[0] for p in parts), lines[0]
  return lines[0]


@pytest.fixture(scope="module")
def stopped(area):
  """A run stopped after step 6 (checkpoints 3 and 6), trained once for every test below."""
  run = area / "stopped"
  assert _train(area, "--workdir", str(run), "--stop-after", "6").returncode == 0
  return run


@pytest.fixture
def run(area, stopped, request):
  """A copy of :func:`stopped` of this test's own (owner and modes kept)."""
  copy = area / request.node.name
  subprocess.run(["cp", "-a", str(stopped), str(copy)], check=True)
  return copy


def _steps(run: pathlib.Path) -> list[str]:
  return sorted(p.name for p in (run / "inverted" / "checkpoints").iterdir())


def test_a_run_directory_in_a_folder_the_user_may_not_write(area):
  locked = area / "locked"
  locked.mkdir(mode=0o555)
  _one_line(_train(area, "--workdir", str(locked / "run")), "is not writable")
  assert list(locked.iterdir()) == []


def test_a_checkpoint_folder_made_read_only_mid_run(area, run):
  """The save that fails is one line naming the cause and the next command; the checkpoints
  before it are intact."""
  (run / "inverted" / "checkpoints").chmod(0o555)
  _one_line(_train(area, "--workdir", str(run), "--resume"),
            "could not write the checkpoint of step 9", "Permission denied",
            "continue with --resume")
  assert _steps(run) == ["3", "6"]  # (--resume after a failed save: test_storage.py's table)


def test_a_checkpoint_the_user_may_not_read_is_not_set_aside(area, run):
  """The array files of the newest checkpoint unreadable (their permissions, not their bytes):
  before, it was renamed ``6.corrupt`` as damaged and the run went back to step 3; now one
  line says what to do, nothing is renamed, and after ``chmod`` the same command resumes from
  step 6."""
  arrays = [p for p in (run / "inverted" / "checkpoints" / "6" / "default").rglob("*")
            if p.is_file() and p.parent.name == "d"]  # (the arrays' data files)
  for f in arrays:
    f.chmod(0)
  _one_line(_train(area, "--workdir", str(run), "--resume"),
            "checkpoint step 6", "cannot be read", "not readable by this user",
            "nothing was renamed")
  assert _steps(run) == ["3", "6"]
  for f in arrays:
    f.chmod(0o644)
  # (the same command, stopped after step 7: the newest checkpoint, 6, restored: nothing
  # set aside)
  resumed = _train(area, "--workdir", str(run), "--resume", "--stop-after", "7")
  assert resumed.returncode == 0 and '"steps": 7' in resumed.stdout, resumed.stderr
  assert "does not verify" not in resumed.stderr and _steps(run) == ["3", "6"]


def test_a_damaged_checkpoint_in_a_folder_the_user_may_not_write(area, run):
  """A checkpoint that does not verify, in a folder the user may not rename in: one line saying
  so and what to do (it was a bare "[Errno 13] Permission denied" naming the rename), nothing
  renamed."""
  checksums = sorted((run / "inverted" / "checksums").iterdir())[-1]
  checksums.write_text(checksums.read_text().replace('"arrays": {"', '"arrays": {"x', 1))
  (run / "inverted" / "checkpoints").chmod(0o555)
  _one_line(_train(area, "--workdir", str(run), "--resume"),
            "checkpoint step 6", "does not verify", "cannot be set aside", "nothing was renamed")
  assert _steps(run) == ["3", "6"]
