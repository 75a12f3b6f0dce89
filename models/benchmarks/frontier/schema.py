"""The frontier's records as types: :class:`Spec` (a row to measure, as a child process
receives it), :class:`Row` (a measured row, as ``frontier_<device>_<date>.json`` holds it) and
:class:`DevicelessRow` (one compiled for a device without it), and
the kinds of row a language model's order lists (:class:`JaxRow`, :class:`PlanRow`,
:class:`ProgramPlanRow`, :class:`TorchRow`).  Rows stay JSON objects (a ``TypedDict`` is a
``dict``): a row carried over from an earlier run's file is the same value as one measured
now, and a field added here is the one place a reader learns what it means
(``tests/benchmarks/test_frontier.py`` checks that every row's fields are declared)."""
from __future__ import annotations

from typing import Literal, NamedTuple, TypedDict


class Spec(TypedDict, total=False):
  """A row to measure (``python -m models.benchmarks.frontier SPEC_JSON``)."""
  stack: str              #: a name of :data:`~.model_stack.STACKS`
  policy: str             #: a name of :data:`~.model_stack.POLICIES` ("plan": ``runs``)
  invact: bool            #: ``invert`` of the layer, or of the whole loss (a language model)
  dtype: str              #: the compute dtype
  repeats: int            #: timed steps (the median is the row's)
  layers: int             #: the stack's layers, where not the shape's (fitted to the device)
  batch: int              #: the batch, where not the shape's
  head: str               #: a language model's head (:data:`~.model_stack.HEADS`)
  configuration: str      #: the row's name where not its policy's (a plan's)
  runs: list              #: a plan: ``[[layers, [tags kept], [tags offloaded]], ...]``
  unrolled: bool          #: the layers unrolled, each its own parameters (not scanned)
  program_budget: int     #: ``invact_jax.plan``'s budget (a :class:`ProgramPlanRow`)
  budget_bytes: int       #: a plan's budget
  predicted_bytes: int    #: a plan's predicted activation bytes
  predicted_step_ms: float  #: a plan's predicted step
  profile: int            #: record the step's K largest XLA operations
  hlo_out: str            #: write the compiled step's optimized HLO here (gzipped text)
  trace_out: str          #: with ``profile``: copy the profiler's trace here (gzipped)
  compile_only: bool      #: compile (and plan) only: the first of two processes
                          #: (:func:`~.measurement.isolated_row`)
  error: str              #: why the row cannot be measured (it is recorded as such)
  fit: str                #: not a row: the stack whose layers (or batch) that fit to find
  field: str              #: with ``fit``: "layers" or "batch"


class Row(TypedDict, total=False):
  """A measured row (or one that failed: ``error``), as the frontier's JSON holds it."""
  model: str              #: the stack's name
  framework: Literal["jax", "torch"]
  configuration: str      #: "default" (no remat), a policy (either with " unrolled": the
                          #: layers not scanned), "plan N %", "program plan N %", or a
                          #: PyTorch configuration
  invact: bool
  head: str               #: "" (a stack without a head), "plain", "tokamax", "invact", "liger"
  dtype: str
  layers: int
  batch: int
  date: str               #: when it was measured (a carried-over row keeps its own)
  activation_bytes: int   #: device peak minus parameters, inputs and gradients; or the
                          #: compiled temp (``memory`` says which)
  memory: str             #: "device peak", "compiled temp", or torch's measure
  compiled_temp_bytes: int  #: a JAX row's compiled temp, as the device's compiler gave it
  step_ms: float          #: the median step
  pareto: bool            #: no row of the model is as fast with as few bytes
  error: str              #: why there is no measurement (out of memory, of time, ...)
  profile: list           #: the step's largest operations (``Spec.profile``; a PyTorch
                          #: row's: its kernels, :func:`~models.benchmarks.profile.torch_kernels`)
  profile_error: str      #: why the profile is missing (the row's figures stand)
  compile_cache: dict     #: ``{"hits", "misses"}`` of the persistent compilation cache (an
                          #: isolated row's process compiled nothing itself: no misses)
  head_tiles: dict        #: an invact language model's head tiles, per gradient mode
  torch: str              #: a PyTorch row's torch version
  budget_bytes: int       #: a plan's budget
  predicted_bytes: int    #: a plan's predicted activation bytes
  predicted_step_ms: float  #: a plan's predicted step
  prediction_error: float   #: measured / predicted activation bytes - 1
  runs: list              #: a plan's runs (``Spec.runs``)
  plan_program: str       #: what invact_jax.plan chose: "inverted" or "standard"
  plan_keeps: list        #: the checkpoint names it keeps
  plan_offloads: list     #: the checkpoint names it offloads
  plan_policy: str        #: the JAX policy it chose, if one
  plan_as_written: bool   #: it left the program as written
  plan_compiled_bytes: int  #: the planned program's compiled temp
  plan_step_flops: float
  plan_recompute_flops: float
  planning_s: float       #: seconds ``invact_jax.plan`` took


class DevicelessRow(Row, total=False):
  """A row compiled for a device without it (:mod:`models.benchmarks.frontier_deviceless`):
  what the device's row will measure, less the step time."""
  compiled_temp_bytes: int  #: the device compiler's temp for the step
  predicted_activation_bytes: int  #: what the device row's ``activation_bytes`` will read
  step_flops: float       #: the step's FLOPs (XLA's cost analysis)
  step_calibration_rows: int  #: device rows the step-time fit of ``predicted_step_ms`` used
  compile_s: float        #: seconds the compile took
  devices: int            #: an FSDP row's devices (its bytes are per device)
  temp_bytes: int         #: an FSDP row's compiled temp per device
  argument_bytes: int     #: an FSDP row's arguments per device (the parameters' shards)
  output_bytes: int       #: an FSDP row's outputs per device (the gradients' shards)


class JaxRow(NamedTuple):
  """A JAX row: a remat policy (:data:`POLICIES`), with or without invert(), and the head;
  ``unrolled``: the layers one after another, each with its own parameters (no ``lax.scan``:
  no residual stacked, :func:`~.model_stack.build`)."""
  policy: str
  invact: bool
  head: str
  unrolled: bool = False


class PlanRow(NamedTuple):
  """The planner's row at ``percent`` % of JAX default's activation bytes."""
  percent: int


class ProgramPlanRow(NamedTuple):
  """:func:`invact_jax.plan`'s row at ``percent`` % of JAX default's activation bytes: the
  program planner on the model's loss as written (no remat, the plain head), with
  ``convert=True`` (``invert``'s program, its head included, as an operator variant), its
  budget the compiled temp; planned and measured in the row's own process."""
  percent: int


class TorchRow(NamedTuple):
  """A PyTorch row (``frontier_torch.CONFIGURATIONS``)."""
  configuration: str


#: A kind of row in a language model's order.
RowKind = JaxRow | PlanRow | ProgramPlanRow | TorchRow
