"""The registry of inverted activations: the one list every other module reads.

Each :class:`Activation` says what the public function is called and how it is selected
(``gelu(approximate=...)``), which ``jax.nn`` function it mirrors, its backward math from the
output (:mod:`.math`), whether it keeps a branch bit, its float64 oracles
(:mod:`.oracles`), and which implementations exist.  The public functions
(``invact_jax.gelu``, ``invact_jax.gelu_reference``, ...), the conversion of unmodified
code, the Flax modules, the models, the benchmarks, the accuracy audit and the tests are
all built from :data:`ACTIVATIONS`.

Adding an activation: one :class:`Activation` entry here naming its backward in :mod:`.math`
and its float64 oracles in :mod:`.oracles` (for a non-monotone one, a fit from
``scripts/fit_inverse.py``), and its public function in :mod:`.api` (a test checks that the
public functions and this registry name the same ops).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from invact_jax.ops import _common
from invact_jax.ops.activations import math as _math
from invact_jax.ops.activations import oracles as _oracles

__all__ = ["Activation", "ACTIVATIONS", "PUBLIC", "get", "by_public", "entry", "nonmonotone",
           "monotone"]

# jax.nn's functions, captured at import: the attribute conversion (``inverted()``) swaps
# module attributes while it runs, and references must keep calling the originals.
_NN = {name: getattr(jax.nn, name) for name in (
    "gelu", "silu", "mish", "sigmoid", "tanh", "softplus", "selu", "celu", "elu", "hard_tanh",
    "leaky_relu", "hard_silu", "hard_sigmoid", "relu6", "relu", "soft_sign", "squareplus",
    "sparse_plus", "sparse_sigmoid")}


def _always(**params) -> bool:
  del params
  return True


@dataclasses.dataclass(frozen=True)
class Activation:
  """One inverted activation.

  Attributes:
    name: registry key (``gelu_tanh``/``gelu_erf`` for the two GELU forms).
    public: the public function (``invact_jax.<public>``) that runs it.
    selector: keyword values of the public function that select this entry
      (``(("approximate", True),)``).
    params: numeric keyword parameters with their defaults (``(("alpha", 1.0),)``); static.
    original: the ``jax.nn`` function it mirrors (captured at import), called as
      ``original(x, **selector, **params)``.
    grad: ``(y, bit, **params) -> f'(x)`` in the compute dtype (:mod:`.math`).
    nonmonotone: the bit is ``x < x_min`` and ``grad`` evaluates a generated fit.
    bit: where the output alone cannot tell f' (a monotone function's branch for some
      parameters, hard_tanh's ends, hard_silu's branch: closed forms, no fit),
      ``bit(x, **params)`` of x in the compute dtype, kept when ``bit_when(**params)``; with
      ``bit_sees_storage=True``, ``bit(x, **params)`` of x in its storage dtype (the dtype
      jax.nn rounds in: sparse_sigmoid's ties depend on the rounding of ``x + 1``).
    kernel_forward: forward on a kernel tile where ``original`` does not lower (None: original).
    aliases: further public names (``swish``).
    piecewise_linear: f' is piecewise constant, so the backward from the output is exact to
      every order (f'' = 0 a.e., as jax.nn) and needs no first-order guard.
    implementations: the ``implementation=`` choices with kernels for it.
    summary: one line for the public docstring.
    forward64, derivative64: float64 oracles; grad64 ``(y, x, **params)``: f'(f^-1(y)) in
      closed form (monotone only; non-monotone ones are inverted by bisection).
  """
  name: str
  public: str
  original: Callable[..., Any]
  grad: Callable[..., Any]
  forward64: Callable[..., Any]
  derivative64: Callable[..., Any]
  summary: str
  selector: tuple[tuple[str, Any], ...] = ()
  params: tuple[tuple[str, float], ...] = ()
  nonmonotone: bool = False
  bit: Callable[..., Any] | None = None
  bit_when: Callable[..., bool] = _always
  bit_sees_storage: bool = False
  grad64: Callable[..., Any] | None = None
  kernel_forward: Callable[..., Any] | None = None
  aliases: tuple[str, ...] = ()
  piecewise_linear: bool = False
  implementations: tuple[str, ...] = ("xla", "pallas", "triton")

  def keeps_bit(self, **params) -> bool:
    return self.nonmonotone or (self.bit is not None and self.bit_when(**params))

  def threshold(self, dtype) -> float:
    """x_min as compared in ``dtype`` (non-monotone activations only)."""
    return _math.branch_threshold(self.name, dtype)


ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation(
        "gelu_tanh", "gelu", _NN["gelu"], functools.partial(_math.fitted_grad, "gelu_tanh"),
        _oracles.gelu_tanh_forward, _oracles.gelu_tanh_derivative,
        "GELU, tanh form (Flax's default); bit: x < x_min ~ -0.7525",
        selector=(("approximate", True),), nonmonotone=True),
    Activation(
        "gelu_erf", "gelu", _NN["gelu"], functools.partial(_math.fitted_grad, "gelu_erf"),
        _oracles.gelu_erf_forward, _oracles.gelu_erf_derivative,
        "GELU, erf form; bit: x < x_min ~ -0.7518",
        selector=(("approximate", False),), nonmonotone=True,
        kernel_forward=_math.gelu_erf_kernel_forward),
    Activation(
        "silu", "silu", _NN["silu"], functools.partial(_math.fitted_grad, "silu"),
        _oracles.silu_forward, _oracles.silu_derivative,
        "SiLU/swish, x * sigmoid(x); bit: x < x_min ~ -1.2785",
        nonmonotone=True, aliases=("swish",)),
    Activation(
        "mish", "mish", _NN["mish"], functools.partial(_math.fitted_grad, "mish"),
        _oracles.mish_forward, _oracles.mish_derivative,
        "Mish, x * tanh(softplus(x)); bit: x < x_min ~ -1.1924", nonmonotone=True),
    Activation(
        "sigmoid", "sigmoid", _NN["sigmoid"], _math.sigmoid_grad,
        _oracles.sigmoid_forward, _oracles.sigmoid_derivative, "Sigmoid; f' = y (1 - y)",
        grad64=_oracles.sigmoid_grad_from_output),
    Activation(
        "tanh", "tanh", _NN["tanh"], _math.tanh_grad,
        _oracles.tanh_forward, _oracles.tanh_derivative, "tanh; f' = (1 - y)(1 + y)",
        grad64=_oracles.tanh_grad_from_output),
    Activation(
        "softplus", "softplus", _NN["softplus"], _math.softplus_grad,
        _oracles.softplus_forward, _oracles.softplus_derivative, "Softplus; f' = 1 - exp(-y)",
        grad64=_oracles.softplus_grad_from_output),
    # A composition comes before the entry it calls (selu before elu, hard_sigmoid before
    # relu6): the conversion tries the forms in this order, and the first match claims.
    Activation(
        "selu", "selu", _NN["selu"], _math.selu_grad,
        _oracles.selu_forward, _oracles.selu_derivative,
        "SELU; f' = scale for x > 0, else y + scale * alpha",
        grad64=_oracles.selu_grad_from_output),
    Activation(
        "celu", "celu", _NN["celu"], _math.celu_grad,
        _oracles.celu_forward, _oracles.celu_derivative,
        "CELU; f' = 1 for x > 0, else y / alpha + 1",
        params=(("alpha", 1.0),), kernel_forward=_math.celu_kernel_forward,
        grad64=_oracles.celu_grad_from_output),
    Activation(
        "elu", "elu", _NN["elu"], _math.elu_grad,
        _oracles.elu_forward, _oracles.elu_derivative,
        "ELU; f' = 1 for x > 0, else y + alpha (a bit only if alpha < 0)",
        params=(("alpha", 1.0),), bit=lambda x, alpha: x > 0, bit_when=lambda alpha: alpha < 0,
        grad64=_oracles.elu_grad_from_output),
    Activation(
        "hard_tanh", "hard_tanh", _NN["hard_tanh"], _math.hard_tanh_grad,
        _oracles.hard_tanh_forward, _oracles.hard_tanh_derivative,
        "Hard tanh; bit: -1 <= x <= 1 (f' = 1 at x = +-1, as jax.nn, where y = +-1 also "
        "comes from |x| > 1)",
        bit=lambda x: ~((x > 1) | (x < -1)), piecewise_linear=True,
        grad64=_oracles.hard_tanh_grad_from_output),
    Activation(
        "leaky_relu", "leaky_relu", _NN["leaky_relu"], _math.leaky_relu_grad,
        _oracles.leaky_relu_forward, _oracles.leaky_relu_derivative,
        "Leaky ReLU; f' = 1 or the slope (a bit only if negative_slope <= 0)",
        params=(("negative_slope", 1e-2),), bit=lambda x, negative_slope: x >= 0,
        bit_when=lambda negative_slope: negative_slope <= 0, piecewise_linear=True,
        grad64=_oracles.leaky_relu_grad_from_output),
    Activation(
        "hard_silu", "hard_silu", _NN["hard_silu"], _math.hard_silu_grad,
        _oracles.hard_silu_forward, _oracles.hard_silu_derivative,
        "Hard SiLU/swish, x * hard_sigmoid(x); bit: x < -3/2 (closed form, no fit)",
        bit=lambda x: x < -1.5, aliases=("hard_swish",),
        kernel_forward=_math.hard_silu_kernel_forward,
        grad64=_oracles.hard_silu_grad_from_output),
    Activation(
        "hard_sigmoid", "hard_sigmoid", _NN["hard_sigmoid"], _math.hard_sigmoid_grad,
        _oracles.hard_sigmoid_forward, _oracles.hard_sigmoid_derivative,
        "Hard sigmoid, relu6(x + 3) / 6; f' = 1/6 for 0 < y < 1", piecewise_linear=True,
        kernel_forward=_math.hard_sigmoid_kernel_forward,
        grad64=_oracles.hard_sigmoid_grad_from_output),
    Activation(
        "relu6", "relu6", _NN["relu6"], _math.relu6_grad,
        _oracles.relu6_forward, _oracles.relu6_derivative,
        "ReLU6; f' = [0 < y < 6] (f'(0) = f'(6) = 0 as in jax.nn.relu6)", piecewise_linear=True,
        kernel_forward=_math.relu6_kernel_forward, grad64=_oracles.relu6_grad_from_output),
    Activation(
        "relu", "relu", _NN["relu"], _math.relu_grad,
        _oracles.relu_forward, _oracles.relu_derivative,
        "ReLU; f' = [y > 0] (f'(0) = 0 as in jax.nn.relu)", piecewise_linear=True,
        kernel_forward=_math.relu_kernel_forward, grad64=_oracles.relu_grad_from_output),
    Activation(
        "soft_sign", "soft_sign", _NN["soft_sign"], _math.soft_sign_grad,
        _oracles.soft_sign_forward, _oracles.soft_sign_derivative,
        "Soft sign, x / (1 + |x|); f' = (1 - |y|)^2",
        grad64=_oracles.soft_sign_grad_from_output),
    Activation(
        "squareplus", "squareplus", _NN["squareplus"], _math.squareplus_grad,
        _oracles.squareplus_forward, _oracles.squareplus_derivative,
        "Squareplus, (x + sqrt(x^2 + b)) / 2; f' = 1 / (1 + b / (4 y^2))",
        params=(("b", 4.0),), grad64=_oracles.squareplus_grad_from_output),
    Activation(
        "sparse_plus", "sparse_plus", _NN["sparse_plus"], _math.sparse_plus_grad,
        _oracles.sparse_plus_forward, _oracles.sparse_plus_derivative,
        "Sparse plus; f' = min(sqrt(y), 1)",
        grad64=_oracles.sparse_plus_grad_from_output),
    Activation(
        "sparse_sigmoid", "sparse_sigmoid", _NN["sparse_sigmoid"], _math.sparse_sigmoid_grad,
        _oracles.sparse_sigmoid_forward, _oracles.sparse_sigmoid_derivative,
        "Sparse sigmoid, clip(x + 1, 0, 2) / 2; f' = 1/2 for 0 < y < 1; bit: x + 1 rounds "
        "to 0 or 2 (f' = 1/4 there, as jax.nn, where y = 0 or 1 also comes from beyond)",
        bit=_math.sparse_sigmoid_bit, bit_sees_storage=True, piecewise_linear=True,
        kernel_forward=_math.sparse_sigmoid_kernel_forward,
        grad64=_oracles.sparse_sigmoid_grad_from_output),
)}


def _public_names() -> dict[str, tuple[Activation, ...]]:
  out: dict[str, list[Activation]] = {}
  for a in ACTIVATIONS.values():
    for p in (a.public,) + a.aliases:
      out.setdefault(p, []).append(a)
  return {k: tuple(v) for k, v in out.items()}


#: public function name -> the entries it selects among (``gelu`` -> gelu_tanh, gelu_erf).
PUBLIC: dict[str, tuple[Activation, ...]] = _public_names()


def get(name: str) -> Activation:
  """The entry ``name``; a KeyError listing the registry otherwise."""
  try:
    return ACTIVATIONS[name]
  except KeyError:
    raise KeyError(f"unknown activation {name!r}; the registry has {sorted(ACTIVATIONS)}") from None


def by_public(public: str, **selector) -> Activation:
  """The entry that ``invact_jax.<public>(x, **selector)`` runs."""
  for a in PUBLIC[public]:
    if all(selector.get(k, v) == v for k, v in a.selector) and \
        all(dict(a.selector).get(k) == v for k, v in selector.items()):
      return a
  raise KeyError(f"no activation {public!r} with {selector}")


def nonmonotone() -> tuple[str, ...]:
  return tuple(n for n, a in ACTIVATIONS.items() if a.nonmonotone)


def monotone() -> tuple[str, ...]:
  return tuple(n for n, a in ACTIVATIONS.items() if not a.nonmonotone)


def _selector(public: str, arg: str, value) -> bool:
  """A selector argument (``approximate``): a Python or NumPy bool, nothing else."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(f"invact_jax.{public}: argument `{arg}` must be True or False, got {value!r}")


def entry(public: str, selector: dict, params: dict) -> tuple[Activation, tuple]:
  """The registry entry ``invact_jax.<public>(**selector)`` runs, and its static params."""
  sel = {k: _selector(public, k, v) for k, v in selector.items()}
  found = by_public(public, **sel)
  return found, tuple((k, _common.static_scalar(public, k, v)) for k, v in params.items())
