"""Helpers shared by the tests."""
import os


def load_script(name: str):
  """``scripts/<name>.py`` as a module (the scripts are not a package)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def env_with_devices(n: int, **extra) -> dict:
  """os.environ for a subprocess that sees ``n`` virtual CPU devices (conftest.py sets 8)."""
  return {**os.environ, **extra, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(
      "--xla_force_host_platform_device_count=8", f"--xla_force_host_platform_device_count={n}")}


# The suite runs XLA:CPU's LLVM backend at -O0 (conftest.py: compile time).  A test that
# claims two compilations of the same math agree to the last ulp (interpret-mode Pallas vs the
# XLA path) compiles at XLA's default level, where that claim is made: at -O0 the kernel body
# inside interpret mode's grid loop and the top-level fusion are lowered differently (measured
# 8-13 ulp apart in float32 for silu and gelu_erf at block_rows=2), and so they are at -O2
# (gelu_tanh, 2 ulp); at XLA's default, 3, they agree.  Where the suite also swaps XLA:CPU's
# fusion emitters for the older ones (conftest.py), they are switched back on here.
DEFAULT_COMPILE = {"xla_backend_optimization_level": 3}
if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", ""):
  DEFAULT_COMPILE["xla_cpu_use_fusion_emitters"] = True


def jit(fun, **kwargs):
  """``jax.jit`` at XLA's default backend optimisation level (see ``DEFAULT_COMPILE``)."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.jit(fun, compiler_options=DEFAULT_COMPILE, **kwargs)
