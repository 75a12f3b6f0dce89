"""The memory-time frontier against what users run instead: a section of the GPU report.

A stack of hand-written transformer layers (:mod:`models.reference_layers`' Llama, GPT-2
and ViT-style blocks) under ``lax.scan``, each layer under a ``jax.checkpoint`` *policy*,
with and without invact_jax (``invert`` of the layer), and the same stack in PyTorch (eager,
``torch.utils.checkpoint``, Liger-Kernel, both, ``torch.compile``;
:mod:`models.benchmarks.frontier_torch`) where torch is importable.  Per row: the
activation bytes (GPU: the allocator's peak minus the parameters, inputs and gradients, one
process per row; CPU: XLA's compiled temp, or for torch the bytes its autograd saves) and
the median step time.

Full language models (a :class:`Shape` with a ``vocab``: ``llama3-1b``, ``llama3-8b``) run
from the tokens through the embedding, the layers, the final RMSNorm and the LM head to the
mean cross-entropy, float32 parameters cast to the compute dtype where they are used (as
MaxText does), grouped-query attention.  Their head is a row field: ``plain`` (the logits,
optax's loss), ``tokamax`` (tokamax's chunked cross-entropy, where it is installed) or, with
invact, ``invert``'s (the whole program converted: its head, norms and activations).  Their
rows run in :data:`LM_ORDER` (the decisive ones first) and a run continues from the rows an
earlier run of the device measured (``done``).

Policies: JAX's (``none``, ``full`` = nothing saveable, ``dots``, ``dots_no_batch``) and
MaxText's presets by ``checkpoint_name`` (the layers tag their projections as MaxText does:
``query_proj``, ``key_proj``, ``value_proj``, ``out_proj``, ``mlpwi_0``, ``mlpwi_1``,
``mlpwo``): ``minimal`` (every projection), ``save_qkv_proj``, ``save_dot_except_mlp``,
``save_out_proj``, and ``minimal_offloaded`` (the projections offloaded to ``pinned_host``)
where the device has memory kinds.

``python -m models.benchmarks.frontier SPEC_JSON`` measures one row in its own process (the
allocator's peak never resets) and prints it as the last line.

The modules: :mod:`.model_stack` (the stacks, blocks, policies, heads: :func:`build`),
:mod:`.measurement` (one row), :mod:`.planning` (the planner's rows), :mod:`.running` (every
row in order: :func:`rows`, :func:`run`), :mod:`.report` (the Pareto front, tables and
plots) and :mod:`.schema` (the spec and row types).
"""
from models.benchmarks.frontier.measurement import ALLOCATOR_FRACTION as ALLOCATOR_FRACTION
from models.benchmarks.frontier.measurement import child_row as child_row
from models.benchmarks.frontier.measurement import layers_that_fit as layers_that_fit
from models.benchmarks.frontier.measurement import measure as measure
from models.benchmarks.frontier.model_stack import FIT as FIT
from models.benchmarks.frontier.model_stack import HEADS as HEADS
from models.benchmarks.frontier.model_stack import PLAN_BUDGETS as PLAN_BUDGETS
from models.benchmarks.frontier.model_stack import POLICIES as POLICIES
from models.benchmarks.frontier.model_stack import STACKS as STACKS
from models.benchmarks.frontier.model_stack import Shape as Shape
from models.benchmarks.frontier.model_stack import build as build
from models.benchmarks.frontier.model_stack import has_memory_kinds as has_memory_kinds
from models.benchmarks.frontier.model_stack import head_tiles as head_tiles
from models.benchmarks.frontier.model_stack import tags as tags
from models.benchmarks.frontier.planning import plan_specs as plan_specs
from models.benchmarks.frontier.planning import profile_from_rows as profile_from_rows
from models.benchmarks.frontier.planning import program_plan_prediction as program_plan_prediction
from models.benchmarks.frontier.planning import program_plan_spec as program_plan_spec
from models.benchmarks.frontier.report import headline_rows as headline_rows
from models.benchmarks.frontier.report import markdown as markdown
from models.benchmarks.frontier.report import newest_per_model as newest_per_model
from models.benchmarks.frontier.report import pareto as pareto
from models.benchmarks.frontier.report import per_token_layer as per_token_layer
from models.benchmarks.frontier.report import plot as plot
from models.benchmarks.frontier.running import DRY_STACKS as DRY_STACKS
from models.benchmarks.frontier.running import GPU_STACKS as GPU_STACKS
from models.benchmarks.frontier.running import LM_ORDER as LM_ORDER
from models.benchmarks.frontier.running import earlier_rows as earlier_rows
from models.benchmarks.frontier.running import rows as rows
from models.benchmarks.frontier.running import run as run
from models.benchmarks.frontier.schema import DevicelessRow as DevicelessRow
from models.benchmarks.frontier.schema import JaxRow as JaxRow
from models.benchmarks.frontier.schema import PlanRow as PlanRow
from models.benchmarks.frontier.schema import ProgramPlanRow as ProgramPlanRow
from models.benchmarks.frontier.schema import Row as Row
from models.benchmarks.frontier.schema import Spec as Spec
from models.benchmarks.frontier.schema import TorchRow as TorchRow

__all__ = [
    "STACKS",
    "POLICIES",
    "PLAN_BUDGETS",
    "FIT",
    "HEADS",
    "JaxRow",
    "PlanRow",
    "ProgramPlanRow",
    "TorchRow",
    "Row",
    "DevicelessRow",
    "Spec",
    "LM_ORDER",
    "GPU_STACKS",
    "DRY_STACKS",
    "Shape",
    "build",
    "measure",
    "child_row",
    "rows",
    "profile_from_rows",
    "plan_specs",
    "layers_that_fit",
    "head_tiles",
    "pareto",
    "per_token_layer",
    "markdown",
    "newest_per_model",
    "earlier_rows",
    "headline_rows",
    "plot",
    "has_memory_kinds",
    "run",
    "tags",
    "program_plan_spec",
    "program_plan_prediction",
    "ALLOCATOR_FRACTION",
]
