"""Converting unmodified code to the inverted ops: ``inverted()`` (attributes) and ``invert``."""
import functools
from typing import Any, Callable

from invact_jax.convert._attributes import ConversionReport, inverted, replaceable  # noqa: F401

__all__ = ["inverted", "invert", "ConversionReport"]


def invert(fn: Callable[..., Any], *, only=None, warn: bool = True,
           norms: bool = True) -> Callable[..., Any]:
  """Function transform: call ``fn`` with the inverted activations (see :func:`inverted`).

  Apply it before ``jax.jit`` so that tracing happens inside: ``jax.jit(invert(loss))``.
  The last call's report is ``wrapped.last_report``.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with inverted(only, warn=warn, norms=norms) as report:
      out = fn(*args, **kwargs)
    wrapped.last_report = report
    return out
  wrapped.last_report = None
  return wrapped
