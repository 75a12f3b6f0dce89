"""The supervisor of one process of a multi-process run (standard library only, so that it
starts at once and holds no JAX state): it runs the worker -- the same command -- as its child
and turns XLA's aborts into one line and an exit code (see :func:`supervise`).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

WORKER_ENV = "INVACT_JAX_WORKER"  # set in the supervised child
# Whichever notices first -- XLA's error poll (an abort, reported here) or the watchdog's next
# key-value access (distributed.py) -- the line is the same.
SERVICE_GONE = "the coordination service (process 0) went away"
# absl log lines of XLA's C++ code ("F1123 06:47:53.861659  4045 client.h:80] ..."); after a
# fatal ("F") one, everything (gRPC details, the stack dump) belongs to the abort.
_NATIVE = re.compile(rb"^[FEW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
# The lines a native log line continues on: gRPC's details, and (XLA of JAX 0.12) a status's
# source locations ("=== Source Location Trace: ===", "external/xla+/xla/util.h:302") with
# the rest of its message after them (". This is only expected if ...").
_GRPC_MORE = re.compile(rb"^(?:Additional GRPC error information|:[A-Z]+:|RPC: |\s*$"
                        rb"|=== Source Location Trace: ===\s*$|\S+\.(?:h|cc|c|cpp):\d+\s*$|\. )")


#: ``--distributed-timeout``'s default (models/training/main.py's parser says the same).
DEFAULT_TIMEOUT_S = 120


def early(argv: list[str]) -> int | None:
  """A multi-process run's supervisor, before the training job is imported: where ``argv``
  (``sys.argv``: the script, then its arguments) asks for one process of several
  (``--coordinator``, ``--distributed``) and this is not the supervised worker, run the same
  command as the worker under :func:`supervise` and return its exit code; else None (then the
  job runs here).  Arguments these three options do not settle (``--help``, a value that is
  no number) are left to the job's own parser: None."""
  import argparse  # pylint: disable=import-outside-toplevel
  if os.environ.get(WORKER_ENV) or any(a in ("-h", "--help") for a in argv[1:]):
    return None
  class Quiet(argparse.ArgumentParser):
    def error(self, message):  # the job's parser says it, in one line
      raise ValueError(message)

  p = Quiet(add_help=False)
  p.add_argument("--coordinator")
  p.add_argument("--distributed", action="store_true")
  p.add_argument("--distributed-timeout", type=int, default=DEFAULT_TIMEOUT_S)
  try:
    args, _ = p.parse_known_args(argv[1:])
  except ValueError:
    return None
  if (args.coordinator is None and not args.distributed) or args.distributed_timeout <= 0:
    return None
  return supervise([sys.executable, *argv], coordinator=args.coordinator,
                   timeout_s=args.distributed_timeout)


def supervise(argv: list[str], *, coordinator: str | None, timeout_s: int) -> int:
  """Run ``argv`` (this script, one process of a multi-process run) as a child and turn the way
  XLA ends a process whose peers or coordinator vanish -- abort() with a C++ stack dump, exit
  134, from a thread Python cannot intercept -- into one line and exit code: 2 when the
  processes never all joined (e.g. process 0 waits for more processes than were started), 1 when
  a running peer or the coordinator (process 0) went away.  The child's own output passes
  through unchanged; XLA's native log lines are held back and only summarized.  The child dies
  with its supervisor (:func:`as_worker`), so killing this process kills the worker."""
  child = subprocess.Popen(argv, env={**os.environ, WORKER_ENV: str(os.getpid())},
                           stderr=subprocess.PIPE)
  previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s))
              for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _relay(child, coordinator, timeout_s, argv)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def as_worker() -> bool:
  """In a child of :func:`supervise`: die with the supervisor (Linux PR_SET_PDEATHSIG, set here
  rather than between fork and exec, which is unsafe in a threaded parent); True if this is
  such a child."""
  parent = os.environ.get(WORKER_ENV)
  if not parent:
    return False
  if sys.platform == "linux":
    import ctypes  # pylint: disable=import-outside-toplevel
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the supervisor died before the line above
      os._exit(1)  # pylint: disable=protected-access
  return True


def _relay(child, coordinator, timeout_s, argv) -> int:
  """Relay the worker's stderr, holding back XLA's native logs; the exit code and, where the
  worker could not say why it ended (XLA aborted, a signal killed it), the one line."""
  native: list[bytes] = []  # held back: shown as they were if the child ends normally
  fatal = in_native = said_error = False
  pending = b""
  out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None

  def emit(data: bytes) -> None:
    if out is not None:
      out.write(data)
      out.flush()
    else:  # e.g. pytest's capture
      sys.stderr.write(data.decode(errors="replace"))
      sys.stderr.flush()
  while True:
    chunk = os.read(child.stderr.fileno(), 65536)
    if not chunk:
      break
    pending += chunk
    *lines, pending = pending.split(b"\n")
    for line in lines:
      if line.startswith(b"error: "):  # the worker's own one line (its watchdog can race
        emit(line + b"\n")             # XLA's fatal log: it may come after it)
        said_error, in_native = True, False
      elif fatal or _NATIVE.match(line) or (in_native and _GRPC_MORE.match(line)):
        native.append(line)
        fatal = fatal or line.startswith(b"F")
        in_native = True
      else:
        emit(line + b"\n")
        in_native = False
    if pending and not fatal and not re.match(rb"^[FEW]\d", pending):
      emit(pending)  # a progress bar's partial line: show it now
      pending = b""
  if pending:
    emit(pending)
  code = child.wait()
  code = code if code >= 0 else 128 - code  # killed by signal s: 128 + s, as a shell says
  aborted = code == 128 + signal.SIGABRT
  if said_error:  # the worker's own line says what happened
    return 1 if aborted else code
  if not aborted and not fatal:
    if native:  # nothing went wrong that these explain: show them as they were
      emit(b"\n".join(native) + b"\n")
    if code > 128 and code - 128 not in (signal.SIGINT, signal.SIGTERM):
      # Killed from outside (SIGKILL: e.g. the kernel's out-of-memory killer) or crashed
      # (SIGSEGV): it could say nothing itself.  A signal this supervisor forwarded (Ctrl-C,
      # SIGTERM) is the user's own stop.
      sys.stderr.write(f"error: the worker process was killed by {_signal_name(code - 128)}"
                       f"{' (e.g. out of memory)' if code - 128 == signal.SIGKILL else ''}; "
                       f"{next_command(argv)}\n")
      sys.stderr.flush()
    return code
  text = b"\n".join(native).decode(errors="replace")
  if "RegisterTask" in text:
    sys.stderr.write(f"error: could not join coordinator {coordinator} within {timeout_s} s (XLA "
                     "gave up registering this process); check --coordinator, --num-processes "
                     "and that every process was started\n")
    sys.stderr.flush()
    return 2
  status = re.search(r"absl::Status: (\w+)", text)
  reason = (SERVICE_GONE if status and status.group(1) in ("UNAVAILABLE", "CANCELLED", "ABORTED")
            else f"XLA aborted: {status.group(1) if status else 'no status'}")
  sys.stderr.write(lost_message(reason, argv) + "\n")
  sys.stderr.flush()
  return 1


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def lost_message(reason: str, argv: list[str] | None = None) -> str:
  """The one-line error of a process that lost the others (watchdog, or a failed collective),
  with what to run next (:func:`next_command`)."""
  return f"error: lost the other processes ({reason}); {next_command(argv)}"


def _workdir(argv: list[str]) -> str | None:
  """The ``--workdir`` of a command line, or None."""
  for i, a in enumerate(argv):
    if a == "--workdir" and i + 1 < len(argv):
      return argv[i + 1]
    if a.startswith("--workdir="):
      return a.split("=", 1)[1]
  return None


def next_command(argv: list[str] | None = None) -> str:
  """What to run once every process is back: the same command with ``--resume`` where a run
  under its ``--workdir`` (``argv``: default this process's) holds a checkpoint, else the
  same command again (nothing was saved to resume)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  workdir = _workdir(sys.argv if argv is None else argv)
  if workdir is not None and any(p.name.isdigit()
                                 for p in pathlib.Path(workdir).glob("*/checkpoints/*")):
    return "once all are back, continue with the same command and --resume"
  return ("no checkpoint was written yet: once all are back, run the same command again "
          "(without --resume)")
