"""What a recognizer is: :class:`Rule` (find matches in a graph; build the unit that replaces
one) and :class:`Built` (that unit, with what the floor pass needs to know about it).

A rule subclass lives in its own file (``_rule_<kind>.py``) and has one entry in
:data:`invact_jax.convert._pass.RULES`, the claim order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from invact_jax.convert import _graph
from invact_jax.convert import _match

__all__ = ["Rule", "Built", "single"]


@dataclasses.dataclass(frozen=True)
class Built:
  """A match's replacement.

  Attributes:
    unit: the nodes it replaces and the function that computes its output instead.
    kept: its backward keeps its output (the floor pass lets matmuls share it).
    norm: a norm's :class:`._rule_norm.NormVJP` (the floor pass fuses the norm with the
      matmuls that read it), else None.
  """
  unit: _graph.Unit
  kept: bool = False
  norm: Any = None


class Rule:
  """One kind of op the conversion finds by its computation and replaces.

  Attributes:
    kind: how :class:`._pass.Found` and the floor audit group its matches (``"head"``,
      ``"norm"``, ``"softmax"``, ``"form"``).
    publics: the invact_jax names it converts (what ``invert(only=...)`` accepts).
    candidates: primitive -> the op a program's unclaimed one suggests (reported as left
      alone).
  """
  kind: str = ""
  publics: tuple = ()
  candidates: dict = {}

  def prepare(self, g: _graph.Graph, opts) -> _graph.Graph:
    """``g`` as the pass finds and replaces matches in (default: as it is); a rule whose op
    a program may compute inside a call it cannot otherwise see inlines the calls it matches
    through."""
    del opts
    return g

  def find(self, g: _graph.Graph, claimed: set, outvars: set, opts) -> tuple[list, list]:
    """``(matches, left)``: the matches in ``g`` outside ``claimed``, and ``(node indices,
    what, why)`` per candidate it saw and could not convert."""
    raise NotImplementedError

  def wanted(self, match, names: frozenset) -> bool:
    """Whether ``match`` is converted under ``names`` (``invert(only=...)``)."""
    return True

  def output(self, g: _graph.Graph, match):
    """The program value the match computes."""
    return g.nodes[match.root].outs[match.output_index]

  def public(self, match) -> str:
    """The invact_jax name the match becomes."""
    return match.public

  def describe(self, match) -> str:
    """What the report calls the form it was found as."""
    return match.name

  def region(self, g: _graph.Graph, match) -> Callable[..., Any]:
    """The program's own equations of the match, as a function of its inputs."""
    return _match.region_of(g, match.nodes, match.inputs, self.output(g, match))

  def recomputable(self, match) -> bool:
    """Whether ``fallback="temp"`` may run it as ``jax.checkpoint`` of its own equations."""
    return False

  def build(self, g: _graph.Graph, match, opts) -> Built:
    """The unit replacing ``match`` (``opts``: the pass's options, its implementations)."""
    raise NotImplementedError


def single(fn: Callable[..., Any]) -> Callable[..., tuple]:
  """``fn`` returning its one output as a 1-tuple (a :class:`_graph.Unit`'s convention)."""
  return lambda *vals: (fn(*vals),)
