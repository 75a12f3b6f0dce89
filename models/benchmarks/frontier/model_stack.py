"""The frontier's stacks: their shapes (:data:`STACKS`), their layers (the reference layers
of :mod:`models.reference_layers`, :data:`LAYERS`) under a policy (JAX's and MaxText's,
:data:`POLICIES`), the language models' heads, and :func:`build` (a stack's loss and inputs)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import invact_jax
from invact_jax import planner, targets
from invact_jax.planner import MAXTEXT_PRESETS
from models import reference_layers
from models.benchmarks.frontier.schema import Row, Spec


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
SAVED = {"full": (), **{name: MAXTEXT_PRESETS[name] for name in (
    "minimal", "save_qkv_proj", "save_dot_except_mlp", "save_out_proj")}}


def offloaded():
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
       for name, saved in SAVED.items() if saved},
    "minimal_offloaded": offloaded,
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


#: A stack's layer by kind (:mod:`models.reference_layers`).
LAYERS = {"llama": reference_layers.llama_layer, "gpt2": reference_layers.gpt2_layer,
          "vit": reference_layers.vit_layer}


def _block(s: Shape, named: bool = True):
  """``layer(p, x)`` of kind ``s.kind`` (:data:`LAYERS`), its attention cuDNN's where the
  program compiles for a GPU in 16 bits (:func:`models.reference_layers.fastest_attention`),
  with MaxText's checkpoint names (``named``) or with none (a layer as most hand-written code
  is)."""
  return functools.partial(LAYERS[s.kind], heads=s.heads, named=named,
                           attention=reference_layers.fastest_attention)


def tags(s: Shape) -> tuple[str, ...]:
  """The ``checkpoint_name`` s a layer of ``s`` tags (MaxText's)."""
  return reference_layers.TAGS["llama" if s.kind == "llama" else "gpt2"]


#: An LM's head: the plain logits + optax, tokamax's chunked loss (invact: invert's).
HEADS = ("plain", "tokamax")


def tokamax_loss():
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
    fn = tokamax_loss()
    if fn is None:
      raise RuntimeError("tokamax (with linear_softmax_cross_entropy_loss) is not installed")
    return fn(h.reshape(-1, s.d), labels.reshape(-1), w.T if s.tied else w, reduction="mean",
              implementation="chunked_xla")
  logits = h @ w.T if s.tied else h @ w  # what users write: the logits in the compute dtype
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def _params(s: Shape, dtype, unrolled: bool = False):
  """The layers' parameters, stacked (``unrolled``: a list, one entry per layer), and, for a
  language model, the embedding, the final norm and an untied head, in the parameters'
  dtype."""
  kind = "llama" if s.kind == "llama" else "gpt2"
  pdtype = jnp.dtype(s.param_dtype or dtype)
  keys = jax.random.split(jax.random.key(0), s.layers + 2)
  layers = [reference_layers.init_layer(kind, s.d, s.ff, pdtype, k, s.kv_width) for k in keys[:-2]]
  params = {"layers": layers if unrolled else jax.tree.map(lambda *a: jnp.stack(a), *layers)}
  if s.vocab:
    params["embed"] = (jax.random.normal(keys[-2], (s.vocab, s.d)) / math.sqrt(s.d)).astype(pdtype)
    params["norm"] = jnp.ones((s.d,), pdtype)
    if not s.tied:
      params["head"] = (jax.random.normal(keys[-1], (s.d, s.vocab)) / math.sqrt(s.d)).astype(pdtype)
  return params


def build(s: Shape, policy: str, invact: bool, dtype,
          runs: list | None = None, head: str = "plain", named: bool = True,
          unrolled: bool = False) -> tuple[Callable, tuple]:
  """``(loss(params, inputs...), (params, inputs...))``: the stack under ``lax.scan``, each
  layer under ``jax.checkpoint(policy)``; for a language model (``s.vocab``) from tokens
  through the embedding, the final norm and ``head`` to the mean cross-entropy.  ``invact``:
  ``invert`` of the layer (a stack) or of the whole loss (a language model: its head too).
  ``runs`` (a plan; ``policy`` is then ignored): ``[[layers, [tags kept], [tags offloaded]],
  ...]`` in forward order (the third entry optional), each run a ``lax.scan`` of its own over
  its slice of the parameters, its layers under ``save_only_these_names(*kept)`` or, where it
  offloads, ``save_and_offload_only_these_names`` to ``pinned_host``.  ``named``: the
  layers tag their projections with MaxText's ``checkpoint_name`` s (else no names).
  ``unrolled``: the layers one after another, each with its own parameters (a list; MaxText's
  ``scan_layers=False``), not a ``lax.scan`` over stacked ones: no residual is stacked into a
  [layers, ...] buffer in the forward and sliced out of it in the backward (on an H200 the
  scan's copies took about 27 ms of llama3-1b's step, docs/profile.md), for a longer compile
  and whatever the compiler's schedule of the unrolled program keeps."""
  dtype = jnp.dtype(dtype)
  params = _params(s, dtype, unrolled)
  block = _block(s, named)
  if s.param_dtype and jnp.dtype(s.param_dtype) != dtype:  # cast where used, as MaxText
    layer_fn = block
    block = lambda p, x: layer_fn(jax.tree.map(lambda a: a.astype(dtype), p), x)  # noqa: E731
  if invact and not s.vocab:
    block = invact_jax.invert(block)

  def remat(pol, none: bool = False):
    if callable(pol) and pol is offloaded:
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
      if unrolled:  # each layer its own parameters and operations: nothing stacked
        for p in stacked[start:start + n]:
          h = layer(p, h)
      else:
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


def shape_of(spec: Spec) -> Shape:
  s = STACKS[spec["stack"]]
  return dataclasses.replace(s, **{k: spec[k] for k in ("layers", "batch") if spec.get(k)})


def head_of(spec: Spec) -> str:
  """A row's head: "" for a stack without one, invert's ("invact") with invact, else the
  spec's ("plain" by default)."""
  if not STACKS[spec["stack"]].vocab:
    return ""
  return "invact" if spec["invact"] else spec.get("head", "plain")


#: What a row's ``configuration`` ends with where its layers are unrolled (``Spec.unrolled``).
UNROLLED = " unrolled"


def row_key(spec: Spec) -> Row:
  """The fields that name a JAX row (``configuration`` "default": no remat; a plan's
  ``configuration`` is given)."""
  configuration = spec.get("configuration") or (
      ("default" if spec["policy"] == "none" else spec["policy"])
      + (UNROLLED if spec.get("unrolled") else ""))
  return {"model": spec["stack"], "framework": "jax", "invact": spec["invact"],
          "configuration": configuration, "head": head_of(spec), "dtype": spec["dtype"]}


def head_tiles(s: Shape, platform: str) -> dict:
  """The tiles :func:`invact_jax.invert` gives a language model's head on ``platform``
  (:func:`invact_jax.ops.cross_entropy.base.default_tiles`, per gradient mode): an invact
  row records them, and a later run carries it over only while they are the same."""
  from invact_jax.ops.cross_entropy import base  # pylint: disable=import-outside-toplevel
  return {"platform": platform, **{m: list(base.default_tiles(s.tokens, s.vocab, m, platform))
                                   for m in base.GRADIENTS}}
