"""Public LM-head loss without its logits: ``linear_cross_entropy`` and its plain reference.

A language model's last projection and its cross-entropy materialize the logits
[tokens, vocabulary] and their gradient: at 8 x 4096 tokens and a 128k vocabulary, 2 x 16 GiB
in float32.  :func:`linear_cross_entropy` computes the same loss holding one chunk of
logits at a time: for a scalar loss with its gradients computed in the forward (three
matmuls, :mod:`.in_forward`), otherwise with a backward that recomputes the logits
(:mod:`.base`).
"""
from __future__ import annotations

import math
import numbers
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.cross_entropy import base
from invact_jax.ops.cross_entropy import in_forward
from invact_jax.ops.cross_entropy.pallas import PallasCrossEntropy

ImplementationLike = _implementation.ImplementationLike

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]

#: How this op can run: XLA (a chunked loop, the default), or the fused Pallas kernels
#: (:mod:`.pallas`: no tile of logits leaves the chip; the default nowhere until a GPU run
#: measures it faster than the XLA path).
IMPLEMENTATIONS: dict[str, _implementation.ImplementationBase] = {
    "xla": _implementation.XLA, "pallas": PallasCrossEntropy()}
#: How the per-token losses are reduced.
Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS: tuple[str, ...] = get_args(Reduction)
_KERNEL_OPTIONS = ("block_rows", "num_warps", "interpret", "skip_below")


def _arrays(fn, x, w, labels, bias, vocab_axis):
  """Checked arrays: ``(x, w, labels, bias, vocabulary axis of w, d, V)``."""
  x = _common.float_array(fn, "x", x)
  w = _common.float_array(fn, "w", w)
  if x.ndim < 1:
    raise ValueError(f"invact_jax.{fn}: argument `x` must have shape [..., d], got a scalar")
  if w.ndim != 2:
    raise ValueError(f"invact_jax.{fn}: argument `w` must be a 2-D weight ([d, V] or [V, d]), "
                     f"got shape {tuple(w.shape)}")
  if isinstance(vocab_axis, bool) or not isinstance(vocab_axis, numbers.Integral) or \
      vocab_axis not in (-2, -1, 0, 1):
    raise ValueError(f"invact_jax.{fn}: argument `vocab_axis` must be -1 or 1 (w is [d, V]) "
                     f"or 0 or -2 (w is [V, d]), got {vocab_axis!r}")
  vocab_axis = int(vocab_axis) % 2
  d, vocab = w.shape[1 - vocab_axis], w.shape[vocab_axis]
  if x.shape[-1] != d:
    raise ValueError(f"invact_jax.{fn}: argument `w` must have {x.shape[-1]} (the last axis "
                     f"of x) on its axis {1 - vocab_axis}, got shape {tuple(w.shape)} with "
                     f"vocab_axis={vocab_axis}")
  if not hasattr(labels, "dtype"):
    labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"invact_jax.{fn}: argument `labels` must be an integer array, got dtype "
                    f"{labels.dtype}")
  if tuple(labels.shape) != tuple(x.shape[:-1]):
    raise ValueError(f"invact_jax.{fn}: argument `labels` must have shape {tuple(x.shape[:-1])} "
                     f"(x's leading axes), got {tuple(labels.shape)}")
  if bias is not None:
    bias = _common.float_array(fn, "bias", bias)
    if tuple(bias.shape) != (vocab,):
      raise ValueError(f"invact_jax.{fn}: argument `bias` must have shape ({vocab},), got "
                       f"{tuple(bias.shape)}")
  return x, w, labels, bias, vocab_axis, d, vocab


def _loss_options(fn, reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap):
  """Checked ``(ignore_index, label smoothing, z-loss, soft cap)``."""
  if reduction not in _REDUCTIONS:
    raise ValueError(f"invact_jax.{fn}: argument `reduction` must be one of {_REDUCTIONS}, "
                     f"got {reduction!r}")
  if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(
      ignore_index, numbers.Integral)):
    raise TypeError(f"invact_jax.{fn}: argument `ignore_index` must be an integer or None, got "
                    f"{ignore_index!r}")
  smoothing = _common.static_scalar(fn, "label_smoothing", label_smoothing)
  if not 0.0 <= smoothing < 1.0:
    raise ValueError(f"invact_jax.{fn}: argument `label_smoothing` must be in [0, 1), got "
                     f"{smoothing}")
  zl = _common.static_scalar(fn, "z_loss", z_loss)
  if not 0.0 <= zl < math.inf:
    raise ValueError(f"invact_jax.{fn}: argument `z_loss` must be finite and >= 0, got {zl}")
  cap = None
  if logit_soft_cap is not None:
    cap = _common.static_scalar(fn, "logit_soft_cap", logit_soft_cap)
    if not 0.0 < cap < math.inf:
      raise ValueError(f"invact_jax.{fn}: argument `logit_soft_cap` must be finite and > 0 "
                       f"(or None), got {cap}")
  return (None if ignore_index is None else int(ignore_index)), float(smoothing), float(zl), cap


def _mode_and_tiles(fn, reduction, w, n, vocab, gradients, chunk_size, vocab_chunk_size):
  """Checked ``(gradient mode, tokens per tile, vocabulary entries per tile)``."""
  if gradients is None:
    gradients = base.default_mode(reduction, w.dtype)
  if gradients not in base.GRADIENTS:
    raise ValueError(f"invact_jax.{fn}: argument `gradients` must be one of {base.GRADIENTS} "
                     f"or None, got {gradients!r}")
  if gradients == "forward" and reduction == "none":
    raise ValueError(f"invact_jax.{fn}: argument `gradients`='forward' needs a scalar loss "
                     "(reduction 'mean' or 'sum'), got reduction='none'")
  default = base.default_tiles(n, vocab, gradients)
  sizes = []
  for arg, v, what, d_v in (("chunk_size", chunk_size, "tokens", default[0]),
                            ("vocab_chunk_size", vocab_chunk_size, "vocabulary entries",
                             default[1])):
    if v is None:
      v = d_v
    elif isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
      raise ValueError(f"invact_jax.{fn}: argument `{arg}` must be a positive integer ({what} "
                       f"per tile of logits) or None, got {v!r}")
    sizes.append(int(v))
  # a tile of more tokens than there are only pads
  return gradients, max(1, min(sizes[0], n)), min(sizes[1], vocab)


def _concrete_labels(fn, labels, ignore_index, vocab) -> None:
  """Concrete labels outside ``[0, V)`` (and not ``ignore_index``): one line."""
  if isinstance(labels, jax.core.Tracer):
    return
  flat = np.asarray(labels).reshape(-1)
  if ignore_index is not None:
    flat = flat[flat != ignore_index]
  if flat.size and (flat.min() < 0 or flat.max() >= vocab):
    bad = int(flat.min() if flat.min() < 0 else flat.max())
    raise ValueError(f"invact_jax.{fn}: argument `labels` must be in [0, {vocab}) (the "
                     f"vocabulary){'' if ignore_index is None else ' or ignore_index'}, got "
                     f"{bad}")


def _vocab_shards(fn, vocab_axis_name) -> tuple[str | tuple | None, int]:
  """Checked ``(vocab_axis_name, number of vocabulary shards)``."""
  if vocab_axis_name is None:
    return None, 1
  names = (vocab_axis_name,) if isinstance(vocab_axis_name, str) else vocab_axis_name
  if not isinstance(names, (tuple, list)) or not names or not all(
      isinstance(a, str) for a in names):
    raise TypeError(f"invact_jax.{fn}: argument `vocab_axis_name` must be a mesh axis name, "
                    f"a tuple of them or None, got {vocab_axis_name!r}")
  name = names[0] if len(names) == 1 else tuple(names)
  try:
    return name, _common.axis_size(name)
  except NameError:
    raise ValueError(f"invact_jax.{fn}: argument `vocab_axis_name` must name axes of the "
                     f"enclosing shard_map, got {vocab_axis_name!r}") from None


def _options(fn, x, w, labels, bias, reduction, ignore_index, label_smoothing, z_loss,
             logit_soft_cap, vocab_axis, chunk_size, vocab_chunk_size, gradients=None,
             vocab_axis_name=None):
  """Checked arguments: ``(x [N, d], w, bias, labels [N], Options, leading shape)``."""
  x, w, labels, bias, vocab_axis, d, vocab = _arrays(fn, x, w, labels, bias, vocab_axis)
  ignore, smoothing, zl, cap = _loss_options(fn, reduction, ignore_index, label_smoothing,
                                             z_loss, logit_soft_cap)
  name, shards = _vocab_shards(fn, vocab_axis_name)
  lead = tuple(x.shape[:-1])
  n = math.prod(lead)
  mode, chunk, vocab_chunk = _mode_and_tiles(fn, reduction, w, n, vocab, gradients, chunk_size,
                                             vocab_chunk_size)
  _concrete_labels(fn, labels, ignore, vocab * shards)
  labels, ignore = _int32_labels(labels, ignore, vocab * shards)
  opts = base.Options(vocab_axis, reduction, ignore, smoothing, zl, cap, chunk, vocab_chunk,
                      mode, vocab_axis_name=name)
  return x.reshape(n, d), w, bias, labels.reshape(n), opts, lead


_INT32 = np.iinfo(np.int32)


def _int32_labels(labels, ignore: int | None, vocab: int):
  """``(labels, ignore_index)`` in int32, what the tiles index with, meaning what they meant:
  a label of a wider type outside ``[0, V)`` stays outside (an int64 label of 2**32 + 3 is
  no class 3), one equal to ``ignore_index`` stays ignored, and an ``ignore_index`` outside
  int32 becomes a value no int32 label in ``[0, V)`` takes (or none, where no label can
  equal it)."""
  info = np.iinfo(labels.dtype)
  fits = info.min >= _INT32.min and info.max <= _INT32.max
  ignore32 = ignore if ignore is None or _INT32.min <= ignore <= _INT32.max else (
      _INT32.min if not fits else None)
  if fits:
    return labels.astype(jnp.int32), ignore32
  outside = -1 if ignore32 != -1 else -2
  keep = (labels >= 0) & (labels < vocab)
  out = jnp.where(keep, labels, outside)
  if ignore is not None and (info.min <= ignore <= info.max):
    out = jnp.where(labels == ignore, ignore32, out)
  return out.astype(jnp.int32), ignore32


def linear_cross_entropy(x: ArrayLike, w: ArrayLike, labels: ArrayLike, *,
                         bias: ArrayLike | None = None, reduction: Reduction = "mean",
                         ignore_index: int | None = None, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_soft_cap: float | None = None,
                         vocab_axis: int = -1, chunk_size: int | None = None,
                         vocab_chunk_size: int | None = None, gradients: base.Gradients | None = None,
                         return_correct: bool = False,
                         vocab_axis_name: str | tuple[str, ...] | None = None,
                         implementation: ImplementationLike = None
                         ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Cross-entropy of ``x @ w (+ bias)`` against integer labels, never holding the logits.

  The plain formula's loss (optax's ``softmax_cross_entropy_with_integer_labels`` of the
  logits, reduced) one chunk of tokens at a time: no [tokens, V] buffer in either pass.
  ``gradients="forward"`` computes the gradients with the loss (three matmuls;
  :mod:`.in_forward`) and keeps them, in float32; ``"backward"`` recomputes each tile's
  logits (a fourth matmul; :mod:`.base`) and keeps ``x``, ``w``, the labels and a float32
  log-sum-exp per token.  Accumulation in float32 (float64 for float64).

  Args:
    x: the final hidden states [..., d] (float16, bfloat16, float32 or float64).
    w: the output weight, [d, V] (``vocab_axis=-1``) or [V, d] (``vocab_axis=0``: a tied
      embedding table), used in ``x``'s dtype (a float32 weight with bfloat16 activations
      is cast per tile or chunk, never kept as a bfloat16 copy).
    labels: integers of ``x``'s leading shape in ``[0, V)`` or ``ignore_index`` (under
      ``jit`` one outside gives its token a NaN loss; concrete labels are checked here).
    bias: [V] or None.
    reduction: ``"mean"`` (over the tokens not ignored; NaN when all are), ``"sum"``, or
      ``"none"`` (per-token losses of ``labels``' shape, 0 for ignored tokens).
    ignore_index: the label of tokens that do not count (padding), or None.
    label_smoothing: ``s`` of ``(1 - s) * onehot + s / V`` targets.
    z_loss: weight of ``logsumexp(logits)^2`` added per token (PaLM's z-loss).
    logit_soft_cap: ``c`` of ``c * tanh(logits / c)`` before the softmax (Gemma 2), or None.
    vocab_axis: which axis of ``w`` is the vocabulary.
    chunk_size, vocab_chunk_size: a tile's tokens and vocabulary entries ("forward": a
      chunk's tokens, the weight gradient's update tile); static ints, ``chunk_size`` clamped
      to the token count; default per mode and platform (``base.default_tiles``).
    gradients: ``"forward"``, ``"backward"`` or None: ``"forward"`` for a scalar loss with
      a float32 (or float64) weight, whose float32 accumulator is the weight's gradient;
      ``"backward"`` otherwise (a 16-bit weight's float32 accumulator would double its
      gradient's memory: pass the float32 master weight, or ``gradients="forward"``).
      Under ``vmap`` or ``scan`` with the gradient taken outside them, ``"forward"`` keeps one
      weight gradient per example or step: use ``"backward"`` there.
    return_correct: also return, per token, whether its label is ``jnp.argmax`` of its
      logits (a tie with an earlier class is not correct): the accuracy's numerator.
    vocab_axis_name: inside ``shard_map``, the mesh axis (or axes) a tensor-parallel head
      splits the vocabulary over: ``w`` and ``bias`` hold this device's contiguous shard, in
      axis-index order, and ``x`` and the (global) labels are the same along the axis; row
      statistics are combined over it (Megatron's vocabulary-parallel cross-entropy).
    implementation: None / "xla" (the chunked loop), or "pallas" (or an
      ``invact_jax.Implementation``): the fused kernels, :mod:`.pallas`.

  Returns:
    The loss: float32 (float64 for float64 inputs), a scalar unless ``reduction="none"``;
    with ``return_correct``, ``(loss, correct)``, ``correct`` a bool array of ``labels``'
    shape (False for ignored tokens).

  Raises:
    ValueError, TypeError: one line naming the argument that is wrong.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> x, w = jnp.ones((4, 8)), jnp.zeros((8, 16))
    >>> labels = jnp.array([0, 3, 5, 15])
    >>> round(float(invact_jax.linear_cross_entropy(x, w, labels)), 4)   # log(16)
    2.7726
  """
  fn = "linear_cross_entropy"
  impl = _implementation.resolve(implementation, op=fn, implementations=IMPLEMENTATIONS,
                                 options=_KERNEL_OPTIONS)
  x2, w, bias, y, opts, lead = _options(fn, x, w, labels, bias, reduction, ignore_index,
                                        label_smoothing, z_loss, logit_soft_cap, vocab_axis,
                                        chunk_size, vocab_chunk_size, gradients,
                                        vocab_axis_name)
  _runs_there(fn, impl, opts, gradients, return_correct)
  out, correct = _loss(x2, w, bias, y, opts, impl)
  out = out.reshape(lead) if reduction == "none" else out
  return (out, correct.reshape(lead)) if return_correct else out


def _runs_there(fn, impl, opts: base.Options, gradients, return_correct) -> None:
  """One line where ``return_correct`` is no bool or ``impl`` cannot run the head ``opts``
  describe."""
  if not isinstance(return_correct, bool):
    raise TypeError(f"invact_jax.{fn}: argument `return_correct` must be a bool, got "
                    f"{return_correct!r}")
  if impl.name != "pallas":
    return
  why = impl.unsupported(opts) or (
      "gradients='forward' (the fused kernels recompute the logits in the backward)"
      if gradients == "forward" else None)
  if why is not None:
    raise ValueError(f"invact_jax.{fn}: implementation='pallas' does not run {why}; use "
                     "implementation='xla'")


def _loss(x, w, bias, y, opts: base.Options, impl=_implementation.XLA):
  """``(loss, correct)`` of checked arguments, by the implementation and gradient mode."""
  if x.shape[0] == 0 or x.shape[1] == 0:  # no tokens, or d = 0 (every logit the bias's):
    loss = base.reference(x, w, bias, y, opts)  # the plain formula (nothing to hold)
    if not x.shape[0]:
      return loss, jnp.zeros(y.shape, bool)
    z = jnp.zeros(y.shape + (w.shape[opts.vocab_axis],), jnp.float32) if bias is None else (
        jnp.broadcast_to(bias, y.shape + bias.shape))
    counted = base._counted(y, opts)  # pylint: disable=protected-access
    return loss, counted & (jnp.argmax(z, axis=-1) == y)
  if impl.name == "pallas":
    return impl.loss(x, w, bias, y, opts)
  if opts.gradients == "forward":
    return in_forward.reduced(x, w, bias, y, opts)
  return base.linear_cross_entropy(x, w, bias, y, opts)


def linear_cross_entropy_reference(x: ArrayLike, w: ArrayLike, labels: ArrayLike, *,
                                   bias: ArrayLike | None = None, reduction: Reduction = "mean",
                                   ignore_index: int | None = None,
                                   label_smoothing: float = 0.0, z_loss: float = 0.0,
                                   logit_soft_cap: float | None = None,
                                   vocab_axis: int = -1) -> jax.Array:
  """The plain formula (all logits at once, JAX's own autodiff): the baseline, same options.

  Args:
    x, w, labels, bias, reduction, ignore_index, label_smoothing, z_loss, logit_soft_cap,
      vocab_axis: as for :func:`linear_cross_entropy`.

  Returns:
    The loss :func:`linear_cross_entropy` computes, from the whole [tokens, V] logits.

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> x, w = jnp.ones((4, 8)), jnp.zeros((8, 16))
    >>> round(float(invact_jax.linear_cross_entropy_reference(x, w, jnp.arange(4))), 4)
    2.7726
  """
  fn = "linear_cross_entropy_reference"
  x2, w, bias, y, opts, lead = _options(fn, x, w, labels, bias, reduction, ignore_index,
                                        label_smoothing, z_loss, logit_soft_cap, vocab_axis,
                                        None, None)
  out = base.reference(x2, w, bias, y, opts)
  return out.reshape(lead) if reduction == "none" else out
