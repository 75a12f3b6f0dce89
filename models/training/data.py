"""Datasets for the training job: images (the embedded digits, ``.npz`` files) and byte-level text.

A :class:`Dataset` holds inputs and targets as arrays the trainer batches by index: images
``[n, H, W, C]`` with class labels ``[n]``, or text windows ``[n, seq_len]`` of byte tokens
with the next byte of every position as targets ``[n, seq_len]``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sys
import sysconfig
import zipfile
import zlib

import jax
import numpy as np

from models.training import errors


#: Labels beyond this imply an absurd classifier head (ImageNet-21k has 21,841 classes).
MAX_CLASSES = 1 << 16
#: Float images beyond this magnitude are unscaled or corrupt (uint8 ones are scaled to [0, 1]).
MAX_PIXEL = 1e4


#: A dataset is missing, unreadable or malformed (:class:`models.training.errors.DataError`).
DataError = errors.DataError


@dataclasses.dataclass(frozen=True)
class Dataset:
  x_train: np.ndarray  # images [n, H, W, C] float32, or text windows [n, seq_len] int32
  y_train: np.ndarray  # labels [n], or next-byte targets [n, seq_len]; int32 in [0, num_classes)
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int     # classes, or the vocabulary (256 byte values)
  name: str
  modality: str = "image"  # "image" or "text"

  @property
  def seq_len(self) -> int:
    return self.x_train.shape[1]

  @property
  def image_size(self) -> int:
    return self.x_train.shape[1]

  @property
  def channels(self) -> int:
    return self.x_train.shape[3]


def fingerprint(dataset: Dataset) -> str:
  """A hash of the arrays (names, dtypes, shapes and bytes) and the class count: the data's
  part of a run's identity (config.json), so that ``--resume`` refuses other data of the same
  shape.  BLAKE2b at memory speed: well under a second for a CIFAR-10-sized ``.npz``."""
  h = hashlib.blake2b(digest_size=16)
  for name in ("x_train", "y_train", "x_test", "y_test"):
    a = np.ascontiguousarray(getattr(dataset, name))
    h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
    h.update(memoryview(a).cast("B"))
  h.update(f"classes:{dataset.num_classes};modality:{dataset.modality}".encode())
  return h.hexdigest()


def load_digits(seed: int = 0) -> Dataset:
  """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package).

  Stratified 80/20 split fixed by ``seed``; pixels scaled from [0, 16] to [0, 1].
  """
  from sklearn.datasets import load_digits as _load  # pylint: disable=import-outside-toplevel
  from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel
  d = _load()
  x = (d.images.astype(np.float32) / 16.0)[..., None]
  y = d.target.astype(np.int32)
  xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  return Dataset(xtr, ytr, xte, yte, 10, "digits")


def _check_headers(path: pathlib.Path) -> None:
  """DataError for a member whose .npy header claims more bytes than the member holds (read
  as it is, it would allocate what its header claims) or does not read."""
  try:
    with zipfile.ZipFile(path) as z:
      for info in z.infolist():
        if not info.filename.endswith(".npy"):
          continue
        with z.open(info) as f:
          try:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
          except (ValueError, OSError, EOFError, zlib.error):
            continue  # not .npy data: said below, by name
          need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
          if need > info.file_size:
            raise DataError(f"cannot read {path} as .npz: its member {info.filename} claims "
                            f"shape {tuple(shape)} ({need:,} bytes) but holds "
                            f"{info.file_size:,} bytes")
  except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
    raise DataError(f"cannot read {path} as .npz: {e}") from None


def load_npz(path: str | pathlib.Path) -> Dataset:
  """Arrays ``x_train, y_train, x_test, y_test``; images [n,H,W] or [n,H,W,C], square.

  uint8 images are scaled to [0, 1]; float ones must be finite and at most ``MAX_PIXEL`` in
  magnitude; labels must be integers in [0, num_classes), num_classes <= ``MAX_CLASSES``.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataError(f"data file not found: {path}")
  if not zipfile.is_zipfile(path):
    with path.open("rb") as f:
      head = f.read(6)
    kind = ("a single .npy array" if head == b"\x93NUMPY" else
            "a zip archive cut short (it ends before its directory: an incomplete copy or "
            "download?)" if head[:4] == b"PK\x03\x04" else "not a zip archive")
    raise DataError(f"cannot read {path} as .npz: it is {kind}; write the data with "
                    "numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
  _check_headers(path)
  try:
    with np.load(path, allow_pickle=False) as f:
      arrays = {k: f[k] for k in f.files}
  except (OSError, ValueError, zipfile.BadZipFile, EOFError, zlib.error, MemoryError) as e:
    why = "it holds object (pickled) arrays; store numeric arrays" if "pickle" in str(e) else e
    raise DataError(f"cannot read {path} as .npz: {why}") from None
  missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
  if missing:
    raise DataError(f"{path} lacks arrays {missing} (has {sorted(arrays)})")
  for k in ("x_train", "y_train", "x_test", "y_test"):
    if not isinstance(arrays[k], np.ndarray):  # NumPy returns a member's raw bytes then
      raise DataError(f"cannot read {path} as .npz: its member {k}.npy is not .npy data "
                      "(no NumPy header); write the data with numpy.savez")
  xs = {}
  for split in ("train", "test"):
    x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
    if x.ndim == 3:
      x = x[..., None]
    if x.ndim != 4 or x.shape[1] != x.shape[2] or min(x.shape[1:]) < 1:
      raise DataError(f"x_{split} must have shape [n, H, W] or [n, H, W, C] with H == W and "
                      f"H, W, C >= 1, got {x.shape}")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
      raise DataError(f"y_{split} must have shape [{x.shape[0]}] to match x_{split}, got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
      raise DataError(f"y_{split} must hold integer labels, got dtype {y.dtype}")
    if x.shape[0] == 0:
      raise DataError(f"x_{split} is empty")
    xs[split] = (x, y)
  if xs["train"][0].shape[1:] != xs["test"][0].shape[1:]:
    raise DataError(f"x_train images {xs['train'][0].shape[1:]} and x_test images "
                    f"{xs['test'][0].shape[1:]} differ in shape")
  num_classes = int(max(xs["train"][1].max(), xs["test"][1].max())) + 1
  if num_classes > MAX_CLASSES:
    raise DataError(f"labels go up to {num_classes - 1}, which would build a {num_classes:,}-class "
                    f"head (at most {MAX_CLASSES:,}); remap the labels to 0..K-1")
  for split, (_, y) in xs.items():
    if y.min() < 0:
      raise DataError(f"y_{split} has negative labels (min {y.min()})")
  if xs["test"][1].max() > xs["train"][1].max():
    raise DataError(f"y_test has label {xs['test'][1].max()} but y_train's labels stop at "
                    f"{xs['train'][1].max()}")
  def scale(x, name):
    if x.dtype == np.uint8:
      return x.astype(np.float32) / 255.0
    if not np.issubdtype(x.dtype, np.floating):
      raise DataError(f"images must be uint8 or floating point, got {x.dtype}")
    bad = ~np.isfinite(x)
    if bad.any():
      raise DataError(f"{name} holds {int(bad.sum()):,} non-finite pixel values (NaN/inf)")
    big = float(np.max(np.abs(x), initial=0.0))
    if big > MAX_PIXEL:
      raise DataError(f"{name} holds pixel values up to {big:.3g}; scale them to a small range "
                      f"such as [0, 1] (at most {MAX_PIXEL:g} in magnitude)")
    return x.astype(np.float32)
  return Dataset(scale(xs["train"][0], "x_train"), xs["train"][1].astype(np.int32),
                 scale(xs["test"][0], "x_test"),
                 xs["test"][1].astype(np.int32), num_classes, path.stem)


def python_stdlib_files() -> list[pathlib.Path]:
  """The running Python's standard-library modules (``<stdlib>/*.py``), sorted by name."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return sorted(root.glob("*.py"))


def load_text(*, seq_len: int = 128, files: list[pathlib.Path] | None = None,
              heldout_every: int = 10, max_test_windows: int = 512) -> Dataset:
  """Byte-level language-modelling data: the Python standard library's own source.

  Every file on a fresh machine has it, nothing is downloaded.  Tokens are bytes (vocabulary
  256); file ``i`` of the sorted list is held out when ``i % heldout_every == heldout_every // 2``
  (a split by file, so no held-out text appears in training).  Each split is the concatenation
  of its files cut into non-overlapping windows of ``seq_len`` inputs; the targets are the same
  windows shifted by one byte.  The held-out set is capped at ``max_test_windows`` windows,
  taken evenly over the held-out text.
  """
  if not isinstance(seq_len, int) or seq_len < 2:
    raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}")
  files = python_stdlib_files() if files is None else [pathlib.Path(f) for f in files]
  if len(files) < heldout_every:
    raise DataError(f"text corpus: need at least {heldout_every} files, found {len(files)} "
                    f"(looked in {sysconfig.get_paths()['stdlib']})")
  parts = {"train": [], "test": []}
  for i, f in enumerate(files):
    split = "test" if i % heldout_every == heldout_every // 2 else "train"
    parts[split].append(f.read_bytes())
  def windows(chunks, cap=None):
    data = np.frombuffer(b"\n".join(chunks), np.uint8)
    n = (data.size - 1) // seq_len
    if n < 1:
      raise DataError(f"text corpus: {data.size} bytes do not fill one window of {seq_len}")
    starts = np.arange(n) * seq_len
    if cap is not None and n > cap:
      starts = starts[np.linspace(0, n - 1, cap).astype(np.int64)]
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = data[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]
  xtr, ytr = windows(parts["train"])
  xte, yte = windows(parts["test"], max_test_windows)
  name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
  return Dataset(xtr, ytr, xte, yte, 256, name, modality="text")


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
