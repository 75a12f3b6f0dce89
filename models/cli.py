"""Command-line options generated from a config dataclass, so that a flag's name, type,
default, help and allowed values are written once, on the field.

A field becomes ``--field-name`` when its metadata has ``help`` (see :func:`option`);
``bool`` fields are switches, ``X | None`` fields take an X.  :func:`check` enforces the
same ``choices`` and ``check`` on the dataclass itself (so a config built in code is held
to the same rules), and :func:`from_args` builds the config back from the parsed namespace.

Why not tyro: a bad value must be one line naming the option with exit code 2; argparse
does that once its usage block is left out (:class:`ArgumentParser`, which every script
uses), tyro prints a multi-line panel.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import types
import typing
from typing import Any, Callable, NoReturn, Sequence

__all__ = ["ArgumentParser", "nearest_existing", "parser", "option", "flag", "add_arguments",
           "from_args", "check",
           "positive_int", "nonnegative_int", "positive_float", "output_file", "output_prefix",
           "comma_list",
           "stop_on_signals", "say_on_stop", "finish", "one_line", "first_line",
           "one_line_warnings"]


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser whose errors are one line, ``PROG: error: MESSAGE``, exit code 2
  (argparse prints its usage block above the message; ``--help`` still shows it)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def parser(doc: str | None) -> ArgumentParser:
  """A script's parser, described by the first line of its docstring.

  Args:
    doc: the script's ``__doc__``.

  Returns:
    An :class:`ArgumentParser` whose errors are one line.
  """
  return ArgumentParser(description=(doc or "").split("\n")[0])


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,  # pylint: disable=redefined-builtin
           check: Callable[[Any], str | None] | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None
           ) -> Any:
  """A dataclass field that is also a command-line option.

  Args:
    default: the field's default.
    help: the option's help text.
    choices: the values allowed (checked by argparse and by :func:`check`).
    check: ``value -> None`` when valid, else the reason (e.g. "must be positive").
    parse: the argparse ``type`` (default: the field's annotated type).
    metavar: argparse's metavar.

  Returns:
    A ``dataclasses.field`` carrying the option's metadata.
  """
  return dataclasses.field(default=default, metadata={
      "help": help, "choices": None if choices is None else tuple(choices), "check": check,
      "parse": parse, "metavar": metavar})


def flag(name: str) -> str:
  """``--field-name`` for field ``field_name``."""
  return "--" + name.replace("_", "-")


def _scalar_type(annotation) -> tuple[type, bool]:
  """(the type X, whether None is allowed) of an annotation ``X`` or ``X | None``."""
  args = typing.get_args(annotation)
  if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
    (inner,) = [a for a in args if a is not type(None)]
    return inner, True
  return annotation, False


@functools.lru_cache(maxsize=None)
def _cli_fields(cls) -> tuple[tuple[dataclasses.Field, type, bool], ...]:
  """``(field, X, None allowed)`` per option field (resolved once per class)."""
  hints = typing.get_type_hints(cls)
  return tuple((f, *_scalar_type(hints[f.name])) for f in dataclasses.fields(cls)
               if "help" in f.metadata)


def add_arguments(parser: argparse.ArgumentParser | Any, cls) -> None:
  """Add one option per :func:`option` field of ``cls`` to ``parser`` (or an argument group).

  Args:
    parser: an ``argparse.ArgumentParser`` or argument group.
    cls: the config dataclass.
  """
  for f, kind, _ in _cli_fields(cls):
    names = [flag(f.name)]
    meta = f.metadata
    help_text = meta["help"] + ("" if f.default is None or kind is bool
                                else f" (default: {f.default})")
    if kind is bool:
      parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                          default=f.default, help=meta["help"])
      continue
    parser.add_argument(*names, dest=f.name, type=meta["parse"] or kind, default=f.default,
                        choices=meta["choices"], metavar=meta["metavar"], help=help_text)


def from_args(cls, args: argparse.Namespace, **overrides):
  """``cls`` built from the parsed options of its fields (and ``overrides``)."""
  values = {f.name: getattr(args, f.name) for f, _, _ in _cli_fields(cls) if hasattr(args, f.name)}
  return cls(**{**values, **overrides})


def check(config, error: type[Exception] = ValueError) -> None:
  """Raise ``error`` naming the option for a value outside its ``choices`` or failing its
  ``check`` (call from ``__post_init__``)."""
  for f, kind, optional in _cli_fields(type(config)):
    value, meta = getattr(config, f.name), f.metadata
    if value is None and optional:
      continue
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                 or (kind is int and not isinstance(value, int))):
      raise error(f"{flag(f.name)} must be {'an integer' if kind is int else 'a number'}, "
                  f"got {value!r}")
    if meta["choices"] is not None and value not in meta["choices"]:
      raise error(f"{flag(f.name)} must be one of {meta['choices']}, got {value!r}")
    why = meta["check"](value) if meta["check"] is not None else None
    if why:
      raise error(f"{flag(f.name)} {why}, got {value!r}")


def _int_at_least(text: str, least: int) -> int:
  """``text`` as an integer of at least ``least`` (an argparse error naming the value otherwise)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
  if value < least:
    raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
  return value


def positive_int(text: str) -> int:
  """An argparse ``type``: an integer >= 1 (argparse's one-line error and exit 2 otherwise)."""
  return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
  """An argparse ``type``: an integer >= 0."""
  return _int_at_least(text, 0)


def positive_float(text: str) -> float:
  """An argparse ``type``: a finite number > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return value


def output_file(text: str) -> pathlib.Path:
  """An argparse ``type``: a file path the script can write (its directory exists and is
  writable, it is not a directory, an existing file is writable) — checked before any work,
  so that nothing is measured and then lost."""
  path = pathlib.Path(text)
  folder = path.parent if str(path.parent) else pathlib.Path(".")
  if path.is_dir():
    raise argparse.ArgumentTypeError(f"{text!r} is a directory")
  if not folder.is_dir():
    raise argparse.ArgumentTypeError(f"the directory {str(folder)!r} does not exist")
  if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
    raise argparse.ArgumentTypeError(f"{text!r} is not writable")
  return path


def nearest_existing(path: pathlib.Path) -> pathlib.Path:
  """``path``, or its nearest parent that exists (what a directory made there would be made in).

  Args:
    path: a path that may not exist yet.

  Returns:
    The first of ``path`` and its parents that exists (the root at the latest).
  """
  while not path.exists() and path != path.parent:
    path = path.parent
  return path


def output_prefix(text: str) -> pathlib.Path:
  """An argparse ``type``: the prefix of files a script writes (``PREFIX.json``, ``.md``, ...)
  in a directory it creates if need be: the prefix is no directory and the nearest existing
  directory above it is writable — checked before any work."""
  path = pathlib.Path(text)
  if path.is_dir():
    raise argparse.ArgumentTypeError(f"{text!r} is a directory (a prefix such as "
                                     f"{str(path / 'results')!r} is wanted)")
  folder = nearest_existing(path.parent if str(path.parent) else pathlib.Path("."))
  if not folder.is_dir():
    raise argparse.ArgumentTypeError(f"{str(folder)!r} is not a directory")
  if not os.access(folder, os.W_OK | os.X_OK):
    raise argparse.ArgumentTypeError(f"{str(folder)!r} is not writable")
  return path


def comma_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
  """An argparse ``type``: a comma-separated list of some of ``choices``.

  Args:
    choices: the allowed items.

  Returns:
    text -> the items, in order; an ``ArgumentTypeError`` naming the choices otherwise.
  """
  def parse(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in choices]
    if bad or not items:
      raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), "
                                       f"got {text!r}")
    return items
  return parse


# ------------------------------------------------------------------------------- signals
_SAYS = {"after": ""}


def stop_on_signals(after_the_name: str = "") -> None:
  """From now on SIGINT and SIGTERM end the script at once, in one line (``error: stopped by
  SIGINT`` and ``after_the_name``) with exit code 128 + the signal's number.  A script calls
  this first thing when run as a script (not imported), so that a signal while it imports JAX
  or loads its data is one line too; a job that must stop gracefully (the training loop,
  :func:`models.training.errors.stop_on_signals`) takes the signals over while it runs and
  puts this back after.  Called again, only the words change.

  The handler exits rather than raising: a signal lands anywhere, and an exception raised in a
  garbage collector's callback or a ``__del__`` is ignored (the job would go on)."""
  import signal  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  _SAYS["after"] = after_the_name

  def handler(signum, frame):
    del frame
    sys.stderr.write(f"error: stopped by {signal.Signals(signum).name}{_SAYS['after']}\n")
    sys.stderr.flush()
    os._exit(128 + signum)  # pylint: disable=protected-access
  for sig in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(sig) is not handler:
      signal.signal(sig, handler)


def say_on_stop(after_the_name: str) -> None:
  """Change the words :func:`stop_on_signals`'s handler ends the script with (nothing where it
  was not installed: a job run from Python, not as a script)."""
  _SAYS["after"] = after_the_name


# ------------------------------------------------------------------------------- the end
def finish(main: Callable[[], int]) -> NoReturn:
  """End a script: run its ``main`` and exit with the code it returns.  What the user's input
  or machine causes is one line on stderr, ``error: …``, never a traceback: a storage failure
  met at any moment of the job (an ``OSError``: a full disk, a read-only or vanished
  directory, a file this user may not write — ``FILE: why``), exit 2; an error whose class
  declares an ``exit_code`` (bad options or data, 2; a diverged run, 1; a signal's stop,
  128 + its number: :mod:`models.training.errors`), that code.  Anything else is a bug: its
  traceback.  A failed script leaves without the libraries' shutdown noise (orbax's writer
  threads and their coroutines, collected at exit, would print tracebacks after the line): it
  flushes and ends at once.  Warnings are one line each (``warning: …``).  Every script in
  ``scripts/`` ends through this.

  Args:
    main: the script's job; returns its exit code.
  """
  import sys  # pylint: disable=import-outside-toplevel
  one_line_warnings()
  try:
    code = main()
  except Exception as e:  # pylint: disable=broad-except  # one line, or the traceback of a bug
    code = getattr(e, "exit_code", 2 if isinstance(e, OSError) else None)
    if not isinstance(code, int):
      raise
    sys.stderr.write(f"error: {one_line(e)}\n")
  if code:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first line of an exception's message (its type's name if empty), for one-line errors."""
  text = str(error).strip()
  return text.splitlines()[0][:limit] if text else type(error).__name__


def one_line(error: BaseException) -> str:
  """An error as the one line a script prints: an ``OSError`` raised by the system (no message
  of its own) as ``FILE: why``, anything else as the first line of its message."""
  if isinstance(error, OSError) and error.strerror and len(error.args) <= 2:
    return f"{error.filename}: {error.strerror}" if error.filename is not None else error.strerror
  return first_line(error, limit=2000)


def one_line_warnings() -> None:
  """From now on a warning prints as one line, ``warning: MESSAGE`` (no source line)."""
  import warnings  # pylint: disable=import-outside-toplevel
  warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
