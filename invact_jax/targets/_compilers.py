"""Finding the compiler of a device that is not attached: XLA:GPU's (the CUDA PJRT plugin,
``jax-cuda12-plugin``) and XLA:TPU's (``libtpu``).

A CUDA plugin is found, in this order:

1. registered by JAX at start-up (a GPU machine, or one started with ``JAX_PLATFORMS=cpu``:
   JAX then registers the plugin without checking for a driver);
2. installed beside JAX but left unregistered (no driver: JAX's start-up check failed and
   logged it): registered here without that check;
3. in a *deviceless directory* — those ``$INVACT_JAX_DEVICELESS`` names (separated by
   ``os.pathsep``; set and empty: none), else ``<sys.prefix>/deviceless`` — where
   ``pip install --target`` (``make deviceless`` in a checkout) put the
   plugin, its PJRT library, ptxas (``nvidia-cuda-nvcc-cu12``) and cuDNN
   (``nvidia-cudnn-cu12``, without the cuBLAS it lists: compiling needs none).  Kept off the
   import path, the plugin stays out of JAX's start-up, which on a machine without a driver
   prints a traceback and its libraries' log lines in every process; it is loaded here, on
   the first compile for a GPU, quietly, and JAX is told of cuDNN's version (JAX looks for it
   once, when it is imported).

``libtpu`` is found by JAX (installed beside it, or ``$TPU_LIBRARY_PATH``), else in a
deviceless directory (``tpu/libtpu/libtpu.so`` there: a directory of its own, never on
``sys.path``, since the ``libtpu`` package sets ``$TPU_LIBRARY_PATH`` as it is imported and a
process started after that would take itself for a TPU host), loaded on the first compile for a TPU with
its start-up log lines (it looks for TPU workers that a CPU machine has none of) sent away.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
import sys

import jax

__all__ = ["DEVICELESS_ENV", "Unavailable", "Cuda", "cuda", "tpu_topology", "install_hint",
           "deviceless_dirs"]

#: The environment variable naming deviceless directories (see the module doc).
DEVICELESS_ENV = "INVACT_JAX_DEVICELESS"


class Unavailable(RuntimeError):
  """The compiler of a target cannot be loaded here; the message says what to install."""


@dataclasses.dataclass(frozen=True)
class Cuda:
  """A loaded CUDA compiler.

  Attributes:
    data_dir: the CUDA directory holding ``bin/ptxas`` (``xla_gpu_cuda_data_dir``), or None
      where JAX found one itself.
    source: how the plugin was found (module doc: ``"registered"``, ``"installed"``, or the
      deviceless directory).
  """
  data_dir: str | None
  source: str


def _jaxlib_version() -> str:
  from jaxlib import version  # pylint: disable=import-outside-toplevel
  return version.__version__


def install_hint(platform: str) -> str:
  """What to install for ``platform``'s deviceless compiles, in one sentence."""
  v = _jaxlib_version()
  if platform == "tpu":
    return (f"install libtpu at JAX {jax.__version__}'s pin (pip install 'jax[tpu]=="
            f"{jax.__version__}'; `make deviceless` in a checkout puts it in "
            f"{pathlib.Path(sys.prefix) / 'deviceless'}; docs/deviceless.md)")
  return (f"install jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12 "
          f"nvidia-cudnn-cu12 (`make deviceless` in a checkout puts them in "
          f"{pathlib.Path(sys.prefix) / 'deviceless'}, off JAX's start-up; "
          f"docs/deviceless.md)")


def deviceless_dirs() -> list[pathlib.Path]:
  """The deviceless directories that hold a plugin (module doc), in the order they are
  searched."""
  return [d for d in _named_dirs() if (d / "jax_plugins").is_dir()]


def _named_dirs() -> list[pathlib.Path]:
  named = os.environ.get(DEVICELESS_ENV)
  return ([pathlib.Path(p) for p in named.split(os.pathsep) if p] if named is not None
          else [pathlib.Path(sys.prefix) / "deviceless"])


def tpu_topology(name: str, **kwargs):
  """JAX's description of the TPU slice ``name`` (``"v5e:2x2"``; ``kwargs`` as
  ``jax.experimental.topologies.get_topology_desc`` takes them), libtpu found as the module
  doc says.

  Raises:
    Unavailable: no libtpu here, or it refuses the slice.
  """
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  from jax._src import cloud_tpu_init  # pylint: disable=import-outside-toplevel
  found, env = cloud_tpu_init.get_tpu_library_path(), {}
  if found is None:
    # (deviceless/tpu, never on sys.path: the libtpu package sets TPU_LIBRARY_PATH as it is
    # imported, and a process started after that takes itself for a TPU host)
    found = next((str(f) for d in _named_dirs()
                  for f in (d / "tpu" / "libtpu" / "libtpu.so",) if f.is_file()), None)
    if found is None:
      raise Unavailable(f"no XLA:TPU compiler for a deviceless TPU compile: "
                        f"{install_hint('tpu')}")
    env["TPU_LIBRARY_PATH"] = found  # (read as libtpu loads)
  if jax.default_backend() != "tpu":
    # No TPU here to share: several processes compiling for one (a test run's workers) may
    # each load libtpu, which otherwise takes a machine-wide lock file.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    with _quiet(), _environment(env):
      return topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
  except Exception as e:  # pylint: disable=broad-except  # a slice libtpu does not know, ...
    raise Unavailable(f"libtpu ({found}) cannot describe {name!r}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}") from e


@contextlib.contextmanager
def _environment(values: dict[str, str]):
  """``values`` set in ``os.environ`` for the block, and whatever the block sets there undone
  after it (JAX's Cloud TPU set-up, run as libtpu loads, sets ``TPU_SKIP_MDS_QUERY``, by which
  a process started later — a training run's workers — takes itself for a Cloud TPU host and
  stops at start-up)."""
  before = dict(os.environ)
  os.environ.update(values)
  try:
    yield
  finally:
    for k in set(os.environ) - set(before):
      del os.environ[k]
    for k, v in before.items():
      if os.environ.get(k) != v:
        os.environ[k] = v


@contextlib.contextmanager
def _quiet():
  """File descriptor 2 sent to /dev/null: the CUDA libraries log to it as they load."""
  sys.stderr.flush()
  saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(null)


@contextlib.contextmanager
def _unchecked():
  """The CUDA plugin's start-up check of the driver's version skipped (there is no driver)."""
  name = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
  old = os.environ.get(name)
  os.environ[name] = "1"
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = old


def _registered() -> bool:
  """Whether JAX can describe a CUDA topology (its plugin is registered)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  jax.devices()  # JAX's start-up: its own plugin discovery first
  return "cuda" in getattr(xla_bridge, "_topology_factories", {})


def _plugin_modules() -> list[str]:
  """The CUDA plugin modules importable now."""
  found = []
  for m in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
    try:
      if importlib.util.find_spec(m) is not None:
        found.append(m)
    except ModuleNotFoundError:  # no jax_plugins package on the path at all
      pass
  return found


def _tell_jax_of_cudnn() -> None:
  """JAX looks for cuDNN's version once, when it is imported (``jax._src.lib``): a plugin
  loaded since is made known there and to the cuDNN attention that reads it."""
  from jax._src import lib  # pylint: disable=import-outside-toplevel
  if getattr(lib, "cuda_versions", None) is not None:
    return
  for pkg in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
    try:
      versions = importlib.import_module(f"{pkg}._versions")
    except ImportError:
      continue
    lib.cuda_versions = versions
    try:
      from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
    except ImportError:
      return
    fused_attention_stablehlo.cuda_versions = versions
    return


def _run_plugin_callbacks() -> None:
  """What JAX does for each plugin it discovers at start-up, for the one registered since:
  the callbacks registered before then (custom partitioning's partitioner, which a sharded
  cuDNN attention lowers through)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  factory = getattr(xla_bridge, "_backend_factories", {}).get("cuda")
  c_api = getattr(factory, "c_api", None)
  if c_api is None:
    return
  for callback in list(getattr(xla_bridge, "_plugin_callbacks", ())):
    callback(c_api=c_api)


def _data_dir() -> str | None:
  """The directory with ``bin/ptxas``: JAX's own where it found one, else the
  ``nvidia-cuda-nvcc`` package's (importable once a deviceless directory is on the path)."""
  from jax._src import lib  # pylint: disable=import-outside-toplevel
  found = getattr(lib, "cuda_path", None)
  if found and (pathlib.Path(found) / "bin" / "ptxas").exists():
    return str(found)
  for module in ("nvidia.cuda_nvcc", "nvidia.cu13"):
    try:
      m = importlib.import_module(module)
    except ImportError:
      continue
    for path in getattr(m, "__path__", []):
      if (pathlib.Path(path) / "bin" / "ptxas").exists():
        return str(path)
  return None


@functools.lru_cache(maxsize=1)
def cuda() -> Cuda:
  """Load the CUDA compiler (module doc), once per process.

  Raises:
    Unavailable: no CUDA plugin here, or it fails to load (the message says what to install).
  """
  if _registered():
    return Cuda(_data_dir(), "registered")
  modules, source = _plugin_modules(), "installed"
  if not modules:
    for d in deviceless_dirs():
      if str(d) not in sys.path:
        sys.path.append(str(d))  # (after JAX's plugin discovery, which has run)
      importlib.invalidate_caches()
      modules, source = _plugin_modules(), str(d)
      if modules:
        break
  if not modules:
    raise Unavailable(f"no CUDA compiler for a deviceless GPU compile: {install_hint('gpu')}")
  try:
    with _quiet(), _unchecked():
      importlib.import_module(modules[0]).initialize()
      _tell_jax_of_cudnn()
      _run_plugin_callbacks()
  except Exception as e:  # pylint: disable=broad-except  # a plugin of another jaxlib, ...
    raise Unavailable(f"the CUDA plugin {modules[0]} ({source}) failed to load: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                      f"{install_hint('gpu')}") from e
  if not _registered():
    raise Unavailable(f"the CUDA plugin {modules[0]} ({source}) registered no compiler; "
                      f"{install_hint('gpu')}")
  return Cuda(_data_dir(), source)
