"""The training job's command line: bad input and options as one line before any work, the
scripts' own checks, the data archive's checks, signals."""
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import invact_jax

from models.training import checkpoints
from models.training import data as data_lib
from models import training
from models.training import main as train_main
from tests import env_with_devices, load_script
from tests.training import SMALL

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_cli(*args, cwd=ROOT):
  env = env_with_devices(1, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_vit.py"), "--no-progress", *args],
                        capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False)


def _assert_one_line_error(out, pattern):
  assert out.returncode != 0
  lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
  # ours: "error: ..."; argparse's (a value outside an option's choices): "PROG: error: ..."
  assert len(lines) == 1 and re.match(r"(\S+: )?error: ", lines[0]), out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert pattern in lines[0], lines[0]


def test_cli_bad_inputs(tmp_path, capsys, monkeypatch):
  """Each case through the script's main() in this process (the exit code and stderr of a
  real process are checked by test_cli_never_overwrites_checkpoints)."""
  import warnings
  monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
  main = train_main.main
  corrupt = tmp_path / "corrupt.npz"
  corrupt.write_bytes(b"not a zip file")
  bad_shape = tmp_path / "shape.npz"
  np.savez(bad_shape, x_train=np.zeros((10, 8, 6)), y_train=np.zeros(10, int),
           x_test=np.zeros((4, 8, 6)), y_test=np.zeros(4, int))
  torn = tmp_path / "torn.npz"
  np.savez(torn, x_train=np.zeros((10, 8, 8)), y_train=np.zeros(10, int),
           x_test=np.zeros((4, 8, 8)), y_test=np.zeros(4, int))
  torn.write_bytes(torn.read_bytes()[:300])  # a copy cut short
  bad_labels = tmp_path / "labels.npz"
  np.savez(bad_labels, x_train=np.zeros((10, 8, 8)), y_train=-np.ones(10, int),
           x_test=np.zeros((4, 8, 8)), y_test=np.zeros(4, int))
  wd = str(tmp_path / "wd")
  cases = [
      (["--data", str(tmp_path / "missing.npz")], "data file not found"),
      (["--data", str(corrupt)], "cannot read"),
      (["--data", str(bad_shape)], "H == W"),
      (["--data", str(bad_labels)], "negative labels"),
      (["--batch-size", "5000"], "larger than the training set"),
      (["--preset", "vit-huge"], "unknown preset"),
      (["--epochs", "0"], "--epochs must be positive"),
      (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
      (["--configuration", "inverted-some"], "argument --configuration: invalid choice: 'inverted-some'"),
      (["--implementation", "cuda"], "argument --implementation: invalid choice: 'cuda'"),
      (["--head-mode", "fused"], "argument --head-mode: invalid choice: 'fused'"),
      (["--seed", "-1"], "--seed must be an integer in [0, 2**32)"),
      (["--shift", "8"], "--shift 8 would move images out of their 8x8 frame"),
      (["--compare", "--stop-after", "2"], "--stop-after does not apply to --compare"),
      (["--data", str(torn)], "a zip archive cut short"),
      (["--head-mode", "chunked"], "--head-mode chunked sets a language model's LM head"),
  ]
  if not invact_jax.available("triton")[0]:
    cases.append((["--implementation", "triton"], "--implementation triton: "))
  for args, pattern in cases:
    try:
      code = main(["--no-progress", *args, "--workdir", wd])
    except SystemExit as e:  # argparse's own checks (choices) exit
      code = e.code
    cap = capsys.readouterr()
    assert code == 2, cap.err
    _assert_one_line_error(subprocess.CompletedProcess(args, code, cap.out, cap.err), pattern)
  assert not pathlib.Path(wd).exists(), "nothing may be written on bad input"


def test_cli_is_generated_from_train_config(capsys):
  """Every TrainConfig field is an option of the same name; argparse's own checks (a type, a
  choice, a range) are one line and exit 2; the 0.1 name --activations is gone."""
  import dataclasses as dc
  with pytest.raises(SystemExit) as e:
    train_main.parser().parse_args(["--help"])
  assert e.value.code == 0
  help_text = capsys.readouterr().out
  for f in dc.fields(training.TrainConfig):
    assert "--" + f.name.replace("_", "-") in help_text, f.name
  args = train_main.parser().parse_args(["--batch-size", "8", "--configuration", "inverted-all",
                       "--no-scan-layers", "--memory-budget", "1MiB"])
  with pytest.raises(SystemExit) as e:
    train_main.parser().parse_args(["--activations", "inverted-all"])
  assert e.value.code == 2
  capsys.readouterr()
  from models import cli
  cfg = cli.from_args(training.TrainConfig, args)
  assert (cfg.batch_size, cfg.configuration, cfg.scan_layers, cfg.memory_budget) == \
      (8, "inverted-all", False, 2**20)
  for argv, pattern in ((["--stop-after", "-1"], "--stop-after: must be >= 1"),
                        (["--distributed-timeout", "0"], "--distributed-timeout: must be >= 1"),
                        (["--dtype", "float8"], "--dtype: invalid choice"),
                        (["--lr", "fast"], "--lr: invalid float value")):
    with pytest.raises(SystemExit) as e:
      train_main.parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pattern in err[0], err


def test_every_script_errors_in_one_line(capsys):
  """Every script builds its parser with cli.parser, whose errors are one line (no usage
  block) and exit 2."""
  from models import cli
  root = pathlib.Path(__file__).resolve().parents[2]
  for path in [*(root / "scripts").glob("*.py"), *(root / "models").rglob("*.py")]:
    if path.name != "cli.py":
      assert "argparse.ArgumentParser(" not in path.read_text(), path
  p = cli.parser("A script.\n\nMore.")
  p.add_argument("--n", type=cli.positive_int)
  for argv, pattern in ((["--n", "0"], "error: argument --n: must be >= 1, got 0"),
                        (["--m"], "error: unrecognized arguments: --m")):
    with pytest.raises(SystemExit) as e:
      p.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(pattern), err
  assert p.description == "A script."


def test_every_script_ends_through_finish_and_a_storage_failure_is_one_line(tmp_path):
  """Every script's entry point is ``cli.finish(...)``: an OSError met anywhere in the job (a
  full disk, an output file it may not write) is ``error: FILE: why``, exit 2, nothing after
  it; a training error keeps its own code; any other exception is a bug's traceback."""
  for path in (ROOT / "scripts").glob("*.py"):
    assert "cli.finish(" in path.read_text() and "sys.exit(main())" not in path.read_text(), path
  cases = {
      "open('" + str(tmp_path / "missing" / "out.json") + "', 'w')":
          (2, f"error: {tmp_path / 'missing' / 'out.json'}: No such file or directory"),
      "training.CheckpointWriteError('the summary', 'w/summary.json', 'No space left on "
      "device')": (2, "error: could not write the summary in w/summary.json: No space left on "
                      "device; the checkpoints written before are intact: free space (or fix "
                      "the directory) and continue with --resume"),
      "training.TrainingDiverged('the loss is nan at step 3')":
          (1, "error: the loss is nan at step 3"),
  }
  for raise_, (code, line) in cases.items():
    body = raise_ if raise_.startswith("open") else f"(_ for _ in ()).throw({raise_})"
    out = subprocess.run([sys.executable, "-c", "from models import cli, training; "
                          f"cli.finish(lambda: {body})"], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    assert (out.returncode, out.stderr) == (code, line + "\n"), out.stderr[-2000:]
  bug = subprocess.run([sys.executable, "-c", "from models import cli; cli.finish(lambda: 1 / 0)"],
                       cwd=ROOT, capture_output=True, text=True, check=False)
  assert bug.returncode == 1 and "Traceback" in bug.stderr and "ZeroDivisionError" in bug.stderr


def test_load_npz_rejects_what_is_not_an_image_archive(tmp_path):
  npy = tmp_path / "array.npz"
  with npy.open("wb") as f:
    np.save(f, np.zeros((3, 4)))
  text = tmp_path / "notes.txt"
  text.write_text("hello")
  objects = tmp_path / "objects.npz"
  np.savez(objects, x_train=np.array([None, 1], dtype=object))
  no_channels = tmp_path / "no_channels.npz"
  x = np.zeros((4, 8, 8, 0), np.float32)
  np.savez(no_channels, x_train=x, y_train=np.zeros(4, int), x_test=x, y_test=np.zeros(4, int))
  import zipfile  # pylint: disable=import-outside-toplevel
  not_npy = tmp_path / "not_npy.npz"  # members named .npy holding something else
  with zipfile.ZipFile(not_npy, "w") as z:
    for k in ("x_train", "y_train", "x_test", "y_test"):
      z.writestr(f"{k}.npy", b"garbage")
  huge = tmp_path / "huge.npz"  # a header claiming 1e11 images: read, it would allocate them
  import io  # pylint: disable=import-outside-toplevel
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False,
                                                "shape": (10**11, 8, 8)})
  with zipfile.ZipFile(huge, "w") as z:
    z.writestr("x_train.npy", header.getvalue() + bytes(640))
  flipped = tmp_path / "flipped.npz"  # a compressed archive with damaged bytes
  np.savez_compressed(flipped, x_train=np.arange(6400, dtype=np.uint8).reshape(100, 8, 8),
                      y_train=np.zeros(100, int), x_test=np.zeros((4, 8, 8), np.uint8),
                      y_test=np.zeros(4, int))
  raw = bytearray(flipped.read_bytes())
  raw[200] ^= 0xFF
  flipped.write_bytes(bytes(raw))
  for path, pattern in [(npy, "single .npy array"), (text, "not a zip archive"),
                        (objects, "object (pickled) arrays"), (no_channels, "C >= 1"),
                        (not_npy, "member x_train.npy is not .npy data"),
                        (huge, "claims shape (100000000000, 8, 8)"),
                        (flipped, "cannot read")]:
    with pytest.raises(data_lib.DataError, match=re.escape(pattern)):
      data_lib.load_npz(path)


def test_bad_options_and_unwritable_workdir_fail_before_writing(digits, tmp_path, monkeypatch):
  for field, value, pattern in [("checkpoint_every", 0, "--checkpoint-every"),
                                ("checkpoint_every", -3, "--checkpoint-every"),
                                ("log_every", 0, "--log-every")]:
    with pytest.raises(training.ConfigError, match=pattern):
      training.validate(dataclasses.replace(SMALL, **{field: value}), digits, 1)
  afile = tmp_path / "afile"
  afile.write_text("")
  with pytest.raises(training.ConfigError, match="exists and is not a directory"):
    training.train(SMALL, digits, afile / "run", progress=False, devices=1)
  real_access = os.access
  locked = tmp_path / "locked"
  locked.mkdir()
  # Root may write anywhere, so the read-only directory is simulated at the permission check.
  monkeypatch.setattr(os, "access", lambda p, m: False if pathlib.Path(p) == locked
                      else real_access(p, m))
  with pytest.raises(training.ConfigError, match="is not writable"):
    training.train(SMALL, digits, locked / "run", progress=False, devices=1)
  assert list(locked.iterdir()) == []


def test_cli_never_overwrites_checkpoints(tmp_path):
  wd = tmp_path / "run"
  ok = _run_cli("--steps", "6", "--batch-size", "32", "--checkpoint-every", "3", "--workdir", str(wd))
  assert ok.returncode == 0, ok.stderr[-3000:]
  _assert_the_memory_line(ok.stdout)  # (make train's last line)
  ckpt = wd / "inverted" / "checkpoints"
  before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
  again = _run_cli("--steps", "6", "--batch-size", "32", "--workdir", str(wd))
  _assert_one_line_error(again, "already holds checkpoints")
  assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before


def _npz(tmp_path, name, **over):
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.random((40, 8, 8), np.float32), y_train=np.arange(40) % 4,
                x_test=rng.random((8, 8, 8), np.float32), y_test=np.arange(8) % 4)
  arrays.update(over)
  path = tmp_path / f"{name}.npz"
  np.savez(path, **arrays)
  return path


def test_data_is_checked_before_training(tmp_path):
  """Non-finite or unscaled pixels and absurd label ranges are refused."""
  x = np.random.default_rng(1).random((40, 8, 8), np.float32)
  cases = [
      (dict(x_train=np.where(np.arange(40)[:, None, None] == 3, np.nan, x)),
       "x_train holds 64 non-finite pixel values"),
      (dict(x_test=np.full((8, 8, 8), np.inf, np.float32)), "x_test holds 512 non-finite"),
      (dict(x_train=x * 1e30), "x_train holds pixel values up to 1e+30"),
      (dict(y_train=np.arange(40) % 4 * 10**6, y_test=np.zeros(8, np.int64)),
       "labels go up to 3000000"),
  ]
  for i, (over, pattern) in enumerate(cases):
    with pytest.raises(data_lib.DataError, match=re.escape(pattern)):
      data_lib.load_npz(_npz(tmp_path, f"bad{i}", **over))
  assert data_lib.load_npz(_npz(tmp_path, "good")).num_classes == 4


def test_sigterm_ends_the_script_in_one_line_and_the_run_resumes(tmp_path):
  """SIGTERM mid-run: the saves in flight complete, one line, exit 143; a resume continues
  from the newest checkpoint."""
  import signal
  import time
  env = env_with_devices(1, JAX_PLATFORMS="cpu")
  run = tmp_path / "run"
  args = [sys.executable, str(ROOT / "scripts" / "train_vit.py"), "--no-progress", "--steps",
          "400", "--batch-size", "16", "--checkpoint-every", "20", "--log-every", "50",
          "--workdir", str(run), "--configuration", "standard"]
  proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and not list((run / "standard" / "checksums").glob("*.json")):
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 143, (proc.returncode, err[-2000:])
  lines = [l for l in err.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM after step"), err
  assert "--resume" in lines[0] and "Traceback" not in err
  saved = checkpoints.latest_step(run / "standard")
  resumed = training.train(training.TrainConfig(steps=400, batch_size=16, checkpoint_every=20,
                                                log_every=50, configuration="standard"),
                           data_lib.load_digits(), run / "standard", resume=True,
                           progress=False, devices=1, stop_after=saved + 2)
  assert saved >= 1 and resumed["steps"] == saved + 2


def test_sigint_stops_at_a_step_boundary_after_the_saves_in_flight(digits, tmp_path, monkeypatch):
  """SIGINT (Ctrl-C) during a step: the loop stops at the next step boundary with
  Interrupted (exit code 130), the checkpoints written intact."""
  import os
  import signal
  before = signal.getsignal(signal.SIGINT)  # (ignored where the suite runs in the background)
  real = training.Trainer.train_step

  def step(self, i):
    if i == 6:
      os.kill(os.getpid(), signal.SIGINT)
    return real(self, i)
  monkeypatch.setattr(training.Trainer, "train_step", step)
  with pytest.raises(training.Interrupted) as e:
    with training.stop_on_signals():
      training.train(SMALL, digits, tmp_path / "run", progress=False, devices=1)
  assert e.value.code == 130 and "stopped by SIGINT after step 7" in str(e.value)
  assert checkpoints.latest_step(tmp_path / "run") == 5
  assert signal.getsignal(signal.SIGINT) is before  # put back


@pytest.mark.parametrize("script, args, signum, words", [
    ("bench_lm_head", ["--tokens", "256", "--vocab", "4096", "--repeats", "99"], "SIGINT", ""),
    ("train_vit", ["--no-progress"], "SIGTERM", " before training started: nothing was saved; "
                                               "run the same command again"),
    ("parity", ["--quick", "--no-progress", "--workdir", "w", "--out", "o/p"], "SIGINT",
     "; run the same command again to continue the study"),
])
def test_a_signal_while_a_script_starts_is_one_line(script, args, signum, words, tmp_path):
  """Ctrl-C (or SIGTERM) while the script imports JAX or loads its data: one line and 128 +
  the signal's number (before: a traceback of 17-56 lines)."""
  import signal
  import time
  env = env_with_devices(1, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  time.sleep(0.5)
  proc.send_signal(getattr(signal, signum))
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + getattr(signal, signum), err[-2000:]
  assert err.strip() == f"error: stopped by {signum}{words}", err[-2000:]


def test_script_inputs_are_checked_before_any_work(tmp_path, capsys):
  """Output paths, sizes and budgets are one line and exit 2 before anything is measured
  (before, a run's results were lost to an unwritable path after the work)."""
  cases = [
      ("bench_lm_head", ["--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
      ("bench_lm_head", ["--json", str(tmp_path)], "is a directory"),
      ("bench_lm_head", ["--tokens", "99999999999"], "below 2**31"),
      ("bench_lm_head", ["--tokens", "100000000", "--vocab", "1000000"], "GiB"),
      ("invert_models", ["--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
      ("invert_models", ["--compile-tries", "-1"], "must be >= 0, got -1"),
      ("floor_audit", ["--json", str(tmp_path)], "is a directory"),
      ("gpu_report", ["--budget-s", "nan"], "must be a finite number > 0"),
      ("benchmark_memory", ["--dtypes", "float64"], "needs JAX_ENABLE_X64"),
      ("benchmark_memory", ["--batches", "x"], "not a positive integer"),
      ("benchmark_memory", ["--dropout", "1.5"], "--dropout must be in [0, 1)"),
      ("benchmark_memory", ["--out", str(tmp_path / "missing" / "m")], "does not exist"),
      ("fit_inverse", ["--names", "nope"], "choose from gelu_tanh"),
      ("fit_inverse", ["--dtypes", "float8"], "choose from float32"),
      ("fit_inverse", ["--degree", "-1", "--write"], "must be >= 1, got -1"),
      ("fit_inverse", ["--json", str(tmp_path)], "is a directory"),
      ("parity", ["--out", str(tmp_path)], "is a directory"),
  ]
  bad_json = tmp_path / "bad.json"
  bad_json.write_text('{"a": 1}')
  cases.append(("parity", ["--out", str(bad_json / "x")], "is not a directory"))
  cases.append(("gpu_report", ["--docs", str(bad_json)], "not a GPU report JSON"))
  for script, argv, pattern in cases:
    try:
      code = load_script(script).main(argv)
    except SystemExit as e:
      code = e.code
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 2 and len(err) == 1 and pattern in err[0], (script, argv, err)


def _assert_the_memory_line(stdout: str) -> None:
  """A finished run's last line: the activations autodiff keeps with the run's configuration
  beside the same model's with standard activations (as :class:`Trainer` measures them), and
  the train step's compiled temp both ways."""
  from models.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  last = stdout.strip().splitlines()[-1]
  m = re.fullmatch(r"activations kept for the backward: ([\d.,]+) MiB with the inverted "
                   r"configuration vs ([\d.,]+) MiB standard \(([\d.]+)x\); the train step's "
                   r"compiled temp ([\d.,]+) MiB vs ([\d.,]+) MiB", last)
  assert m, last
  ours, standard = (float(m.group(i).replace(",", "")) for i in (1, 2))
  assert ours < standard and float(m.group(3)) == pytest.approx(ours / standard, abs=0.01)
  cfg = dataclasses.replace(training.TrainConfig(), batch_size=32, configuration="standard")
  standard_trainer = trainer_lib.Trainer(cfg, data_lib.load_digits(cfg.seed))
  assert f"{standard_trainer.activation_bytes() / 2**20:,.2f}" == m.group(2)


def test_the_memory_line_of_a_standard_run_has_no_comparison():
  from models.training import compare  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(training.TrainConfig(), configuration="standard")
  assert compare.memory_line(cfg, {
      "activation_bytes": 2**20, "standard_activation_bytes": 2**20,
      "compiled_temp_bytes": 2**21, "standard_compiled_temp_bytes": 2**21,
      "device_peak_bytes": None}) == ("activations kept for the backward: 1.00 MiB with the "
                                      "standard configuration; the train step's compiled temp "
                                      "2.00 MiB")
