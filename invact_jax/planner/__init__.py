"""The memory planner: :func:`plan` chooses, on any JAX program, per tensor of the program's
layer loop, what the backward keeps, recomputes or offloads, under a byte budget.

The pipeline, for ``plan(fn, *example_args, budget=...)``:

1. Trace ``fn`` and find its layer loop: a ``lax.scan`` over stacked inputs (parameters),
   through nested ``jit`` calls and inside ``shard_map``s (profiled from one device's shapes
   and re-made where it stands; not where its layer names the mesh's axes: a collective, or
   a custom derivative traced with them, traces only with the mesh); of several, the one
   whose tensors weigh most (the report names the others).
2. The candidate tensors of one layer: the values the program names with
   ``checkpoint_name`` (MaxText, keras-hub, the project's models), and otherwise the outputs of
   its matmuls, convolutions and custom-derivative calls (``invert``'s converted sites),
   named ``matmul_0``, ``matmul_1``, ... in program order, each with its source line; and the
   matmuls' operands the layer computes elementwise (a norm's output, the probabilities:
   ``matmul_3_lhs``); a custom-derivative call's residuals that its forward computes go by
   the call's name (a flash attention's output and row log-sum-exp: without both kept,
   ``jax.checkpoint`` re-runs its forward), named inside the call
   (:mod:`invact_jax._vjp_residuals`).  Other elementwise values are always recomputed from
   them.  A ``jax.checkpoint`` the layer already has is replaced by the plan's.
3. Their costs from the program: bytes exactly from shape and dtype (per layer); the recompute
   FLOPs each saves counted on one layer's traced linearization (which holds the recompute a
   policy asks for) with XLA's cost-analysis conventions (:func:`invact_jax.memory.jaxpr_flops`:
   no lowering, no compile); the peak of keeping nothing compiled once (the minimum, and the
   base of the run-phase model).
4. :func:`invact_jax.planner.solve` (MONeT's integer program) chooses one set for every layer;
   where it keeps every tensor worth keeping, the program as written is compiled first (no
   recompute at all, if it fits); else the planned program is compiled: where XLA's temp is
   off its prediction by more than 5 % the bytes a kept tensor adds per layer are recalibrated
   (least squares over every plan compiled: XLA:CPU keeps 16-bit values as float32, say) and
   the plan solved again, and where it is above the budget the target is lowered by the
   excess.
5. The solved plan is one choice among the program's others, costed the same way
   (:func:`_cheapest`): JAX's none / full / dots / dots_no_batch, MaxText's presets whose
   names the layer has (:data:`MAXTEXT_PRESETS`), every set compiled on the way that fits,
   and a plan by runs of layers where one is predicted to pay (:func:`_per_run`).  A choice's
   recompute is its traced gradient step's FLOPs less the step without remat's (XLA's count
   of the compiled step); the least whose compiled temp fits is taken, so the plan never
   recomputes more than a fixed policy that fits.  So a plan costs two compiles where the
   model holds, plus the tracing.
6. The returned function is ``fn`` with the layer body under ``jax.checkpoint`` with the names
   policy of the plan (``planner.policy``: offloaded tensors go to ``pinned_host``), or the
   fixed policy taken, or one scan per run of layers.

With ``convert=True`` the same runs on ``invert(fn)`` too, from the program whose step does
the fewest FLOPs recomputing nothing up; a program that cannot beat a plan already made is
not planned, and the plan whose step does fewer FLOPs is taken.

The modules, in the pipeline's order: :mod:`~invact_jax.planner.layer_loop` (steps 1-2, and
one layer under a policy), :mod:`~invact_jax.planner.cost_model` (3),
:mod:`~invact_jax.planner.integer_program` (4: :func:`solve` on a :class:`LayerProfile`),
:mod:`~invact_jax.planner.choose` (4-5), :mod:`~invact_jax.planner.apply` (6) and
:mod:`~invact_jax.planner.api` (:func:`plan`, its report).
"""
from invact_jax.planner.api import Planned as Planned
from invact_jax.planner.api import PlanReport as PlanReport
from invact_jax.planner.api import parse_budget as parse_budget
from invact_jax.planner.api import plan as plan
from invact_jax.planner.apply import apply_plan as apply_plan
from invact_jax.planner.integer_program import MAX_RUNS as MAX_RUNS
from invact_jax.planner.integer_program import MIN_RUN as MIN_RUN
from invact_jax.planner.integer_program import InfeasibleBudget as InfeasibleBudget
from invact_jax.planner.integer_program import LayerProfile as LayerProfile
from invact_jax.planner.integer_program import Plan as Plan
from invact_jax.planner.integer_program import evaluate as evaluate
from invact_jax.planner.integer_program import policy as policy
from invact_jax.planner.integer_program import solve as solve
from invact_jax.planner.layer_loop import FIXED_POLICIES as FIXED_POLICIES
from invact_jax.planner.layer_loop import MAXTEXT_PRESETS as MAXTEXT_PRESETS
from invact_jax.planner.layer_loop import Tensor as Tensor

__all__ = ["plan", "apply_plan", "Planned", "PlanReport", "Tensor", "parse_budget",
           "FIXED_POLICIES",
           "MAXTEXT_PRESETS", "LayerProfile", "Plan", "InfeasibleBudget", "solve", "evaluate",
           "policy", "MIN_RUN", "MAX_RUNS"]
