"""What one ``invert`` conversion did: :class:`ProgramReport`."""
from __future__ import annotations

import collections
import dataclasses

__all__ = ["ProgramReport", "FELL_BACK"]

#: Why ``fallback="temp"`` changed a site.
FELL_BACK = ("inverting it raised the gradient's compiled temp above the unconverted "
             "program's (fallback='temp')")


@dataclasses.dataclass
class ProgramReport:
  """What one ``invert`` conversion did.

  Attributes:
    converted: ``(public name, form, where)`` per converted op, ``where`` the source line of
      the equation that produced its output.
    left_alone: ``(what, where, why)`` per candidate that was not converted.
    recomputed: ``(public name, where, why)`` per activation that ``fallback="temp"`` runs as
      ``jax.checkpoint`` of its own equations instead of inverting it: it keeps its input and
      recomputes its derivative in the backward.
  """
  converted: list = dataclasses.field(default_factory=list)
  left_alone: list = dataclasses.field(default_factory=list)
  recomputed: list = dataclasses.field(default_factory=list)

  @property
  def replaced(self) -> dict[str, int]:
    """Converted ops by invact_jax function name (``{"gelu": 12, "layer_norm": 25}``)."""
    return dict(collections.Counter(p for p, _, _ in self.converted))

  @property
  def forms(self) -> dict[str, int]:
    """Converted ops by the form they were recognized as."""
    return dict(collections.Counter(f for _, f, _ in self.converted))

  def __str__(self) -> str:
    if not self.converted:
      text = "invact_jax.invert: nothing was converted"
    else:
      text = "invact_jax.invert converted: " + ", ".join(
          f"{k} x{v}" for k, v in sorted(self.replaced.items()))
    for title, entries in (("recomputed from its input", self.recomputed),
                           ("left alone", self.left_alone)):
      if entries:
        groups = collections.Counter((w, y) for w, _, y in entries)
        text += f"; {title}: " + "; ".join(f"{w} x{n} ({y})" for (w, y), n in groups.items())
    return text
