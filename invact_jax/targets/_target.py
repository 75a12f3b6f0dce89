"""Compile targets: this machine's backend, or a device XLA compiles for without one.

A :class:`Target` is what a compile is for: ``"cpu"`` (this machine), ``"h100"`` or
``"h200"`` (one GPU, compiled by XLA:GPU on any machine: *deviceless*), ``"h100x8"`` (eight
GPUs of one host, for sharded programs), a ``GpuTargetConfigProto`` text file, or a TPU slice
(``"v5e:2x2"``, with ``libtpu``).  :func:`compiling_for` makes one the *current* target:
everything in invact_jax that decides by compiling (``invert``'s checks, the planner, the
memory figures) compiles for it, and code that picks an implementation by platform asks
:func:`platform` (cuDNN's attention on a GPU, the LM head's tiles).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.resources
import math
import os
import re
import warnings
from typing import Any, Callable, Iterator, Literal

import jax
import numpy as np

from invact_jax.targets import _compilers

__all__ = ["Target", "Platform", "resolve", "current", "platform", "compiling_for", "local",
           "GPUS", "TPUS"]

Platform = Literal["cpu", "gpu", "tpu"]

#: GPU targets by name: their ``GpuTargetConfigProto`` files in this package.
GPUS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}
#: TPU targets by name: (default topology, chips per host bounds of one host, HBM per chip).
TPUS = {"v5e": ("1x1", (2, 2, 1), 16 * 2**30), "v5p": ("2x2x1", (2, 2, 1), 95 * 2**30),
        "v6e": ("1x1", (2, 2, 1), 32 * 2**30)}

#: XLA options of every deviceless GPU compile.  Without the device XLA does not autotune, so
#: a matmul it would offer to Triton keeps an untuned Triton fusion, where on the device the
#: autotuner times each against cuBLAS and mostly picks cuBLAS for a large one: compiled with
#: Triton's matmuls off, the H100's compiled temps are met to the MiB (the plain LM head at
#: N=8192, d=4096, V=128256: 5,253,399,312 B deviceless, 5,253,399,056 B on the device; with
#: Triton's fusions 40 % more), the rows the autotuner gives a Triton matmul excepted
#: (docs/deviceless.md; :meth:`Target.with_options` loads a device's autotuning results).
DEVICELESS_GPU_OPTIONS = (("xla_gpu_enable_triton_gemm", False),)

_GPU_NAME = re.compile(r"(?P<kind>[a-z0-9]+?)(?:x(?P<count>[0-9]+))?")
_TPU_NAME = re.compile(r"(?P<kind>v[0-9][a-z]*)(?::(?P<topology>[0-9]+(?:x[0-9]+){1,2}))?")


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """What a compile is for.

  Attributes:
    name: ``"cpu"`` (or this machine's backend), ``"h100"``, ``"h100x8"``, ``"v5e:2x2"``, a
      target-config file's path.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    devices: the devices compiled for (this machine's, or a topology's: never run).
    device_kind: the devices' kind (``"NVIDIA H100 80GB HBM3"``).
    memory_bytes: each device's memory (None where unknown: this machine's CPU).
    deviceless: compiled for without the device (the figures are its compiler's).
    compiler_options: XLA options every compile for it takes (where ptxas is).
  """
  name: str
  platform: Platform
  devices: tuple
  device_kind: str
  memory_bytes: int | None
  deviceless: bool
  compiler_options: tuple = ()

  @property
  def key(self) -> tuple:
    """What a compile's result depends on: the name and the options (a cache key)."""
    return (self.name, self.compiler_options)

  def __repr__(self) -> str:
    return (f"Target({self.name!r}, {self.platform}, {len(self.devices)} × {self.device_kind}"
            f"{', deviceless' if self.deviceless else ''})")

  def with_options(self, **options: Any) -> Target:
    """The target compiled with XLA ``options`` besides (or instead of) its own; e.g. a
    device's autotuning results, dumped there with ``--xla_gpu_dump_autotune_results_to``,
    as ``xla_gpu_load_autotune_results_from=PATH``."""
    merged = {**dict(self.compiler_options), **options}
    return dataclasses.replace(self, compiler_options=tuple(merged.items()))

  def one(self) -> Target:
    """The target's first device alone (what a measurement of one device's program is for)."""
    if len(self.devices) == 1:
      return self
    return dataclasses.replace(self, name=f"{self.name} (device 0)", devices=self.devices[:1])

  def mesh(self, shape: tuple[int, ...] | None = None,
           axis_names: tuple[str, ...] = ("d",)) -> jax.sharding.Mesh:
    """A mesh over the target's devices (``shape``: default, all in one axis)."""
    shape = tuple(shape) if shape is not None else (len(self.devices),)
    if math.prod(shape) != len(self.devices) or len(shape) != len(axis_names):
      raise ValueError(f"argument `shape`: {shape} with axes {axis_names} does not cover the "
                       f"{len(self.devices)} devices of {self.name}")
    return jax.sharding.Mesh(np.array(self.devices, dtype=object).reshape(shape), axis_names)

  def place(self, tree: Any) -> Any:
    """``tree`` with every array (or shape struct, or Python number) a
    ``jax.ShapeDtypeStruct`` on the target: a sharding over a mesh of as many devices carried
    over to the target's (the same axes and partition), else replicated over its devices (on
    the mesh the sharded leaves are carried to, where there are any: one program, one mesh)."""
    leaves, treedef = jax.tree.flatten(tree)
    meshes = [self._mesh_like(getattr(getattr(l, "sharding", None), "mesh", None))
              for l in leaves]
    mesh = next((m for m in meshes if m is not None), None) or self.mesh()
    placed = [self._placed(l, m, mesh) for l, m in zip(leaves, meshes)]
    return jax.tree.unflatten(treedef, placed)

  def _mesh_like(self, mesh) -> jax.sharding.Mesh | None:
    """``mesh`` (of several devices) on the target's devices, or None (no such mesh)."""
    devices = getattr(mesh, "devices", None)
    if devices is None or devices.size == 1:
      return None
    if set(devices.flat) <= set(self.devices):
      return mesh
    if devices.size != len(self.devices):
      raise ValueError(f"an argument is sharded over {devices.size} devices (mesh "
                       f"{dict(mesh.shape)}), but target {self.name} has {len(self.devices)}")
    kinds = {"axis_types": mesh.axis_types} if hasattr(mesh, "axis_types") else {}
    return jax.sharding.Mesh(np.array(self.devices, dtype=object).reshape(devices.shape),
                             mesh.axis_names, **kinds)

  def _placed(self, leaf, mesh, default_mesh):
    """``leaf`` as a shape struct on the target: a Python scalar weak-typed and replicated, an
    array replicated, or with its sharding's spec on ``mesh`` where one is given."""
    replicated = jax.sharding.NamedSharding(default_mesh, jax.sharding.PartitionSpec())
    if isinstance(leaf, (bool, int, float, complex)) and not isinstance(leaf, np.generic):
      dtype = jax.dtypes.canonicalize_dtype(type(leaf))
      return jax.ShapeDtypeStruct((), dtype, weak_type=True, sharding=replicated)
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      return leaf
    sharding = replicated
    if mesh is not None:
      given = leaf.sharding
      sharding = jax.sharding.NamedSharding(mesh, given.spec,
                                            memory_kind=getattr(given, "memory_kind", None))
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype,
                                weak_type=bool(getattr(leaf, "weak_type", False)),
                                sharding=sharding)

  def lower(self, fn: Callable[..., Any], *args, **kwargs) -> jax.stages.Lowered:
    """``jax.jit(fn)`` (``fn`` itself where it is jitted) traced and lowered for the target
    at ``args``/``kwargs`` (arrays or shape structs; on a deviceless target placed there by
    :meth:`place`), traced as for the target (:func:`compiling_for`)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    if not self.deviceless:
      with compiling_for(self):
        return jitted.lower(*args, **kwargs)
    args, kwargs = self.place((args, kwargs))
    with compiling_for(self), self._described():
      return jitted.lower(*args, **kwargs)

  def _described(self):
    """A context in which what asks JAX for the device (Pallas's Triton lowering of JAX 0.11+,
    for the compute capability) finds the target's: an abstract mesh without axes naming its
    device, where the caller set none with axes (this JAX has no abstract devices: none)."""
    make = getattr(jax.sharding, "AbstractDevice", None)
    current = jax.sharding.get_abstract_mesh()
    if make is None or getattr(current, "axis_names", ()):
      return contextlib.nullcontext()
    device = make(device_kind=self.device_kind, num_cores=None,
                  platform="cuda" if self.platform == "gpu" else self.platform)
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((), (), abstract_device=device))

  def compile(self, lowered: jax.stages.Lowered,
              options: dict[str, Any] | None = None) -> jax.stages.Compiled:
    """``lowered`` compiled with the target's options and ``options`` (deviceless: outside
    JAX's persistent compilation cache, which cannot read such an executable back)."""
    merged = {**dict(self.compiler_options), **(options or {})}
    if not self.deviceless:
      return lowered.compile(compiler_options=merged or None)
    with _uncached():
      return lowered.compile(compiler_options=merged or None)


@contextlib.contextmanager
def _uncached() -> Iterator[None]:
  """No entry written to JAX's persistent compilation cache while the block runs: an
  executable compiled without its device cannot be loaded back (JAX would warn at each
  later compile of the program and compile it again)."""
  try:
    from jax._src import config  # pylint: disable=import-outside-toplevel
    never = config.persistent_cache_min_compile_time_secs(math.inf)
  except Exception:  # pylint: disable=broad-except  # (a JAX without the state)
    never = contextlib.nullcontext()
  with never, warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
    yield


# ------------------------------------------------------------------------ the current one
_CURRENT: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "invact_jax_target", default=None)


def _trace_state():
  """A JAX configuration state in its trace context and jit key, so that a function traced
  for one target is traced again for another (its platform choices differ); None where this
  JAX has no such states (a trace is then cached across targets)."""
  try:
    from jax._src import config  # pylint: disable=import-outside-toplevel
    return config.config_ext.Config("invact_jax_target", None, include_in_jit_key=True,
                                    include_in_trace_context=True)
  except Exception:  # pylint: disable=broad-except
    return None


_STATE = _trace_state()


@functools.lru_cache(maxsize=None)
def local(backend: str | None = None) -> Target:
  """This machine's ``backend`` (default: JAX's default backend) as a target."""
  devices = tuple(jax.devices(backend) if backend else jax.devices())
  kind = devices[0].platform
  try:  # (this process's own device: another process's has no statistics here)
    stats = jax.local_devices(backend=backend)[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  return Target(kind, "gpu" if kind in ("cuda", "rocm", "gpu") else kind, devices,
                devices[0].device_kind, stats.get("bytes_limit"), False)


def current() -> Target:
  """The target compiles are for now: the innermost :func:`compiling_for`'s, else
  :func:`local`."""
  return _CURRENT.get() or local()


def platform() -> Platform:
  """The current target's platform: what code choosing an implementation by platform asks
  (instead of ``jax.default_backend()``)."""
  return current().platform


@contextlib.contextmanager
def compiling_for(device: str | Target | None) -> Iterator[Target]:
  """Make ``device`` (:func:`resolve`; None: leave the current one) the current target
  while the block runs.

  Example:
    >>> import jax.numpy as jnp
    >>> from invact_jax import targets
    >>> with targets.compiling_for("cpu") as t:
    ...   targets.platform()
    'cpu'
  """
  if device is None:
    yield current()
    return
  t = resolve(device)
  token = _CURRENT.set(t)
  state = _STATE.swap_local(t.name if t.deviceless else None) if _STATE is not None else None
  try:
    yield t
  finally:
    if _STATE is not None:
      _STATE.set_local(state)
    _CURRENT.reset(token)


# ------------------------------------------------------------------------------ resolving
def resolve(device: str | os.PathLike | Target | None) -> Target:
  """The target ``device`` names.

  Args:
    device: a :class:`Target`; None (the current one); ``"cpu"`` (or this machine's
      backend's name, ``"gpu"``, ``"tpu"``); ``"h100"``, ``"h200"`` with ``"xN"`` for N
      devices of one host (``"h100x8"``); a ``GpuTargetConfigProto`` text file; ``"v5e"``,
      ``"v5p"``, ``"v6e"`` with ``":AxB[xC]"`` for a slice's chips (``"v5e:2x2"``).

  Returns:
    The target (a deviceless one's compiler loaded: :mod:`._compilers`).

  Raises:
    ValueError: ``device`` names no target (the message names the argument).
    RuntimeError: the target's compiler is not installed here (the message says what to
      install).
  """
  if isinstance(device, Target):
    return device
  if device is None:
    return current()
  if not isinstance(device, (str, os.PathLike)):
    raise TypeError(f"argument `device` must be a target name, a file or a Target, got "
                    f"{type(device).__name__}")
  return _resolved(os.fspath(device))


@functools.lru_cache(maxsize=None)
def _resolved(name: str) -> Target:
  """The target a name gives: this machine's CPU or accelerator, an H100/H200 (``xN``), a
  GpuTargetConfigProto file, or a TPU slice; one line for a name it does not know."""
  low = name.strip().lower()
  if low in ("cpu", "local"):
    return local("cpu")
  if low in ("gpu", "tpu", "cuda"):
    if jax.default_backend() != ("gpu" if low == "cuda" else low):
      raise ValueError(f"argument `device`: {name!r} names this machine's {low}, but JAX's "
                       f"backend here is {jax.default_backend()!r}; name a device to compile "
                       f"for without one ({', '.join(GPUS)}, {', '.join(TPUS)})")
    return local()
  if os.path.sep in name or name.endswith((".txtpb", ".pbtxt")):
    if not os.path.isfile(name):
      raise ValueError(f"argument `device`: no target-config file {name!r}")
    with open(name, encoding="utf-8") as f:
      return _gpu(name, f.read(), 1)
  m = _GPU_NAME.fullmatch(low)
  if m and m["kind"] in GPUS:
    count = int(m["count"] or 1)
    if count < 1:
      raise ValueError(f"argument `device`: {name!r}: at least one device")
    text = (importlib.resources.files(__package__) / GPUS[m["kind"]]).read_text()
    return _gpu(low, text, count)
  m = _TPU_NAME.fullmatch(low)
  if m and m["kind"] in TPUS:
    return _tpu(low, m["kind"], m["topology"])
  raise ValueError(f"argument `device`: unknown target {name!r}: one of 'cpu', "
                   f"{', '.join(repr(g) for g in GPUS)} (with 'xN' for N devices: 'h100x8'), "
                   f"{', '.join(repr(t) for t in TPUS)} (with ':AxB' for a slice: 'v5e:2x2'), "
                   f"or a GpuTargetConfigProto text file")


def _field(text: str, key: str) -> str | None:
  m = re.search(rf"^\s*{key}\s*:\s*\"?([^\"\n]*)\"?\s*$", text, re.M)
  return m.group(1) if m else None


def _gpu(name: str, config: str, count: int) -> Target:
  """``count`` GPUs described by ``config`` (a GpuTargetConfigProto's text), compiled for by
  XLA:GPU without one (the CUDA plugin's compiler)."""
  try:
    compiler = _compilers.cuda()
  except _compilers.Unavailable as e:
    raise RuntimeError(f"target {name!r}: {e}") from None
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                          target_config=config)
  memory = _field(config, "device_memory_size")
  options = (("xla_gpu_cuda_data_dir", compiler.data_dir),) if compiler.data_dir else ()
  return Target(name, "gpu", tuple(topology.devices), topology.devices[0].device_kind,
                int(memory) if memory else None, True, options + DEVICELESS_GPU_OPTIONS)


def _tpu(name: str, kind: str, topology: str | None) -> Target:
  """A TPU slice of ``kind`` and ``topology`` (default: the kind's in :data:`TPUS`, with its
  HBM per chip), compiled for by libtpu without one."""
  default, host_bounds, hbm = TPUS[kind]
  topology = topology or default
  dims = [int(d) for d in topology.split("x")] + [1] * (3 - len(topology.split("x")))
  bounds = tuple(min(a, b) for a, b in zip(dims, host_bounds))
  try:
    desc = _compilers.tpu_topology(f"{kind}:{topology}", chip_config_name="default",
                                   chips_per_host_bounds=bounds, num_slices=1)
  except _compilers.Unavailable as e:
    raise RuntimeError(f"target {name!r}: {e}") from None
  return Target(name, "tpu", tuple(desc.devices), desc.devices[0].device_kind, hbm, True)
