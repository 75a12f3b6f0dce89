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
