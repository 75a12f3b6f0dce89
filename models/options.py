"""Model options: the transformer-block fields every config shares, and one vocabulary.

Memory *modes* say what an op keeps for the backward:

* ``activation_mode``: ``"standard"`` (``jax.nn``), ``"checkpointed"`` (``jax.checkpoint``
  around the activation: keeps its input, as PyTorch does) or ``"inverted"`` (keeps its
  output + a bit mask);
* ``norm_mode``: ``"standard"`` (Flax's norms), ``"inverted"`` (keeps xhat + float32 rstd) or
  ``"fused"`` (norm and the projections that read it keep one tensor; post-norm blocks,
  whose norm feeds the next block, run it as ``"inverted"``);
* ``softmax_mode``: ``"standard"`` or ``"inverted"`` (keeps only the probabilities);
* ``dropout_mode``: ``"standard"`` (a bool mask), ``"regenerate"`` (only the key) or
  ``"bits"`` (the mask packed 8 per byte);
* ``head_mode`` (text models' LM head and loss): ``"standard"`` (the logits [tokens,
  vocabulary] and their gradient materialized) or ``"chunked"``
  (``invact_jax.linear_cross_entropy``: one tile of logits at a time, forward and
  backward).  ViT's classification head is a few logits per image: it is always standard.

*Implementations* say how an op runs: ``implementation`` (None/"xla", "pallas", "triton")
for the invact_jax ops and ``attention`` ("auto": cuDNN's flash attention through
``jax.nn.dot_product_attention`` on a GPU in 16 bits with the standard softmax, else
"xla"; "xla": einsum + softmax, the probabilities materialized; "dot_product":
``jax.nn.dot_product_attention``'s default).

:data:`CONFIGURATIONS` names the combinations the scripts and benchmarks compare; the
baseline is always ``"standard"``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from invact_jax.ops import NAMES as _IMPLEMENTATION_NAMES
from invact_jax.ops.activations import registry

ACTIVATION_MODES = ("standard", "checkpointed", "inverted")
NORM_MODES = ("standard", "inverted", "fused")
SOFTMAX_MODES = ("standard", "inverted")
DROPOUT_MODES = ("standard", "regenerate", "bits")
HEAD_MODES = ("standard", "chunked")
ATTENTION_CHOICES = ("auto", "xla", "dot_product")
#: ``implementation``: how the invact_jax ops run (None: the library's default, XLA).
IMPLEMENTATION_CHOICES = (None, *_IMPLEMENTATION_NAMES)

#: Named memory configurations (model-config overrides).  "standard" is the baseline.
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    # JAX's default: every op as jax.nn/Flax writes it, the LM head's logits materialized.
    "standard": {"activation_mode": "standard", "head_mode": "standard"},
    "checkpointed": {"activation_mode": "checkpointed", "head_mode": "standard"},
    "inverted": {"activation_mode": "inverted"},
    # Norms and softmax too, unfused (their outputs stay taggable by a memory plan).
    "inverted-norms": {"activation_mode": "inverted", "norm_mode": "inverted",
                       "softmax_mode": "inverted"},
    # Every op of the block keeps its output (or bits, or nothing).
    "inverted-all": {"activation_mode": "inverted", "norm_mode": "fused",
                     "softmax_mode": "inverted", "dropout_mode": "regenerate"},
}

def configuration(name: str, *, implementation: str | None = None,
                  head_mode: str | None = None) -> dict[str, Any]:
  """The model-config overrides of configuration ``name``, with the ops' implementation
  and the LM head's mode where given.

  Args:
    name: a key of :data:`CONFIGURATIONS` (the memory modes).
    implementation: how the invact_jax ops run (:data:`IMPLEMENTATION_CHOICES`; None: the
      library's default).
    head_mode: the text models' LM head (:data:`HEAD_MODES`; None: the configuration's).

  Returns:
    The overrides, a dict of :class:`BlockOptions` fields.

  Raises:
    ValueError: an unknown name, implementation or head mode (the message names which).
  """
  if name not in CONFIGURATIONS:
    raise ValueError(f"unknown configuration {name!r}; choose from {tuple(CONFIGURATIONS)}")
  out = dict(CONFIGURATIONS[name])
  for field, value, allowed in (("implementation", implementation, IMPLEMENTATION_CHOICES[1:]),
                                ("head_mode", head_mode, HEAD_MODES)):
    if value is not None:
      if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; choose from {tuple(allowed)}")
      out[field] = value
  return out


# Every saveable tensor of a block, tagged with jax.ad_checkpoint.checkpoint_name.
TAGS = ("norm_attn", "query", "key", "value", "attn_probs", "attn_context", "attn_out",
        "norm_mlp", "mlp_pre", "mlp_act", "mlp_out")
#: ``remat``: the ``jax.checkpoint`` policy of each layer (None: no remat).
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  """Transformer-block sizes and memory options shared by every model config."""
  hidden: int = 768
  depth: int = 12
  heads: int = 12
  mlp_dim: int = 3072
  dropout: float = 0.0
  norm_eps: float = 1e-6
  activation: str = "gelu_tanh"          # a registry name (invact_jax.registry)
  activation_mode: str = "standard"
  scan_layers: bool = False
  remat: str = "none"
  save_names: tuple[tuple[str, ...], ...] | None = None
  attention: str = "auto"                # cuDNN flash attention where it runs, else "xla"
  norm_mode: str = "standard"
  softmax_mode: str = "standard"
  dropout_mode: str = "standard"
  head_mode: str = "chunked"             # text models' LM head (see the module doc)
  implementation: str | None = None
  dtype: str = "float32"  # compute dtype; parameters stay float32

  def __post_init__(self):
    validate(self)

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


def _one_of(cfg, field: str, allowed) -> None:
  if getattr(cfg, field) not in allowed:
    raise ValueError(f"{field} must be one of {tuple(allowed)}, got {getattr(cfg, field)!r}")


def validate(cfg) -> None:
  """Raise ValueError for option values no layer understands (message names the field)."""
  for field, allowed in (("activation_mode", ACTIVATION_MODES), ("norm_mode", NORM_MODES),
                         ("softmax_mode", SOFTMAX_MODES), ("dropout_mode", DROPOUT_MODES),
                         ("head_mode", HEAD_MODES),
                         ("attention", ATTENTION_CHOICES),
                         ("implementation", IMPLEMENTATION_CHOICES), ("remat", tuple(REMAT_POLICIES))):
    _one_of(cfg, field, allowed)
  if cfg.activation not in registry.ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(registry.ACTIVATIONS)}, got "
                     f"{cfg.activation!r}")
  for field in ("hidden", "depth", "heads", "mlp_dim"):
    v = getattr(cfg, field)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{field} must be a positive integer, got {v!r}")
  if not 0.0 <= cfg.dropout < 1.0:
    raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout!r}")
  if cfg.hidden % cfg.heads:
    raise ValueError(f"hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
  if cfg.save_names is not None:
    if len(cfg.save_names) not in (1, cfg.depth):
      raise ValueError(f"save_names must have 1 or depth ({cfg.depth}) entries, "
                       f"got {len(cfg.save_names)}")
    bad = sorted({t for names in cfg.save_names for t in names} - set(TAGS))
    if bad:
      raise ValueError(f"save_names: unknown tags {bad}; choose from {TAGS}")
