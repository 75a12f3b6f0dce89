"""Joining JAX's multi-controller runtime: one process per host, one global mesh.

``scripts/train_vit.py --coordinator HOST:PORT --num-processes N --process-id I`` (one command
per host), or ``--distributed`` alone where JAX detects the cluster (SLURM, Open MPI, Cloud TPU,
...: ``jax.distributed.initialize()`` with no arguments).  Call :func:`initialize` before
anything else touches JAX's devices.  On CPU the processes talk through gloo.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time

import jax

from models.training.supervisor import SERVICE_GONE, lost_message
from models.training.errors import ConfigError, first_line

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
  # The heartbeat bounds how long the others wait for a process that died (the watchdog
  # below turns that into one line before XLA aborts).
  heartbeat_s = max(int(timeout_s), 10)
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=int(timeout_s),
                               heartbeat_timeout_seconds=heartbeat_s)
  except Exception as e:  # pylint: disable=broad-except  # XLA raises runtime errors of many kinds
    where = f"coordinator {coordinator}" if coordinator else "the detected cluster"
    raise ConfigError(f"could not join {where} within {timeout_s} s as process {process_id} of "
                      f"{num_processes} ({first_line(e)}); check --coordinator, --num-processes "
                      "and that every process was started") from None
  if num_processes is not None and jax.process_count() != num_processes:
    raise ConfigError(f"--num-processes {num_processes}: the coordinator at {coordinator} runs "
                      f"{jax.process_count()} processes; give every process the same value")
  _Watchdog.start(stale_s=heartbeat_s / 2)
  return True


_AGREED: dict[str, int] = {}  # topic -> calls of agree() so far in this process


def agree(options: dict, timeout_s: float = 60.0, topic: str = "options",
          how: str = "were started differently",
          advice: str = "start every process with the same options and data") -> None:
  """Every process of the run holds the same ``options`` (the run's options and its data's
  fingerprint; or, under another ``topic``, what each process derived from them, such as its
  memory plan): compared through the coordination service before the first step.

  Each process publishes its options; process 0 compares them all and publishes the verdict.
  On a difference process 0 raises ConfigError (``the processes {how}: ...``) naming the
  first option that differs, the processes and ``advice``; the others print the same line
  and exit 2, and nothing trains.
  A topic may be compared again (each call of it in order has keys of its own)."""
  client = _client()
  if client is None or jax.process_count() == 1:
    return
  # every process calls agree() in the same order: the n-th call of a topic has keys of its own
  _AGREED[topic] = _AGREED.get(topic, -1) + 1
  prefix = f"invact_jax/{topic}/{_AGREED[topic]}"
  me = jax.process_index()
  text = json.dumps(options, sort_keys=True, default=str)
  client.key_value_set(f"{prefix}/{me}", text, allow_overwrite=True)
  wait_ms = int(timeout_s * 1000)
  if me != 0:
    verdict = client.blocking_key_value_get(f"{prefix}/verdict", wait_ms)
    if verdict == "ok":
      return
    # Process 0 says it (fail()); this one acknowledges and leaves first: process 0 hosts the
    # coordination service, and a process still running when it leaves is aborted by XLA.
    _say_and_exit(f"error: process 0: {verdict}", 2, then=lambda: client.key_value_set(
        f"{_Watchdog.PREFIX}/ack/{me}", "1", allow_overwrite=True))
  mine, verdict = json.loads(text), "ok"
  for p in range(1, jax.process_count()):
    try:
      theirs = json.loads(client.blocking_key_value_get(f"{prefix}/{p}", wait_ms))
    except Exception as e:  # pylint: disable=broad-except  # the service's timeout or loss
      verdict = (f"process {p} did not publish its {topic} within {timeout_s:.0f} s "
                 f"({first_line(e)})")
      break
    differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if differ:
      k = differ[0]
      more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
      verdict = (f"the processes {how}: {k} is "
                 f"{mine.get(k, '(absent)')!r} in process 0 and {theirs.get(k, '(absent)')!r} "
                 f"in process {p}{more}; {advice}")
      break
  client.key_value_set(f"{prefix}/verdict", verdict, allow_overwrite=True)
  if verdict != "ok":
    raise ConfigError(verdict)


def fail(message: str, code: int) -> int:
  """Print ``error: <message>``; in a multi-process run also tell the other processes (their
  watchdogs stop with the same line and code) and exit at once: a normal exit would wait in
  JAX's shutdown barrier for processes that wait for this one, until XLA aborts it.  Returns
  ``code`` when there are no others."""
  client = _client()
  if client is not None:
    _leave_first()
  sys.stderr.write(f"error: {message}\n")
  sys.stderr.flush()
  if client is None:
    return code
  try:
    client.key_value_set(f"{_Watchdog.PREFIX}/error/{jax.process_index()}", f"{code} {message}",
                         allow_overwrite=True)
    # Stay until the others' watchdogs have read it (or 3 s): exiting first could make their
    # XLA clients abort, and process 0 exiting first would abort this one.
    deadline = time.monotonic() + 3.0
    while (len(client.key_value_dir_get(f"{_Watchdog.PREFIX}/ack/")) < jax.process_count() - 1
           and time.monotonic() < deadline):
      time.sleep(0.05)
  except Exception:  # pylint: disable=broad-except  # the service may be gone already
    pass
  os._exit(code)  # pylint: disable=protected-access


def _client():
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  return jax_distributed.global_state.client


def finished() -> None:
  """Tell the other processes this one ends normally (its silence is not a failure)."""
  _Watchdog.finish()


class _Watchdog:
  """Each process bumps a counter in the coordination service's key-value store every
  ``poll_s`` and watches the others'.  A counter that stops moving for ``stale_s`` (half of
  XLA's heartbeat timeout, so this fires first), or a service that stops answering, ends the
  process with one line and exit code 1.  Without it the others wait in a collective until
  XLA's heartbeat check aborts them (exit 134, a C++ stack dump); XLA's client has a
  missed-heartbeat callback, but a Python callable cannot receive its status (std::bad_cast).
  A thread, not the training loop, bumps the counter: a process that compiles or checkpoints
  for a long time is alive."""
  PREFIX = "invact_jax/watchdog"
  POLL_S = 0.5
  _instance = None

  def __init__(self, stale_s: float, poll_s: float):
    self.client = _client()
    self.me, self.n = jax.process_index(), jax.process_count()
    self.stale_s, self.poll_s = stale_s, poll_s
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="invact_jax-watchdog", daemon=True)

  @classmethod
  def start(cls, stale_s: float, poll_s: float = POLL_S) -> None:
    if cls._instance is None and jax.process_count() > 1:
      cls._instance = cls(stale_s, poll_s)
      cls._instance.thread.start()
      atexit.register(cls._instance.stop.set)  # before JAX's own shutdown (atexit is LIFO)

  @classmethod
  def finish(cls) -> None:
    w = cls._instance
    if w is not None and not w.stop.is_set():
      w.stop.set()
      w.thread.join()
      w.client.key_value_set(f"{cls.PREFIX}/done/{w.me}", "1", allow_overwrite=True)

  def _run(self) -> None:
    """The watchdog's loop: bump this process's heartbeat, relay another process's one-line
    error, and end the run when a process stops answering or the coordination service goes."""
    seen = {p: (None, time.monotonic()) for p in range(self.n) if p != self.me}
    beat = 0
    while not self.stop.wait(self.poll_s):
      try:
        beat += 1
        self.client.key_value_set(f"{self.PREFIX}/alive/{self.me}", str(beat),
                                  allow_overwrite=True)
        alive = {k.rsplit("/", 1)[-1]: v
                 for k, v in self.client.key_value_dir_get(f"{self.PREFIX}/alive/")}
        done = {k.rsplit("/", 1)[-1] for k, _ in
                self.client.key_value_dir_get(f"{self.PREFIX}/done/")}
        errors = [(k, v) for k, v in self.client.key_value_dir_get(f"{self.PREFIX}/error/")
                  if k.rsplit("/", 1)[-1] != str(self.me)]  # its own: fail() said it already
      except Exception:  # pylint: disable=broad-except  # XLA raises runtime errors
        if self.stop.is_set():
          return
        lost(SERVICE_GONE)
      for key, value in errors:  # another process failed with a one-line error: same line
        code, message = value.split(" ", 1)
        _say_and_exit(f"error: process {key.rsplit('/', 1)[-1]}: {message}", int(code),
                      then=lambda: self.client.key_value_set(
                          f"{self.PREFIX}/ack/{self.me}", "1", allow_overwrite=True),
                      linger_s=1.0)  # let the failing process leave first (it waits for acks)
      now = time.monotonic()
      for p, (value, since) in seen.items():
        if str(p) in done:
          continue
        if alive.get(str(p)) != value:
          seen[p] = (alive.get(str(p)), now)
        elif now - since > self.stale_s:
          lost(f"process {p} stopped answering for {self.stale_s:g} s")


def collective_failed(error: Exception) -> None:
  """A collective raised (its peer went away): one line, exit 1.  Gloo's error names only a
  socket, so ask the coordination service first: if it is gone too, process 0 is what went
  away, and the line says so as the watchdog and the supervisor would."""
  try:
    _client().key_value_dir_get(f"{_Watchdog.PREFIX}/alive/")
  except Exception:  # pylint: disable=broad-except  # XLA raises runtime errors
    lost(SERVICE_GONE)
  lost(first_line(error))


def lost(reason: str) -> None:
  """This process lost the others (a collective failed, or the watchdog saw it): one line, exit
  1 at once — a normal exit would wait in JAX's shutdown barrier and print XLA's errors."""
  _say_and_exit(lost_message(reason), 1)


# Held by the first thread that leaves: one line per process, whichever thread notices first.
_LEAVING = threading.Lock()


def _leave_first() -> None:
  """Return to the first thread that leaves this process; block any other until the exit."""
  if not _LEAVING.acquire(blocking=False):
    threading.Event().wait()  # another thread said its line and exits


def _say_and_exit(line: str, code: int, linger_s: float = 0.0, then=None) -> None:
  """One line on stderr, then ``then()`` (an acknowledgement to the process that failed, which
  may then take the coordination service down), then exit at once (from any thread: the main
  one may be stuck in a collective, and a normal exit would wait in JAX's shutdown barrier).
  A second thread that would leave meanwhile (the watchdog seeing the service go once the
  acknowledgement let process 0 exit) waits for the first one's exit instead of saying more."""
  _leave_first()
  sys.stderr.write(line + "\n")
  sys.stderr.flush()
  if then is not None:
    try:
      then()
    except Exception:  # pylint: disable=broad-except  # the service may be gone already
      pass
  time.sleep(linger_s)
  os._exit(code)  # pylint: disable=protected-access


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
