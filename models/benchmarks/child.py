"""Benchmark rows measured in child processes: ``python -m <module> SPEC_JSON`` prints one
JSON row as its last line (:func:`child_main`), the parent collects it (:func:`run_child`),
and a row that could not be measured says why (:func:`error_row`).

Each row runs in a process of its own so that one configuration's compiled programs, device
memory or crash cannot touch the next row's figures.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Callable

__all__ = ["error_row", "child_main", "run_child"]


def error_row(e: BaseException, **fields) -> dict:
  """A row saying why it was not measured: ``fields`` and ``"error"``, the exception's type
  and first line (out of memory, an unsupported configuration, ...).

  Args:
    e: the exception.
    **fields: the row's identifying fields.

  Returns:
    ``{**fields, "error": "Type: first line"}``.
  """
  text = str(e).strip().splitlines()
  return {**fields, "error": f"{type(e).__name__}: {text[0][:200] if text else ''}"}


def child_main(measure: Callable[[dict], dict],
               key: Callable[[dict], dict] = lambda spec: {}) -> None:
  """The ``__main__`` of a module :func:`run_child` runs: ``measure`` the JSON spec in
  ``sys.argv[1]`` and print its row as the last line, or :func:`error_row` with ``key(spec)``.

  Args:
    measure: spec -> row.
    key: spec -> the fields an error row keeps.
  """
  spec = json.loads(sys.argv[1])
  try:
    row = measure(spec)
  except Exception as e:  # pylint: disable=broad-except  # out of memory, no compiler, ...
    row = error_row(e, **key(spec))
  print(json.dumps(row))


def run_child(module: str, spec: dict, timeout_s: float, env=None) -> dict:
  """Run ``python -m module SPEC_JSON`` and return the JSON row it prints last.

  Args:
    module: the module to run (its ``__main__`` prints one JSON object as its last line).
    spec: the row's specification, passed as the only argument, JSON-encoded.
    timeout_s: seconds before the child is killed (``math.inf``: no limit).
    env: the child's environment (``None``: this process's).

  Returns:
    The child's row, or ``{"error": ...}`` naming a timeout or the child's last stderr line.
  """
  cmd = [sys.executable, "-m", module, json.dumps(spec)]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                         timeout=None if math.isinf(timeout_s) else max(timeout_s, 1.0))
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout_s:.0f} s"}
  lines = out.stdout.strip().splitlines()
  try:
    return json.loads(lines[-1])
  except (IndexError, ValueError):
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
