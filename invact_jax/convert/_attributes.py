"""``inverted()``: make unmodified code that looks activations up by attribute use ours.

Inside ``with invact_jax.inverted() as report:``, calls such as ``jax.nn.gelu(x)``,
``nn.gelu(x)`` (``flax.linen``), ``nnx.silu(x)`` run the invact_jax namesakes (every public
name of the registry), and with ``norms=True`` (default) ``jax.nn.softmax`` and the
``__call__`` of Flax's ``linen``/``nnx`` ``LayerNorm``/``RMSNorm`` run the output-saving ops
with the same parameters.  Forward outputs and parameter trees are unchanged.

How: while any block is active, the module attributes are replaced by dispatchers that
look at a *thread-local* stack of active blocks: in a thread inside a block they run (and
count) the inverted op, elsewhere the original.  No lock is held while a block runs, other
threads are unaffected, and a nested block counts in every enclosing report.

What it cannot catch: a function captured before the block (a dataclass default
``act = nn.gelu``, ``from jax.nn import gelu``, a dict built at import), or code traced by
``jax.jit`` outside it.  ``invact_jax.invert`` (a program transformation) catches those.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading
import warnings
from typing import Any, Callable, Iterator

import jax.numpy as jnp

from invact_jax.convert._report import ConversionReport
from invact_jax.ops.activations import api as _acts
from invact_jax.ops.activations import registry
from invact_jax.ops.norms import api as _norms
from invact_jax.ops.softmax import api as _softmax
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["inverted", "replaceable"]

# Modules whose attributes model code commonly calls.
_MODULES = ("jax.nn", "flax.linen", "flax.linen.activation", "flax.nnx",
            "flax.nnx.nn.activations")


def replaceable() -> dict[str, Callable[..., Any]]:
  """Public name -> inverted function, for every name of the registry."""
  return {p: getattr(_acts, p) for p in registry.PUBLIC}


def _originals() -> dict[int, str]:
  """id of each jax.nn original (captured at import by the registry) -> public name."""
  return {id(entries[0].original): entries[0].public for entries in registry.PUBLIC.values()}


@dataclasses.dataclass
class _Block:
  report: ConversionReport
  names: frozenset
  norms: bool


_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {"count": 0, "undo": []}


def _active_blocks() -> list[_Block]:
  """The `inverted()` blocks open in this thread, outermost first."""
  return getattr(_LOCAL, "blocks", [])


def _blocks_for(public: str | None, norms: bool) -> list[_Block]:
  return [b for b in _active_blocks()
          if (public is None or public in b.names) and (b.norms or not norms)]


def _count(blocks, public: str, qual: str) -> None:
  for b in blocks:
    b.report.converted.append((public, qual, ""))


def _activation_dispatcher(qual: str, public: str, original, inverted_fn):
  """The attribute installed in place of an activation: the inverted function while a block of
  ``inverted()`` that names ``public`` is open in this thread, else the original (counted per
  attribute ``qual``)."""
  @functools.wraps(original)
  def dispatch(*args, **kwargs):
    blocks = _blocks_for(public, norms=False)
    if not blocks:
      return original(*args, **kwargs)
    _count(blocks, public, qual)
    return inverted_fn(*args, **kwargs)
  dispatch.__invact_original__ = original
  return dispatch


def _softmax_dispatcher(qual: str, original):
  """The attribute installed in place of a softmax: invact_jax's where a block converting norms and
  softmaxes is open and the call is one it expresses (a floating array, no ``where``), else the
  original."""
  @functools.wraps(original)
  def dispatch(x, axis=-1, where=None, **kwargs):
    blocks = _blocks_for(None, norms=True)
    if (not blocks or where is not None or kwargs or not hasattr(x, "dtype")
        or jnp.dtype(x.dtype).name not in ("float16", "bfloat16", "float32", "float64")):
      return original(x, axis=axis, where=where, **kwargs)
    try:
      out = _softmax.softmax(x, axis=axis)
    except (TypeError, ValueError):  # e.g. a tuple of axes: not expressible, keep the original
      return original(x, axis=axis, where=where, **kwargs)
    _count(blocks, "softmax", qual)
    return out
  dispatch.__invact_original__ = original
  return dispatch


def _norm_dtype(module_dtype, *arrays):
  if module_dtype is not None:
    return module_dtype
  return jnp.result_type(*[a for a in arrays if a is not None])


def _last_axis_only(m) -> bool:
  axes = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
  return (axes(m.reduction_axes) == (-1,) and axes(m.feature_axes) == (-1,)
          and m.axis_name is None)


def output_saving_norm(module, x, scale, bias, rms: bool):
  """A Flax norm ``module``'s forward by invact_jax's norm (same epsilon and dtype)."""
  dtype = _norm_dtype(module.dtype, x, scale, bias)
  if rms:
    return _norms.rms_norm(x, scale, epsilon=module.epsilon, dtype=dtype)
  return _norms.layer_norm(x, scale, bias, epsilon=module.epsilon, dtype=dtype)


def linen_norm_call(original, rms: bool, qual: str | None):
  """A ``linen`` norm ``__call__`` that runs the output-saving norm (``qual=None``: always;
  else only inside a conversion block, counting ``qual``)."""
  def __call__(self, x, *, mask=None):
    blocks = None if qual is None else _blocks_for(None, norms=True)
    if (qual is not None and not blocks) or mask is not None or not _last_axis_only(self):
      return original(self, x, mask=mask)
    n = x.shape[-1]
    scale = self.param("scale", self.scale_init, (n,), self.param_dtype) if self.use_scale else None
    bias = (self.param("bias", self.bias_init, (n,), self.param_dtype)
            if not rms and self.use_bias else None)
    if blocks:
      _count(blocks, "softmax", qual)
    return output_saving_norm(self, x, scale, bias, rms)
  # What linen does to a @compact __call__ at class creation (scopes, parameter creation).
  from flax.linen import module as linen_module  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  return linen_module.wrap_method_once(nn.compact(__call__))


def nnx_norm_call(original, rms: bool, qual: str | None):
  """An ``nnx`` norm ``__call__`` running the output-saving norm (see linen_norm_call)."""
  def __call__(self, x, *, mask=None):
    blocks = None if qual is None else _blocks_for(None, norms=True)
    if (qual is not None and not blocks) or mask is not None or not _last_axis_only(self):
      return original(self, x, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    bias = None if rms or self.bias is None else self.bias[...]
    if blocks:
      _count(blocks, "softmax", qual)
    return output_saving_norm(self, x, scale, bias, rms)
  return __call__


_NORM_CLASSES = (("flax.linen", "LayerNorm", False, linen_norm_call),
                 ("flax.linen", "RMSNorm", True, linen_norm_call),
                 ("flax.nnx", "LayerNorm", False, nnx_norm_call),
                 ("flax.nnx", "RMSNorm", True, nnx_norm_call))


def _install() -> list:
  """Swap every replaceable attribute of :data:`_MODULES` (and the norm classes' calls) for its
  dispatcher; the undo list."""
  undo = []
  originals = _originals()
  fns = replaceable()
  for modname in _MODULES:
    try:
      mod = importlib.import_module(modname)
    except ImportError:
      continue
    for attr, value in list(vars(mod).items()):
      qual = f"{modname}.{attr}"
      public = originals.get(id(value))
      if public is not None:
        setattr(mod, attr, _activation_dispatcher(qual, public, value, fns[public]))
      elif value is _softmax_base.NN_SOFTMAX:
        setattr(mod, attr, _softmax_dispatcher(qual, value))
      else:
        continue
      undo.append((mod, attr, value))
  for modname, clsname, rms, make in _NORM_CLASSES:
    try:
      cls = getattr(importlib.import_module(modname), clsname)
    except (ImportError, AttributeError):
      continue
    original = vars(cls)["__call__"]
    setattr(cls, "__call__", make(original, rms, f"{modname}.{clsname}"))
    undo.append((cls, "__call__", original))
  return undo


@contextlib.contextmanager
def _installed() -> Iterator[list]:
  """The dispatchers installed while any block is open (installed by the first, removed by the
  last, across threads)."""
  with _INSTALL_LOCK:
    if _INSTALLED["count"] == 0:
      _INSTALLED["undo"] = _install()
    _INSTALLED["count"] += 1
    undo = _INSTALLED["undo"]
  try:
    yield undo
  finally:
    with _INSTALL_LOCK:
      _INSTALLED["count"] -= 1
      if _INSTALLED["count"] == 0:
        for obj, attr, value in reversed(_INSTALLED["undo"]):
          setattr(obj, attr, value)
        _INSTALLED["undo"] = []


def _names(only) -> frozenset:
  """The registry names ``only`` selects (None: every activation; aliases as their function), or
  one line naming an unknown one."""
  public = tuple(registry.PUBLIC)
  if only is None:
    return frozenset(public)
  if isinstance(only, str):
    only = (only,)
  only = tuple(only)
  unknown = [n for n in only if n not in public]
  if unknown:
    raise ValueError(f"argument `only`: cannot replace {unknown}; choose from {sorted(public)}")
  return frozenset(registry.PUBLIC[n][0].public for n in only)  # aliases (swish) -> silu


@contextlib.contextmanager
def inverted(only: str | tuple[str, ...] | None = None, *, warn: bool = True,
             norms: bool = True) -> Iterator[ConversionReport]:
  """Context manager: ``jax.nn``/Flax activations called in the block are the inverted ones.

  The attribute swap, kept for code that looks functions up at call time; the recommended
  entry point is :func:`invact_jax.invert`, which also converts what this cannot reach
  (functions captured before the block, hand-written forms, other libraries).

  A ``jax.jit`` function first traced inside the block keeps the inverted ops after it: JAX
  caches the trace, and a swapped attribute is not part of its cache key (nothing the block
  could change without changing the numerics is).  Trace it outside the block, or call
  ``f.clear_cache()`` (JAX's) on leaving it; ``invert`` has no such state.

  Args:
    only: public names to replace (a name or a tuple; default: every registry name).
    warn: warn at exit if nothing was replaced.
    norms: also swap softmax and Flax's LayerNorm/RMSNorm (see the module doc).

  Yields:
    The block's :class:`ConversionReport` (what was replaced, filled in as the block runs).

  Returns:
    A context manager.

  Example:
    >>> import jax, jax.numpy as jnp, invact_jax
    >>> def mlp(x, w):               # unmodified code calling jax.nn.gelu
    ...   return jnp.sum(jax.nn.gelu(x @ w))
    >>> with invact_jax.inverted() as report:
    ...   g = jax.grad(mlp, argnums=1)(jnp.ones((2, 4)), jnp.ones((4, 8)))
    >>> report.replaced, report.forms
    ({'gelu': 1}, {'jax.nn.gelu': 1})
  """
  block = _Block(ConversionReport(), _names(only), norms)
  with _installed() as undo:
    block.report.patched = [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in undo]
    stack = _active_blocks()
    _LOCAL.blocks = stack + [block]
    try:
      yield block.report
    finally:
      _LOCAL.blocks = stack
  if warn and not block.report.converted:
    warnings.warn(str(block.report), stacklevel=3)
