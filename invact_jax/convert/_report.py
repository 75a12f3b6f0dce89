"""What a conversion did — ``invert``'s or ``inverted()``'s: :class:`ConversionReport`."""
from __future__ import annotations

import collections
import dataclasses

__all__ = ["ConversionReport", "FELL_BACK"]

#: Why ``fallback="temp"`` changed a site.
FELL_BACK = ("inverting it raised the gradient's compiled temp above the unconverted "
             "program's (fallback='temp')")


@dataclasses.dataclass
class ConversionReport:
  """What one conversion did: ``invert(fn).last_report``, or what ``with inverted() as report``
  yields.

  Attributes:
    converted: ``(public name, form, where)`` per converted op: ``invert``'s ``form`` is the
      form it was recognized as and ``where`` the source line of the equation that produced its
      output; ``inverted()``'s ``form`` is the attribute it swapped (``"jax.nn.gelu"``,
      ``"flax.linen.LayerNorm"``) and ``where`` empty (one entry per call).
    left_alone: ``(what, where, why)`` per candidate that was not converted.
    recomputed: ``(public name, where, why)`` per activation that ``fallback="temp"`` runs as
      ``jax.checkpoint`` of its own equations instead of inverting it: it keeps its input and
      recomputes its derivative in the backward.
    patched: ``inverted()``: the attributes it swapped while the block ran.
  """
  converted: list = dataclasses.field(default_factory=list)
  left_alone: list = dataclasses.field(default_factory=list)
  recomputed: list = dataclasses.field(default_factory=list)
  patched: list = dataclasses.field(default_factory=list)

  @property
  def replaced(self) -> dict[str, int]:
    """Converted ops by invact_jax function name (``{"gelu": 12, "layer_norm": 25}``)."""
    return dict(collections.Counter(p for p, _, _ in self.converted))

  @property
  def forms(self) -> dict[str, int]:
    """Converted ops by the form they were recognized as (``inverted()``: the attribute)."""
    return dict(collections.Counter(f for _, f, _ in self.converted))

  def __str__(self) -> str:
    if not self.converted and self.patched:
      return ("invact_jax.inverted: no activation call was replaced (activations captured "
              "before the block, imported by name, or traced by jax.jit outside it?)")
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
