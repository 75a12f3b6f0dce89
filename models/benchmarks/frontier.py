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
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name as _checkpoint_name

import invact_jax
from invact_jax import memory, planner, targets
from invact_jax.program_planner import MAXTEXT_PRESETS
from models.benchmarks import child
from models.benchmarks import profile as op_profile
from models import reference_layers

__all__ = ["STACKS", "POLICIES", "PLAN_BUDGETS", "FIT", "HEADS", "JaxRow", "PlanRow",
           "ProgramPlanRow", "TorchRow",
           "LM_ORDER", "GPU_STACKS",
           "DRY_STACKS", "Shape", "build", "measure", "child_row", "rows", "profile_from_rows",
           "plan_specs", "layers_that_fit", "head_tiles", "pareto", "per_token_layer",
           "markdown", "newest_per_model", "earlier_rows", "headline_rows", "plot"]


@dataclasses.dataclass(frozen=True)
class Shape:
  """A stack's shape: ``kind`` (``llama``, ``gpt2``, ``vit``), width, heads, MLP width,
  layers, sequence, batch; for a full language model also the key/value heads (0: as many
  as the query heads), the vocabulary (0: a stack without embedding or head, its loss the
  mean square of its output), whether the head is the embedding table (``tied``) and the
  parameters' dtype ("": the compute dtype)."""
  kind: str
  d: int
  heads: int
  ff: int
  layers: int
  seq: int
  batch: int
  kv_heads: int = 0
  vocab: int = 0
  tied: bool = True
  param_dtype: str = ""

  @property
  def tokens(self) -> int:
    return self.seq * self.batch

  @property
  def kv_width(self) -> int:
    return (self.kv_heads or self.heads) * (self.d // self.heads)


#: The stacks and models; "dry" ones run on a CPU in seconds (the test suite's).
STACKS = {
    "llama3-1b": Shape("llama", 2048, 32, 8192, 16, 8192, 1, kv_heads=8, vocab=128256,
                       tied=True, param_dtype="float32"),
    "llama3-8b": Shape("llama", 4096, 32, 14336, 4, 4096, 1, kv_heads=8, vocab=128256,
                       tied=False, param_dtype="float32"),
    "llama-7b": Shape("llama", 4096, 32, 11008, 4, 4096, 1),
    "llama": Shape("llama", 1024, 16, 2816, 12, 1024, 24),
    "gpt2-medium": Shape("gpt2", 1024, 16, 4096, 24, 1024, 8),
    "vit-l16": Shape("vit", 1024, 16, 4096, 24, 197, 64),
    "dry-llama": Shape("llama", 64, 4, 176, 2, 16, 2),
    "dry-gpt2": Shape("gpt2", 64, 4, 256, 2, 16, 2),
    "dry-llama3": Shape("llama", 64, 4, 176, 2, 32, 2, kv_heads=2, vocab=2048, tied=True,
                        param_dtype="float32"),
}

#: Stacks sized on a GPU to what fits the JAX default step (:func:`layers_that_fit`): as
#: many layers, or the largest batch; elsewhere they keep their shape.
FIT = {"llama-7b": "layers", "llama3-8b": "layers", "llama3-1b": "batch"}

#: A JAX row's process takes the allocator's whole pool at start (one region).  Grown on
#: demand, XLA's BFC allocator keeps every region it took (no garbage collection), those of
#: compiling's autotuning too, and a step's one large temp allocation can then find no room
#: beside them though it fits the pool (llama3-1b's JAX default, docs/gpu-report.md).
ROW_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}

#: The planner's budgets, as fractions of JAX default's activation bytes of the stack.
PLAN_BUDGETS = (0.25, 0.5, 0.75)

_PROJECTIONS = MAXTEXT_PRESETS["minimal"]
#: MaxText's presets the frontier runs (and ``full``): the ``checkpoint_name`` s each saves.
_SAVED = {"full": (), **{name: MAXTEXT_PRESETS[name] for name in (
    "minimal", "save_qkv_proj", "save_dot_except_mlp", "save_out_proj")}}


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
  """Whether the device can offload to ``pinned_host`` (a GPU; not XLA:CPU; compiling for a
  GPU without one, its figures are the compiler's: yes)."""
  if targets.current().deviceless:
    return targets.platform() == "gpu"
  try:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  except Exception:  # pylint: disable=broad-except
    return False
  return jax.default_backend() != "cpu" and "pinned_host" in kinds


# ------------------------------------------------------------------------ the layers
def _attention(q, k, v, causal: bool):
  """cuDNN's flash attention compiling for a GPU (:func:`invact_jax.targets.platform`) in 16
  bits (grouped-query: fewer key/value heads); elsewhere the flash-style custom_vjp of
  :mod:`models.reference_layers` (the same residuals: q, k, v, o, a row log-sum-exp), the
  key/value heads repeated."""
  if targets.platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  if k.shape[2] != q.shape[2]:
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
  return reference_layers.flash_attention(q, k, v, causal)


def _block(s: Shape, named: bool = True):
  """``layer(p, x)`` of kind ``s.kind`` with MaxText's checkpoint names (``named``), or
  with none (a layer as most hand-written code is)."""
  dh = s.d // s.heads
  checkpoint_name = _checkpoint_name if named else (lambda x, name: x)

  def attention(p, h, causal, rotary):
    b, t, _ = h.shape
    split = lambda y: y.reshape(b, t, y.shape[-1] // dh, dh)  # noqa: E731
    q = split(checkpoint_name(h @ p["wq"], "query_proj"))
    k = split(checkpoint_name(h @ p["wk"], "key_proj"))
    v = split(checkpoint_name(h @ p["wv"], "value_proj"))
    if rotary:
      q, k = reference_layers.rope(q), reference_layers.rope(k)
    o = _attention(q, k, v, causal).reshape(b, t, s.d)
    return checkpoint_name(o @ p["wo"], "out_proj")

  def llama(p, x):
    x = x + attention(p, reference_layers.rms_norm(x, p["n1"]), True, True)
    h = reference_layers.rms_norm(x, p["n2"])
    g = checkpoint_name(h @ p["wg"], "mlpwi_0")
    u = checkpoint_name(h @ p["wu"], "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(g) * u) @ p["wd"], "mlpwo")

  def gpt2(p, x, causal=True):
    x = x + attention(p, reference_layers.layer_norm(x, p["g1"], p["b1"]), causal, False)
    h = reference_layers.layer_norm(x, p["g2"], p["b2"])
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


#: An LM's head: the plain logits + optax, tokamax's chunked loss (invact: invert's).
HEADS = ("plain", "tokamax")


def _tokamax_loss():
  """tokamax's ``linear_softmax_cross_entropy_loss`` (chunked XLA), or None where tokamax
  (with it) is not installed."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("tokamax") is None:
    return None
  import tokamax  # pylint: disable=import-outside-toplevel
  return getattr(tokamax, "linear_softmax_cross_entropy_loss", None)


def _head_loss(s: Shape, head: str, h, w, labels):
  """The mean cross-entropy of the final hidden states ``h`` [B, T, d] against ``labels``,
  the head weight ``w`` ([V, d] tied, else [d, V]) in the compute dtype."""
  if head == "tokamax":
    fn = _tokamax_loss()
    if fn is None:
      raise RuntimeError("tokamax (with linear_softmax_cross_entropy_loss) is not installed")
    return fn(h.reshape(-1, s.d), labels.reshape(-1), w.T if s.tied else w, reduction="mean",
              implementation="chunked_xla")
  logits = h @ w.T if s.tied else h @ w  # what users write: the logits in the compute dtype
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def _params(s: Shape, dtype):
  """The stacked layers' parameters (and, for a language model, the embedding, the final
  norm and an untied head) in the parameters' dtype."""
  kind = "llama" if s.kind == "llama" else "gpt2"
  pdtype = jnp.dtype(s.param_dtype or dtype)
  keys = jax.random.split(jax.random.key(0), s.layers + 2)
  layers = [reference_layers.init_layer(kind, s.d, s.ff, pdtype, k, s.kv_width) for k in keys[:-2]]
  params = {"layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}
  if s.vocab:
    params["embed"] = (jax.random.normal(keys[-2], (s.vocab, s.d)) / math.sqrt(s.d)).astype(pdtype)
    params["norm"] = jnp.ones((s.d,), pdtype)
    if not s.tied:
      params["head"] = (jax.random.normal(keys[-1], (s.d, s.vocab)) / math.sqrt(s.d)).astype(pdtype)
  return params


def build(s: Shape, policy: str, invact: bool, dtype,
          runs: list | None = None, head: str = "plain", named: bool = True
          ) -> tuple[Callable, tuple]:
  """``(loss(params, inputs...), (params, inputs...))``: the stack under ``lax.scan``, each
  layer under ``jax.checkpoint(policy)``; for a language model (``s.vocab``) from tokens
  through the embedding, the final norm and ``head`` to the mean cross-entropy.  ``invact``:
  ``invert`` of the layer (a stack) or of the whole loss (a language model: its head too).
  ``runs`` (a plan; ``policy`` is then ignored): ``[[layers, [tags kept], [tags offloaded]],
  ...]`` in forward order (the third entry optional), each run a ``lax.scan`` of its own over
  its slice of the parameters, its layers under ``save_only_these_names(*kept)`` or, where it
  offloads, ``save_and_offload_only_these_names`` to ``pinned_host``.  ``named``: the
  layers tag their projections with MaxText's ``checkpoint_name`` s (else no names)."""
  dtype = jnp.dtype(dtype)
  params = _params(s, dtype)
  block = _block(s, named)
  if s.param_dtype and jnp.dtype(s.param_dtype) != dtype:  # cast where used, as MaxText
    layer_fn = block
    block = lambda p, x: layer_fn(jax.tree.map(lambda a: a.astype(dtype), p), x)  # noqa: E731
  if invact and not s.vocab:
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

  def layers(stacked, h):
    start = 0
    for n, layer in plan:
      run = jax.tree.map(lambda a, i=start, n=n: a[i:i + n], stacked)
      h, _ = jax.lax.scan(lambda h, p, layer=layer: (layer(p, h), None), h, run)
      start += n
    return h

  if not s.vocab:
    x = (jax.random.normal(jax.random.key(1), (s.batch, s.seq, s.d), jnp.float32)).astype(dtype)

    def loss(params, x):
      return jnp.mean(layers(params["layers"], x).astype(jnp.float32) ** 2)
    return loss, (params, x)

  tokens = jax.random.randint(jax.random.key(1), (s.batch, s.seq + 1), 0, s.vocab)

  def lm_loss(params, tokens):
    h = params["embed"][tokens[:, :-1]].astype(dtype)
    h = reference_layers.rms_norm(layers(params["layers"], h), params["norm"].astype(dtype))
    w = params["embed"] if s.tied else params["head"]
    return _head_loss(s, head, h, w.astype(dtype), tokens[:, 1:])
  return (invact_jax.invert(lm_loss) if invact else lm_loss), (params, tokens)


def _shape(spec: dict) -> Shape:
  s = STACKS[spec["stack"]]
  return dataclasses.replace(s, **{k: spec[k] for k in ("layers", "batch") if spec.get(k)})


def head_of(spec: dict) -> str:
  """A row's head: "" for a stack without one, invert's ("invact") with invact, else the
  spec's ("plain" by default)."""
  if not STACKS[spec["stack"]].vocab:
    return ""
  return "invact" if spec["invact"] else spec.get("head", "plain")


def _key(spec: dict) -> dict:
  """The fields that name a JAX row (``configuration`` "default": no remat; a plan's
  ``configuration`` is given)."""
  configuration = spec.get("configuration") or (
      "default" if spec["policy"] == "none" else spec["policy"])
  return {"model": spec["stack"], "framework": "jax", "invact": spec["invact"],
          "configuration": configuration, "head": head_of(spec), "dtype": spec["dtype"]}


def head_tiles(s: Shape, platform: str) -> dict:
  """The tiles :func:`invact_jax.invert` gives a language model's head on ``platform``
  (:func:`invact_jax.ops.cross_entropy.base.default_tiles`, per gradient mode): an invact
  row records them, and a later run carries it over only while they are the same."""
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  return {"platform": platform, **{m: list(base.default_tiles(s.tokens, s.vocab, m, platform))
                                   for m in base.GRADIENTS}}


def measure(spec: dict) -> dict:
  """One row: ``spec`` = {stack, policy, invact, dtype, repeats[, layers][, batch][, head]
  [, runs, configuration][, profile]}; with ``profile`` (K), the row's ``profile``: the step's
  K largest XLA operations (:func:`models.benchmarks.profile.op_times`).  One row with its
  profile, as a later GPU session asks for it: ``python -m models.benchmarks.frontier
  '{"stack": "llama3-1b", "policy": "none", "invact": true, "dtype": "bfloat16",
  "repeats": 3, "batch": 2, "profile": 15}'``."""
  s = _shape(spec)
  planned = None
  if "program_budget" in spec:  # invact_jax.plan of the model as written (no remat, plain head)
    loss, args = build(s, "none", False, jnp.dtype(spec["dtype"]), None, "plain")
    t0 = time.perf_counter()
    loss = planned = invact_jax.plan(loss, *args, budget=spec["program_budget"], convert=True)
    planning_s = time.perf_counter() - t0
  else:
    loss, args = build(s, spec["policy"], spec["invact"], jnp.dtype(spec["dtype"]),
                       spec.get("runs"), spec.get("head", "plain"))
  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(*args).compile()
  row = {**_key(spec), "layers": s.layers, "batch": s.batch}
  if planned is not None:
    rep = planned.report
    row.update({"plan_program": rep.configuration, "plan_keeps": list(rep.keep),
                "plan_offloads": list(rep.offload), "plan_policy": rep.policy,
                "plan_as_written": rep.as_written, "predicted_bytes": rep.predicted_bytes,
                "plan_compiled_bytes": rep.compiled_bytes, "plan_step_flops": rep.step_flops,
                "plan_recompute_flops": rep.predicted_recompute_flops,
                "planning_s": round(planning_s, 2)})
  if spec["invact"] and s.vocab:
    row["head_tiles"] = head_tiles(s, targets.platform())
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
  if spec.get("profile"):
    row["profile"] = op_profile.op_times(compiled, *args, steps=1, top=spec["profile"])
  return row


def child_row(spec: dict) -> dict:
  """A row measured in this process (``python -m models.benchmarks.frontier``); a spec with
  ``fit`` (a stack's name) gives ``{"fit": n}``, :func:`layers_that_fit` of that stack."""
  try:
    if "fit" in spec:
      return {"fit": layers_that_fit(spec["fit"], spec["dtype"], field=spec["field"])}
    return measure(spec)
  except Exception as e:  # pylint: disable=broad-except  # out of memory, unsupported, ...
    return child.error_row(e, **({} if "fit" in spec else _key(spec)))


# --------------------------------------------------------------- the planner's rows
# Which measured policies give which tags' figures: (policy with the group kept, policy
# without it) -- the group's tags are those the first keeps and the second does not.
_GROUPS = (("save_qkv_proj", "full"), ("save_out_proj", "full"),
           ("minimal", "save_dot_except_mlp"))
_PLAN_POLICIES = ("full", "save_qkv_proj", "save_out_proj", "save_dot_except_mlp", "minimal")


def _widths(s: Shape) -> dict[str, tuple[int, int]]:
  """Per tag, (elements per token of the tensor, multiply-adds per token of its matmul)."""
  w = {"query_proj": s.d, "key_proj": s.kv_width, "value_proj": s.kv_width, "out_proj": s.d,
       "mlpwi_0": s.ff, "mlpwi_1": s.ff, "mlpwi": s.ff, "mlpwo": s.d}
  fan_in = {t: (s.ff if t == "mlpwo" else s.d) for t in w}
  return {t: (w[t], w[t] * fan_in[t]) for t in tags(s)}


def _side(rs: list[dict], stack: str, invact: bool) -> dict:
  """configuration -> measured JAX row of one side (the plain head or invert's)."""
  return {r["configuration"]: r for r in rs
          if r.get("model") == stack and r.get("framework") == "jax"
          and r.get("invact") == invact and "error" not in r
          and r.get("head", "") in ("", "plain", "invact")}


def profile_from_rows(rs: list[dict], stack: str, invact: bool,
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
  by = _side(rs, stack, invact)
  if from_shapes or any(p not in by for p in _PLAN_POLICIES):
    return _profile_from_shapes(by, stack, invact)
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


def _profile_from_shapes(by: dict, stack: str, invact: bool) -> planner.LayerProfile | None:
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
  layers = full.get("layers") or STACKS[stack].layers
  s = dataclasses.replace(STACKS[stack], layers=layers, batch=full.get("batch") or
                          STACKS[stack].batch)
  widths = _widths(s)
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


def plan_specs(rs: list[dict], stack: str, *, dtype: str, repeats: int,
               budgets=PLAN_BUDGETS) -> list[dict]:
  """Per budget (a fraction of JAX default's activation bytes), the planner's plan over both
  sides (:func:`profile_from_rows`) as a row spec (``runs``, ``configuration`` "plan N %",
  ``predicted_bytes``), or an ``error`` row when no plan fits or the rows are missing."""
  default = _jax_row(rs, stack, "default", False)
  # both sides calibrated the same way: from the presets' rows where both have them
  shapes = any(p not in _side(rs, stack, i) for p in _PLAN_POLICIES for i in (False, True))
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
    minimal = _jax_row(rs, stack, "minimal", invact)
    base = 0.0 if profile.fixed_cost else minimal["step_ms"]
    out.append({**spec, "invact": invact, "runs": runs,
                "layers": default.get("layers") or STACKS[stack].layers,
                "batch": default.get("batch") or STACKS[stack].batch,
                "budget_bytes": budget, "predicted_bytes": plan.predicted_bytes,
                "predicted_step_ms": base + plan.predicted_cost})
  return out


def _jax_row(rs: list[dict], stack: str, configuration: str, invact: bool) -> dict | None:
  """The measured JAX row of ``stack`` under ``configuration``, with invert or without."""
  return next((r for r in rs if r.get("model") == stack and r.get("framework") == "jax"
               and r.get("configuration") == configuration and bool(r.get("invact")) == invact
               and "error" not in r), None)


def program_plan_spec(rs: list[dict], stack: str, percent: int, *, dtype: str, repeats: int,
                      fields: dict) -> dict:
  """The row spec of :class:`ProgramPlanRow` ``percent``: its budget (``program_budget``,
  ``budget_bytes``) that fraction of the measured JAX default's activation bytes, or an
  ``error`` where that row is missing."""
  spec = {"stack": stack, "policy": "none", "invact": True, "dtype": dtype, "repeats": repeats,
          "configuration": f"program plan {percent} %", **fields}
  default = _jax_row(rs, stack, "default", False)
  if default is None:
    return {**spec, "error": "JAX default's row, the budget's reference, is missing"}
  budget = int(percent / 100 * default["activation_bytes"])
  return {**spec, "program_budget": budget, "budget_bytes": budget}


def program_plan_prediction(row: dict, rs: list[dict]) -> dict:
  """A measured :class:`ProgramPlanRow`'s predictions beside its measurement:
  ``prediction_error`` (activation bytes against the plan's predicted compiled temp) and,
  where the chosen program's default row was measured, ``predicted_step_ms``: that row's step
  scaled by the planned step's FLOPs over its FLOPs without recompute (the recompute run at
  the step's own FLOP rate)."""
  out = {}
  if "error" in row or not row.get("predicted_bytes"):
    return out
  out["prediction_error"] = row["activation_bytes"] / row["predicted_bytes"] - 1
  base = _jax_row(rs, row["model"], "default", row.get("plan_program") == "inverted")
  flops, recompute = row.get("plan_step_flops"), row.get("plan_recompute_flops", 0.0)
  if base is not None and flops and flops > recompute:
    out["predicted_step_ms"] = base["step_ms"] * flops / (flops - recompute)
  return out


#: The fraction of a device's memory JAX's allocator takes by default: a deviceless target's
#: limit, as :func:`layers_that_fit` reads the allocator's on the device.
ALLOCATOR_FRACTION = 0.75


def layers_that_fit(stack: str, dtype: str, *, limit_bytes: int | None = None,
                    fraction: float = 0.85, most: int = 32, field: str = "layers") -> int:
  """As many layers of ``stack`` (``field="batch"``: the largest batch) as JAX default's step
  fits in ``fraction`` of the device's memory (``limit_bytes``, default: the allocator's
  ``bytes_limit``; compiling for a device without it, :data:`ALLOCATOR_FRACTION` of its
  memory), at most ``most``: the step's compiled temp at 2 and 4 extrapolated (a scanned
  stack's temp is linear in its depth and its batch), plus the parameters and their
  gradients.  Compiles only (nothing is allocated on the device), for the current target.
  Without ``limit_bytes`` on a device that reports none (a CPU), the stack's own ``field``."""
  s = STACKS[stack]
  if limit_bytes is None:
    target = targets.current()
    if target.deviceless and target.memory_bytes:
      limit_bytes = int(ALLOCATOR_FRACTION * target.memory_bytes)
    else:
      stats = jax.local_devices()[0].memory_stats() or {}
      if "bytes_limit" not in stats:
        return getattr(s, field)
      limit_bytes = int(stats["bytes_limit"])

  def temp_and_params(n: int) -> tuple[int, int]:
    box = {}

    def make():
      box["loss"], args = build(dataclasses.replace(s, **{field: n}), "none", False,
                                jnp.dtype(dtype))
      return args
    args = jax.eval_shape(make)
    temp = memory.compiled(jax.value_and_grad(box["loss"]), *args).temp
    params = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args[0]))
    return temp, params
  (t2, p2), (t4, p4) = temp_and_params(2), temp_and_params(4)
  per_unit = (t4 - t2) / 2 + 2 * (p4 - p2) / 2
  fixed = t2 + 2 * p2 - 2 * per_unit
  least = 1 if field == "batch" else 2
  n = int(max(least, min(most, (fraction * limit_bytes - fixed) // per_unit)))
  if field == "layers":
    return n  # a scanned stack's temp is linear in its depth: the extrapolation is exact
  # a batch's temp is nearly linear: the extrapolation checked, a step at a time

  def fits(m: int) -> bool:
    t, p = temp_and_params(m)
    return t + 2 * p <= fraction * limit_bytes
  while n > least and not fits(n):
    n -= 1
  while n < most and fits(n + 1):
    n += 1
  return n


class JaxRow(NamedTuple):
  """A JAX row: a remat policy (:data:`POLICIES`), with or without invert(), and the head."""
  policy: str
  invact: bool
  head: str


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


#: A language model's rows, the decisive ones first: a deadline cuts the rest.  ``full``
#: with invact is early because the plans are calibrated on each side's ``default``,
#: ``full`` and ``dots_no_batch``.
LM_ORDER = (
    JaxRow("none", False, "plain"), JaxRow("dots_no_batch", False, "plain"),
    JaxRow("full", False, "plain"), JaxRow("save_qkv_proj", False, "plain"),
    JaxRow("minimal_offloaded", False, "plain"), JaxRow("none", True, "invact"),
    JaxRow("dots_no_batch", True, "invact"), JaxRow("full", True, "invact"),
    JaxRow("save_qkv_proj", True, "invact"), PlanRow(25), PlanRow(50), TorchRow("eager"),
    TorchRow("liger"), ProgramPlanRow(25), ProgramPlanRow(50),
    JaxRow("dots_no_batch", False, "tokamax"),
    JaxRow("save_qkv_proj", False, "tokamax"), JaxRow("full", False, "tokamax"),
    *(JaxRow(p, i, "invact" if i else "plain") for p in (
        "minimal", "save_dot_except_mlp", "save_out_proj", "dots") for i in (False, True)),
    JaxRow("minimal_offloaded", True, "invact"), PlanRow(75), ProgramPlanRow(75),
    TorchRow("checkpoint"),
    TorchRow("liger+checkpoint"), TorchRow("compile"))


def _torch_head(configuration: str) -> str:
  """A PyTorch language model's head: Liger's fused linear cross-entropy where Liger runs."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  return "liger" if frontier_torch.CONFIGURATIONS[configuration].liger else "plain"


def _same_row(a: dict, b: dict) -> bool:
  return all(a.get(k) == b.get(k) for k in ("model", "framework", "configuration", "invact",
                                            "head"))


def rows(stacks, *, dtype: str = "bfloat16", policies=None, repeats: int = 5,
         in_process: bool = False, torch_configurations=None, deadline: float = math.inf,
         plans: bool = True, done=(), date: str = "",
         progress: Callable[[str], None] = lambda _: None) -> list[dict]:
  """Per stack: the torch rows where torch is importable (the baselines first: a deadline
  cuts the JAX rows, not the comparison), every (policy, invact) row, then the planner's plans
  (with ``plans``, where the policies it is calibrated on were measured); per language model
  the rows of :data:`LM_ORDER` (:func:`_lm_rows`), those in ``done`` (an earlier run's rows
  of the same layers and batch) carried over, not measured again.  Stacks in :data:`FIT`
  have as many layers, or the largest batch, as fit (on a GPU; found in a child process).
  Rows measured here carry ``date``."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  policies = [p for p in (policies or POLICIES) if p != "minimal_offloaded" or has_memory_kinds()]
  out = []

  def one(spec):
    row = (child_row(spec) if in_process else
           {**_key(spec), **child.run_child("models.benchmarks.frontier", spec,
                                          deadline - time.time(),
                                          env={**os.environ, **ROW_ENV})})
    return {**row, "date": date} if date else row

  def torch_row(name, configuration, fields):
    spec = {"stack": name, "configuration": configuration, "dtype": dtype, "repeats": repeats,
            "shape": dataclasses.asdict(dataclasses.replace(STACKS[name], **fields))}
    res = child.run_child("models.benchmarks.frontier_torch", spec, deadline - time.time())
    head = _torch_head(configuration) if STACKS[name].vocab else ""
    return {"model": name, "framework": "torch", "configuration": configuration, "invact": False,
            "head": head, "dtype": dtype, **fields, **res, **({"date": date} if date else {})}

  def plan_rows(name, budgets):
    for spec in plan_specs(out, name, dtype=dtype, repeats=repeats, budgets=budgets):
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

  def program_plan_row(name, percent, fields):
    spec = program_plan_spec(out, name, percent, dtype=dtype, repeats=repeats, fields=fields)
    if "error" in spec:
      out.append({**_key(spec), "error": spec["error"]})
      return
    progress(f"frontier {name} {spec['configuration']}")
    row = one(spec)
    row["budget_bytes"] = spec["budget_bytes"]
    for k, v in fields.items():  # (an error row says which model it is of, too)
      row.setdefault(k, v)
    row.update(program_plan_prediction(row, out))
    out.append(row)

  def fitted(name, field):
    """The stack's ``field`` that fits, from a child process: compiling for the device
    (autotuning) grows this process's allocator, which would keep that memory from the
    rows' own processes."""
    spec = {"fit": name, "dtype": dtype, "field": field}
    res = child_row(spec) if in_process else child.run_child(
        "models.benchmarks.frontier", spec, deadline - time.time())
    return res.get("fit"), res.get("error")

  torch_ok = frontier_torch.importable()
  for name in stacks:
    fit = FIT.get(name)
    fields = {"layers": STACKS[name].layers, "batch": STACKS[name].batch}
    if fit:
      fields[fit], why = _carried_fit(done, name, fit), None
      if fields[fit] is not None:
        progress(f"frontier {name}: the {fit} that fits, {fields[fit]}, carried over")
      else:
        progress(f"frontier {name}: the {fit} that fits")
        fields[fit], why = fitted(name, fit)
      if why is not None:
        out.append({"model": name, "framework": "jax", "configuration": "default",
                    "invact": False, "head": "plain" if STACKS[name].vocab else "",
                    "error": f"the {fit} that fits: {why}"})
        continue
    if STACKS[name].vocab:
      if not _lm_rows(name, fields, out, policies=policies, torch_configurations=torch_configurations,
                      torch_ok=torch_ok, one=one, torch_row=torch_row, plan_rows=plan_rows,
                      program_plan_row=program_plan_row,
                      plans=plans, done=done, deadline=deadline, dtype=dtype,
                      repeats=repeats, progress=progress):
        return out
      continue
    for configuration in ((frontier_torch.CONFIGURATIONS if torch_configurations is None
                           else torch_configurations) if torch_ok else ()):
      if time.time() > deadline:
        progress("frontier: out of time")
        return out
      progress(f"frontier {name} torch {configuration}")
      out.append(torch_row(name, configuration, fields))
    for policy in policies:
      for invact in (False, True):
        if time.time() > deadline:
          progress("frontier: out of time")
          return out
        spec = {"stack": name, "policy": policy, "invact": invact, "dtype": dtype,
                "repeats": repeats, **fields}
        progress(f"frontier {name} {policy}{' +invact' if invact else ''}")
        out.append(one(spec))
    if plans and set(_PLAN_POLICIES) | {"none"} <= set(policies):
      plan_rows(name, PLAN_BUDGETS)
  return out


def _lm_rows(name, fields, out, *, policies, torch_configurations, torch_ok, one, torch_row,
             plan_rows, program_plan_row, plans, done, deadline, dtype, repeats,
             progress) -> bool:
  """A language model's rows in :data:`LM_ORDER` appended to ``out`` (rows of ``done`` for
  the same model, configuration, invact, head, layers and batch carried over, an invact row
  only while its head's tiles are today's, :func:`head_tiles`); False when the deadline cut
  them."""
  from models.benchmarks import frontier_torch  # pylint: disable=import-outside-toplevel
  shape = dataclasses.replace(STACKS[name], **fields)
  earlier = [r for r in done if r.get("model") == name and "error" not in r
             and all(r.get(k) == v for k, v in fields.items())
             and (not r.get("invact") or r.get("head_tiles") == head_tiles(
                 shape, (r.get("head_tiles") or {}).get("platform", "")))]
  wanted = frontier_torch.CONFIGURATIONS if torch_configurations is None else torch_configurations
  for item in LM_ORDER:
    if isinstance(item, PlanRow):
      configuration = f"plan {item.percent} %"
      carried = next((r for r in earlier if r.get("configuration") == configuration), None)
      if carried is not None:
        out.append(carried)
      elif plans:
        plan_rows(name, (item.percent / 100,))
      continue
    if isinstance(item, ProgramPlanRow):
      configuration = f"program plan {item.percent} %"
      carried = next((r for r in earlier if r.get("configuration") == configuration), None)
      carried = carried or _infeasible_before(done, out, name, item.percent, fields,
                                              dtype=dtype, repeats=repeats)
      if carried is not None:
        out.append(carried)
      elif plans and time.time() <= deadline:
        program_plan_row(name, item.percent, fields)
      continue
    if isinstance(item, TorchRow):
      if not torch_ok or item.configuration not in wanted:
        continue
      key = {"model": name, "framework": "torch", "configuration": item.configuration,
             "invact": False, "head": _torch_head(item.configuration)}
    else:
      if item.policy not in policies:
        continue
      spec = {"stack": name, "policy": item.policy, "invact": item.invact, "dtype": dtype,
              "repeats": repeats, "head": "plain" if item.invact else item.head, **fields}
      key = _key(spec)
    carried = next((r for r in earlier if _same_row(r, key)), None)
    if carried is not None:
      out.append(carried)
      continue
    if time.time() > deadline:
      progress("frontier: out of time")
      return False
    progress(f"frontier {name} {key['configuration']} head={key['head']}"
             f"{' +invact' if key['invact'] else ''}")
    out.append(torch_row(name, item.configuration, fields) if key["framework"] == "torch"
               else one(spec))
  return True


def _carried_fit(done: list[dict], name: str, field: str) -> int | None:
  """The ``field`` (layers or batch) an earlier run fitted to the device for stack ``name``:
  the one value its measured rows share (None where none was measured or they differ)."""
  values = {r.get(field) for r in done if r.get("model") == name and "error" not in r}
  return values.pop() if len(values) == 1 and None not in values else None


def _infeasible_before(done: list[dict], out: list[dict], name: str, percent: int,
                       fields: dict, *, dtype: str, repeats: int) -> dict | None:
  """An earlier run's :class:`ProgramPlanRow` ``percent`` that the planner found infeasible at
  the budget this run gives it (JAX default's row the same): the same answer again, not
  planned again."""
  spec = program_plan_spec(out, name, percent, dtype=dtype, repeats=repeats, fields=fields)
  return next((r for r in done if r.get("model") == name
               and r.get("configuration") == spec["configuration"]
               and str(r.get("error", "")).startswith("InfeasibleBudget")
               and "budget_bytes" in spec and r.get("budget_bytes") == spec["budget_bytes"]
               and all(r.get(k) == v for k, v in fields.items())), None)


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
  """A plan row's runs (or what invact_jax.plan chose) and its prediction (empty for other
  rows)."""
  if "plan_program" in r:
    kept = ", ".join(r["plan_keeps"]) or "nothing"
    choice = ("as written" if r.get("plan_as_written") else
              f"JAX's {r['plan_policy']}" if r.get("plan_policy") else f"keeps [{kept}]")
    program = "invert(loss)" if r["plan_program"] == "inverted" else "the loss as written"
    note = (f"invact_jax.plan of {program}: {choice}"
            + (f"; offload {', '.join(r['plan_offloads'])}" if r.get("plan_offloads") else ""))
  elif "runs" in r:
    note = " + ".join(f"{run[0]}×[{', '.join(run[1]) or 'nothing'}"
                      + (f"; offload {', '.join(run[2])}" if len(run) > 2 else "") + "]"
                      for run in r["runs"])
  else:
    return ""
  note += f"; predicted {r['predicted_bytes'] / 2**20:,.1f} MiB"
  if "prediction_error" in r:
    note += f" ({r['prediction_error']:+.1%})"
  if r.get("predicted_step_ms") is not None:
    note += f", {r['predicted_step_ms']:.1f} ms"
  return note


def per_token_layer(r: dict) -> float:
  """A row's activation bytes per token and layer, in units of ``d`` elements of its dtype
  (the floor of a pre-norm Llama layer is about 6 d + 2 ff; a language model's head counts
  in)."""
  s = STACKS[r["model"]]
  layers = r.get("layers") or s.layers
  batch = r.get("batch") or s.batch
  itemsize = jnp.dtype(r.get("dtype", "bfloat16")).itemsize
  return r["activation_bytes"] / (batch * s.seq * layers * s.d * itemsize)


def markdown(rs: list[dict]) -> str:
  """The rows as a markdown table (``front``: on the model's Pareto front; ``d per
  token-layer``: :func:`per_token_layer`)."""
  lines = ["| model | framework | configuration | invact | head | activations MiB | "
           "d per token-layer | step ms | front | plan |",
           "|---|---|---|---|---|---:|---:|---:|---|---|"]
  for r in rs:
    head = r.get("head") or "—"
    if "error" in r:
      lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                   f"{'yes' if r['invact'] else 'no'} | {head} | — | — | — | {r['error']} | |")
      continue
    lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                 f"{'yes' if r['invact'] else 'no'} | {head} | "
                 f"{r['activation_bytes'] / 2**20:,.1f} | "
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
      if data.get("dry") or data.get("deviceless"):
        continue
      models = {r["model"] for r in data["rows"] if "error" not in r} - taken
      if models:
        out.append((p, {**data, "rows": [r for r in data["rows"] if r["model"] in models]}))
        taken |= models
  return out


def headline_rows(data: dict, path: str) -> list[str]:
  """The README headline's rows from a frontier JSON (``path`` as linked): per model, the
  fastest JAX-only configuration and the fastest with invact whose activations fit 25 % and
  50 % of JAX default's and PyTorch + Liger's, each where that row was measured."""
  ok = [r for r in data["rows"] if "error" not in r]
  source = f"[{path.rsplit('/', 1)[-1]}]({path}) · [docs](docs/gpu-report.md)"
  where = f"{data['device']}, JAX {data.get('versions', {}).get('jax', '?')}, {data['date']}"
  out = []
  for model in sorted({r["model"] for r in ok}):
    mine = [r for r in ok if r["model"] == model]
    default = _jax_row(mine, model, "default", False)
    budgets = [] if default is None else [
        (f"{f:.0%} of JAX default's", f * default["activation_bytes"]) for f in (0.25, 0.5)]
    liger = next((r for r in mine if r["framework"] == "torch" and r["configuration"] == "liger"),
                 None)
    if liger is not None:
      budgets.append((f"PyTorch + Liger's ({liger['activation_bytes'] / 2**30:.2f} GiB, "
                      f"{liger['step_ms']:.1f} ms)", liger["activation_bytes"]))

    def best(invact, budget):  # a plan is invact's whatever configuration it chose
      fits = [r for r in mine if r["framework"] == "jax" and r["activation_bytes"] <= budget
              and (r["invact"] or r["configuration"].startswith("plan")) == invact]
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


#: The stacks a GPU run measures, in order (the language models first).
GPU_STACKS = ("llama3-1b", "llama3-8b", "llama", "gpt2-medium", "vit-l16")
#: The dry run's (CPU, tiny, in this process): a language model (its layers are the stacks').
DRY_STACKS = ("dry-llama3",)


def earlier_rows(out_dir, device: str) -> list[dict]:
  """The rows of the newest non-dry frontier JSON of ``device`` in ``out_dir`` (what a run
  continues from), or []."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  slug = re.sub(r"[^a-z0-9]+", "-", device.lower())
  for p in sorted(pathlib.Path(out_dir).glob(f"frontier_{slug}_????-??-??.json"), reverse=True):
    data = json.loads(p.read_text())
    if not data.get("dry"):
      return data["rows"]
  return []


def run(out_dir, *, device: str, date: str, dry: bool, deadline: float = math.inf,
        stacks=None, progress: Callable[[str], None] = lambda _: None) -> dict:
  """The frontier section: rows for :data:`GPU_STACKS` (``dry``: :data:`DRY_STACKS`, three
  policies, no plans — tests/benchmarks/test_frontier.py runs those —, in this process),
  continuing from the device's newest frontier JSON in
  ``out_dir`` (its rows carried over), their Pareto front, ``frontier_<device>_<date>.json``
  (``device``, ``rows``), ``.md`` and ``.png`` in ``out_dir``."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  stacks = stacks or list(DRY_STACKS if dry else GPU_STACKS)
  rs = pareto(rows(stacks, dtype="float32" if dry else "bfloat16",
                   policies=["none", "full", "dots_no_batch"] if dry else None,
                   repeats=2 if dry else 7, in_process=dry,
                   torch_configurations=("eager", "checkpoint") if dry else None,
                   deadline=deadline, progress=progress, date=date, plans=not dry,
                   done=() if dry else earlier_rows(out_dir, device)))
  out = pathlib.Path(out_dir) / f"frontier_{re.sub(r'[^a-z0-9]+', '-', device.lower())}_{date}"
  out.parent.mkdir(parents=True, exist_ok=True)
  versions = {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None)}
  out.with_suffix(".json").write_text(json.dumps({"device": device, "date": date, "dry": dry,
                                                  "versions": versions, "rows": rs}, indent=1))
  out.with_suffix(".md").write_text(markdown(rs) + "\n")
  if any("error" not in r for r in rs):
    plot(rs, out.with_suffix(".png"))
  path = out.with_suffix(".json").resolve()
  root = pathlib.Path(__file__).resolve().parents[2]
  # the report names it as the docs link it: from the repository's root where it is inside
  return {"json": str(path.relative_to(root) if path.is_relative_to(root) else path),
          "rows": rs}


if __name__ == "__main__":  # a child: one row, one JSON line
  child.child_main(child_row)
