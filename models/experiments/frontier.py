"""The memory-time frontier against what users run instead (issue 42): a section of the GPU
report.

A stack of hand-written transformer layers (:mod:`models.experiments.floor`'s Llama, GPT-2
and ViT-style blocks) under ``lax.scan``, each layer under a ``jax.checkpoint`` *policy*,
with and without invact_jax (``invert`` of the layer), and the same stack in PyTorch (eager,
``torch.utils.checkpoint``, Liger-Kernel, both, ``torch.compile``;
:mod:`models.experiments.frontier_torch`) where torch is importable.  Per row: the
activation bytes (GPU: the allocator's peak minus the parameters, inputs and gradients, one
process per row; CPU: XLA's compiled temp, or for torch the bytes its autograd saves) and
the median step time.

Policies: JAX's (``none``, ``full`` = nothing saveable, ``dots``, ``dots_no_batch``) and
MaxText's presets by ``checkpoint_name`` (the layers tag their projections as MaxText does:
``query_proj``, ``key_proj``, ``value_proj``, ``out_proj``, ``mlpwi_0``, ``mlpwi_1``,
``mlpwo``): ``minimal`` (every projection), ``save_qkv_proj``, ``save_dot_except_mlp``,
``save_out_proj``, and ``minimal_offloaded`` (the projections offloaded to ``pinned_host``)
where the device has memory kinds.

``python -m models.experiments.frontier SPEC_JSON`` measures one row in its own process (the
allocator's peak never resets) and prints it as the last line.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import invact_jax
from invact_jax import memory, planner
from models.experiments import cli
from models.experiments import floor

__all__ = ["STACKS", "POLICIES", "PLAN_BUDGETS", "FIT", "Shape", "build", "measure", "child",
           "rows", "profile_from_rows", "plan_specs", "layers_that_fit", "pareto",
           "per_token_layer", "markdown", "newest_per_model",
           "headline_rows", "plot"]


@dataclasses.dataclass(frozen=True)
class Shape:
  """A stack's shape: ``kind`` (``llama``, ``gpt2``, ``vit``), width, heads, MLP width,
  layers, sequence, batch."""
  kind: str
  d: int
  heads: int
  ff: int
  layers: int
  seq: int
  batch: int

  @property
  def tokens(self) -> int:
    return self.seq * self.batch


#: Issue 42's stacks; "dry" ones run on a CPU in seconds (the test suite's).
STACKS = {
    "llama-7b": Shape("llama", 4096, 32, 11008, 4, 4096, 1),
    "llama": Shape("llama", 1024, 16, 2816, 12, 1024, 24),
    "gpt2-medium": Shape("gpt2", 1024, 16, 4096, 24, 1024, 8),
    "vit-l16": Shape("vit", 1024, 16, 4096, 24, 197, 64),
    "dry-llama": Shape("llama", 64, 4, 176, 2, 16, 2),
    "dry-gpt2": Shape("gpt2", 64, 4, 256, 2, 16, 2),
}

#: Stacks sized on a GPU to as many layers as fit (the JAX default step, see
#: :func:`layers_that_fit`); elsewhere they keep their ``layers``.
FIT = ("llama-7b",)

#: The planner's budgets, as fractions of JAX default's activation bytes of the stack.
PLAN_BUDGETS = (0.25, 0.5, 0.75)

_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "mlpwi_0",
                "mlpwi_1", "mlpwi", "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
#: MaxText's presets (and ``full``): the ``checkpoint_name`` s each saves.
_SAVED = {"full": (), "minimal": _PROJECTIONS, "save_qkv_proj": _QKV,
          "save_dot_except_mlp": (*_QKV, "out_proj"), "save_out_proj": ("out_proj",)}


def _offloaded():
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(_PROJECTIONS),
      offload_src="device", offload_dst="pinned_host")


#: policy name -> a ``jax.checkpoint`` policy (None: no remat), or a factory (offload).
POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **{name: jax.checkpoint_policies.save_only_these_names(*saved)
       for name, saved in _SAVED.items() if saved},
    "minimal_offloaded": _offloaded,
}


def has_memory_kinds() -> bool:
  """Whether the device can offload to ``pinned_host`` (a GPU; not XLA:CPU)."""
  try:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  except Exception:  # pylint: disable=broad-except
    return False
  return jax.default_backend() != "cpu" and "pinned_host" in kinds


# ------------------------------------------------------------------------ the layers
def _attention(q, k, v, causal: bool):
  """cuDNN's flash attention on a GPU in 16 bits; elsewhere the flash-style custom_vjp of
  :mod:`models.experiments.floor` (the same residuals: q, k, v, o, a row log-sum-exp)."""
  if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return floor.flash_attention(q, k, v, causal)


def _block(s: Shape):
  """``layer(p, x)`` of kind ``s.kind`` with MaxText's checkpoint names."""
  dh = s.d // s.heads

  def attention(p, h, causal, rotary):
    b, t, _ = h.shape
    split = lambda y: y.reshape(b, t, s.heads, dh)  # noqa: E731
    q = split(checkpoint_name(h @ p["wq"], "query_proj"))
    k = split(checkpoint_name(h @ p["wk"], "key_proj"))
    v = split(checkpoint_name(h @ p["wv"], "value_proj"))
    if rotary:
      q, k = floor.rope(q), floor.rope(k)
    o = _attention(q, k, v, causal).reshape(b, t, s.d)
    return checkpoint_name(o @ p["wo"], "out_proj")

  def llama(p, x):
    x = x + attention(p, floor.rms_norm(x, p["n1"]), True, True)
    h = floor.rms_norm(x, p["n2"])
    g = checkpoint_name(h @ p["wg"], "mlpwi_0")
    u = checkpoint_name(h @ p["wu"], "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(g) * u) @ p["wd"], "mlpwo")

  def gpt2(p, x, causal=True):
    x = x + attention(p, floor.layer_norm(x, p["g1"], p["b1"]), causal, False)
    h = floor.layer_norm(x, p["g2"], p["b2"])
    a = jax.nn.gelu(checkpoint_name(h @ p["w1"], "mlpwi") + p["c1"], approximate=True)
    return x + checkpoint_name(a @ p["w2"], "mlpwo") + p["c2"]

  if s.kind == "llama":
    return llama
  return gpt2 if s.kind == "gpt2" else (lambda p, x: gpt2(p, x, causal=False))


def tags(s: Shape) -> tuple[str, ...]:
  """The ``checkpoint_name`` s a layer of ``s`` tags (MaxText's)."""
  if s.kind == "llama":
    return ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
  return ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo")


def build(s: Shape, policy: str, invact: bool, dtype,
          runs: list | None = None) -> tuple[Callable, tuple]:
  """``(loss(params, x), (params, x))``: the stack under ``lax.scan``, each layer under
  ``jax.checkpoint(policy)``, invact_jax's ``invert`` of the layer inside it.  ``runs``
  (a plan; ``policy`` is then ignored): ``[[layers, [tags kept], [tags offloaded]], ...]``
  in forward order (the third entry optional), each run a ``lax.scan`` of its own over its
  slice of the parameters, its layers under ``save_only_these_names(*kept)`` or, where it
  offloads, ``save_and_offload_only_these_names`` to ``pinned_host``."""
  kind = "llama" if s.kind == "llama" else "gpt2"
  keys = jax.random.split(jax.random.key(0), s.layers)
  layers = [floor.init_layer(kind, s.d, s.ff, dtype, k) for k in keys]
  params = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  x = (jax.random.normal(jax.random.key(1), (s.batch, s.seq, s.d), jnp.float32)).astype(dtype)
  block = _block(s)
  if invact:
    block = invact_jax.invert(block)

  def remat(pol, none: bool = False):
    if callable(pol) and pol is _offloaded:
      pol = pol()
    return block if none else jax.checkpoint(block, policy=pol, prevent_cse=False)
  if runs is None:
    plan = [(s.layers, remat(POLICIES[policy], none=policy == "none"))]
  else:
    if sum(r[0] for r in runs) != s.layers:
      raise ValueError(f"argument `runs`: {sum(r[0] for r in runs)} layers for a stack of "
                       f"{s.layers}")
    plan = [(r[0], remat(planner.policy(r[1], r[2] if len(r) > 2 else ()))) for r in runs]

  def loss(params, x):
    h, start = x, 0
    for n, layer in plan:
      run = jax.tree.map(lambda a, i=start, n=n: a[i:i + n], params)
      h, _ = jax.lax.scan(lambda h, p, layer=layer: (layer(p, h), None), h, run)
      start += n
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return loss, (params, x)


def _shape(spec: dict) -> Shape:
  s = STACKS[spec["stack"]]
  return dataclasses.replace(s, layers=spec["layers"]) if spec.get("layers") else s


def _key(spec: dict) -> dict:
  """The fields that name a JAX row (``configuration`` "default": no remat; a plan's
  ``configuration`` is given)."""
  configuration = spec.get("configuration") or (
      "default" if spec["policy"] == "none" else spec["policy"])
  return {"model": spec["stack"], "framework": "jax", "invact": spec["invact"],
          "configuration": configuration, "dtype": spec["dtype"]}


def measure(spec: dict) -> dict:
  """One row: ``spec`` = {stack, policy, invact, dtype, repeats[, layers][, runs,
  configuration]}."""
  s = _shape(spec)
  loss, args = build(s, spec["policy"], spec["invact"], jnp.dtype(spec["dtype"]),
                     spec.get("runs"))
  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(*args).compile()
  row = {**_key(spec), "layers": s.layers}
  if memory.reports_peak():
    peak = memory.device_peak(step, *args)
    # activations: the step's peak increase minus what it returns (the gradients: params'
    # size) — the inputs were resident before
    row["activation_bytes"] = peak["peak_increase"] - peak["output_bytes"]
    row["memory"] = "device peak"
  else:
    row["activation_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    row["memory"] = "compiled temp"
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(spec.get("repeats", 5)):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  row["step_ms"] = 1e3 * statistics.median(times)
  return row


def child(spec: dict) -> dict:
  """A row measured in this process (``python -m models.experiments.frontier``)."""
  try:
    return measure(spec)
  except Exception as e:  # pylint: disable=broad-except  # out of memory, unsupported, ...
    return cli.error_row(e, **_key(spec))


# --------------------------------------------------------------- the planner's rows
# Which measured policies give which tags' figures: (policy with the group kept, policy
# without it) -- the group's tags are those the first keeps and the second does not.
_GROUPS = (("save_qkv_proj", "full"), ("save_out_proj", "full"),
           ("minimal", "save_dot_except_mlp"))
_PLAN_POLICIES = ("full", "save_qkv_proj", "save_out_proj", "save_dot_except_mlp", "minimal")


def _widths(s: Shape) -> dict[str, tuple[int, int]]:
  """Per tag, (elements per token of the tensor, multiply-adds per token of its matmul)."""
  w = {"query_proj": s.d, "key_proj": s.d, "value_proj": s.d, "out_proj": s.d,
       "mlpwi_0": s.ff, "mlpwi_1": s.ff, "mlpwi": s.ff, "mlpwo": s.d}
  fan_in = {t: (s.ff if t == "mlpwo" else s.d) for t in w}
  return {t: (w[t], w[t] * fan_in[t]) for t in tags(s)}


def profile_from_rows(rs: list[dict], stack: str, invact: bool) -> planner.LayerProfile | None:
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

  Costs are milliseconds, so the planner minimizes the predicted step time.  None when a
  row it needs is missing or failed."""
  by = {r["configuration"]: r for r in rs
        if r.get("model") == stack and r.get("framework") == "jax"
        and r.get("invact") == invact and "error" not in r}
  if any(p not in by for p in _PLAN_POLICIES):
    return None
  layers = by["full"].get("layers") or STACKS[stack].layers
  s = dataclasses.replace(STACKS[stack], layers=layers)
  widths = _widths(s)
  nbytes = dict.fromkeys(widths, 0.0)
  gain = dict.fromkeys(widths, 0.0)
  for with_, without in _GROUPS:
    group = [t for t in widths if t in _SAVED[with_] and t not in _SAVED[without]]
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


def plan_specs(rs: list[dict], stack: str, *, dtype: str, repeats: int,
               budgets=PLAN_BUDGETS) -> list[dict]:
  """Per budget (a fraction of JAX default's activation bytes), the planner's plan over both
  sides (:func:`profile_from_rows`) as a row spec (``runs``, ``configuration`` "plan N %",
  ``predicted_bytes``), or an ``error`` row when no plan fits or the rows are missing."""
  default = next((r for r in rs if r.get("model") == stack and r.get("framework") == "jax"
                  and r.get("configuration") == "default" and not r.get("invact")
                  and "error" not in r), None)
  profiles = [p for p in (profile_from_rows(rs, stack, i) for i in (False, True)) if p]
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
    minimal = next(r for r in rs if r.get("model") == stack and r.get("framework") == "jax"
                   and r.get("configuration") == "minimal" and r.get("invact") == invact)
    out.append({**spec, "invact": invact, "runs": runs,
                "layers": default.get("layers") or STACKS[stack].layers,
                "budget_bytes": budget, "predicted_bytes": plan.predicted_bytes,
                "predicted_step_ms": minimal["step_ms"] + plan.predicted_cost})
  return out


def layers_that_fit(stack: str, dtype: str, *, limit_bytes: int | None = None,
                    fraction: float = 0.85, most: int = 32) -> int:
  """As many layers of ``stack`` as JAX default's step fits in ``fraction`` of the device's
  memory (``limit_bytes``, default: the allocator's ``bytes_limit``), at most ``most``: the
  step's compiled temp at 2 and 4 layers extrapolated (a scanned stack's temp is linear in
  its depth), plus the parameters and their gradients.  Compiles only (nothing is allocated
  on the device).  Without ``limit_bytes`` on a device that reports none (a CPU), the stack's
  own ``layers``."""
  s = STACKS[stack]
  if limit_bytes is None:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      return s.layers
    limit_bytes = int(stats["bytes_limit"])

  def temp_and_params(n: int) -> tuple[int, int]:
    box = {}

    def make():
      box["loss"], args = build(dataclasses.replace(s, layers=n), "none", False,
                                jnp.dtype(dtype))
      return args
    args = jax.eval_shape(make)
    compiled = jax.jit(jax.value_and_grad(box["loss"])).lower(*args).compile()
    params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args[0]))
    return int(compiled.memory_analysis().temp_size_in_bytes), params
  (t2, p2), (t4, p4) = temp_and_params(2), temp_and_params(4)
  per_layer = (t4 - t2) / 2 + 2 * (p4 - p2) / 2
  fixed = t2 + 2 * p2 - 2 * per_layer
  return int(max(2, min(most, (fraction * limit_bytes - fixed) // per_layer)))


def rows(stacks, *, dtype: str = "bfloat16", policies=None, repeats: int = 5,
         in_process: bool = False, torch_variants=None, deadline: float = math.inf,
         plans: bool = True, progress: Callable[[str], None] = lambda _: None) -> list[dict]:
  """Per stack: the torch rows where torch is importable (the baselines first: a deadline
  cuts the JAX rows, not the comparison), every (policy, invact) row, then the planner's plans
  (with ``plans``, where the policies it is calibrated on were measured).
  Stacks in :data:`FIT` have as many layers as fit (on a GPU)."""
  from models.experiments import frontier_torch  # pylint: disable=import-outside-toplevel
  policies = [p for p in (policies or POLICIES) if p != "minimal_offloaded" or has_memory_kinds()]
  out = []

  def one(spec):
    return (child(spec) if in_process else
            {**_key(spec), **cli.run_child("models.experiments.frontier", spec,
                                           deadline - time.time())})
  for name in stacks:
    layers = layers_that_fit(name, dtype) if name in FIT else STACKS[name].layers
    for variant in ((frontier_torch.VARIANTS if torch_variants is None else torch_variants)
                    if frontier_torch.importable() else ()):
      if time.time() > deadline:
        progress("frontier: out of time")
        return out
      progress(f"frontier {name} torch {variant}")
      spec = {"stack": name, "variant": variant, "dtype": dtype, "repeats": repeats,
              "shape": dataclasses.asdict(dataclasses.replace(STACKS[name], layers=layers))}
      res = cli.run_child("models.experiments.frontier_torch", spec, deadline - time.time())
      out.append({"model": name, "framework": "torch", "configuration": variant,
                  "invact": False, "dtype": dtype, "layers": layers, **res})
    for policy in policies:
      for invact in (False, True):
        if time.time() > deadline:
          progress("frontier: out of time")
          return out
        spec = {"stack": name, "policy": policy, "invact": invact, "dtype": dtype,
                "repeats": repeats, "layers": layers}
        progress(f"frontier {name} {policy}{' +invact' if invact else ''}")
        out.append(one(spec))
    if plans and set(_PLAN_POLICIES) | {"none"} <= set(policies):
      for spec in plan_specs(out, name, dtype=dtype, repeats=repeats):
        if "error" in spec or time.time() > deadline:
          out.append({**_key(spec), "error": spec.get("error", "out of time"),
                      **({"budget_bytes": spec["budget_bytes"]} if "budget_bytes" in spec else {})})
          continue
        progress(f"frontier {name} {spec['configuration']}")
        row = one(spec)
        row.update({k: spec[k] for k in ("budget_bytes", "predicted_bytes", "predicted_step_ms",
                                         "runs")})
        if "error" not in row:
          row["prediction_error"] = row["activation_bytes"] / spec["predicted_bytes"] - 1
        out.append(row)
  return out


def pareto(rs: list[dict]) -> list[dict]:
  """``rs`` with ``pareto`` set: no other row of the model is at least as fast with at most
  as many activation bytes (and better in one)."""
  for r in rs:
    if "error" in r:
      r["pareto"] = False
      continue
    r["pareto"] = not any(
        o is not r and "error" not in o and o["model"] == r["model"]
        and o["activation_bytes"] <= r["activation_bytes"] and o["step_ms"] <= r["step_ms"]
        and (o["activation_bytes"] < r["activation_bytes"] or o["step_ms"] < r["step_ms"])
        for o in rs)
  return rs


def _plan_note(r: dict) -> str:
  """A plan row's runs and its prediction (empty for other rows)."""
  if "runs" not in r:
    return ""
  runs = " + ".join(f"{run[0]}×[{', '.join(run[1]) or 'nothing'}"
                    + (f"; offload {', '.join(run[2])}" if len(run) > 2 else "") + "]"
                    for run in r["runs"])
  note = f"{runs}; predicted {r['predicted_bytes'] / 2**20:,.1f} MiB"
  if "prediction_error" in r:
    note += f" ({r['prediction_error']:+.1%})"
  if r.get("predicted_step_ms") is not None:
    note += f", {r['predicted_step_ms']:.1f} ms"
  return note


def per_token_layer(r: dict) -> float:
  """A row's activation bytes per token and layer, in units of ``d`` elements of its dtype
  (issue 39's unit: the floor of a pre-norm Llama layer is about 6 d + 2 ff)."""
  s = STACKS[r["model"]]
  layers = r.get("layers") or s.layers
  itemsize = jnp.dtype(r.get("dtype", "bfloat16")).itemsize
  return r["activation_bytes"] / (s.batch * s.seq * layers * s.d * itemsize)


def markdown(rs: list[dict]) -> str:
  """The rows as a markdown table (``front``: on the model's Pareto front; ``d per
  token-layer``: :func:`per_token_layer`)."""
  lines = ["| model | framework | configuration | invact | activations MiB | d per token-layer | "
           "step ms | front | plan |", "|---|---|---|---|---:|---:|---:|---|---|"]
  for r in rs:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                   f"{'yes' if r['invact'] else 'no'} | — | — | — | {r['error']} | |")
      continue
    lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                 f"{'yes' if r['invact'] else 'no'} | {r['activation_bytes'] / 2**20:,.1f} | "
                 f"{per_token_layer(r):.1f} | {r['step_ms']:.1f} | "
                 f"{'*' if r.get('pareto') else ''} | {_plan_note(r)} |")
  return "\n".join(lines)


def newest_per_model(paths) -> list:
  """Of frontier JSONs ``frontier_<device>_<date>.json`` (dry runs skipped), per device and
  model the rows of the newest file that measured the model (rows of one model are never
  mixed across runs: their step times compare only within a run).  Returns ``[(path,
  data)]``, ``data`` holding only the models taken from that file; newest first per device."""
  import pathlib  # pylint: disable=import-outside-toplevel
  by_device: dict = {}
  for p in sorted(map(pathlib.Path, paths)):
    by_device.setdefault(p.stem.rsplit("_", 1)[0], []).append(p)
  out = []
  for device in sorted(by_device):
    taken: set = set()
    for p in reversed(by_device[device]):
      data = json.loads(p.read_text())
      if data.get("dry"):
        continue
      models = {r["model"] for r in data["rows"] if "error" not in r} - taken
      if models:
        out.append((p, {**data, "rows": [r for r in data["rows"] if r["model"] in models]}))
        taken |= models
  return out


def headline_rows(data: dict, path: str) -> list[str]:
  """The README headline's rows from a frontier JSON (``path`` as linked): per model, the
  fastest JAX-only configuration and the fastest with invact whose activations fit 25 % and
  50 % of JAX default's and (where measured) PyTorch + Liger's."""
  ok = [r for r in data["rows"] if "error" not in r]
  source = f"[{path.rsplit('/', 1)[-1]}]({path}) · [docs](docs/gpu-report.md)"
  where = f"{data['device']}, JAX {data.get('versions', {}).get('jax', '?')}, {data['date']}"
  out = []
  for model in sorted({r["model"] for r in ok}):
    mine = [r for r in ok if r["model"] == model]
    default = next((r for r in mine if r["framework"] == "jax" and not r["invact"]
                    and r["configuration"] == "default"), None)
    if default is None:
      continue
    budgets = [(f"{f:.0%} of JAX default's", f * default["activation_bytes"]) for f in (0.25, 0.5)]
    liger = next((r for r in mine if r["framework"] == "torch" and r["configuration"] == "liger"),
                 None)
    if liger is not None:
      budgets.append((f"PyTorch + Liger's ({liger['activation_bytes'] / 2**30:.2f} GiB, "
                      f"{liger['step_ms']:.1f} ms)", liger["activation_bytes"]))

    def best(invact, budget):
      fits = [r for r in mine if r["framework"] == "jax" and r["invact"] == invact
              and r["activation_bytes"] <= budget]
      return min(fits, key=lambda r: r["step_ms"], default=None)

    def cell(r):
      return ("none fits" if r is None else
              f"{r['configuration']}: {r['step_ms']:.1f} ms, {r['activation_bytes'] / 2**30:.2f} GiB")
    for label, budget in budgets:
      j, i = best(False, budget), best(True, budget)
      ratio = f" ({i['step_ms'] / j['step_ms']:.2f}×)" if i and j else ""
      out.append(f"| frontier: {model}, fastest within {label} activations | {cell(j)} | "
                 f"{cell(i)}{ratio} | {where} | {source} |")
  return out


def plot(rs: list[dict], path) -> None:
  """Step time against activation memory per model, the Pareto front drawn."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  models = sorted({r["model"] for r in rs if "error" not in r})
  fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4.5),
                           squeeze=False)
  for ax, m in zip(axes[0], models):
    pts = [r for r in rs if r["model"] == m and "error" not in r]
    for r in pts:
      style = {"jax": "o", "torch": "s"}[r["framework"]]
      color = "C1" if r["invact"] else ("C2" if r["framework"] == "torch" else "C0")
      ax.scatter(r["activation_bytes"] / 2**20, r["step_ms"], marker=style, c=color)
      ax.annotate(r["configuration"] + ("+inv" if r["invact"] else ""),
                  (r["activation_bytes"] / 2**20, r["step_ms"]), fontsize=6)
    front = sorted((r for r in pts if r.get("pareto")), key=lambda r: r["activation_bytes"])
    ax.plot([r["activation_bytes"] / 2**20 for r in front], [r["step_ms"] for r in front],
            "k--", lw=1, label="Pareto front")
    ax.set_xlabel("activation MiB")
    ax.set_ylabel("step ms")
    ax.set_title(m)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(out_dir, *, device: str, date: str, dry: bool, deadline: float = math.inf,
        stacks=None, progress: Callable[[str], None] = lambda _: None) -> dict:
  """The frontier section: rows for issue 42's stacks (``dry``: one tiny stack, two policies,
  in this process), their Pareto front, ``frontier_<device>_<date>.json`` (``device``,
  ``rows``), ``.md`` and ``.png`` in ``out_dir``."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  stacks = stacks or (["dry-llama"] if dry else ["llama", "llama-7b", "gpt2-medium", "vit-l16"])
  rs = pareto(rows(stacks, dtype="float32" if dry else "bfloat16",
                   policies=["none", "full"] if dry else None, repeats=2 if dry else 7,
                   in_process=dry, torch_variants=("eager", "checkpoint") if dry else None,
                   deadline=deadline, progress=progress))
  out = pathlib.Path(out_dir) / f"frontier_{re.sub(r'[^a-z0-9]+', '-', device.lower())}_{date}"
  out.parent.mkdir(parents=True, exist_ok=True)
  versions = {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None)}
  out.with_suffix(".json").write_text(json.dumps({"device": device, "date": date, "dry": dry,
                                                  "versions": versions, "rows": rs}, indent=1))
  out.with_suffix(".md").write_text(markdown(rs) + "\n")
  if any("error" not in r for r in rs):
    plot(rs, out.with_suffix(".png"))
  return {"json": str(out.with_suffix(".json")), "rows": rs}


if __name__ == "__main__":
  print(json.dumps(child(json.loads(sys.argv[1]))))
