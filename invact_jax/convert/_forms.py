"""The computations the program-level conversion recognizes, traced from their sources.

Each :class:`Form` is a function that computes an activation, a norm or a softmax the way a
library or a user writes it.  The conversion traces it at the shapes and dtypes it meets and
matches the traced equations against the program, so the patterns follow the installed JAX,
Flax and Equinox versions instead of being spelled out by hand:

* activations: every registry entry, traced from its ``jax.nn`` original (both GELU forms);
  numeric parameters (``alpha``, ``negative_slope``) are traced as sentinels and read back
  from the program;
* norms: Flax ``linen.LayerNorm``/``RMSNorm`` (fast and two-pass variance, with and without
  scale/bias, any ``dtype``) and ``nnx.LayerNorm``/``RMSNorm``, Equinox ``nn.LayerNorm``/``nn.RMSNorm`` (vmapped over rows, as
  Equinox models apply them), transformers' Flax Llama/Mistral/Gemma RMSNorm (``x /
  sqrt(mean(x^2) + eps)`` in float32; Gemma's ``1 + weight`` is computed outside the match and
  is the scale), and the plain-jnp ``rsqrt`` forms; ``eps`` is a sentinel;
* compositions: ``x * sigmoid(c * x)`` (transformers' ``quick_gelu``) as a scaled SiLU;
* softmax over the last axis: ``jax.nn.softmax`` and the hand-written max-subtracted form.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax.ops.activations import registry
from invact_jax.ops.softmax import base as _softmax_base

__all__ = ["Form", "FORMS", "SENTINELS"]

# Traced in place of a form's numeric parameters; exactly representable in every float dtype,
# and read back from the matched program.  (A program whose own constant equals a sentinel
# still matches correctly: the value read back is that constant.)
SENTINELS = {"eps": 2.0 ** -15 + 2.0 ** -21, "alpha": 0.1328125, "negative_slope": 0.064453125,
             "c": 1.6875}


@dataclasses.dataclass(frozen=True)
class Form:
  """One way of computing an op.

  Attributes:
    name: what the report calls it (``jax.nn.gelu(approximate=False)``, ``flax.linen.LayerNorm``).
    kind: ``activation``, ``layer_norm``, ``rms_norm`` or ``softmax``.
    public: the invact_jax function it becomes (``gelu``, ``layer_norm``, ...).
    roles: the traced function's arguments: ``x`` then ``scale``/``bias``.
    build: ``(x_dtype, param_dtype, out_dtype) -> f(x, *params)``, or None where the form
      cannot produce that combination.
    entry: the registry entry (activations).
    params: sentinel names read back from the program.
  """
  name: str
  kind: str
  public: str
  roles: tuple[str, ...]
  build: Callable[[Any, Any, Any], Callable[..., Any] | None]
  entry: Any = None
  params: tuple[str, ...] = ()


# ------------------------------------------------------------------------ activations
def _activation_forms() -> list[Form]:
  forms = []
  for a in registry.ACTIVATIONS.values():
    kwargs = dict(a.selector)
    kwargs.update({k: SENTINELS[k] for k, _ in a.params})
    label = ", ".join(f"{k}={v}" for k, v in a.selector)
    fn = functools.partial(a.original, **kwargs)

    def build(xd, pd, od, fn=fn):
      del pd
      return fn if od == xd else None
    forms.append(Form(f"jax.nn.{a.original.__name__}" + (f"({label})" if label else ""),
                      "activation", a.public, ("x",), build, entry=a,
                      params=tuple(k for k, _ in a.params)))
  return forms


def _scaled_silu(x):
  """``x * sigmoid(c * x)``: transformers' ``quick_gelu`` (c = 1.702), SiLU for c = 1."""
  return x * jax.nn.sigmoid(SENTINELS["c"] * x)


def _composition_forms() -> list[Form]:
  def build(xd, pd, od):
    del pd
    return _scaled_silu if od == xd else None
  return [Form("x * sigmoid(c * x) (quick_gelu)", "scaled_silu", "silu", ("x",), build,
               entry=registry.get("silu"), params=("c",))]


# ------------------------------------------------------------------------------ norms
def _flax_linen(cls_name: str, rms: bool, use_scale: bool, use_bias: bool, fast: bool):
  def build(xd, pd, od):
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    kw = dict(epsilon=SENTINELS["eps"], dtype=od, param_dtype=pd, use_scale=use_scale)
    if not rms:
      kw.update(use_bias=use_bias, use_fast_variance=fast)
    module = getattr(nn, cls_name)(**kw)

    def f(x, *params):
      names = (["scale"] if use_scale else []) + (["bias"] if use_bias and not rms else [])
      return module.apply({"params": dict(zip(names, params))}, x)
    return f
  return build


def _flax_nnx(cls_name: str, rms: bool, use_scale: bool, use_bias: bool, fast: bool):
  def build(xd, pd, od):
    from flax import nnx  # pylint: disable=import-outside-toplevel

    def f(x, *params):
      kw = dict(epsilon=SENTINELS["eps"], dtype=od, param_dtype=pd, use_scale=use_scale,
                rngs=nnx.Rngs(0))
      if not rms:
        kw.update(use_bias=use_bias, use_fast_variance=fast)
      module = getattr(nnx, cls_name)(x.shape[-1], **kw)
      names = (["scale"] if use_scale else []) + (["bias"] if use_bias and not rms else [])
      for name, p in zip(names, params):
        getattr(module, name).value = p
      return module(x)
    return f
  return build


def _equinox(cls_name: str):
  def build(xd, pd, od):
    try:
      import equinox as eqx  # pylint: disable=import-outside-toplevel
    except ImportError:
      return None
    del od

    def f(x, *params):
      d = x.shape[-1]
      module = getattr(eqx.nn, cls_name)(d, eps=SENTINELS["eps"], dtype=pd)
      fields = (lambda m: m.weight,) if cls_name == "RMSNorm" else (lambda m: m.weight,
                                                                    lambda m: m.bias)
      for get, p in zip(fields, params):
        module = eqx.tree_at(get, module, p)
      g = module
      for _ in range(x.ndim - 1):
        g = jax.vmap(g)
      return g(x)
    return f
  return build


def _transformers_rms(x, w, *, dtype):
  """transformers' FlaxLlamaRMSNorm (also Mistral, and Gemma with ``w = 1 + weight``)."""
  variance = jnp.asarray(x, dtype=jnp.float32)
  variance = jnp.power(variance, 2)
  variance = variance.mean(-1, keepdims=True)
  x = x / jnp.sqrt(variance + SENTINELS["eps"])
  return w * jnp.asarray(x, dtype=dtype)


def _jnp_rms(x, w, *, dtype):
  """The usual hand-written RMSNorm: float32 statistics, rsqrt, scale after the cast."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + SENTINELS["eps"])
  return xf.astype(dtype) * w


def _jnp_layer_norm(x, w, b, *, dtype):
  """The usual hand-written LayerNorm: jnp.mean / jnp.var, rsqrt, affine."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.var(x, axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + SENTINELS["eps"])
  return (y * w + b).astype(dtype)


def _jnp_layer_norm_f32(x, w, b, *, dtype):
  """LayerNorm with float32 statistics and affine, cast once at the end."""
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.var(xf, axis=-1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + SENTINELS["eps"]) * w + b).astype(dtype)


def _jnp_layer_norm_fast(x, w, b, *, dtype):
  """LayerNorm with the variance as E[x^2] - E[x]^2."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(x * x, axis=-1, keepdims=True) - mean * mean
  return ((x - mean) * jax.lax.rsqrt(var + SENTINELS["eps"]) * w + b).astype(dtype)


def _jnp_rms_same_dtype(x, w, *, dtype):
  """RMSNorm computed in the input's dtype (no upcast)."""
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + SENTINELS["eps"])
  return (y * w).astype(dtype)


def _plain(fn):
  def build(xd, pd, od):
    del xd, pd
    return functools.partial(fn, dtype=od)
  return build


def _norm_forms() -> list[Form]:
  forms = []
  for fast in (True, False):
    for use_scale, use_bias in ((True, True), (True, False), (False, True), (False, False)):
      roles = ("x",) + (("scale",) if use_scale else ()) + (("bias",) if use_bias else ())
      forms.append(Form(f"flax.linen.LayerNorm({'' if fast else 'use_fast_variance=False, '}"
                        f"use_scale={use_scale}, use_bias={use_bias})", "layer_norm",
                        "layer_norm", roles, _flax_linen("LayerNorm", False, use_scale,
                                                         use_bias, fast), params=("eps",)))
    forms.append(Form(f"flax.nnx.LayerNorm({'' if fast else 'use_fast_variance=False'})",
                      "layer_norm", "layer_norm", ("x", "scale", "bias"),
                      _flax_nnx("LayerNorm", False, True, True, fast), params=("eps",)))
  for use_scale in (True, False):
    forms.append(Form(f"flax.linen.RMSNorm(use_scale={use_scale})", "rms_norm", "rms_norm",
                      ("x", "scale") if use_scale else ("x",),
                      _flax_linen("RMSNorm", True, use_scale, False, True), params=("eps",)))
  forms.append(Form("flax.nnx.RMSNorm", "rms_norm", "rms_norm", ("x", "scale"),
                    _flax_nnx("RMSNorm", True, True, False, True), params=("eps",)))
  forms += [
      Form("equinox.nn.LayerNorm", "layer_norm", "layer_norm", ("x", "scale", "bias"),
           _equinox("LayerNorm"), params=("eps",)),
      Form("equinox.nn.RMSNorm", "rms_norm", "rms_norm", ("x", "scale"), _equinox("RMSNorm"),
           params=("eps",)),
      Form("transformers FlaxLlamaRMSNorm", "rms_norm", "rms_norm", ("x", "scale"),
           _plain(_transformers_rms), params=("eps",)),
      Form("jnp RMSNorm (rsqrt)", "rms_norm", "rms_norm", ("x", "scale"), _plain(_jnp_rms),
           params=("eps",)),
      Form("jnp LayerNorm (mean, var, rsqrt)", "layer_norm", "layer_norm",
           ("x", "scale", "bias"), _plain(_jnp_layer_norm), params=("eps",)),
      Form("jnp LayerNorm (float32 statistics)", "layer_norm", "layer_norm",
           ("x", "scale", "bias"), _plain(_jnp_layer_norm_f32), params=("eps",)),
      Form("jnp LayerNorm (E[x^2] - E[x]^2)", "layer_norm", "layer_norm",
           ("x", "scale", "bias"), _plain(_jnp_layer_norm_fast), params=("eps",)),
      Form("jnp RMSNorm (input dtype)", "rms_norm", "rms_norm", ("x", "scale"),
           _plain(_jnp_rms_same_dtype), params=("eps",)),
  ]
  return forms


# ---------------------------------------------------------------------------- softmax
def _hand_softmax(x):
  e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _hand_softmax_no_stop(x):
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_forms() -> list[Form]:
  def build(fn):
    return lambda xd, pd, od: fn if xd == od else None
  return [Form("jax.nn.softmax", "softmax", "softmax", ("x",),
               build(functools.partial(_softmax_base.NN_SOFTMAX, axis=-1))),
          Form("softmax by hand (exp(x - max) / sum)", "softmax", "softmax", ("x",),
               build(_hand_softmax)),
          Form("softmax by hand (exp(x - max) / sum, no stop_gradient)", "softmax", "softmax",
               ("x",), build(_hand_softmax_no_stop))]


FORMS: tuple[Form, ...] = tuple(_norm_forms() + _softmax_forms() + _composition_forms()
                                + _activation_forms())
