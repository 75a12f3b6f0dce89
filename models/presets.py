"""The project's models by name (``vit-b16``, ``gpt2``, ``llama-1b``, ...): their configs, and
the loss and inputs of one gradient step, as the benchmarks, the planner's profiles and the
floor figures build them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import text, vit

MODELS = {
    "vit-ti16": ("vit", "ti16"), "vit-s16": ("vit", "s16"), "vit-b16": ("vit", "b16"),
    "bert-base": ("text", "bert-base"), "gpt2": ("text", "gpt2"),
    "llama-small": ("text", "llama-small"), "llama-1b": ("text", "llama-1b"),
}


def model_config(model: str, **overrides):
  kind, preset = MODELS[model]
  base = vit.PRESETS[preset] if kind == "vit" else text.PRESETS[preset]
  return base.replace(**overrides)


def loss_and_inputs(cfg, batch: int, seq_len: int, key):
  """``(loss(params, x, y), params, x, y)`` for one gradient step of model config ``cfg``."""
  k1, k2, k3 = jax.random.split(key, 3)
  if isinstance(cfg, vit.ViTConfig):
    model = vit.ViT(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(k1, (batch, cfg.image_size, cfg.image_size, cfg.channels))
    y = jax.random.randint(k2, (batch,), 0, cfg.num_classes)
  else:
    model = text.TextTransformer(cfg, rngs=nnx.Rngs(0))
    x = jax.random.randint(k1, (batch, seq_len), 0, cfg.vocab)
    y = jnp.roll(x, -1, axis=1)
  graphdef, params = nnx.split(model, nnx.Param)
  drop_key = k3 if cfg.dropout > 0 else None

  def loss(params, x, y):
    model = nnx.merge(graphdef, params)
    if isinstance(model, text.TextTransformer):  # its head_mode decides the logits' fate
      return model.loss(x, y, drop_key)[0].mean()
    return optax.softmax_cross_entropy_with_integer_labels(model(x, drop_key), y).mean()
  return loss, params, x, y
