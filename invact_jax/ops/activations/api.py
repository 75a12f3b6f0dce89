"""Public inverted activations, built from the registry: drop-ins for ``jax.nn``.

For every public name of :data:`.registry.PUBLIC` this module defines

* ``<public>(x, [selector/params,] *, implementation=None)``: the inverted activation, a
  ``jax.custom_vjp`` keeping only y (+ the packed branch bit), forward bit-identical to
  ``jax.nn``'s on the XLA path;
* ``<public>_reference(x, ...)``: ``jax.nn``'s own function (JAX autodiff), the baseline.

Signatures mirror ``jax.nn`` (``gelu(x, approximate=True)``, ``elu(x, alpha=1.0)``,
``leaky_relu(x, negative_slope=0.01)``), with ``implementation=`` added (see
:mod:`invact_jax.ops._implementation`).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from invact_jax.ops import _common
from invact_jax.ops import _implementation
from invact_jax.ops.activations import base
from invact_jax.ops.activations import registry

__all__: list[str] = []


def _options(entries) -> list[tuple[str, Any]]:
  """The public keyword arguments (selector first, then numeric params) with defaults."""
  out: dict[str, Any] = {}
  for a in entries:
    for k, v in a.selector:
      out.setdefault(k, v)  # the first entry's selector value is the default
    for k, v in a.params:
      out.setdefault(k, v)
  return list(out.items())


def _select(public: str, entries, kwargs: dict):
  sel = {k: kwargs[k] for a in entries for k, _ in a.selector}
  for a in entries:
    if all(bool(sel[k]) == bool(v) for k, v in a.selector):
      params = tuple((k, _common.static_scalar(public, k, kwargs[k])) for k, _ in a.params)
      return a, params
  raise AssertionError(sel)  # unreachable: selectors cover both values


def _doc(public: str, entries, options) -> str:
  first = entries[0]
  lines = [f"{first.summary.split(';')[0]}, keeping only its output"
           + (" and a 1-bit branch mask" if any(a.nonmonotone for a in entries) else "")
           + " for the backward.", ""]
  lines += [f"Drop-in for ``jax.nn.{first.original.__name__}``: same signature (plus "
            "``implementation=``) and bit-identical outputs on the XLA path.  The backward "
            "computes f'(x) from the stored output:", ""]
  lines += [f"* {a.name}: {a.summary}" for a in entries]
  lines += ["", "Args:", "  x: floating-point array (float16, bfloat16, float32 or float64)."]
  for k, v in options:
    lines.append(f"  {k}: as in ``jax.nn`` (default {v!r})"
                 + ("; a static number (the backward is specialised on it)."
                    if isinstance(v, float) else "."))
  lines += ["  implementation: None (XLA), \"xla\", \"pallas\", \"triton\", or an",
            "    :class:`invact_jax.Implementation` with kernel options.", "",
            "Example:", "  >>> import jax, jax.numpy as jnp, invact_jax",
            "  >>> x = jnp.linspace(-3.0, 3.0, 7)",
            f"  >>> bool(jnp.all(invact_jax.{public}(x) == invact_jax.{public}_reference(x)))",
            "  True",
            f"  >>> g = jax.grad(lambda x: invact_jax.{public}(x).sum())(x)",
            f"  >>> g_ref = jax.grad(lambda x: invact_jax.{public}_reference(x).sum())(x)",
            "  >>> bool(jnp.allclose(g, g_ref, atol=1e-5))",
            "  True"]
  return "\n".join(lines)


def _signature(options, with_implementation: bool) -> inspect.Signature:
  params = [inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
  params += [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=v)
             for k, v in options]
  if with_implementation:
    params.append(inspect.Parameter("implementation", inspect.Parameter.KEYWORD_ONLY,
                                    default=None))
  return inspect.Signature(params)


def _make(public: str, entries) -> tuple[Callable, Callable]:
  options = _options(entries)
  sig = _signature(options, True)
  sig_ref = _signature(options, False)

  def fn(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    x = _common.float_array(public, "x", kw.pop("x"))
    implementation = kw.pop("implementation")
    entry, params = _select(public, entries, kw)
    backend = _implementation.resolve(implementation, op=public, supported=entry.implementations)
    return base.apply(base.Op(entry, params), backend, x)

  def reference(*args, **kwargs):
    bound = sig_ref.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    entry, _ = _select(public, entries, kw)
    x = kw.pop("x")
    return entry.original(x, **{k: kw[k] for k, _ in entry.selector},
                          **{k: kw[k] for k, _ in entry.params})

  for f, name, s in ((fn, public, sig), (reference, f"{public}_reference", sig_ref)):
    f.__name__ = f.__qualname__ = name
    f.__module__ = __name__
    f.__signature__ = s
  fn.__doc__ = _doc(public, entries, options)
  reference.__doc__ = (f"``jax.nn.{entries[0].original.__name__}`` with JAX's own autodiff "
                       f"(it keeps x and intermediates): the baseline of "
                       f":func:`invact_jax.{public}`.")
  return fn, reference


for _public, _entries in registry.PUBLIC.items():
  _fn, _ref = _make(_public, _entries)
  globals()[_public], globals()[f"{_public}_reference"] = _fn, _ref
  __all__ += [_public, f"{_public}_reference"]
del _public, _entries, _fn, _ref
