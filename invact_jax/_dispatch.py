"""``implementation=`` dispatch for the inverted activations (tokamax-style).

A backend turns an :class:`~invact_jax._activations.ActivationSpec` into a forward
``x -> (y, packed_mask)`` and a backward ``(y, packed_mask, dy) -> dx``.  All
backends share the mask layout of :mod:`invact_jax._bitpack`, so residuals are
interchangeable.

* ``"xla"``: plain jnp (fused by XLA), every platform.
* ``"pallas"``: the fused kernels of :mod:`pallas_kernels` (Triton on GPU; on
  other platforms they run in Pallas interpret mode, for testing).
* ``"triton"``: reserved for jax-triton kernels; not written yet, so asking for it raises a
  ``RuntimeError`` with the reason (see :func:`available`).
* ``None``: XLA for now on every platform (bit-identical to ``jax.nn``); it will pick the
  kernels on GPU once measurements there show them faster.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

from invact_jax import _bitpack

__all__ = ["Backend", "Implementation", "IMPLEMENTATIONS", "resolve", "available"]

IMPLEMENTATIONS = (None, "xla", "pallas", "triton")


@dataclasses.dataclass(frozen=True)
class Backend:
  """Static (hashable) description of how to run one activation."""
  name: str = "xla"
  interpret: bool = False
  block_rows: int | None = None  # kernel block height = mask bytes per program (None: heuristic)

  def forward(self, spec, x):
    if self.name == "xla":
      return spec.forward_and_mask(x)
    return _kernel_forward(self, spec, x)

  def backward(self, spec, y, packed, dy, *, guard):
    if self.name == "xla":
      bits = None if packed is None else _bitpack.unpack_bits(packed, y.shape)
      g = guard(spec.derivative(y, bits))
      return (dy.astype(g.dtype) * g).astype(dy.dtype)
    return _kernel_backward(self, spec, y, packed, dy)


def first_order_message(name: str) -> str:
  return (f"invact_jax.{name}: higher-order derivatives are not supported. Its backward pass "
          "reconstructs f'(x) from the stored output y (that is what saves the memory), and "
          "the derivative of that reconstruction is not the second derivative of the "
          f"activation. Use invact_jax.{name}_reference (jax.nn) where you need "
          "second derivatives (e.g. Hessians); forward-mode jax.jvp is not supported either.")


# Kernels are not differentiable; only higher-order differentiation reaches them (the
# custom_vjp never differentiates its fwd/bwd at first order), so say why it is refused.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_forward(backend, spec, x):
  kernels = _kernels(backend.name)
  kw = dict(interpret=backend.interpret, block_rows=backend.block_rows)
  if spec.bit is None:  # one output
    y = _sharded_elementwise(lambda x: kernels.forward(spec, x, **kw)[0], "d", "d", x)
    return y, None
  return _sharded_elementwise(lambda x: kernels.forward(spec, x, **kw), "d", "dm", x)


@_kernel_forward.defjvp
def _kernel_forward_jvp(backend, spec, primals, tangents):
  del backend, primals, tangents
  raise NotImplementedError(first_order_message(spec.name))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel_backward(backend, spec, y, packed, dy):
  kernels = _kernels(backend.name)
  kw = dict(interpret=backend.interpret, block_rows=backend.block_rows)
  if packed is None:
    return _sharded_elementwise(lambda y, dy: kernels.backward(spec, y, None, dy, **kw),
                                "dd", "d", y, dy)
  return _sharded_elementwise(lambda y, m, dy: kernels.backward(spec, y, m, dy, **kw),
                              "dmd", "d", y, packed, dy)


@_kernel_backward.defjvp
def _kernel_backward_jvp(backend, spec, primals, tangents):
  del backend, primals, tangents
  raise NotImplementedError(first_order_message(spec.name))


# ------------------------------------------------------------------ sharding of the kernels
# A pallas_call is opaque to XLA's partitioner, which would gather its operands around it.
# The kernels are elementwise over every axis, the mask's last axis being the data's last
# axis in groups of 8 (bit k of byte j is element 8j + k), so each shard runs the kernel
# on its own block: "... (m k)" with k = 8 for data-like arrays ("d"), "... m" for masks
# ("m"), every operand and result with the data's sharding.  When a shard of the last axis
# would not hold whole mask bytes, that axis is kept unsharded (XLA then moves data, which
# the sharding tests would show; transformer widths are multiples of 8 * shards).
def _local_spec(mesh, spec, shape):
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  last = spec[-1]
  if last is not None:
    axes = last if isinstance(last, tuple) else (last,)
    parts = int(np.prod([mesh.shape[a] for a in axes]))
    if shape[-1] % (8 * parts):
      spec = spec[:-1] + (None,)
  return jax.sharding.PartitionSpec(*spec)


def _sharded_elementwise(fn, kinds_in: str, kinds_out: str, *args):
  """``fn(*args)`` run per shard; ``kinds_*``: "d" data [..., n], "m" mask [..., n/8]."""
  if args[0].ndim == 0:
    return fn(*args)
  if "m" not in kinds_in + kinds_out:
    factors, rule_kw = {"d": "... n"}, {}
  elif args[0].shape[-1] % 8 == 0:
    factors = {"d": "... (m k)", "m": "... m"}
    rule_kw = dict(k=8, need_replication_factors=("k",))
  else:  # mask bytes hold padding: keep the last axis whole
    factors = {"d": "... n", "m": "... m"}
    rule_kw = dict(need_replication_factors=("n", "m"))
  rule = (", ".join(factors[k] for k in kinds_in) + " -> "
          + ", ".join(factors[k] for k in kinds_out))
  single = len(kinds_out) == 1

  op = custom_partitioning(fn)

  def sharding(mesh, arg_shapes):
    x = arg_shapes[0]
    return jax.sharding.NamedSharding(mesh, _local_spec(mesh, x.sharding.spec, x.shape))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    s = sharding(mesh, arg_shapes)
    return s if single else (s,) * len(kinds_out)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    s = sharding(mesh, arg_shapes)
    return mesh, fn, (s if single else (s,) * len(kinds_out)), (s,) * len(kinds_in)

  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=rule, **rule_kw)
  return op(*args)


def _kernels(name):
  if name == "pallas":
    from pallas_kernels import activations  # pylint: disable=import-outside-toplevel
    return activations
  raise ValueError(name)


def _platform() -> str:
  return jax.default_backend()


@functools.lru_cache(maxsize=None)
def available(name: str) -> tuple[bool, str]:
  """Whether backend ``name`` can run on this platform, and why not."""
  if name == "xla":
    return True, ""
  if name == "pallas":
    if importlib.util.find_spec("pallas_kernels") is None:
      return False, "the pallas_kernels package is not installed"
    return True, "" if _platform() == "gpu" else "interpret mode (no GPU)"
  if name == "triton":
    return False, ("the jax-triton kernels are not written yet (they need a GPU with "
                   "jax-triton >= 0.4 to be tested); use implementation='pallas' or 'xla'")
  raise ValueError(name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
  """An ``implementation=`` choice with kernel options (the strings use the defaults).

  Example:
    >>> import jax.numpy as jnp, invact_jax
    >>> impl = invact_jax.Implementation(name="pallas", block_rows=64)
    >>> y = invact_jax.gelu(jnp.ones((4, 128)), implementation=impl)

  Attributes:
    name: "xla", "pallas" or "triton".
    block_rows: kernel block height in mask bytes (8 elements each) per program, a power
      of two; None picks ~32 KiB of input per program (``pallas_kernels.elementwise``).
    interpret: run the Pallas kernels in interpret mode; None: only where there is no GPU.
  """
  name: str
  block_rows: int | None = None
  interpret: bool | None = None

  def __post_init__(self):
    if self.name not in ("xla", "pallas", "triton"):
      raise ValueError(f"Implementation: argument `name` must be 'xla', 'pallas' or 'triton', "
                       f"got {self.name!r}")
    b = self.block_rows
    if b is not None and (not isinstance(b, int) or b < 1 or b & (b - 1)):
      raise ValueError(f"Implementation: argument `block_rows` must be a positive power of "
                       f"two (Pallas GPU blocks need power-of-two sizes), got {b!r}")


def resolve(implementation) -> Backend:
  """Backend for ``implementation`` (see module doc); raises on an unusable choice."""
  if isinstance(implementation, Implementation):
    options = implementation
    implementation = options.name
  else:
    options = None
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(f"argument `implementation` must be one of {IMPLEMENTATIONS} or an "
                       f"invact_jax.Implementation, got {implementation!r}")
  if implementation is None:
    # XLA everywhere until GPU measurements show the kernels faster (README, issue 8): the
    # XLA path is bit-identical to jax.nn, and XLA already fuses both passes.
    return Backend("xla")
  ok, why = available(implementation)
  if not ok:
    raise RuntimeError(f"implementation={implementation!r} cannot run here: {why}")
  interpret = implementation == "pallas" and _platform() != "gpu"
  if options is None:
    return Backend(implementation, interpret=interpret)
  if options.interpret is not None:
    interpret = options.interpret
  return Backend(implementation, interpret=interpret, block_rows=options.block_rows)
