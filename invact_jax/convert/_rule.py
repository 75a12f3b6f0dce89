"""What a recognizer is: :class:`Rule` (find matches in a graph; build the unit that replaces
one; say what the floor keeps of one) and :class:`Built` (that unit, with what the fusion pass
needs to know about it).

A rule subclass lives in its own file (``_rule_<kind>.py``) and has one entry in
:data:`invact_jax.convert._pass.RULES`, the claim order.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from invact_jax.convert import graph as _graph
from invact_jax.convert import _match

__all__ = ["Rule", "Built", "single"]


@dataclasses.dataclass(frozen=True)
class Built:
  """A match's replacement.

  Attributes:
    unit: the nodes it replaces and the function that computes its output instead.
    kept: its backward keeps its output (the floor pass lets matmuls share it).
    fusion: what the floor pass fuses with the matmuls that read the unit's output (a norm's
      :class:`._rule_norm.NormVJP`: its residuals, recompute and backward), else None.
  """
  unit: _graph.Unit
  kept: bool = False
  fusion: Any = None


class Rule:
  """One kind of op the conversion finds by its computation and replaces.

  Attributes:
    kind: the rule's name (:meth:`._pass.Found.of` groups matches by it).
    publics: the invact_jax names it converts (what ``invert(only=...)`` accepts).
    candidates: primitive -> the op a program's unclaimed one suggests (reported as left
      alone).
    with_norms: converted only where ``invert(norms=True)`` (the norms and softmaxes), not by
      the activations alone.
  """
  kind: str = ""
  publics: tuple = ()
  candidates: dict = {}
  with_norms: bool = False

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

  # -- the floor (:mod:`._floor`): what a backward must keep of a match at the least
  def floor(self, audit, match) -> None:
    """Record the floor's arrays for ``match`` on ``audit`` (the floor's walk of the graph
    ``audit.g``: ``audit.anchor(ref, role, itemsize)`` keeps a value once,
    ``audit.record(key, role, shape, dtype, nbytes, where)`` an array of the rule's own, a
    row statistic say, and ``audit.walk(ref)`` what computing ``ref`` needs).  Default: the
    match's output, once."""
    audit.anchor(self.output(audit.g, match), self.role(match), self.kept_itemsize(match))

  def role(self, match) -> str:
    """What the floor calls the value the match keeps (its output)."""
    return f"{self.public(match)} output"

  def kept_itemsize(self, match) -> int:
    """The most bytes per element the floor keeps the match's output in (default: its own
    dtype's)."""
    del match
    return 1 << 30

  def no_cotangent(self, match) -> tuple:
    """The match's inputs its output's gradient does not reach (a softmax's shift)."""
    del match
    return ()


def single(fn: Callable[..., Any]) -> Callable[..., tuple]:
  """``fn`` returning its one output as a 1-tuple (a :class:`_graph.Unit`'s convention)."""
  return lambda *vals: (fn(*vals),)
