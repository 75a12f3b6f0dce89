"""Training for ViT image classifiers and GPT-style byte LMs: data order, AdamW schedule,
checkpoints, data parallelism.

Importable logic behind ``scripts/train_vit.py``.  Everything that changes the result is
a field of :class:`TrainConfig`; the data order of epoch ``e`` is a permutation drawn from
``fold_in(key(seed), e)`` and the dropout key of step ``s`` is ``fold_in(key(seed + 1), s)``,
so a run resumed from a checkpoint continues exactly as the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import invact_jax
from invact_jax import memory
from models import options, text, vit
from models.experiments import checkpoints
from models.experiments import cli
from models.experiments import data as data_lib


class TrainingDiverged(RuntimeError):
  """The loss or the parameters became non-finite; the run stopped before checkpointing them."""


class ConfigError(ValueError):
  """A training option is invalid for the data or the machine (message names it)."""


class StopRequested(BaseException):
  """SIGINT or SIGTERM arrived (raised by the training loop between two steps, after
  :func:`stop_on_signals`'s handler noted it; a BaseException, so that no ``except Exception``
  swallows it)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class Interrupted(RuntimeError):
  """Training stopped on a signal after the checkpoint saves in flight completed.

  Attributes:
    code: the exit code (128 + the signal's number: 130 for SIGINT, 143 for SIGTERM).
  """

  def __init__(self, signum: int, step: int, workdir):
    import signal  # pylint: disable=import-outside-toplevel
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; the "
                     f"checkpoints written are intact: continue with --resume --workdir {workdir}")
    self.code = 128 + signum


_STOP: dict = {"signum": None}  # the signal stop_on_signals noted, if any


@contextlib.contextmanager
def stop_on_signals():
  """While the block runs, SIGINT and SIGTERM are noted (not raised where they land: inside a
  library's code an exception could be swallowed or leave a save half done); the training
  loop stops at its next step boundary (:class:`StopRequested`).  The previous handlers are
  put back after the block."""
  import signal  # pylint: disable=import-outside-toplevel

  def handler(signum, frame):
    del frame
    _STOP["signum"] = _STOP["signum"] or signum
  _STOP["signum"] = None
  old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
    if _STOP["signum"] is not None:  # arrived after the last step (or before the first)
      raise StopRequested(_STOP["signum"])
  finally:
    for s, h in old.items():
      signal.signal(s, h)


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (a full disk, a read-only or vanished directory); the
  checkpoints written before are intact (message names the directory and the cause)."""


# How a storage failure reads in orbax/TensorStore's errors (they raise ValueError, not OSError).
_IO_FAILURE = re.compile(r"No space left on device|Read-only file system|Permission denied|"
                         r"Disk quota exceeded|os_error_code=.?\d+|No such file or directory")

# Library logs held back while training (asyncio's "Task exception was never retrieved",
# orbax's background threads' tracebacks, exceptions of coroutines collected at shutdown):
# one line says what failed.  INVACT_JAX_LIBRARY_LOGS=1 lets them through.
LIBRARY_LOGS_ENV = "INVACT_JAX_LIBRARY_LOGS"


@contextlib.contextmanager
def quiet_libraries():
  """Hold back the logs of the libraries training runs (asyncio, absl/orbax) and the tracebacks
  of their background threads and collected coroutines, unless INVACT_JAX_LIBRARY_LOGS=1."""
  if os.environ.get(LIBRARY_LOGS_ENV) == "1":
    yield
    return
  import logging  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  loggers = [logging.getLogger(n) for n in ("asyncio", "absl", "orbax", "tensorstore")]
  levels = [lg.level for lg in loggers]
  hooks = (sys.unraisablehook, threading.excepthook)
  main_thread = threading.main_thread()

  def thread_hook(args):
    if args.thread is main_thread:
      hooks[1](args)
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  sys.unraisablehook, threading.excepthook = (lambda _: None), thread_hook
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)
    sys.unraisablehook, threading.excepthook = hooks


def _checkpoint_io(manager, what: str, call):
  """``call()`` (a checkpoint save or wait); a storage failure becomes one
  CheckpointWriteError naming the directory and the cause."""
  try:
    return call()
  except Exception as e:  # pylint: disable=broad-except  # orbax/TensorStore raise ValueError
    text = str(e)
    m = _IO_FAILURE.search(text)
    if not isinstance(e, OSError) and m is None:
      raise
    cause = getattr(e, "strerror", None) or (m.group(0) if m else first_line(e))
    if cause.startswith("os_error_code"):
      cause = first_line(e)
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
    raise CheckpointWriteError(
        f"could not write {what} in {manager.directory}: {cause}; the checkpoints written "
        "before are intact: free space (or fix the directory) and continue with --resume"
    ) from None


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of an exception's message (its type's name if empty), for one-line errors."""
  text = str(error).strip()
  return text.splitlines()[0][:limit] if text else type(error).__name__


def _positive(v) -> str | None:
  return None if v > 0 else "must be positive"


def _positive_finite(v) -> str | None:
  return None if math.isfinite(v) and v > 0 else "must be a positive finite number"


def _finite_nonnegative(v) -> str | None:
  return None if math.isfinite(v) and v >= 0 else "must be a finite number >= 0"


def _seed(v) -> str | None:
  if v is None or isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
    return "must be an integer in [0, 2**32)"
  return None


def _nonnegative(v) -> str | None:
  return None if v >= 0 else "must be >= 0"


def _known_configuration(name) -> str | None:
  try:
    options.configuration(name)
  except ValueError as e:
    return f"must be a configuration of models.options ({e})"
  return None


def parse_bytes(text: str) -> int:
  """'123', '300MiB', '1.5GB' -> bytes (an argparse ``type``)."""
  import argparse  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
           "gib": 2**30}
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in units:
    raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 300MiB, 2GB, 123456)")
  return int(float(m.group(1)) * units[m.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Options of one training run; each field is also ``scripts/train_vit.py``'s option of the
  same name (``--batch-size`` for ``batch_size``: :mod:`models.experiments.cli`)."""
  preset: str = cli.option("digits", "model preset (models.vit.PRESETS; text data: "
                           "models.text.PRESETS)")
  batch_size: int = cli.option(64, "global batch size", check=_positive)
  epochs: int = cli.option(100, "epochs (when --steps is not given)", check=_positive)
  steps: int | None = cli.option(None, "total steps (overrides --epochs)", check=_positive)
  lr: float = cli.option(3e-3, "peak learning rate (AdamW)", check=_positive_finite)
  warmup_steps: int = cli.option(200, "linear warm-up steps", check=_nonnegative)
  schedule: str = cli.option("cosine", "learning-rate schedule after warm-up",
                             choices=("cosine", "constant"))
  weight_decay: float = cli.option(0.05, "AdamW weight decay", check=_finite_nonnegative)
  dtype: str = cli.option("float32", "compute dtype (parameters stay float32)",
                          choices=("float32", "bfloat16", "float16"))
  seed: int = cli.option(0, "seed of the initialisation, data order and dropout",
                         check=_seed)
  configuration: str = cli.option(
      "inverted", "which ops run in their memory-saving form: a configuration of "
      f"models.options ({', '.join(options.CONFIGURATIONS)}), optionally +pallas or +triton",
      check=_known_configuration)
  scan_layers: bool = cli.option(False, "run the layers under jax.lax.scan")
  remat: str = cli.option("none", "jax.checkpoint policy per layer",
                          choices=tuple(options.REMAT_POLICIES))
  memory_budget: int | None = cli.option(
      None, "bytes (or e.g. 300MiB) for the gradient step: the planner picks what each layer "
      "keeps and the configuration (layers scanned)", check=_positive, parse=parse_bytes)
  checkpoint_every: int = cli.option(500, "steps between checkpoints", check=_positive)
  log_every: int = cli.option(20, "steps between metrics lines", check=_positive)
  shift: int | None = cli.option(None, "random-translation augmentation in pixels (default: "
                                 "image_size // 8)", check=_nonnegative)

  def __post_init__(self):
    cli.check(self, ConfigError)

  def model_config(self, dataset: data_lib.Dataset) -> vit.ViTConfig | text.TextConfig:
    if dataset.modality == "text":
      return self._text_config(dataset)
    if self.preset not in vit.PRESETS:
      raise ConfigError(f"unknown preset {self.preset!r}; choose from {sorted(vit.PRESETS)}")
    base = vit.PRESETS[self.preset]
    patch = base.patch_size
    if dataset.image_size % patch:
      patch = math.gcd(dataset.image_size, patch)
      if patch < 2 and dataset.image_size > 1:
        raise ConfigError(f"images of size {dataset.image_size} do not split into patches of "
                          f"preset {self.preset!r} (patch {base.patch_size})")
    try:
      return base.replace(image_size=dataset.image_size, patch_size=patch,
                          channels=dataset.channels, num_classes=dataset.num_classes,
                          **options.configuration(self.configuration), dtype=self.dtype,
                          scan_layers=self.scan_layers, remat=self.remat)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  def _text_config(self, dataset: data_lib.Dataset) -> text.TextConfig:
    if self.preset not in text.PRESETS or text.PRESETS[self.preset].family == "bert":
      raise ConfigError(f"unknown preset {self.preset!r} for text data; choose from "
                        f"{sorted(k for k, v in text.PRESETS.items() if v.family != 'bert')}")
    base = text.PRESETS[self.preset]
    try:
      return base.replace(vocab=dataset.num_classes, max_len=max(base.max_len, dataset.seq_len),
                          **options.configuration(self.configuration), dtype=self.dtype,
                          scan_layers=self.scan_layers, remat=self.remat)
    except ValueError as e:
      raise ConfigError(str(e)) from None

  def total_steps(self, n_train: int) -> int:
    return self.steps if self.steps is not None else self.epochs * (n_train // self.batch_size)


def validate(cfg: TrainConfig, dataset: data_lib.Dataset, n_devices: int) -> None:
  """Raise ConfigError for options that cannot work with this data or machine (each option's
  own range is checked when the config is built: :func:`models.experiments.cli.check`)."""
  n = dataset.x_train.shape[0]
  if cfg.batch_size > n:
    raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the training set ({n} images)")
  if cfg.batch_size % n_devices:
    raise ConfigError(f"--batch-size {cfg.batch_size} must be divisible by the {n_devices} "
                      "devices it is sharded over")
  if cfg.total_steps(n) <= 0:
    raise ConfigError("the run has no steps (check --epochs / --steps)")
  if cfg.shift is not None and dataset.modality != "image":
    raise ConfigError("--shift translates images; the data is text")
  if cfg.shift is not None and cfg.shift >= min(dataset.x_train.shape[1:3]):
    h, w = dataset.x_train.shape[1:3]
    raise ConfigError(f"--shift {cfg.shift} would move images out of their {h}x{w} frame "
                      f"(must be below {min(h, w)})")
  implementation = options.configuration(cfg.configuration).get("implementation")
  if implementation is not None:
    ok, why = invact_jax.available(implementation)
    if not ok:
      raise ConfigError(f"--configuration {cfg.configuration}: {why}")
  cfg.model_config(dataset)


def schedule(cfg: TrainConfig, total: int) -> optax.Schedule:
  warmup = min(cfg.warmup_steps, max(total - 1, 0))
  if cfg.schedule == "constant":
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup),
                                 optax.constant_schedule(cfg.lr)], [warmup])
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total, warmup + 1),
                                            end_value=cfg.lr * 0.01)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  return np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(seed), epoch), n))


def batch_indices(seed: int, step: int, n: int, batch: int) -> np.ndarray:
  """Indices of the training batch of ``step``: epoch-wise permutations from the seed."""
  per_epoch = n // batch
  epoch, i = divmod(step, per_epoch)
  return _epoch_permutation(seed, epoch, n)[i * batch:(i + 1) * batch]


def shift_offsets(shift: int, seed: int, step: int, batch: int) -> np.ndarray:
  """[2, batch] per-image offsets in [0, 2 * shift] of :func:`random_shift` for (seed, step)."""
  rng = np.random.default_rng([seed, step, 7])
  return rng.integers(0, 2 * shift + 1, size=(2, batch))


def random_shift(images: np.ndarray, shift: int, seed: int, step: int,
                 offsets: np.ndarray | None = None) -> np.ndarray:
  """Translate each image by up to ``shift`` pixels (zero fill), deterministic in (seed, step).

  ``offsets``: the rows of :func:`shift_offsets` for these images (a process building its
  part of a global batch passes its rows); default: those of the whole batch.
  """
  if shift <= 0:
    return images
  b, h, w, _ = images.shape
  dy, dx = shift_offsets(shift, seed, step, b) if offsets is None else offsets
  padded = np.pad(images, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
  rows = dy[:, None] + np.arange(h)[None, :]
  cols = dx[:, None] + np.arange(w)[None, :]
  return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


def dropout_key(seed: int, step: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed + 1), step)


def plan_model(model_cfg, budget: int, batch: int, seq_len: int = 128):
  """The model config under the planner's cheapest plan whose compiled gradient step
  (per device, layers scanned) fits ``budget`` bytes -- uniform or per layer, whichever
  compiles to fewer FLOPs; raises ConfigError if none fits."""
  from invact_jax import planner  # pylint: disable=import-outside-toplevel
  from models.experiments import plan_profiles as planning  # pylint: disable=import-outside-toplevel
  cfg = model_cfg.replace(scan_layers=True)
  least = planning.least_temp(cfg, batch, planning.PLANNED_CONFIGURATIONS, seq_len=seq_len)
  if budget < least:  # before the profiling (minutes): no plan can fit
    raise ConfigError(f"--memory-budget: {planner.InfeasibleBudget(int(budget), least)}")
  profiles = planning.profile(cfg, batch, seq_len=seq_len)
  try:
    plan, _ = planning.plan_for_budget(cfg, batch, budget, profiles, seq_len=seq_len,
                                       uniform=None)
  except planner.InfeasibleBudget as e:
    raise ConfigError(f"--memory-budget: {e}") from None
  return cfg.replace(save_names=plan.save_names(), **options.configuration(plan.configuration)), plan


@dataclasses.dataclass
class Trainer:
  """Model, optimizer and compiled steps for one config on a data-parallel mesh."""
  cfg: TrainConfig
  dataset: data_lib.Dataset
  devices: int | None = None  # data-parallel over the first N local devices (None: all)
  shard_params: bool = False  # FSDP: parameters and optimizer state split over the data axis

  def __post_init__(self):
    devs = jax.devices()  # every process's devices (multi-process: a global mesh)
    if self.devices is not None and jax.process_count() > 1:
      raise ConfigError("devices: a multi-process run uses every process's devices")
    if self.devices is not None:
      if not 1 <= self.devices <= len(devs):
        raise ConfigError(f"devices must be in [1, {len(devs)}], got {self.devices}")
      devs = devs[:self.devices]
    self.mesh = Mesh(np.array(devs), ("data",))
    validate(self.cfg, self.dataset, self.mesh.size)
    self.model_cfg = self.cfg.model_config(self.dataset)
    self.plan = None
    if self.cfg.memory_budget is not None:
      self.model_cfg, self.plan = plan_model(
          self.model_cfg, self.cfg.memory_budget, self.cfg.batch_size // self.mesh.size,
          **({"seq_len": self.dataset.seq_len} if self.dataset.modality == "text" else {}))
    module = text.TextTransformer if self.dataset.modality == "text" else vit.ViT
    model = module(self.model_cfg, rngs=nnx.Rngs(self.cfg.seed))
    self.graphdef, params = nnx.split(model, nnx.Param)
    self.total = self.cfg.total_steps(self.dataset.x_train.shape[0])
    self.lr = schedule(self.cfg, self.total)
    self.tx = optax.adamw(self.lr, weight_decay=self.cfg.weight_decay)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    self.param_sharding = jax.tree.map(self._state_sharding, params)
    self.params = jax.device_put(params, self.param_sharding)
    opt_state = self.tx.init(self.params)
    self.opt_sharding = jax.tree.map(self._state_sharding, opt_state)
    self.opt_state = jax.device_put(opt_state, self.opt_sharding)
    self.step = 0
    # The state keeps its layout across steps (sharding propagation alone may pick another).
    self.train_step_fn = jax.jit(
        self._train_step_fn, donate_argnums=(0, 1),
        out_shardings=(self.param_sharding, self.opt_sharding, self.replicated, self.replicated))
    self._eval_step = jax.jit(self._eval_step_fn)

  def _state_sharding(self, leaf) -> NamedSharding:
    """Replicated, or with ``shard_params`` split over the data axis along the leaf's largest
    dimension that the mesh divides (FSDP / ZeRO-3: XLA gathers each weight where a step
    uses it and reduce-scatters its gradient; the batch stays split as before).  A leaf with
    no such dimension (a step counter) stays replicated."""
    shape = getattr(leaf, "shape", ())
    n = self.mesh.size
    dims = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not self.shard_params or n == 1 or not dims:
      return self.replicated
    axis = max(dims, key=lambda i: (shape[i], -i))
    return NamedSharding(self.mesh, P(*([None] * axis), "data"))

  def state_bytes_per_device(self) -> int:
    """Bytes of parameters + optimizer state one device holds."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.state()))

  # -- compiled functions
  def _loss(self, params, x, y, key):
    """(mean cross-entropy, accuracy) of one batch."""
    # FSDP: gather the weights, not the activations (left alone, sharding propagation may
    # split a layer's output features over the devices and all-gather its batch instead:
    # measured on the digits ViT, its input images, logits and attention scores).
    params = jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: self.replicated, params))
    loss, correct = self._losses(params, x, y, key)
    return loss.mean(), jnp.mean(correct)

  def _losses(self, params, x, y, key):
    """Per-example (per-position for text) cross-entropy and correctness; a text model's
    own ``loss`` (its head_mode: the logits never materialized when chunked)."""
    model = nnx.merge(self.graphdef, params)
    if hasattr(model, "loss"):
      return model.loss(x, y, key)
    logits = model(x, key)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y),
            jnp.argmax(logits, -1) == y)

  def _train_step_fn(self, params, opt_state, x, y, key):
    (loss, acc), grads = jax.value_and_grad(self._loss, has_aux=True)(params, x, y, key)
    grads = jax.lax.with_sharding_constraint(grads, self.param_sharding)  # reduce-scatter
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, acc

  def _eval_step_fn(self, params, x, y, valid):
    loss, correct = self._losses(params, x, y, None)
    valid = valid.reshape(valid.shape + (1,) * (y.ndim - 1))  # text: every position of a window
    return jnp.sum(jnp.where(valid, loss, 0.0)), jnp.sum(correct & valid)

  # -- host-side helpers
  def _sharded(self, shape, rows: Callable[[slice], np.ndarray]) -> jax.Array:
    """A global array split over the data axis; each process builds only the rows of its own
    devices (``rows(slice)``), so every process reads only its part of a global batch."""
    return jax.make_array_from_callback(
        tuple(shape), self.batch_sharding, lambda index: rows(index[0])[(slice(None),) + index[1:]])

  def batch(self, step: int):
    """The global batch of ``step`` (same data order for any number of processes/devices)."""
    b, d = self.cfg.batch_size, self.dataset
    idx = batch_indices(self.cfg.seed, step, d.x_train.shape[0], b)
    shift = 0
    if d.modality == "image":
      shift = d.image_size // 8 if self.cfg.shift is None else self.cfg.shift
    offsets = shift_offsets(shift, self.cfg.seed, step, b) if shift > 0 else None
    def x_rows(sl):
      x = d.x_train[idx[sl]]
      return x if offsets is None else random_shift(x, shift, self.cfg.seed, step, offsets[:, sl])
    x = self._sharded((b, *d.x_train.shape[1:]), x_rows)
    y = self._sharded((b, *d.y_train.shape[1:]), lambda sl: d.y_train[idx[sl]])
    return x, y

  def train_step(self, step: int):
    x, y = self.batch(step)
    key = dropout_key(self.cfg.seed, step)
    self.params, self.opt_state, loss, acc = self.train_step_fn(self.params, self.opt_state, x, y, key)
    self.step = step + 1
    return loss, acc

  def gradients(self, step: int = 0):
    """(loss, gradient of the loss w.r.t. the parameters) on the batch and dropout key of
    ``step``, at the current parameters (no update)."""
    x, y = self.batch(step)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: self._loss(p, x, y, dropout_key(
        self.cfg.seed, step))[0]))
    return loss_and_grad(self.params)

  def compiled_memory(self) -> memory.CompiledMemory:
    x, y = self.batch(0)
    return memory.compiled(self.train_step_fn, self.params, self.opt_state, x, y,
                           dropout_key(self.cfg.seed, 0))

  def device_peak(self) -> dict[str, int]:
    """One train step on copies of the state, with the allocator's figures (GPU)."""
    x, y = self.batch(0)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the step donates its state)
    return memory.device_peak(self.train_step_fn, copy(self.params), copy(self.opt_state), x, y,
                              dropout_key(self.cfg.seed, 0))

  def evaluate(self) -> dict[str, float]:
    """Mean loss and accuracy over the test set (per image, or per byte of text)."""
    x, y = self.dataset.x_test, self.dataset.y_test
    b = self.cfg.batch_size
    loss_sum, correct = 0.0, 0
    for start in range(0, x.shape[0], b):
      xb, yb = x[start:start + b], y[start:start + b]
      valid = np.ones(b, bool)
      if xb.shape[0] < b:  # pad the last batch to keep one compiled shape
        pad = b - xb.shape[0]
        valid[b - pad:] = False
        xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
        yb = np.concatenate([yb, np.zeros(pad, yb.dtype)])
      put = lambda a: self._sharded(a.shape, lambda sl, a=a: a[sl])  # noqa: E731
      l, c = self._eval_step(self.params, put(xb), put(yb), put(valid))
      loss_sum += float(l)
      correct += int(c)
    n = y.size  # images, or predicted bytes
    return {"test_loss": loss_sum / n, "test_acc": correct / n}

  # -- checkpoints (orbax)
  def state(self) -> dict[str, Any]:
    return {"params": self.params, "opt_state": self.opt_state}

  def restore(self, manager, workdir: pathlib.Path) -> int:
    """Restore the newest checkpoint that reads and verifies (:func:`checkpoints.restore`)."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state())
    step, restored = checkpoints.restore(manager, workdir, abstract, config_error=ConfigError,
                                         first_line=first_line)
    self.params, self.opt_state = restored["params"], restored["opt_state"]
    self.step = step
    return step


def _check_writable(workdir: pathlib.Path) -> None:
  """ConfigError unless ``workdir`` (or the nearest existing parent) can be written."""
  probe = workdir
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  if not probe.is_dir():
    raise ConfigError(f"--workdir {workdir}: {probe} exists and is not a directory")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir {workdir}: {probe} is not writable")


def saved_options(saved: dict) -> dict:
  """A saved ``TrainConfig`` dict in today's field names (``activations`` before 0.3)."""
  if "activations" in saved and "configuration" not in saved:
    saved = {("configuration" if k == "activations" else k): v for k, v in saved.items()}
  return saved


def run_identity(cfg: TrainConfig, data: str | None) -> dict[str, Any]:
  """What config.json records: every option that shapes the result, and the data's
  fingerprint (``data.fingerprint``)."""
  return {**dataclasses.asdict(cfg), "data": data}


def prepare_workdir(cfg: TrainConfig, workdir: pathlib.Path, *, resume: bool,
                    data: str | None = None) -> None:
  """Check the run directory before anything is written to it.

  ``--resume`` continues only the same run: config.json must be there and record the same
  options and the same data (``data``: its fingerprint); anything else is one line naming
  what differs, and nothing is renamed or written."""
  _check_writable(workdir)
  existing = checkpoints.latest_step(workdir)
  cfg_file = workdir / "config.json"
  if resume:
    if existing is None:
      raise ConfigError(f"--resume: no checkpoint in {workdir / 'checkpoints'}")
    if not cfg_file.is_file():
      raise ConfigError(f"--resume: {cfg_file} is missing, so the checkpoints' options (dtype, "
                        "configuration, data) cannot be checked; restore it or start a new "
                        "--workdir")
    try:
      saved = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
      raise ConfigError(f"--resume: {cfg_file} is not the JSON this script writes ({e}); "
                        "restore it or start a new --workdir") from None
    if not isinstance(saved, dict):
      raise ConfigError(f"--resume: {cfg_file} holds no options (a JSON object was expected)")
    saved = saved_options(saved)
    now = run_identity(cfg, data)
    if "data" not in saved or data is None:  # written before 0.3, or no data to compare
      saved["data"] = now["data"]
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k, "(absent)") != now.get(k, "(absent)")]
    if differ:
      what = "; ".join("the data (another file, or other contents)" if k == "data" else
                       f"{cli.flag(k) if k in now else k}: {saved.get(k, '(absent)')!r} in the "
                       f"run, {now.get(k, '(absent)')!r} now" for k in differ)
      raise ConfigError(f"--resume: options differ from the checkpointed run ({cfg_file}): "
                        f"{what}")
  elif existing is not None:
    raise ConfigError(f"{workdir} already holds checkpoints (step {existing}); pass --resume to "
                      "continue that run or --workdir to start a new one")


def write_atomic(path: pathlib.Path, text: str) -> None:
  """Replace ``path``'s content at once: a reader (another process of the run, on a shared file
  system) sees the old file or the new one, never a truncated one."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def _logged_up_to(metrics_path: pathlib.Path, step: int) -> list[dict[str, Any]]:
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
      raise ConfigError(f"--resume: {metrics_path} line {i + 1} is {why}; restore the file or "
                        "delete that line") from None
    step_of = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step_of, int) or isinstance(step_of, bool):
      raise ConfigError(f"--resume: {metrics_path} line {i + 1} has no integer \"step\" "
                        f"(got {step_of!r}); restore the file or delete that line")
    if step_of <= step:
      kept.append(record)
  return kept


def _all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


def _stop_diverged(manager, bar, what: str):
  manager.wait_until_finished()
  last = manager.latest_step()
  manager.close()
  if bar is not None:
    bar.close()
  kept = (f"the last checkpoint (step {last}) holds finite parameters" if last is not None
          else "no checkpoint was written")
  raise TrainingDiverged(f"training diverged: {what}; stopped without saving it, {kept} "
                         "(lower --lr, or check the data's scale)")


def train(cfg: TrainConfig, dataset: data_lib.Dataset, workdir: str | pathlib.Path, *,
          resume: bool = False, progress: bool = True, stop_after: int | None = None,
          time_steps: bool = True, devices: int | None = None,
          shard_params: bool = False) -> dict[str, Any]:
  """Train (or resume) a run in ``workdir``; returns the summary (also in summary.json).

  ``stop_after``: stop once this step is reached, as if killed (checkpoints as usual).
  ``shard_params``: FSDP (see :meth:`Trainer._state_sharding`); a run may resume with or
  without it (the layout is not part of the config; checkpoints restore into either).
  """
  workdir = pathlib.Path(workdir)
  trainer = Trainer(cfg, dataset, devices, shard_params)  # validates before anything is written
  data = data_lib.fingerprint(dataset)
  prepare_workdir(cfg, workdir, resume=resume, data=data)
  # Multi-process: every process trains and checkpoints (orbax writes collectively); only
  # process 0 writes the logs, shows progress and holds the run directory's lock.
  main = jax.process_index() == 0
  workdir.mkdir(parents=True, exist_ok=True)
  with (RunLock(workdir) if main else contextlib.nullcontext()), quiet_libraries():
    if main:  # checked again now that no other run can write here
      prepare_workdir(cfg, workdir, resume=resume, data=data)
    return _train(cfg, dataset, workdir, trainer, data, resume=resume, progress=progress,
                  stop_after=stop_after, time_steps=time_steps, main=main)


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
      raise ConfigError(f"--workdir {self.path.parent}: another run ({holder}) is writing to "
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


def _steps(cfg: TrainConfig, trainer, manager, workdir: pathlib.Path, steps: range, log, bar,
           step_times: list, *, time_steps: bool, main: bool, per_epoch: int) -> None:
  """Train ``steps``: log, evaluate each epoch, checkpoint (its checksums first)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  t_last, n_last = time.perf_counter(), steps.start
  for step in steps:
    if _STOP["signum"] is not None:
      raise StopRequested(_STOP["signum"])
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
      _checkpoint_io(manager, f"the checksums of step {done}", lambda: checkpoints.record(
          workdir, done, trainer.state(), main))
      _checkpoint_io(manager, f"the checkpoint of step {done}", lambda: manager.save(
          done, args=ocp.args.StandardSave(trainer.state()), force=True))
      if main:
        checkpoints.prune(workdir, set(manager.all_steps()) | {done})
    if bar is not None:
      bar.update(1)


def _train(cfg: TrainConfig, dataset: data_lib.Dataset, workdir: pathlib.Path, trainer,
           data: str, *, resume: bool, progress: bool, stop_after: int | None,
           time_steps: bool, main: bool) -> dict[str, Any]:
  if main:  # the other processes read it in prepare_workdir: replaced at once
    write_atomic(workdir / "config.json", json.dumps(run_identity(cfg, data), indent=1))
  manager = checkpoints.manager(workdir, cfg.checkpoint_every)
  start = trainer.restore(manager, workdir) if resume else 0
  metrics_path = workdir / "metrics.jsonl"
  history = _logged_up_to(metrics_path, start) if resume and metrics_path.is_file() else []
  if main:  # the lines log() wrote, as it wrote them
    write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in history))
  n = dataset.x_train.shape[0]
  per_epoch = n // cfg.batch_size
  step_times = []

  bar = None
  if progress and main:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=trainer.total, initial=start, unit="step", dynamic_ncols=True,
               desc=f"{cfg.preset} {cfg.configuration}")
  def log(record):
    history.append(record)
    if main:
      with metrics_path.open("a") as f:
        f.write(json.dumps(record) + "\n")

  end = trainer.total if stop_after is None else min(trainer.total, stop_after)
  try:
    _steps(cfg, trainer, manager, workdir, range(start, end), log, bar, step_times,
           time_steps=time_steps, main=main, per_epoch=per_epoch)
  except StopRequested as e:  # the saves in flight complete: what was saved stays intact
    _STOP["signum"] = None
    try:
      manager.wait_until_finished()
    finally:
      manager.close()
      if bar is not None:
        bar.close()
    raise Interrupted(e.signum, trainer.step, workdir.parent if workdir.name ==
                      cfg.configuration else workdir) from None
  _checkpoint_io(manager, "the last checkpoint", manager.wait_until_finished)
  _checkpoint_io(manager, "the last checkpoint", manager.wait_until_finished)
  manager.close()
  if bar is not None:
    bar.close()
  evals = [h for h in history if "test_acc" in h]
  trains = [h for h in history if "loss" in h]
  summary = {
      "preset": cfg.preset, "configuration": cfg.configuration, "dtype": cfg.dtype,
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
          "budget": trainer.plan.budget, "configuration": trainer.plan.configuration,
          "keep": [list(k) for k in trainer.plan.save_names()],
          "predicted_bytes": trainer.plan.predicted_bytes},
  }
  if main:
    write_atomic(workdir / "summary.json", json.dumps(summary, indent=1))
  summary["history"] = history
  summary["trainer"] = trainer
  return summary
