"""Converting unmodified code to the inverted ops.

* :func:`invert` (a program transformation, the recommended entry point): traces the function
  and converts every activation, norm and softmax found by its computation, whatever object
  the code called.
* :func:`inverted` (a context manager, the attribute swap): swaps ``jax.nn``/Flax attributes
  while a block runs; it catches only code that looks the functions up at call time.
"""
from invact_jax.convert._attributes import ConversionReport, inverted, replaceable  # noqa: F401
from invact_jax.convert._program import ProgramReport, invert  # noqa: F401

__all__ = ["inverted", "invert", "ConversionReport", "ProgramReport"]
