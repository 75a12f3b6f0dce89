"""Test-session setup: 8 virtual CPU devices for the sharding tests (before JAX starts)."""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# XLA:CPU's LLVM backend at -O0: compiling is most of the suite's time, and the figures the
# tests check do not depend on it (buffer assignment, hence compiled temp bytes, and XLA's
# FLOP counts are computed on the HLO before LLVM; measured equal on the planner's model,
# whose compiles took 4.2 s instead of 7.0 s).  The last-ulp comparisons of two compilations
# compile at the default level (tests.jit).  XLA_FLAGS=--xla_backend_optimization_level=3 runs
# everything at XLA's default.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Python tracebacks in MLIR locations only serve error messages.  XLA's call inliner copies
# every op's stack into inlined calls, and with pytest-xdist's deep worker stacks (JAX keeps
# 100 frames by default) compiling interpret-mode Pallas kernels under custom_partitioning
# took over 15 minutes instead of 1 s (XLA:CPU, JAX 0.10.2).  16 frames keep the user's part.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "16")

# One persistent XLA compilation cache per test run and xdist worker, shared with the scripts
# the worker's tests start (same HLO => same executable; many tests compile the same model step
# from fresh closures).  A new directory per run, removed at the end, so nothing carries over
# between runs; one per worker, because JAX writes entries without a lock when the cache has no
# size limit.  A cache directory the user set is left alone.
_OURS = "invact_jax_test_xla_cache_"
_CACHE = None
if _OURS in os.environ.get("JAX_COMPILATION_CACHE_DIR", _OURS):
  import tempfile
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  _CACHE = os.path.join(tempfile.gettempdir(),
                        f"{_OURS}{_run}_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
  if _CACHE is not None:
    import shutil
    shutil.rmtree(_CACHE, ignore_errors=True)
