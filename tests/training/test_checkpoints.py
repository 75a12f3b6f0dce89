"""Fault injection into a run's checkpoints: every fault ends in the newest checkpoint that
verifies or in a one-line error; nothing that verifies is renamed, nothing silently wrong is
loaded.  (That a resume past a checkpoint set aside ends bit-identical to an uninterrupted run
is tests/training/test_storage.py's chain of faults, which ends with one set aside.)"""
import json
import pathlib
import shutil
import warnings

import jax
import numpy as np
import pytest

from models.training import checkpoints
from models.training import data as data_lib
from models.training import errors
from models import training
from tests.training import SMALL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A run stopped after step 11 (checkpoints 5, 10) and its state's shapes."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  base = tmp_path_factory.mktemp("runs")
  part = training.train(SMALL, data_lib.load_digits(), base / "part", progress=False,
                        stop_after=11, devices=1)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, part["trainer"].state())
  return base / "part", abstract


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)


def _flip_a_bit(run):
  f = _largest_data_file(run / "checkpoints" / "10")
  data = bytearray(f.read_bytes())
  data[len(data) // 2] ^= 0x10
  f.write_bytes(bytes(data))


def _truncate(run):
  f = _largest_data_file(run / "checkpoints" / "10")
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _delete_a_file(run):
  _largest_data_file(run / "checkpoints" / "10").unlink()


def _empty_newer_step(run):
  (run / "checkpoints" / "99").mkdir()


def _half_written_newer_step(run):
  shutil.copytree(run / "checkpoints" / "10", run / "checkpoints" / "15")
  for f in (run / "checkpoints" / "15").rglob("_METADATA"):
    f.unlink()


def _sums_missing(run):
  (run / "checksums" / "10.json").unlink()


def _sums_edited(run):
  path = run / "checksums" / "10.json"
  data = json.loads(path.read_text())
  key = next(iter(data["arrays"]))
  data["arrays"][key][0] ^= 1
  path.write_text(json.dumps(data))


# fault -> (how, the step set aside, why it says (one of), the step restored).  The flipped bit
# (the middle byte of the largest data file) lands in an array's bytes, and the checksums
# differ, or in the file's record framing, and TensorStore cannot read it (seen once in a
# suite run, 2026-11-26): either way the step is set aside.
FAULTS = {"bit flip": (_flip_a_bit, "10", ("differ from what was saved", "unreadable"), 5),
          "truncated file": (_truncate, "10", "unreadable", 5),
          "missing file": (_delete_a_file, "10", "unreadable", 5),
          "empty step directory": (_empty_newer_step, "99", "unreadable", 10),
          "half-written step": (_half_written_newer_step, "15", "unreadable", 10),
          "checksums missing": (_sums_missing, "10", "no checksums were recorded", 5),
          "checksums edited": (_sums_edited, "10", "differ from what was saved", 5)}


def _restore(run, abstract):
  mgr = checkpoints.manager(run, SMALL.checkpoint_every)
  try:
    return checkpoints.restore(mgr, run, abstract)
  finally:
    mgr.close()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_falls_back_to_the_newest_checkpoint_that_verifies(runs, tmp_path, fault):
  part, abstract = runs
  run = tmp_path / "run"
  shutil.copytree(part, run)
  inject, bad, why, good = FAULTS[fault]
  inject(run)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step, state = _restore(run, abstract)
  said = [str(w.message) for w in caught if "does not verify" in str(w.message)]
  whys = why if isinstance(why, tuple) else (why,)
  assert len(said) == 1 and f"checkpoint step {bad} does not verify" in said[0] \
      and any(w in said[0] for w in whys) and "\n" not in said[0], said
  names = {p.name for p in (run / "checkpoints").iterdir()}
  assert f"{bad}.corrupt" in names and names & {"5", "10"} == {"5", "10"} - {bad}, names
  assert step == good and checkpoints.verify(run, step, state) is None


def test_no_checkpoint_that_verifies_is_one_line_and_renames_only_the_bad(runs, tmp_path):
  part, abstract = runs
  run = tmp_path / "run"
  shutil.copytree(part, run)
  shutil.rmtree(run / "checksums")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(training.ConfigError, match="no checkpoint in .* reads and verifies") as e:
      _restore(run, abstract)
  assert "\n" not in str(e.value)
  assert {p.name for p in (run / "checkpoints").iterdir()} == {"5.corrupt", "10.corrupt"}


def test_checksums_change_with_any_flipped_bit_and_moved_words():
  x = np.arange(1000, dtype=np.float32).reshape(10, 100)
  base = checkpoints.checksums({"x": x})["['x']"]
  flipped = x.copy()
  flipped.view(np.uint32)[3, 7] ^= 1 << 31
  assert checkpoints.checksums({"x": flipped})["['x']"] != base
  swapped = x.copy()
  swapped[0, :2] = swapped[0, 1::-1]
  assert checkpoints.checksums({"x": swapped})["['x']"][1] != base[1]
  for dtype in ("bfloat16", "float16", "int8", "bool", "float64"):
    a = np.ones((3, 5)).astype(dtype) if dtype != "bfloat16" else jax.numpy.ones((3, 5), dtype)
    assert len(checkpoints.checksums({"a": a})["['a']"]) == 2
  assert checkpoints.checksums({"k": jax.random.key(0)})  # PRNG keys: their key data


def test_host_and_device_sums_agree():
  """The host path (one process) and the device path (several) give the same sums, so a run
  resumed with another process count verifies its checkpoints."""
  rng = np.random.default_rng(0)
  for dtype in ("float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"):
    a = jax.numpy.asarray(rng.normal(size=(7, 33)) * 50).astype(dtype)
    host = checkpoints._host_sums(np.asarray(a))  # pylint: disable=protected-access
    device = np.asarray(checkpoints._sums([a])[0])  # pylint: disable=protected-access
    np.testing.assert_array_equal(host, device, err_msg=dtype)


class _Manager:
  """What checkpoint_io reads of orbax's CheckpointManager: its directory and its wait."""

  def __init__(self, directory):
    self.directory = directory

  def wait_until_finished(self):
    pass


def test_any_error_of_a_checkpoint_whose_run_directory_is_gone_is_the_lost_run():
  """orbax's background finalize of an earlier save raises ValueError("Checkpoint directory does
  not exist") when the run directory was removed meanwhile (seen in the suite: a race with the
  vanished-run-directory test): the run is lost, not a crash; with the run directory present,
  an error that is no storage failure passes through as it is."""
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    work = pathlib.Path(tmp) / "w"
    (work / "checkpoints").mkdir(parents=True)
    (work / "config.json").write_text("{}")
    manager = _Manager(work / "checkpoints")

    def orbax_finalize():
      raise ValueError(f"Checkpoint directory does not exist: {work}/checkpoints/5.orbax-"
                       "checkpoint-tmp/default.orbax-checkpoint-tmp.")
    with pytest.raises(ValueError, match="Checkpoint directory does not exist"):
      checkpoints.checkpoint_io(manager, "the checkpoint of step 10", orbax_finalize)
    shutil.rmtree(work)
    with pytest.raises(errors.RunDirectoryLost, match="found before the checkpoint of step 5"):
      checkpoints.checkpoint_io(manager, "the checkpoint of step 10", orbax_finalize)
