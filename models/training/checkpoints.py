"""A training run's checkpoints: orbax writes and reads them, this module proves them.

Orbax (TensorStore's OCDBT files) records no checksum of the arrays it writes: a flipped bit
in a data file is restored without a word.  So every save records, beside the checkpoint, two
32-bit sums of every array's bits (``checksums/<step>.json`` in the run directory: the plain
sum of its 32-bit words, which changes with any single flipped bit, and their sum weighted by
odd position factors, which also changes when words move), in exact integer arithmetic: on
the host where the state is whole in one process, else on the device by a jitted reduction
(the same words and sums: the same on every process and every sharding).
A resume restores the newest checkpoint whose arrays read and whose sums match; one that does
not (unreadable, torn, truncated, corrupted, its sums missing) is set aside as
``<step>.corrupt`` with one warning line naming why, and the one before it is tried.  Nothing
that verifies is ever renamed; a checkpoint of another model (shapes that differ) is refused,
not set aside.  The manager is told the item's handler (one ``StandardCheckpointHandler``), so
a step directory left empty or half written does not change how it reads the others.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.training import errors

__all__ = ["SetAside", "manager", "checksums", "record", "prune", "verify", "set_aside_name", "restore",
           "latest_step", "CheckpointWriteError", "checkpoint_io"]

CHECKSUMS = "checksums"


class SetAside(RuntimeError):
  """A checkpoint that cannot be loaded (the message says why)."""


def manager(workdir: pathlib.Path, every: int):
  """The run's orbax ``CheckpointManager`` (the last two checkpoints kept, one every
  ``every`` steps), its single item read and written by a ``StandardCheckpointHandler``."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
  return ocp.CheckpointManager(workdir.resolve() / "checkpoints", options=opts,
                               item_handlers=ocp.StandardCheckpointHandler())


def latest_step(workdir: pathlib.Path) -> int | None:
  """The newest step directory under ``workdir/checkpoints`` (complete or not), or None."""
  ckpt = workdir / "checkpoints"
  if not ckpt.is_dir():
    return None
  steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()]
  return max(steps) if steps else None


def _words(x) -> jax.Array:
  """``x``'s bits as a flat vector of uint32 words (PRNG keys: their key data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    x = jax.random.key_data(x)
  size = np.dtype(x.dtype).itemsize
  if size == 4:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif size == 8:
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  elif size == 2:
    w = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  else:
    w = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32) if x.dtype != bool \
        else x.astype(jnp.uint32)
  return w.reshape(-1)


@jax.jit
def _sums(leaves):
  out = []
  for x in leaves:
    w = _words(x)
    odd = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1
    out.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)]))
  return out


def _host_words(a: np.ndarray) -> np.ndarray:
  """:func:`_words` in NumPy (the same words in the same order)."""
  if a.dtype == np.bool_:
    return a.astype(np.uint32).reshape(-1)
  flat = np.ascontiguousarray(a).reshape(-1)
  size = a.dtype.itemsize
  if size in (4, 8):
    return flat.view(np.uint32)
  return (flat.view(np.uint16) if size == 2 else flat.view(np.uint8)).astype(np.uint32)


def _host_sums(a: np.ndarray) -> np.ndarray:
  w = _host_words(a)
  odd = 2 * np.arange(w.size, dtype=np.uint32) + 1
  return np.array([np.sum(w, dtype=np.uint32), np.sum(w * odd, dtype=np.uint32)])


def _addressable(v) -> bool:
  return not isinstance(v, jax.Array) or v.is_fully_addressable


def checksums(tree) -> dict[str, list[int]]:
  """Per array of ``tree`` (by its key path), its two 32-bit sums: computed on the host where
  every array is whole in this process (no compile), else on the device (a global, exact
  reduction: the same on every process)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  leaves = [jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)
            else v for _, v in flat]
  if all(_addressable(v) for v in leaves):
    sums = [_host_sums(np.asarray(v)) for v in leaves]
  else:
    sums = [np.asarray(x) for x in _sums(leaves)]
  return {jax.tree_util.keystr(k): [int(v) for v in x] for (k, _), x in zip(flat, sums)}


def _path(workdir: pathlib.Path, step: int) -> pathlib.Path:
  return workdir / CHECKSUMS / f"{step}.json"


def record(workdir: pathlib.Path, step: int, tree, main: bool) -> None:
  """Record the sums of the state checkpoint ``step`` saves (every process computes them; the
  main process writes them, replacing the file at once)."""
  sums = checksums(tree)
  if not main:
    return
  path = _path(workdir, step)
  path.parent.mkdir(exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps({"step": step, "arrays": sums}))
  os.replace(tmp, path)


def prune(workdir: pathlib.Path, steps) -> None:
  """Remove the sums of checkpoints that are gone (not in ``steps``)."""
  keep = {f"{s}.json" for s in steps}
  folder = workdir / CHECKSUMS
  if folder.is_dir():
    for p in folder.glob("*.json"):
      if p.name not in keep:
        p.unlink(missing_ok=True)


def verify(workdir: pathlib.Path, step: int, tree) -> str | None:
  """None when ``tree`` (checkpoint ``step`` as restored) has the sums recorded at its save,
  else why not."""
  path = _path(workdir, step)
  try:
    recorded = json.loads(path.read_text())["arrays"]
  except FileNotFoundError:
    return f"no checksums were recorded for it ({path} is missing)"
  except PermissionError:
    raise _Unreadable(f"{path} is not readable by this user") from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its checksums ({path}) do not read ({type(e).__name__})"
  got = checksums(tree)
  if set(got) != set(recorded):
    return f"its checksums ({path}) name other arrays"
  bad = [k for k in got if got[k] != recorded[k]]
  if bad:
    return f"{len(bad)} array(s) differ from what was saved, e.g. {bad[0]}"
  return None


def _other_model(mgr, step: int, abstract) -> str | None:
  """How checkpoint ``step`` differs from the model when its metadata reads and its arrays'
  shapes differ (another model, not a torn write); None otherwise.  Shapes are compared as
  multisets (key paths are spelled differently by the metadata)."""
  try:
    meta = mgr.item_metadata(step)
    saved = sorted(tuple(getattr(v, "shape", ())) for v in jax.tree.leaves(meta))
  except Exception:  # pylint: disable=broad-except  # unreadable metadata: a torn checkpoint
    return None
  want = sorted(tuple(v.shape) for v in jax.tree.leaves(abstract))
  if not saved or saved == want:
    return None
  if len(saved) != len(want):
    return f"{len(saved)} arrays where the model has {len(want)}"
  differ = next(i for i, (a, b) in enumerate(zip(saved, want)) if a != b)
  return f"an array of shape {saved[differ]} where the model has {want[differ]}"


def _load(mgr, workdir: pathlib.Path, step: int, abstract) -> Any:
  """Checkpoint ``step`` restored and verified; SetAside (why) otherwise."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  locked = _not_readable(pathlib.Path(mgr.directory) / str(step))
  if locked is not None:  # (checked first: orbax's failed reads print from their threads)
    raise _Unreadable(f"{locked} is not readable by this user")
  try:
    restored = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except  # orbax raises many kinds
    if isinstance(e, PermissionError) or _PERMISSION.search(str(e)):
      raise _Unreadable(f"a file of it is not readable by this user "
                        f"({errors.first_line(e, 160)})") from None
    other = _other_model(mgr, step, abstract)
    if other:
      raise LookupError(other) from None
    raise SetAside(f"it is unreadable ({type(e).__name__}: {errors.first_line(e, 200)})") from None
  why = verify(workdir, step, restored)
  if why is not None:
    raise SetAside(why)
  return restored


def _not_readable(folder: pathlib.Path) -> pathlib.Path | None:
  """The first file or folder under ``folder`` this user may not read (folders: nor enter)."""
  found: list = []

  def denied(e: OSError) -> None:
    found.append(pathlib.Path(e.filename))
  for here, dirs, files in os.walk(folder, onerror=denied):
    for name in dirs:
      if not os.access(os.path.join(here, name), os.R_OK | os.X_OK):
        return pathlib.Path(here, name)
    for name in files:
      if not os.access(os.path.join(here, name), os.R_OK):
        return pathlib.Path(here, name)
    if found:
      return found[0]
  return found[0] if found else None


class _Unreadable(Exception):
  """A checkpoint that this user may not read (its permissions, not its bytes): not set aside,
  the resume stops with one line."""


# How a permission fault reads in orbax/TensorStore's errors.
_PERMISSION = re.compile(r"PERMISSION_DENIED|Permission denied")


def set_aside_name(bad: pathlib.Path) -> pathlib.Path:
  """Where a checkpoint that does not verify is moved: ``<step>.corrupt``, or where a step of
  that number was set aside before (damaged again after a re-run), ``<step>.corrupt.<k>`` with
  the first free ``k``: nothing set aside is overwritten, and recovery is never blocked by a
  name."""
  aside = bad.with_name(f"{bad.name}.corrupt")
  k = 1
  while aside.exists():
    aside = bad.with_name(f"{bad.name}.corrupt.{k}")
    k += 1
  return aside


def restore(mgr, workdir: pathlib.Path, abstract) -> tuple:
  """``(step, state)`` of the newest checkpoint that reads and verifies; each newer one is set
  aside (``<step>.corrupt``) with a warning naming why.

  Raises:
    errors.ConfigError: one line, when a checkpoint holds another model (nothing renamed) or
      when none verifies.
  """
  for step in sorted(mgr.all_steps(), reverse=True):
    try:
      return step, _load(mgr, workdir, step, abstract)
    except LookupError as e:
      raise errors.ConfigError(f"--resume: checkpoint step {step} in {mgr.directory} holds another "
                         f"model ({e}); nothing was renamed") from None
    except _Unreadable as e:
      raise errors.ConfigError(
          f"--resume: checkpoint step {step} in {mgr.directory} cannot be read: {e}; nothing "
          "was renamed: give this user read access to it and continue with the same "
          "command") from None
    except SetAside as e:
      bad = mgr.directory / str(step)
      aside = set_aside_name(bad)
      if jax.process_index() == 0:  # every process saw the same files; one sets them aside
        try:
          bad.rename(aside)
        except OSError as err:
          raise errors.ConfigError(
              f"--resume: checkpoint step {step} in {mgr.directory} does not verify ({e}) and "
              f"cannot be set aside ({err.strerror}); nothing was renamed: make the directory "
              "writable for this user and continue with the same command") from None
      mgr.reload()
      warnings.warn(f"checkpoint step {step} does not verify: {e}; moved it to {aside.name} "
                    "and falling back to the previous checkpoint", stacklevel=3)
  raise errors.ConfigError(f"--resume: no checkpoint in {mgr.directory} reads and verifies")


class CheckpointWriteError(OSError):
  """A file of the run could not be written (a checkpoint, its checksums, the metrics log, the
  summary: a full disk, a read-only or vanished directory); the checkpoints written before are
  intact.  The message names what, where and why, and says how to continue: ``--resume`` of
  ``scripts/train_vit.py`` where a checkpoint was saved before, else the same command again
  (:meth:`said` words it for another command).

  Attributes:
    what: what was being written ("the checkpoint of step 10", "the metrics of step 5").
    where: the directory or file.
    cause: the system's reason ("No space left on device").
    resumable: whether a checkpoint was saved before (``--resume`` has one to continue from).
  """

  def __init__(self, what: str, where, cause: str, resumable: bool = True):
    self.what, self.where, self.cause, self.resumable = what, where, cause, resumable
    super().__init__(self.said("continue with --resume" if resumable else
                               "run the same command again (without --resume)"))

  def resumable_in(self, workdir) -> "CheckpointWriteError":
    """The same failure, said as resumable (``--resume`` of the command that ran in
    ``workdir`` has a checkpoint to continue from); ``where`` stays the file that failed."""
    del workdir
    return CheckpointWriteError(self.what, self.where, self.cause, resumable=True)

  def said(self, next_step: str) -> str:
    """The one line, ending with ``next_step`` (how the command that was running continues)."""
    kept = ("the checkpoints written before are intact" if self.resumable else
            "no checkpoint was saved before it")
    return (f"could not write {self.what} in {self.where}: {self.cause}; {kept}: free space "
            f"(or fix the directory) and {next_step}")


# How a storage failure reads in orbax/TensorStore's errors (they raise ValueError, not OSError).
_IO_FAILURE = re.compile(r"No space left on device|Read-only file system|Permission denied|"
                         r"Disk quota exceeded|os_error_code=.?\d+|No such file or directory")


def checkpoint_io(manager, what: str, call, where=None):
  """``call()`` (a checkpoint save or wait, or another write to the run directory); a storage
  failure becomes one CheckpointWriteError naming ``where`` (default: the checkpoints'
  directory) and the cause, once the saves still in flight have finished."""
  try:
    return call()
  except Exception as e:  # pylint: disable=broad-except  # orbax/TensorStore raise ValueError
    text = str(e)
    m = _IO_FAILURE.search(text)
    workdir = pathlib.Path(manager.directory).parent
    # The run directory gone (rm -rf while training): whatever orbax's threads raise about it.
    gone = not (workdir / "config.json").is_file()
    if not isinstance(e, OSError) and m is None and not gone:
      raise
    cause = getattr(e, "strerror", None) or (m.group(0) if m else errors.first_line(e))
    if cause.startswith("os_error_code"):
      cause = errors.first_line(e)
    step = re.search(r"/(\d+)\.orbax-checkpoint-tmp", text)  # an earlier save, written async
    if step is not None:
      what = f"the checkpoint of step {step.group(1)}"
    if call != manager.wait_until_finished:
      # An earlier save may still be writing in the background: let it finish (the process
      # may exit right after this error) so that what was saved before is not lost.
      try:
        manager.wait_until_finished()
      except Exception:  # pylint: disable=broad-except  # reported below as not intact
        what += " (and an earlier one still being written)"
    if not (workdir / "config.json").is_file():  # (gone meanwhile, or before): the run is lost
      raise errors.RunDirectoryLost(workdir, what) from None
    raise CheckpointWriteError(what, manager.directory if where is None else where, cause,
                               resumable=latest_step(workdir) is not None) from None
