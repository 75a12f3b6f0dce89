"""Joining JAX's multi-controller runtime: one process per host, one global mesh.

``scripts/train_vit.py --coordinator HOST:PORT --num-processes N --process-id I`` (one command
per host), or ``--distributed`` alone where JAX detects the cluster (SLURM, Open MPI, Cloud TPU,
...: ``jax.distributed.initialize()`` with no arguments).  Call :func:`initialize` before
anything else touches JAX's devices.  On CPU the processes talk through gloo.
"""
from __future__ import annotations

import re
import socket
import time

import jax

from models.experiments.training import ConfigError

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def check(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
  """ConfigError (naming the option) unless the three options form a valid launch."""
  given = [coordinator is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise ConfigError("--coordinator, --num-processes and --process-id go together (or use "
                      "--distributed where JAX detects the cluster)")
  if coordinator is None:
    return
  m = _ADDRESS.match(coordinator)
  if not m or not 0 < int(m.group(2)) < 65536:
    raise ConfigError(f"--coordinator must be HOST:PORT (port 1-65535), got {coordinator!r}")
  if num_processes < 1:
    raise ConfigError(f"--num-processes must be at least 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process-id must be in [0, {num_processes - 1}], got {process_id}")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               timeout_s: int = 120) -> bool:
  """Join the run's processes (``timeout_s`` to find all of them); False if single-process.

  Raises ConfigError with one line when the coordinator cannot be reached, or the processes
  do not all arrive in time (e.g. a mismatched --num-processes).
  """
  check(coordinator, num_processes, process_id)
  if coordinator is None and not auto:
    return False
  if coordinator is not None:
    _preflight(coordinator, process_id, timeout_s)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
  try:
    # The heartbeat bounds how long the others wait for a process that died (they then
    # abort; JAX's client offers no Python-level error for it).
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=int(timeout_s),
                               heartbeat_timeout_seconds=max(int(timeout_s), 10))
  except Exception as e:  # pylint: disable=broad-except  # XLA raises runtime errors of many kinds
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    where = f"coordinator {coordinator}" if coordinator else "the detected cluster"
    raise ConfigError(f"could not join {where} within {timeout_s} s as process {process_id} of "
                      f"{num_processes} ({first}); check --coordinator, --num-processes and that "
                      "every process was started") from None
  if num_processes is not None and jax.process_count() != num_processes:
    raise ConfigError(f"--num-processes {num_processes}: the coordinator at {coordinator} runs "
                      f"{jax.process_count()} processes; give every process the same value")
  return True


def _preflight(coordinator: str, process_id: int, timeout_s: float) -> None:
  """Fail with one line before JAX does: XLA's client aborts the process (no Python
  exception) when it cannot register with the coordinator."""
  m = _ADDRESS.match(coordinator)
  host, port = m.group(1).strip("[]"), int(m.group(2))
  if process_id == 0:  # the coordination service will listen here
    try:
      with socket.create_server(("", port)):
        pass
    except OSError as e:
      raise ConfigError(f"--coordinator {coordinator}: process 0 cannot listen on port {port} "
                        f"({e.strerror or e})") from None
    return
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=2):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConfigError(f"--coordinator {coordinator}: nothing answered within {timeout_s:g} s "
                          f"({e.strerror or e}); start process 0 first and check the address"
                          ) from None
      time.sleep(0.5)
