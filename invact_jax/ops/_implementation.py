"""``implementation=``: one way for every op family to choose how it runs (tokamax-style).

* ``None`` / ``"xla"``: plain jnp in a ``jax.custom_vjp``, fused by XLA, on every platform.
  ``None`` is XLA on every platform until GPU measurements show a kernel faster there.
* ``"pallas"``: the Pallas kernels of :mod:`pallas_kernels` (Triton lowering on a GPU,
  interpret mode elsewhere, for tests).
* ``"triton"``: raw Triton kernels called through jax-triton on a CUDA GPU.  On other
  platforms it is an error, except with ``Implementation(name="triton", interpret=True)``,
  which runs the same kernels in Triton's interpreter (slow; for tests and debugging).

Each family (``ops/<family>/``) has an ``IMPLEMENTATIONS`` map in its ``api.py``: name ->
an instance of that backend's :class:`ImplementationBase` subclass (``base.py`` for XLA,
``pallas.py``, ``triton.py``).  :func:`resolve` turns a user's choice into one of them with
its kernel options; the family's ``custom_vjp`` takes it as a static argument and calls its
methods.  A choice the family lacks, or an option its kernels ignore, is a ValueError naming
the op, never a silent fallback.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import ClassVar, Literal, Mapping, Union, get_args

from invact_jax import targets

__all__ = ["Implementation", "ImplementationBase", "ImplementationLike", "ImplementationName", "Xla", "XLA", "NAMES",
           "resolve", "available"]

#: Every implementation name (each family has a subset: its ``IMPLEMENTATIONS`` keys).
#: An implementation by name.
ImplementationName = Literal["xla", "pallas", "triton"]
NAMES: tuple[str, ...] = get_args(ImplementationName)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
  """An ``implementation=`` choice with kernel options (a plain string uses the defaults).

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> impl = invact_jax.Implementation(name="pallas", block_rows=64)
    >>> y = invact_jax.gelu(jnp.ones((4, 128)), implementation=impl)

  Attributes:
    name: "xla", "pallas" or "triton".
    block_rows: elementwise kernels: block height in mask bytes (8 elements each) per
      program, a power of two; None picks ~32 KiB of input per program.
    num_warps: kernels: warps per program (a power of two); None: the kernel's default.
    interpret: run kernels in interpret mode (Pallas or Triton's interpreter); None: Pallas
      interprets where there is no GPU, Triton never does unless asked.
    skip_below: the LM head's fused backward (``linear_cross_entropy``, "pallas"): a tile
      whose largest logits-gradient entry is below this adds nothing (Cut Cross-Entropy's
      gradient filtering; None, the default: every tile adds; docs/lm-head.md).
  """
  name: str
  block_rows: int | None = None
  num_warps: int | None = None
  interpret: bool | None = None
  skip_below: float | None = None

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"Implementation: argument `name` must be one of {NAMES}, got "
                       f"{self.name!r}")
    for arg in ("block_rows", "num_warps"):
      b = getattr(self, arg)
      if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1 or b & (b - 1)):
        raise ValueError(f"Implementation: argument `{arg}` must be a positive power of two "
                         f"(kernel blocks need power-of-two sizes), got {b!r}")
    if self.skip_below is not None and (
        isinstance(self.skip_below, bool) or not isinstance(self.skip_below, (int, float))
        or not 0 <= self.skip_below < float("inf")):
      raise ValueError(f"Implementation: argument `skip_below` must be a finite number >= 0 "
                       f"or None, got {self.skip_below!r}")
    if self.name == "xla" and (self.block_rows or self.num_warps or self.interpret
                               or self.skip_below is not None):
      raise ValueError("Implementation: name='xla' takes no kernel options (block_rows, "
                       "num_warps, interpret, skip_below)")


#: What ``implementation=`` accepts: None (XLA), a name, or an :class:`Implementation`.
ImplementationLike = Union[ImplementationName, Implementation, None]


@dataclasses.dataclass(frozen=True)
class ImplementationBase:
  """A resolved implementation of an op family: hashable (a static argument of the family's
  ``custom_vjp``), with the kernel options :func:`resolve` filled in.

  Each family's ``NAMES`` maps a name to a default instance of one subclass per
  backend: ``base.py`` (XLA, also the reference), ``pallas.py``, ``triton.py``.  ``name`` is
  a class attribute; the fields are the kernel options (unused by XLA).
  """
  name: ClassVar[str] = "xla"
  interpret: bool = False
  block_rows: int | None = None
  num_warps: int | None = None


@dataclasses.dataclass(frozen=True)
class Xla(ImplementationBase):
  """The XLA implementation of a family with no kernels (softmax, dropout)."""


#: The resolved XLA implementation of a family with no kernels.
XLA = Xla()


def _platform() -> str:
  return targets.platform()


def available(name: str) -> tuple[bool, str]:
  """Whether implementation ``name`` runs compiled on the current target
  (:func:`invact_jax.targets.current`: this machine unless compiling for another), and if
  not, why.

  Example:
    >>> import invact_jax
    >>> invact_jax.available("xla")
    (True, '')
  """
  target = targets.current()
  return _available(name, target.platform, target.deviceless)


@functools.lru_cache(maxsize=None)
def _available(name: str, platform: str, deviceless: bool) -> tuple[bool, str]:
  """Whether implementation ``name`` runs on ``platform`` (``deviceless``: compiled for a device
  this machine lacks), and how (interpret mode) or why not."""
  if name == "xla":
    return True, ""
  if name == "pallas":
    if importlib.util.find_spec("pallas_kernels") is None:
      return False, "the pallas_kernels package is not installed"
    return True, "" if platform == "gpu" else "interpret mode (no GPU)"
  if name == "triton":
    if platform != "gpu":
      return False, (f"Triton kernels need a CUDA GPU (this platform is {platform}); use "
                     "implementation='xla', or 'pallas' (interpret mode without a GPU)")
    if deviceless:
      return False, ("jax-triton compiles its kernels for the GPU attached (none here, "
                     "compiling for a GPU without one); use implementation='pallas', which "
                     "XLA:GPU compiles")
    for mod in ("triton", "jax_triton"):
      if importlib.util.find_spec(mod) is None:
        return False, (f"the {mod!r} package is not installed (pip install "
                       "'invact-jax[triton]')")
    return True, ""
  raise ValueError(f"unknown implementation {name!r}; choose from {NAMES}")


def resolve(implementation, *, op: str, implementations: Mapping[str, ImplementationBase],
            options: tuple[str, ...] = ("block_rows", "num_warps", "interpret")
            ) -> ImplementationBase:
  """The family's implementation instance for ``implementation`` of op ``op``, with its
  kernel options; a clear error if it cannot run here.

  Args:
    implementation: None, a name, or an :class:`Implementation`.
    op: public name of the op (for messages).
    implementations: the family's ``IMPLEMENTATIONS`` (name -> default instance).
    options: the :class:`Implementation` options this op's kernels take.

  Returns:
    ``implementations[name]`` with ``interpret``, ``block_rows`` and ``num_warps`` set.
  """
  opts = None
  if isinstance(implementation, Implementation):
    opts, name = implementation, implementation.name
  elif implementation is None:
    name = "xla"
  elif isinstance(implementation, str) and implementation in NAMES:
    name = implementation
  else:
    raise ValueError(f"invact_jax.{op}: argument `implementation` must be None, one of "
                     f"{NAMES} or an invact_jax.Implementation, got {implementation!r}")
  if name not in implementations:
    raise ValueError(f"invact_jax.{op}: implementation={name!r} is not available for this op; it "
                     f"has {tuple(implementations)}")
  if opts is not None:
    given = [o for o in ("block_rows", "num_warps", "skip_below") if getattr(opts, o) is not None]
    unused = [o for o in given if o not in options]
    if unused:
      raise ValueError(f"invact_jax.{op}: Implementation option(s) {unused} have no effect on "
                       f"this op's {name} kernels (they take {[o for o in options]})")
  if name == "xla":
    return implementations["xla"]
  interpret = opts.interpret if opts is not None and opts.interpret is not None else None
  if name == "pallas":
    ok, why = available("pallas")
    if not ok:
      raise RuntimeError(f"invact_jax.{op}: implementation='pallas' cannot run here: {why}")
    interpret = (_platform() != "gpu") if interpret is None else interpret
  else:  # triton
    if interpret:
      if importlib.util.find_spec("triton") is None:
        raise RuntimeError(f"invact_jax.{op}: Implementation(name='triton', interpret=True) needs "
                           "the 'triton' package (pip install 'invact-jax[triton]')")
    else:
      ok, why = available("triton")
      if not ok:
        raise RuntimeError(f"invact_jax.{op}: implementation='triton' cannot run here: {why}")
      interpret = False
  extra = ({"skip_below": opts.skip_below}
           if opts is not None and opts.skip_below is not None else {})
  return dataclasses.replace(implementations[name], interpret=bool(interpret),
                             block_rows=None if opts is None else opts.block_rows,
                             num_warps=None if opts is None else opts.num_warps, **extra)
