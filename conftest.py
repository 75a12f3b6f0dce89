"""Test-session setup: 8 virtual CPU devices for the sharding tests (before JAX starts)."""
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# Python tracebacks in MLIR locations only serve error messages.  XLA's call inliner copies
# every op's stack into inlined calls, and with pytest-xdist's deep worker stacks (JAX keeps
# 100 frames by default) compiling interpret-mode Pallas kernels under custom_partitioning
# took over 15 minutes instead of 1 s (XLA:CPU, JAX 0.10.2).  16 frames keep the user's part.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "16")

# One persistent XLA compilation cache per test run, shared by the xdist workers and the
# scripts the tests start (same HLO => same executable; many tests compile the same model
# step from fresh closures).  A new directory per run, so nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                         f"invact_jax_test_xla_cache_{_run}")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
