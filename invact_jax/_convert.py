"""Make unmodified JAX/Flax code use the inverted activations.

``with invact_jax.inverted() as report:`` swaps, for the duration of the block, the
activation functions that model code reaches *by attribute* — ``jax.nn.gelu(x)``,
``nn.gelu(x)`` (``flax.linen``), ``nnx.gelu(x)``, ``jax.nn.silu(x)``, ... — for their
``invact_jax`` namesakes.  Forward outputs and parameter trees are unchanged (the
forward is ``jax.nn``'s, bit for bit); only what the backward keeps changes.

What it cannot catch: a function captured *before* the block, e.g. a dataclass field
default ``activation: Callable = nn.gelu`` evaluated at class definition, a
``from jax.nn import gelu`` at the top of the user's module, or a function already
traced and cached by ``jax.jit`` outside the block.  Those calls keep ``jax.nn``'s
version; the ``report`` counts every replaced call made while tracing, and
``report.replaced`` is empty (with a warning at exit, unless ``warn=False``) when nothing
was caught, so the uncaught case is detectable.

With ``norms=True`` (the default) the block also swaps ``jax.nn.softmax`` for
``invact_jax.softmax`` (keeps only its output) and the ``__call__`` of Flax's
``linen.LayerNorm``/``linen.RMSNorm``/``nnx.LayerNorm``/``nnx.RMSNorm`` for the
output-saving norms, with the same parameters (names, shapes, initializers) and output
dtype.  Calls these cannot express (a ``where=`` softmax, norms over other axes, with
``axis_name`` or ``mask=``) keep the original and are not counted.  Wrap *before* jitting:
``jax.jit(invact_jax.invert(loss_fn))``.

The swap is process-wide while the block runs (not thread-local).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import threading
import warnings
from typing import Any, Callable, Iterator

import jax

import jax.numpy as jnp

from invact_jax import _activations
from invact_jax import _norms
from invact_jax import _softmax

__all__ = ["inverted", "invert", "ConversionReport", "REPLACEABLE"]

# jax.nn name -> invact_jax function
REPLACEABLE: dict[str, Callable[..., Any]] = {
    "gelu": _activations.gelu, "silu": _activations.silu, "swish": _activations.silu,
    "mish": _activations.mish, "sigmoid": _activations.sigmoid, "softplus": _activations.softplus,
    "elu": _activations.elu, "leaky_relu": _activations.leaky_relu, "relu": _activations.relu,
}

# Modules whose attributes model code commonly calls.
_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
            "flax.nnx.nn.activations")

_LOCK = threading.RLock()


@dataclasses.dataclass
class ConversionReport:
  """What an ``inverted()`` block replaced: call counts by qualified name."""
  calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  patched: list[str] = dataclasses.field(default_factory=list)

  @property
  def replaced(self) -> dict[str, int]:
    return dict(self.calls)

  def __str__(self) -> str:
    if not self.calls:
      return ("invact_jax.inverted: no activation call was replaced (activations captured "
              "before the block, imported by name, or traced by jax.jit outside it?)")
    return "invact_jax.inverted replaced: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.calls.items()))


def _originals() -> dict[str, Callable[..., Any]]:
  import jax.nn  # pylint: disable=import-outside-toplevel
  return {name: getattr(jax.nn, name) for name in REPLACEABLE}


def _wrap(qualname: str, fn: Callable[..., Any], report: ConversionReport):
  @functools.wraps(fn)
  def replaced(*args, **kwargs):
    report.calls[qualname] += 1
    return fn(*args, **kwargs)
  replaced.__invact_original__ = qualname
  return replaced


@contextlib.contextmanager
def inverted(only: tuple[str, ...] | None = None, *, warn: bool = True, norms: bool = True
             ) -> Iterator[ConversionReport]:
  """Context manager: ``jax.nn``/Flax activations called in the block are the inverted ones.

  Args:
    only: ``jax.nn`` names to replace (default: all of ``REPLACEABLE``).
    warn: warn at exit if nothing was replaced.
    norms: also swap softmax and Flax's LayerNorm/RMSNorm (see the module doc).

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> def mlp(x, w):               # unmodified code calling jax.nn.gelu
    ...   return jnp.sum(jax.nn.gelu(x @ w))
    >>> with invact_jax.inverted() as report:
    ...   g = jax.grad(mlp, argnums=1)(jnp.ones((2, 4)), jnp.ones((4, 8)))
    >>> report.replaced
    {'jax.nn.gelu': 1}
  """
  with _inverted(only, warn=warn, norms=norms) as report:
    yield report


def _norm_dtype(module_dtype, *arrays):
  if module_dtype is not None:
    return module_dtype
  return jnp.result_type(*[a for a in arrays if a is not None])


def _last_axis_only(m) -> bool:
  axes = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
  return (axes(m.reduction_axes) in ((-1,),) and axes(m.feature_axes) in ((-1,),)
          and m.axis_name is None)


def _output_saving_norm(module, x, scale, bias, rms: bool, report, qual: str):
  """The Flax norm ``module``'s forward by invact_jax's norm, counted in ``report``."""
  if report is not None:
    report.calls[qual] += 1
  dtype = _norm_dtype(module.dtype, x, scale, bias)
  if rms:
    return _norms.rms_norm(x, scale, epsilon=module.epsilon, dtype=dtype)
  return _norms.layer_norm(x, scale, bias, epsilon=module.epsilon, dtype=dtype)


def _linen_norm_call(original, rms: bool, report: ConversionReport, qual: str):
  def __call__(self, x, *, mask=None):
    if mask is not None or not _last_axis_only(self):
      return original(self, x, mask=mask)
    n = x.shape[-1]
    scale = self.param("scale", self.scale_init, (n,), self.param_dtype) if self.use_scale else None
    bias = (self.param("bias", self.bias_init, (n,), self.param_dtype)
            if not rms and self.use_bias else None)
    return _output_saving_norm(self, x, scale, bias, rms, report, qual)
  # What linen does to a @compact __call__ at class creation (scopes, parameter creation).
  from flax.linen import module as linen_module  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  return linen_module.wrap_method_once(nn.compact(__call__))


def _nnx_norm_call(original, rms: bool, report: ConversionReport, qual: str):
  def __call__(self, x, *, mask=None):
    if mask is not None or not _last_axis_only(self):
      return original(self, x, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    bias = None if rms or self.bias is None else self.bias[...]
    return _output_saving_norm(self, x, scale, bias, rms, report, qual)
  return __call__


_NORM_CLASSES = (("flax.linen", "LayerNorm", False, _linen_norm_call),
                 ("flax.linen", "RMSNorm", True, _linen_norm_call),
                 ("flax.nnx", "LayerNorm", False, _nnx_norm_call),
                 ("flax.nnx", "RMSNorm", True, _nnx_norm_call))


def _softmax_dropin(original, report: ConversionReport, qual: str):
  @functools.wraps(original)
  def softmax(x, axis=-1, where=None, **kwargs):
    if where is not None or kwargs or not isinstance(axis, int) or not hasattr(x, "dtype"):
      return original(x, axis=axis, where=where, **kwargs)
    report.calls[qual] += 1
    return _softmax.softmax(x, axis=axis)
  return softmax


@contextlib.contextmanager
def _inverted(only, *, warn: bool, norms: bool) -> Iterator[ConversionReport]:
  names = tuple(REPLACEABLE) if only is None else tuple(only)
  unknown = [n for n in names if n not in REPLACEABLE]
  if unknown:
    raise ValueError(f"argument `only`: cannot replace {unknown}; choose from {sorted(REPLACEABLE)}")
  report = ConversionReport()
  with _LOCK:
    originals = _originals()
    by_id = {id(originals[n]): n for n in names}
    undo = []
    for modname in _MODULES:
      try:
        mod = importlib.import_module(modname)
      except ImportError:
        continue
      for attr, value in list(vars(mod).items()):
        name = by_id.get(id(value))
        if name is None:
          continue
        qual = f"{modname}.{attr}"
        setattr(mod, attr, _wrap(qual, REPLACEABLE[name], report))
        undo.append((mod, attr, value))
        report.patched.append(qual)
    if norms:
      import jax.nn  # pylint: disable=import-outside-toplevel
      original_softmax = jax.nn.softmax
      for modname in _MODULES:
        try:
          mod = importlib.import_module(modname)
        except ImportError:
          continue
        for attr, value in list(vars(mod).items()):
          if value is original_softmax:
            qual = f"{modname}.{attr}"
            setattr(mod, attr, _softmax_dropin(value, report, qual))
            undo.append((mod, attr, value))
            report.patched.append(qual)
      for modname, clsname, rms, make in _NORM_CLASSES:
        try:
          cls = getattr(importlib.import_module(modname), clsname)
        except (ImportError, AttributeError):
          continue
        qual = f"{modname}.{clsname}"
        original = vars(cls)["__call__"]
        setattr(cls, "__call__", make(original, rms, report, qual))
        undo.append((cls, "__call__", original))
        report.patched.append(qual)
    try:
      yield report
    finally:
      for mod, attr, value in reversed(undo):
        setattr(mod, attr, value)
  if warn and not report.calls:
    warnings.warn(str(report), stacklevel=3)


def invert(fn: Callable[..., Any], *, only: tuple[str, ...] | None = None,
           warn: bool = True, norms: bool = True) -> Callable[..., Any]:
  """Function transform: call ``fn`` with the inverted activations (see :func:`inverted`).

  Apply it before ``jax.jit`` so that tracing happens inside: ``jax.jit(invert(loss))``.
  The last call's report is ``wrapped.last_report``.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with inverted(only, warn=warn, norms=norms) as report:
      out = fn(*args, **kwargs)
    wrapped.last_report = report
    return out
  wrapped.last_report = None
  return wrapped
