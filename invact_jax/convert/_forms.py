"""The computations the program-level conversion recognizes, traced from their sources.

Each :class:`Form` is a function that computes an activation, a norm or a softmax the way a
library or a user writes it.  The conversion traces it at the shapes and dtypes it meets and
matches the traced equations against the program, so the patterns follow the installed JAX,
Flax and Equinox versions instead of being spelled out by hand:

* activations: every registry entry, traced from its ``jax.nn`` original (both GELU forms);
  numeric parameters (``alpha``, ``negative_slope``) are traced as sentinels and read back
  from the program;
* compositions: ``x * sigmoid(c * x)`` (transformers' ``quick_gelu``) as a scaled SiLU;
  GPT-2's tanh GELU written by hand (``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 *
  x ** 3)))`` and its usual reorderings) as ``gelu``;
* softmax over the last axis: ``jax.nn.softmax``, the hand-written max-subtracted form
  (where ``jax.nn.softmax`` is one ``custom_jvp`` call, whose body the conversion does not
  enter) and ``exp(x - logsumexp(x))``.

Norms, and softmaxes over any axes, are found by their algebra instead (:mod:`._algebra`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from invact_jax.ops.activations import registry
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["Form", "FORMS", "SENTINELS"]

# Traced in place of a form's numeric parameters; exactly representable in every float dtype,
# and read back from the matched program.  (A program whose own constant equals a sentinel
# still matches correctly: the value read back is that constant.)
SENTINELS = {"alpha": 0.1328125, "negative_slope": 0.064453125, "c": 1.6875, "b": 2.3125}


@dataclasses.dataclass(frozen=True)
class Form:
  """One way of computing an op.

  Attributes:
    name: what the report calls it (``jax.nn.gelu(approximate=False)``, ``flax.linen.LayerNorm``).
    kind: ``activation``, ``scaled_silu`` or ``softmax``.
    public: the invact_jax function it becomes (``gelu``, ``softmax``, ...).
    build: ``dtype -> f(x)`` computing the form for an ``x`` of that dtype (the output in
      the same dtype).
    entry: the registry entry (activations).
    params: sentinel names read back from the program.
    defaults: ``(name, value)`` of numeric parameters the form computes at their defaults
      (traced without passing them: JAX then inlines the default as a literal).
  """
  name: str
  kind: str
  public: str
  build: Callable[[Any], Callable[..., Any] | None]
  entry: Any = None
  params: tuple[str, ...] = ()
  defaults: tuple[tuple[str, float], ...] = ()


# ------------------------------------------------------------------------ activations
def _activation_forms() -> list[Form]:
  """Every registry activation as ``jax.nn`` calls it: with its parameters as sentinels (caught
  from the program), and with their defaults (literals)."""
  forms = []
  for a in registry.ACTIVATIONS.values():
    kwargs = dict(a.selector)
    kwargs.update({k: SENTINELS[k] for k, _ in a.params})
    label = ", ".join(f"{k}={v}" for k, v in a.selector)
    fn = functools.partial(a.original, **kwargs)
    name = f"jax.nn.{a.original.__name__}" + (f"({label})" if label else "")
    forms.append(Form(name, "activation", a.public, lambda dtype, fn=fn: fn, entry=a,
                      params=tuple(k for k, _ in a.params)))
    if a.params:  # called with its defaults: a literal in the traced function, no argument
      fn = functools.partial(a.original, **dict(a.selector))
      forms.append(Form(f"{name} (default {', '.join(k for k, _ in a.params)})", "activation",
                        a.public, lambda dtype, fn=fn: fn, entry=a, defaults=tuple(a.params)))
  return forms


def _scaled_silu(x):
  """``x * sigmoid(c * x)``: transformers' ``quick_gelu`` (c = 1.702), SiLU for c = 1."""
  return x * jax.nn.sigmoid(SENTINELS["c"] * x)


_TANH_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh_half_first(x):
  """GPT-2's GELU as nanoGPT/minGPT ports and transformers' ``gelu_new`` write it."""
  return 0.5 * x * (1.0 + jnp.tanh(_TANH_GELU_C * (x + 0.044715 * x ** 3)))


def _gelu_tanh_x_first(x):
  return x * 0.5 * (1.0 + jnp.tanh(_TANH_GELU_C * (x + 0.044715 * x ** 3)))


def _gelu_tanh_cubed_by_products(x):
  return 0.5 * x * (1.0 + jnp.tanh(_TANH_GELU_C * (x + 0.044715 * x * x * x)))


def _composition_forms() -> list[Form]:
  """Activations written out: a quick GELU (``x * sigmoid(c x)``) and the tanh GELU in three
  spellings."""
  gelu = registry.get("gelu_tanh")
  hand = [Form(f"tanh GELU by hand ({name})", "activation", "gelu", lambda dtype, fn=fn: fn,
               entry=gelu)
          for name, fn in (("0.5 * x * (1 + tanh(...x ** 3))", _gelu_tanh_half_first),
                           ("x * 0.5 * (1 + tanh(...x ** 3))", _gelu_tanh_x_first),
                           ("0.5 * x * (1 + tanh(...x * x * x))", _gelu_tanh_cubed_by_products))]
  return [Form("x * sigmoid(c * x) (quick_gelu)", "scaled_silu", "silu",
               lambda dtype: _scaled_silu, entry=registry.get("silu"), params=("c",)), *hand]


# ---------------------------------------------------------------------------- softmax
def _hand_softmax(x):
  e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _hand_softmax_no_stop(x):
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_from_logsumexp(x):
  return jnp.exp(x - jax.nn.logsumexp(x, axis=-1, keepdims=True))


def _softmax_forms() -> list[Form]:
  """Last-axis softmaxes as written: ``jax.nn.softmax``, by hand with or without ``stop_gradient``
  on the max, and ``exp(x - logsumexp(x))``."""
  def build(fn):
    return lambda dtype: fn
  return [Form("jax.nn.softmax", "softmax", "softmax",
               build(functools.partial(_softmax_base.NN_SOFTMAX, axis=-1))),
          Form("softmax by hand (exp(x - max) / sum)", "softmax", "softmax",
               build(_hand_softmax)),
          Form("softmax by hand (exp(x - max) / sum, no stop_gradient)", "softmax", "softmax",
               build(_hand_softmax_no_stop)),
          Form("softmax as exp(x - logsumexp(x))", "softmax", "softmax",
               build(_softmax_from_logsumexp))]


FORMS: tuple[Form, ...] = tuple(_softmax_forms() + _composition_forms() + _activation_forms())
