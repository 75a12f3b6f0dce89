"""Converting unmodified code to the inverted ops.

* :func:`invert` (a program transformation, the recommended entry point): traces the function
  and converts every activation, norm, softmax and LM head found by its computation, whatever
  object the code called.
* :func:`inverted` (a context manager, the attribute swap): swaps ``jax.nn``/Flax attributes
  while a block runs; it catches only code that looks the functions up at call time.

The pipeline of :func:`invert`, one file per stage:

1. trace ``fn`` and flatten the jaxpr to a graph (``graph.py``, public: the planner reads
   programs with it too);
2. the rule table (``_pass.RULES``, in claim order): each :class:`._rule.Rule` may first
   prepare the graph (the LM head inlines a ``custom_jvp``/``custom_vjp`` call its
   cross-entropy is computed through, ``_graph.inline``), then finds its
   matches outside what earlier rules claimed and builds the ``custom_vjp`` unit of each —
   the LM head (``_rule_head.py`` over ``_head_find.py``: its loss followed by
   ``_head_follow.py`` with a rule per primitive, ``_head_rules.py``; the reduction folded in,
   ``_head_fold.py``), norms (``_rule_norm.py``) and softmaxes (``_rule_softmax.py``) by
   their algebra (``_algebra.py``; the values followed by ``_algebra_follow.py`` with a rule
   per primitive, ``_algebra_rules.py``), activations and softmax calls as traced forms
   (``_rule_forms.py`` over ``_forms.py`` and the matcher ``_match.py``);
3. the floor pass (``_fusion.py``): matmuls keep what their neighbours keep;
4. evaluate the graph with the units swapped in, nested bodies through the same pass
   (``_pass.py``); ``fallback="temp"`` measures and changes sites (``_fallback.py``); the
   report (``_report.py``).

A new recognizer is one rule (a ``Rule`` subclass in its own ``_rule_<kind>.py``), one entry
in ``_pass.RULES`` and its own test file (docs/conversion.md has a worked example).  The
primitive-name sets every stage reads are in ``_primitives.py``.

:func:`floor_audit` (``_floor.py``) holds a program's kept arrays against its floor, found by
the same rules: each match as its rule's :meth:`~._rule.Rule.floor` accounts for it.
"""
from invact_jax.convert._attributes import inverted as inverted
from invact_jax.convert._attributes import linen_norm_call as linen_norm_call
from invact_jax.convert._attributes import nnx_norm_call as nnx_norm_call
from invact_jax.convert._attributes import replaceable as replaceable
from invact_jax.convert._floor import FORWARD_GRADIENT as FORWARD_GRADIENT
from invact_jax.convert._floor import FloorAudit as FloorAudit
from invact_jax.convert._floor import floor_audit as floor_audit
from invact_jax.convert._pass import forget_measurements as forget_measurements
from invact_jax.convert._program import invert as invert
from invact_jax.convert._program import inverted_for_plan as inverted_for_plan
from invact_jax.convert._report import ConversionReport as ConversionReport

__all__ = ["inverted", "invert", "ConversionReport", "floor_audit", "FloorAudit",
           "FORWARD_GRADIENT"]
