"""The training job: resume equivalence, data parallelism, bad input, --compare outputs."""
import dataclasses
import json
import re
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax

from models.experiments import checkpoints
from models.experiments import data as data_lib
from models.experiments import training
from tests import env_with_devices, load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = training.TrainConfig(steps=12, batch_size=32, checkpoint_every=5, log_every=2,
                             warmup_steps=3)


@pytest.fixture(scope="module")
def digits():
  return data_lib.load_digits()


def _leaves(params):
  return [np.asarray(l) for l in jax.tree.leaves(params)]


def test_resume_after_kill_matches_uninterrupted(digits, tmp_path):
  """Killed after step 11 (checkpoints 5 and 10), the latest checkpoint then torn: the resume
  sets it aside with a warning, continues from step 5, and ends bit-identical."""
  full = training.train(SMALL, digits, tmp_path / "full", progress=False, devices=1)
  part = training.train(SMALL, digits, tmp_path / "part", progress=False, stop_after=11, devices=1)
  assert part["steps"] == 11 and not part["finished"]
  ckpt = tmp_path / "part" / "checkpoints"
  assert sorted(p.name for p in ckpt.iterdir()) == ["10", "5"]
  for f in (ckpt / "10").rglob("*"):
    if f.is_file():
      f.write_bytes(b"torn write")
  with (tmp_path / "part" / "metrics.jsonl").open("a") as f:  # the kill cut a log line short
    f.write('{"step": 12, "lo')
  with pytest.warns(UserWarning, match=r"checkpoint step 10 does not verify: it is unreadable.*"
                                       r"falling back"):
    resumed = training.train(SMALL, digits, tmp_path / "part", resume=True, progress=False,
                             devices=1)
  assert (ckpt / "10.corrupt").is_dir()
  assert resumed["finished"] and resumed["steps"] == SMALL.steps
  for a, b in zip(_leaves(full["trainer"].params), _leaves(resumed["trainer"].params)):
    np.testing.assert_array_equal(a, b)
  # The metrics log continues without duplicates past the checkpoint.
  steps = [json.loads(l)["step"] for l in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
           if "loss" in json.loads(l)]
  assert steps == sorted(set(steps)) and steps[-1] == SMALL.steps


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
      training.prepare_workdir(SMALL, tmp_path / "r", resume=True)


def test_a_full_disk_is_one_line_and_loses_nothing(digits, tmp_path, monkeypatch):
  """A checkpoint write that fails for lack of space (orbax/TensorStore raise ValueError, not
  OSError, from their writer threads) is one CheckpointWriteError naming the directory and the
  cause; the checkpoint before it is intact and --resume finishes the run."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  real = ocp.CheckpointManager.save

  def full(self, step, *args, **kwargs):
    if step == 10:
      raise ValueError(f"RESOURCE_EXHAUSTED: Error writing local file \"{self.directory}/10."
                       "orbax-checkpoint-tmp/x\": Failed to write 8 bytes to file 5: No space "
                       "left on device [os_error_code='28']")
    return real(self, step, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, "save", full)
  with pytest.raises(training.CheckpointWriteError) as e:
    training.train(SMALL, digits, tmp_path / "w", progress=False, devices=1)
  line = str(e.value)
  assert "\n" not in line and "checkpoint of step 10" in line and "No space left" in line
  assert str(tmp_path / "w" / "checkpoints") in line
  assert checkpoints.latest_step(tmp_path / "w") == 5
  monkeypatch.setattr(ocp.CheckpointManager, "save", real)
  resumed = training.train(SMALL, digits, tmp_path / "w", resume=True, progress=False, devices=1)
  assert resumed["finished"]


def test_a_metrics_log_it_cannot_read_is_one_line_naming_it(tmp_path):
  """On resume: a last line cut short by a kill is dropped; any other line that is not UTF-8,
  not JSON or has no integer step stops the resume with the file and the line."""
  path = tmp_path / "metrics.jsonl"
  good = b'{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n'
  path.write_bytes(good + b'{"step": 6, "lo')
  assert [r["step"] for r in training._logged_up_to(path, 4)] == [2, 4]
  for bad, why in [(b"\xff\xfe not text\n", "line 2 is not UTF-8"),
                   (b"{oops\n", "line 2 is not JSON"),
                   (b'{"step": "four"}\n', "line 2 has no integer"),
                   (b"[1, 2]\n", "line 2 has no integer")]:
    lines = good.split(b"\n")
    path.write_bytes(lines[0] + b"\n" + bad + lines[1] + b"\n")
    with pytest.raises(training.ConfigError, match=re.escape(str(path)) + " " + why) as e:
      training._logged_up_to(path, 4)
    assert "\n" not in str(e.value)


def test_files_other_processes_read_are_replaced_at_once(tmp_path):
  """config.json and metrics.jsonl are rewritten by process 0 while the others read them
  (a resumed multi-process run read a truncated config.json: CI, 2026-11-23); a reader running
  beside the writer never sees a partial file (with Path.write_text, most reads fail)."""
  import threading  # pylint: disable=import-outside-toplevel
  path = tmp_path / "config.json"
  text = json.dumps(list(range(2000)))
  training.write_atomic(path, text)
  done, seen = threading.Event(), []
  def read():
    while not done.is_set():
      seen.append(path.read_text())
  reader = threading.Thread(target=read)
  reader.start()
  try:
    for _ in range(300):
      training.write_atomic(path, text)
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
  a = training.batch_indices(3, 17, 1000, 64)
  np.testing.assert_array_equal(a, training.batch_indices(3, 17, 1000, 64))
  assert not np.array_equal(a, training.batch_indices(4, 17, 1000, 64))
  x = np.random.default_rng(0).random((5, 8, 8, 1)).astype(np.float32)
  np.testing.assert_array_equal(training.random_shift(x, 1, 0, 3), training.random_shift(x, 1, 0, 3))


def _run_cli(*args, cwd=ROOT):
  env = env_with_devices(1, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_vit.py"), "--no-progress", *args],
                        capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False)


def _assert_one_line_error(out, pattern):
  assert out.returncode != 0
  lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert pattern in lines[0], lines[0]


def test_cli_bad_inputs(tmp_path, capsys, monkeypatch):
  """Each case through the script's main() in this process (the exit code and stderr of a
  real process are checked by test_cli_never_overwrites_checkpoints)."""
  import warnings
  monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
  main = load_script("train_vit").main
  corrupt = tmp_path / "corrupt.npz"
  corrupt.write_bytes(b"not a zip file")
  bad_shape = tmp_path / "shape.npz"
  np.savez(bad_shape, x_train=np.zeros((10, 8, 6)), y_train=np.zeros(10, int),
           x_test=np.zeros((4, 8, 6)), y_test=np.zeros(4, int))
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
      (["--configuration", "inverted-some"], "--configuration must be a configuration"),
      (["--seed", "-1"], "--seed must be an integer in [0, 2**32)"),
      (["--shift", "8"], "--shift 8 would move images out of their 8x8 frame"),
      (["--compare", "--stop-after", "2"], "--stop-after does not apply to --compare"),
  ]
  if not invact_jax.available("triton")[0]:
    cases.append((["--configuration", "inverted+triton"], "--configuration inverted+triton: "))
  for args, pattern in cases:
    code = main(["--no-progress", *args, "--workdir", wd])
    cap = capsys.readouterr()
    assert code == 2, cap.err
    _assert_one_line_error(subprocess.CompletedProcess(args, code, cap.out, cap.err), pattern)
  assert not pathlib.Path(wd).exists(), "nothing may be written on bad input"


def test_cli_is_generated_from_train_config(capsys):
  """Every TrainConfig field is an option of the same name; argparse's own checks (a type, a
  choice, a range) are one line and exit 2; the 0.1 name --activations is gone."""
  import dataclasses as dc
  script = load_script("train_vit")
  with pytest.raises(SystemExit) as e:
    script.parse(["--help"])
  assert e.value.code == 0
  help_text = capsys.readouterr().out
  for f in dc.fields(training.TrainConfig):
    assert "--" + f.name.replace("_", "-") in help_text, f.name
  args = script.parse(["--batch-size", "8", "--configuration", "inverted-all",
                       "--no-scan-layers", "--memory-budget", "1MiB"])
  with pytest.raises(SystemExit) as e:
    script.parse(["--activations", "inverted-all"])
  assert e.value.code == 2
  capsys.readouterr()
  from models.experiments import cli
  cfg = cli.from_args(training.TrainConfig, args)
  assert (cfg.batch_size, cfg.configuration, cfg.scan_layers, cfg.memory_budget) == \
      (8, "inverted-all", False, 2**20)
  for argv, pattern in ((["--stop-after", "-1"], "--stop-after: must be >= 1"),
                        (["--distributed-timeout", "0"], "--distributed-timeout: must be >= 1"),
                        (["--dtype", "float8"], "--dtype: invalid choice"),
                        (["--lr", "fast"], "--lr: invalid float value")):
    with pytest.raises(SystemExit) as e:
      script.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pattern in err[0], err


def test_every_script_errors_in_one_line(capsys):
  """Every script builds its parser with cli.parser, whose errors are one line (no usage
  block) and exit 2."""
  from models.experiments import cli
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
  ckpt = wd / "inverted" / "checkpoints"
  before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
  again = _run_cli("--steps", "6", "--batch-size", "32", "--workdir", str(wd))
  _assert_one_line_error(again, "already holds checkpoints")
  assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before


def test_compare_writes_table_json_png(digits, tmp_path):
  from models.experiments import compare
  # Scanned layers: with unrolled ones XLA:CPU (JAX 0.10) recomputes GELU's last multiply from
  # the pre-activation and the tanh in the inverted backward fusion, keeping both alive, and
  # the inverted step then compiles 0.2 % above the standard one (digits ViT, float32; README
  # "Status").  Scanned, it is 31 % below.
  cfg = dataclasses.replace(SMALL, steps=6, scan_layers=True)
  out = compare.compare(cfg, digits, tmp_path / "cmp", progress=False)
  assert "| final test accuracy |" in out["table"]
  assert out["png"].stat().st_size > 1000
  runs = json.loads(out["json"].read_text())["runs"]
  assert set(runs) == {"standard", "inverted"}
  # Same seed, same data order: the first logged losses agree to float tolerance.
  first = {k: next(h for h in v["history"] if "loss" in h)["loss"] for k, v in runs.items()}
  assert abs(first["standard"] - first["inverted"]) < 1e-3
  assert runs["inverted"]["compiled_temp_bytes"] < runs["standard"]["compiled_temp_bytes"]


def test_memory_budget_plans_the_model(digits, monkeypatch):
  """Wiring of --memory-budget (profiling and plans are measured in tests/test_planner.py;
  here a fixed profile keeps the test short)."""
  from invact_jax import planner
  from models.experiments import plan_profiles as planning
  prof = planner.LayerProfile(configuration="inverted", depth=4, base_bytes=2_000_000,
                              tags=("query", "mlp_pre"), tag_bytes=(50_000, 200_000),
                              tag_gain=(1.0, 4.0), full_cost=5.0)
  monkeypatch.setattr(planning, "profile", lambda cfg, batch, **kw: [prof])
  cfg = dataclasses.replace(SMALL, memory_budget=200 * 2**20)
  trainer = training.Trainer(cfg, digits, devices=1)
  assert trainer.plan.keep == (("query", "mlp_pre"),) * 4
  assert trainer.model_cfg.save_names == (("query", "mlp_pre"),)
  assert trainer.model_cfg.scan_layers and trainer.model_cfg.activation_mode == "inverted"
  trainer.train_step(0)  # the planned model trains
  # A budget below what any plan compiles to fails before the (minutes of) profiling, and
  # names that least compiled temp.
  monkeypatch.setattr(planning, "profile", lambda *a, **k: pytest.fail("profiled"))
  with pytest.raises(training.ConfigError, match=r"minimum feasible budget is [\d,]+ bytes"):
    training.Trainer(dataclasses.replace(SMALL, memory_budget=1024), digits, devices=1)


def _npz(tmp_path, name, **over):
  rng = np.random.default_rng(0)
  arrays = dict(x_train=rng.random((40, 8, 8), np.float32), y_train=np.arange(40) % 4,
                x_test=rng.random((8, 8, 8), np.float32), y_test=np.arange(8) % 4)
  arrays.update(over)
  path = tmp_path / f"{name}.npz"
  np.savez(path, **arrays)
  return path


def test_data_is_checked_before_training(tmp_path):
  """Issue 15 (4): non-finite or unscaled pixels and absurd label ranges are refused."""
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
    training.prepare_workdir(dataclasses.replace(SMALL, dtype="bfloat16"), wd, resume=True,
                             data=saved["data"])
  cfg_file.unlink()
  with pytest.raises(training.ConfigError, match=r"config.json is missing"):
    training.train(dataclasses.replace(SMALL, dtype="bfloat16"), digits, wd, resume=True,
                   progress=False, devices=1)
  assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == before
  # A config.json written before 0.3 (``activations``, no fingerprint) still resumes.
  old = {("activations" if k == "configuration" else k): v for k, v in saved.items() if k != "data"}
  cfg_file.write_text(json.dumps(old))
  assert training.train(SMALL, digits, wd, resume=True, progress=False, devices=1)["finished"]


def test_one_writer_per_run_directory(digits, tmp_path):
  """A second run on a directory another run is writing to stops at once with one line; a
  lock file left by a run that ended (killed, say) holds nothing."""
  wd = tmp_path / "r"
  wd.mkdir()
  with training.RunLock(wd):
    with pytest.raises(training.ConfigError, match=r"another run \(pid \d+ on .*\) is writing"):
      training.train(SMALL, digits, wd, progress=False, devices=1)
  assert not (wd / "checkpoints").exists() and not (wd / "config.json").exists()
  (wd / ".lock").write_text("pid 1 on a-host-that-is-gone\n")  # stale: nobody holds it
  assert training.train(SMALL, digits, wd, progress=False, devices=1, stop_after=2)["steps"] == 2


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
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_script_inputs_are_checked_before_any_work(tmp_path, capsys):
  """Output paths, sizes and budgets are one line and exit 2 before anything is measured
  (before, a run's results were lost to an unwritable path after the work)."""
  cases = [
      ("bench_lm_head", ["--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
      ("bench_lm_head", ["--json", str(tmp_path)], "is a directory"),
      ("bench_lm_head", ["--tokens", "99999999999"], "below 2**31"),
      ("bench_lm_head", ["--tokens", "100000000", "--vocab", "1000000"], "GiB"),
      ("invert_models", ["--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
      ("floor_audit", ["--json", str(tmp_path)], "is a directory"),
      ("gpu_report", ["--budget-s", "nan"], "must be a finite number > 0"),
      ("benchmark_memory", ["--dtypes", "float64"], "needs JAX_ENABLE_X64"),
      ("benchmark_memory", ["--batches", "x"], "not a positive integer"),
      ("benchmark_memory", ["--dropout", "1.5"], "--dropout must be in [0, 1)"),
      ("benchmark_memory", ["--out", str(tmp_path / "missing" / "m")], "does not exist"),
  ]
  bad_json = tmp_path / "bad.json"
  bad_json.write_text('{"a": 1}')
  cases.append(("gpu_report", ["--docs", str(bad_json)], "not a GPU report JSON"))
  for script, argv, pattern in cases:
    try:
      code = load_script(script).main(argv)
    except SystemExit as e:
      code = e.code
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 2 and len(err) == 1 and pattern in err[0], (script, argv, err)
