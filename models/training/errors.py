"""What ends a training run early, and how it is said: the exceptions the entry point turns
into one line and an exit code, the signal handling that stops at a step boundary, and the
library logs held back meanwhile."""
from __future__ import annotations

import contextlib
import os
import sys

from models.cli import first_line  # noqa: F401  (re-exported: training.first_line)


class TrainingDiverged(RuntimeError):
  """The loss or the parameters became non-finite; the run stopped before checkpointing them."""
  exit_code = 1  #: a script that meets it ends with this code (:func:`models.cli.finish`)


class ConfigError(ValueError):
  """A training option is invalid for the data or the machine (message names it)."""
  exit_code = 2  #: a script that meets it ends with this code (:func:`models.cli.finish`)


class DataError(ValueError):
  """A dataset is missing, unreadable or malformed (message names the problem)."""
  exit_code = 2  #: a script that meets it ends with this code (:func:`models.cli.finish`)


class RunDirectoryLost(OSError):
  """The run directory (its ``config.json``) vanished while training: nothing more is written
  there, so that no checkpoint, log or summary appears in a directory that no longer says which
  run it holds (message names the directory)."""

  def __init__(self, workdir, what: str):
    super().__init__(f"the run directory {workdir} was removed while training (its config.json "
                     f"is gone, found before {what}); nothing more was written: restore it and "
                     "continue with --resume, or start the run again")


class StopRequested(BaseException):
  """SIGINT or SIGTERM arrived (raised by the training loop between two steps, after
  :func:`stop_on_signals`'s handler noted it; a BaseException, so that no ``except Exception``
  swallows it)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


class Interrupted(RuntimeError):
  """Training stopped on a signal after the checkpoint saves in flight completed.

  Attributes:
    code: the exit code (128 + the signal's number: 130 for SIGINT, 143 for SIGTERM).
  """

  def __init__(self, signum: int, step: int, workdir, resumable: bool = True):
    import signal  # pylint: disable=import-outside-toplevel
    name = signal.Signals(signum).name
    if resumable:
      text = (f"stopped by {name} after step {step}; the checkpoints written are intact: "
              f"continue with the same command and --resume --workdir {workdir}")
    else:
      text = (f"stopped by {name} after step {step}, before the first checkpoint: nothing was "
              f"saved to resume; run the same command again (without --resume) to start over")
    super().__init__(text)
    self.signum, self.step, self.workdir, self.resumable = signum, step, workdir, resumable
    self.code = self.exit_code = 128 + signum

  def resumable_in(self, workdir) -> "Interrupted":
    """The same stop, said as resumable with ``--resume --workdir WORKDIR`` (a comparison's
    run stopped before its first checkpoint while the other run holds checkpoints)."""
    return Interrupted(self.signum, self.step, workdir, resumable=True)


_STOP: dict = {"signum": None}  # the signal stop_on_signals noted, if any


def raise_if_stop_requested() -> None:
  """Raise :class:`StopRequested` if :func:`stop_on_signals` noted a signal (the training loop
  calls this at each step boundary)."""
  if _STOP["signum"] is not None:
    raise StopRequested(_STOP["signum"])


def clear_stop() -> None:
  """Forget the noted signal (once the stop it asked for is under way)."""
  _STOP["signum"] = None


@contextlib.contextmanager
def stop_on_signals():
  """While the block runs, SIGINT and SIGTERM are noted (not raised where they land: inside a
  library's code an exception could be swallowed or leave a save half done); the training
  loop stops at its next step boundary (:class:`StopRequested`).  The previous handlers are
  put back after the block."""
  import signal  # pylint: disable=import-outside-toplevel

  def handler(signum, frame):
    del frame
    _STOP["signum"] = _STOP["signum"] or signum
  _STOP["signum"] = None
  old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
    if _STOP["signum"] is not None:  # arrived after the last step (or before the first)
      raise StopRequested(_STOP["signum"])
  finally:
    for s, h in old.items():
      signal.signal(s, h)


# Library logs held back while training (asyncio's "Task exception was never retrieved",
# orbax's background threads' tracebacks, exceptions of coroutines collected at shutdown):
# one line says what failed.  INVACT_JAX_LIBRARY_LOGS=1 lets them through.
LIBRARY_LOGS_ENV = "INVACT_JAX_LIBRARY_LOGS"


@contextlib.contextmanager
def quiet_libraries():
  """Hold back the logs of the libraries training runs (asyncio, absl/orbax) and the tracebacks
  of their background threads and collected coroutines, unless INVACT_JAX_LIBRARY_LOGS=1."""
  if os.environ.get(LIBRARY_LOGS_ENV) == "1":
    yield
    return
  import logging  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  loggers = [logging.getLogger(n) for n in ("asyncio", "absl", "orbax", "tensorstore")]
  levels = [lg.level for lg in loggers]
  hooks = (sys.unraisablehook, threading.excepthook)
  main_thread = threading.main_thread()

  def thread_hook(args):
    if args.thread is main_thread:
      hooks[1](args)
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  sys.unraisablehook, threading.excepthook = (lambda _: None), thread_hook
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)
    sys.unraisablehook, threading.excepthook = hooks
