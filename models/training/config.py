"""The training job's options: :class:`TrainConfig` holds every field that changes the result
(each with its command-line help and check, see :mod:`models.cli`), :func:`validate` checks it
against the data and the machine, :func:`schedule` is its learning-rate schedule."""
from __future__ import annotations

import dataclasses
import math
import re

import optax

import invact_jax
from models import cli
from models import options, text, vit
from models.training import data as data_lib
from models.training import errors


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


def parse_bytes(text: str) -> int:
  """'123', '300MiB', '1.5GB' -> bytes (an argparse ``type``)."""
  import argparse  # pylint: disable=import-outside-toplevel
  units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
           "gib": 2**30}
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in units:
    raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 300MiB, 2GB, 123456)")
  return int(float(m.group(1)) * units[m.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Options of one training run; each field is also ``scripts/train_vit.py``'s option of the
  same name (``--batch-size`` for ``batch_size``: :mod:`models.cli`)."""
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
      f"models.options ({', '.join(options.CONFIGURATIONS)})", choices=tuple(options.CONFIGURATIONS))
  implementation: str | None = cli.option(
      None, "how the invact_jax ops run (default: XLA)", choices=options.IMPLEMENTATION_CHOICES[1:])
  head_mode: str | None = cli.option(
      None, "the text models' LM head: standard (the logits materialized) or chunked "
      "(invact_jax.linear_cross_entropy); default: the configuration's", choices=options.HEAD_MODES)
  scan_layers: bool = cli.option(False, "run the layers under jax.lax.scan")
  remat: str = cli.option("none", "jax.checkpoint policy per layer",
                          choices=tuple(options.REMAT_POLICIES))
  memory_budget: int | None = cli.option(
      None, "bytes (or e.g. 300MiB) for the gradient step's compiled temp per device: "
      "invact_jax.plan picks what each layer keeps or recomputes and whether invert() of the "
      "loss runs (layers scanned)", check=_positive, parse=parse_bytes)
  checkpoint_every: int = cli.option(500, "steps between checkpoints", check=_positive)
  log_every: int = cli.option(20, "steps between metrics lines", check=_positive)
  shift: int | None = cli.option(None, "random-translation augmentation in pixels (default: "
                                 "image_size // 8)", check=_nonnegative)

  def __post_init__(self):
    cli.check(self, errors.ConfigError)

  def model_config(self, dataset: data_lib.Dataset) -> vit.ViTConfig | text.TextConfig:
    if dataset.modality == "text":
      return self._text_config(dataset)
    if self.preset not in vit.PRESETS:
      raise errors.ConfigError(f"unknown preset {self.preset!r}; choose from {sorted(vit.PRESETS)}")
    base = vit.PRESETS[self.preset]
    patch = base.patch_size
    if dataset.image_size % patch:
      patch = math.gcd(dataset.image_size, patch)
      if patch < 2 and dataset.image_size > 1:
        raise errors.ConfigError(f"images of size {dataset.image_size} do not split into patches of "
                          f"preset {self.preset!r} (patch {base.patch_size})")
    try:
      return base.replace(image_size=dataset.image_size, patch_size=patch,
                          channels=dataset.channels, num_classes=dataset.num_classes,
                          **self.model_overrides(), dtype=self.dtype,
                          scan_layers=self.scan_layers, remat=self.remat)
    except ValueError as e:
      raise errors.ConfigError(str(e)) from None

  def _text_config(self, dataset: data_lib.Dataset) -> text.TextConfig:
    """The text model for ``dataset`` (a text preset, its vocabulary the data's); one
    ConfigError line for another preset or a bad override."""
    if self.preset not in text.PRESETS or text.PRESETS[self.preset].family == "bert":
      raise errors.ConfigError(f"unknown preset {self.preset!r} for text data; choose from "
                        f"{sorted(k for k, v in text.PRESETS.items() if v.family != 'bert')}")
    base = text.PRESETS[self.preset]
    try:
      return base.replace(vocab=dataset.num_classes, max_len=max(base.max_len, dataset.seq_len),
                          **self.model_overrides(), dtype=self.dtype,
                          scan_layers=self.scan_layers, remat=self.remat)
    except ValueError as e:
      raise errors.ConfigError(str(e)) from None

  def model_overrides(self) -> dict:
    """The model-config fields this run sets: its configuration's memory modes, the ops'
    implementation and the LM head's mode (:func:`models.options.configuration`)."""
    return options.configuration(self.configuration, implementation=self.implementation,
                                 head_mode=self.head_mode)

  @property
  def run_name(self) -> str:
    """The run's directory name under ``--workdir``: the configuration, then the
    implementation and head mode where set (``inverted``, ``inverted-pallas-head-chunked``)."""
    return "-".join([self.configuration, *([self.implementation] if self.implementation else []),
                     *([f"head-{self.head_mode}"] if self.head_mode else [])])

  def total_steps(self, n_train: int) -> int:
    return self.steps if self.steps is not None else self.epochs * (n_train // self.batch_size)


def validate(cfg: TrainConfig, dataset: data_lib.Dataset, n_devices: int) -> None:
  """Raise ConfigError for options that cannot work with this data or machine (each option's
  own range is checked when the config is built: :func:`models.cli.check`)."""
  n = dataset.x_train.shape[0]
  if cfg.batch_size > n:
    raise errors.ConfigError(f"--batch-size {cfg.batch_size} is larger than the training set ({n} images)")
  if cfg.batch_size % n_devices:
    raise errors.ConfigError(f"--batch-size {cfg.batch_size} must be divisible by the {n_devices} "
                      "devices it is sharded over")
  if cfg.total_steps(n) <= 0:
    raise errors.ConfigError("the run has no steps (check --epochs / --steps)")
  if cfg.shift is not None and dataset.modality != "image":
    raise errors.ConfigError("--shift translates images; the data is text")
  if cfg.head_mode is not None and dataset.modality == "image":
    raise errors.ConfigError(f"--head-mode {cfg.head_mode} sets a language model's LM head; "
                             "the data is images (a ViT's classifier has no such head)")
  if cfg.shift is not None and cfg.shift >= min(dataset.x_train.shape[1:3]):
    h, w = dataset.x_train.shape[1:3]
    raise errors.ConfigError(f"--shift {cfg.shift} would move images out of their {h}x{w} frame "
                      f"(must be below {min(h, w)})")
  if cfg.implementation is not None:
    ok, why = invact_jax.available(cfg.implementation)
    if not ok:
      raise errors.ConfigError(f"--implementation {cfg.implementation}: {why}")
  cfg.model_config(dataset)


def schedule(cfg: TrainConfig, total: int) -> optax.Schedule:
  warmup = min(cfg.warmup_steps, max(total - 1, 0))
  if cfg.schedule == "constant":
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup),
                                 optax.constant_schedule(cfg.lr)], [warmup])
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total, warmup + 1),
                                            end_value=cfg.lr * 0.01)
