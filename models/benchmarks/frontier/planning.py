"""The planner's rows of the frontier: layer profiles calibrated on the device's own
rows (:func:`profile_from_rows`), the plans' specs, and the program planner's rows."""
from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp

from invact_jax import planner
from models.benchmarks.frontier import model_stack
from models.benchmarks.frontier.schema import Row, Spec


# Which measured policies give which tags' figures: (policy with the group kept, policy
# without it) -- the group's tags are those the first keeps and the second does not.
_GROUPS = (("save_qkv_proj", "full"), ("save_out_proj", "full"),
           ("minimal", "save_dot_except_mlp"))


PLAN_POLICIES = ("full", "save_qkv_proj", "save_out_proj", "save_dot_except_mlp", "minimal")


def layer_widths(s: model_stack.Shape) -> dict[str, tuple[int, int]]:
  """Per tag, (elements per token of the tensor, multiply-adds per token of its matmul)."""
  w = {"query_proj": s.d, "key_proj": s.kv_width, "value_proj": s.kv_width, "out_proj": s.d,
       "mlpwi_0": s.ff, "mlpwi_1": s.ff, "mlpwi": s.ff, "mlpwo": s.d}
  fan_in = {t: (s.ff if t == "mlpwo" else s.d) for t in w}
  return {t: (w[t], w[t] * fan_in[t]) for t in model_stack.tags(s)}


def plan_side(rs: list[Row], stack: str, invact: bool) -> dict[str, Row]:
  """configuration -> measured JAX row of one side (the plain head or invert's)."""
  return {r["configuration"]: r for r in rs
          if r.get("model") == stack and r.get("framework") == "jax"
          and r.get("invact") == invact and "error" not in r
          and r.get("head", "") in ("", "plain", "invact")}


def profile_from_rows(rs: list[Row], stack: str, invact: bool,
                      from_shapes: bool = False) -> planner.LayerProfile | None:
  """The planner's :class:`~invact_jax.planner.LayerProfile` of one stack and one side
  (with or without invact), calibrated on the device by the frontier's own measured rows:

  * ``base_bytes``: the activation bytes of ``full`` (every layer recomputed);
  * per group of tags (q/k/v: ``save_qkv_proj`` − ``full``; the output projection:
    ``save_out_proj`` − ``full``; the MLP's: ``minimal`` − ``save_dot_except_mlp``), the
    activation bytes per layer it adds and the step milliseconds per layer keeping it saves,
    shared among the group's tags in proportion to their tensors' sizes (bytes) and their
    matmuls' multiply-adds (time);
  * ``full_cost``: ``full``'s step minus ``minimal``'s, per layer (at least the gains' sum);
  * where ``minimal_offloaded`` was measured (a device with host memory), ``tag_offload_cost``:
    its step minus ``minimal``'s per layer (the transfers of every projection not hidden
    behind compute), shared among the projections in proportion to their tensors' sizes.

  Costs are milliseconds, so the planner minimizes the predicted step time.  With
  ``from_shapes`` (or where the presets' rows are missing: a language model's early rows),
  :func:`_profile_from_shapes`.  None when a row it needs is missing or failed."""
  by = plan_side(rs, stack, invact)
  if from_shapes or any(p not in by for p in PLAN_POLICIES):
    return _profile_from_shapes(by, stack, invact)
  layers = by["full"].get("layers") or model_stack.STACKS[stack].layers
  s = dataclasses.replace(model_stack.STACKS[stack], layers=layers)
  widths = layer_widths(s)
  nbytes = dict.fromkeys(widths, 0.0)
  gain = dict.fromkeys(widths, 0.0)
  for with_, without in _GROUPS:
    group = [t for t in widths if t in model_stack.SAVED[with_] and t not in model_stack.SAVED[without]]
    b = max(by[with_]["activation_bytes"] - by[without]["activation_bytes"], 0) / layers
    ms = max(by[without]["step_ms"] - by[with_]["step_ms"], 0.0) / layers
    for t in group:
      nbytes[t] = b * widths[t][0] / sum(widths[u][0] for u in group)
      gain[t] = ms * widths[t][1] / sum(widths[u][1] for u in group)
  full_cost = max((by["full"]["step_ms"] - by["minimal"]["step_ms"]) / layers, sum(gain.values()))
  moved = ()
  if "minimal_offloaded" in by:
    ms = max(by["minimal_offloaded"]["step_ms"] - by["minimal"]["step_ms"], 0.0) / layers
    size = sum(widths[t][0] for t in widths)
    moved = tuple(float(ms * widths[t][0] / size) for t in widths)
  return planner.LayerProfile(
      configuration="inverted" if invact else "standard", depth=layers,
      base_bytes=int(by["full"]["activation_bytes"]), tags=tuple(widths),
      tag_bytes=tuple(int(round(nbytes[t])) for t in widths),
      tag_gain=tuple(float(gain[t]) for t in widths), full_cost=float(full_cost),
      tag_offload_cost=moved)


def _profile_from_shapes(by: dict[str, Row], stack: str, invact: bool) -> planner.LayerProfile | None:
  """A profile from three rows of one side, ``full``, ``dots_no_batch`` (every projection
  kept) and, where measured, ``minimal_offloaded``: each tag's bytes exactly from its shape
  ([tokens, width] in the row's dtype, per layer); the recompute time per layer
  (``full`` − ``dots_no_batch``) shared among the tags by their matmuls' multiply-adds; the
  offload time per layer (``minimal_offloaded`` − ``dots_no_batch``) by their sizes; the step
  with every tag kept (``dots_no_batch``) as the fixed cost, so that the two sides compete on
  their whole step.  None when ``full`` or ``dots_no_batch`` is missing."""
  if "full" not in by or "dots_no_batch" not in by:
    return None
  full, keep = by["full"], by["dots_no_batch"]
  layers = full.get("layers") or model_stack.STACKS[stack].layers
  s = dataclasses.replace(model_stack.STACKS[stack], layers=layers, batch=full.get("batch") or
                          model_stack.STACKS[stack].batch)
  widths = layer_widths(s)
  itemsize = jnp.dtype(full.get("dtype", "bfloat16")).itemsize
  recompute = max(full["step_ms"] - keep["step_ms"], 0.0) / layers
  macs = sum(m for _, m in widths.values())
  moved = ()
  if "minimal_offloaded" in by:
    ms = max(by["minimal_offloaded"]["step_ms"] - keep["step_ms"], 0.0) / layers
    size = sum(e for e, _ in widths.values())
    moved = tuple(float(ms * e / size) for e, _ in widths.values())
  return planner.LayerProfile(
      configuration="inverted" if invact else "standard", depth=layers,
      base_bytes=int(full["activation_bytes"]), tags=tuple(widths),
      tag_bytes=tuple(s.tokens * e * itemsize for e, _ in widths.values()),
      tag_gain=tuple(float(recompute * m / macs) for _, m in widths.values()),
      full_cost=float(recompute), fixed_cost=float(keep["step_ms"]), tag_offload_cost=moved)


def plan_specs(rs: list[Row], stack: str, *, dtype: str, repeats: int,
               budgets=model_stack.PLAN_BUDGETS) -> list[Spec]:
  """Per budget (a fraction of JAX default's activation bytes), the planner's plan over both
  sides (:func:`profile_from_rows`) as a row spec (``runs``, ``configuration`` "plan N %",
  ``predicted_bytes``), or an ``error`` row when no plan fits or the rows are missing."""
  default = jax_row(rs, stack, "default", False)
  # both sides calibrated the same way: from the presets' rows where both have them
  shapes = any(p not in plan_side(rs, stack, i) for p in PLAN_POLICIES for i in (False, True))
  profiles = [p for p in (profile_from_rows(rs, stack, i, shapes) for i in (False, True)) if p]
  out = []
  for frac in budgets:
    name = f"plan {100 * frac:.0f} %"
    spec = {"stack": stack, "policy": "plan", "invact": True, "dtype": dtype,
            "repeats": repeats, "configuration": name}
    if default is None or not profiles:
      out.append({**spec, "error": "the rows the planner is calibrated on are missing"})
      continue
    budget = int(frac * default["activation_bytes"])
    try:
      plan = planner.solve(profiles, budget, uniform=False)
    except planner.InfeasibleBudget as e:
      out.append({**spec, "budget_bytes": budget, "error": str(e)})
      continue
    offload = plan.offload or ((),) * len(plan.keep)
    runs = [[len(list(g)), list(k)] + ([list(o)] if o else [])
            for (k, o), g in itertools.groupby(zip(plan.keep, offload))]
    invact = plan.configuration == "inverted"
    profile = next(p for p in profiles if p.configuration == plan.configuration)
    # the step with the plan's recompute: its cost on top of every tag kept (``minimal``), or
    # the whole step where the profile's fixed cost is that step (_profile_from_shapes)
    minimal = jax_row(rs, stack, "minimal", invact)
    base = 0.0 if profile.fixed_cost else minimal["step_ms"]
    out.append({**spec, "invact": invact, "runs": runs,
                "layers": default.get("layers") or model_stack.STACKS[stack].layers,
                "batch": default.get("batch") or model_stack.STACKS[stack].batch,
                "budget_bytes": budget, "predicted_bytes": plan.predicted_bytes,
                "predicted_step_ms": base + plan.predicted_cost})
  return out


def jax_row(rs: list[Row], stack: str, configuration: str, invact: bool) -> Row | None:
  """The measured JAX row of ``stack`` under ``configuration``, with invert or without."""
  return next((r for r in rs if r.get("model") == stack and r.get("framework") == "jax"
               and r.get("configuration") == configuration and bool(r.get("invact")) == invact
               and "error" not in r), None)


def program_plan_spec(rs: list[Row], stack: str, percent: int, *, dtype: str, repeats: int,
                      fields: dict) -> Spec:
  """The row spec of :class:`ProgramPlanRow` ``percent``: its budget (``budget_bytes``) that
  fraction of the measured JAX default's activation bytes, or an ``error`` where that row is
  missing.  The planner plans compiled temp (``program_budget``): the budget less what the
  device's peak holds beyond a step's compiled temp, as JAX default's row measured it
  (``activation_bytes - compiled_temp_bytes``; 127.5 MiB on the H200 of 2026-11-29, every
  row alike; nothing where the row recorded no compiled temp, or on a CPU)."""
  spec = {"stack": stack, "policy": "none", "invact": True, "dtype": dtype, "repeats": repeats,
          "configuration": f"program plan {percent} %", **fields}
  default = jax_row(rs, stack, "default", False)
  if default is None:
    return {**spec, "error": "JAX default's row, the budget's reference, is missing"}
  budget = int(percent / 100 * default["activation_bytes"])
  beyond = max(default["activation_bytes"] - default.get("compiled_temp_bytes",
                                                         default["activation_bytes"]), 0)
  return {**spec, "program_budget": budget - beyond, "budget_bytes": budget}


def program_plan_prediction(row: Row, rs: list[Row]) -> Row:
  """A measured :class:`ProgramPlanRow`'s predictions beside its measurement:
  ``prediction_error`` (activation bytes against the plan's predicted compiled temp) and,
  where the chosen program's default row was measured, ``predicted_step_ms``: that row's step
  scaled by the planned step's FLOPs over its FLOPs without recompute (the recompute run at
  the step's own FLOP rate)."""
  out = {}
  if "error" in row or not row.get("predicted_bytes"):
    return out
  out["prediction_error"] = row["activation_bytes"] / row["predicted_bytes"] - 1
  base = jax_row(rs, row["model"], "default", row.get("plan_program") == "inverted")
  flops, recompute = row.get("plan_step_flops"), row.get("plan_recompute_flops", 0.0)
  if base is not None and flops and flops > recompute:
    out["predicted_step_ms"] = base["step_ms"] * flops / (flops - recompute)
  return out


def with_predictions(rs: list[Row]) -> list[Row]:
  """``rs`` with every measured :class:`ProgramPlanRow`'s predictions
  (:func:`program_plan_prediction`) taken against all of ``rs``: a plan measured before the
  default row of the program it chose gets its predicted step once that row is there."""
  for r in rs:
    if str(r.get("configuration", "")).startswith("program plan") and "error" not in r:
      r.update(program_plan_prediction(r, rs))
  return rs
