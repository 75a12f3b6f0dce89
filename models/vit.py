"""Vision Transformer (Flax NNX) with presets Ti/16, S/16, B/16 and a small 8x8 ``digits``."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models import layers
from models import options


@dataclasses.dataclass(frozen=True)
class ViTConfig(options.BlockOptions):
  """ViT hyper-parameters; block sizes and memory options from ``options.BlockOptions``."""
  image_size: int = 224
  patch_size: int = 16
  channels: int = 3
  num_classes: int = 1000

  def __post_init__(self):
    super().__post_init__()
    if self.image_size % self.patch_size:
      raise ValueError(f"image_size ({self.image_size}) must be divisible by patch_size "
                       f"({self.patch_size})")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


PRESETS = {
    "ti16": ViTConfig(hidden=192, depth=12, heads=3, mlp_dim=768),
    "s16": ViTConfig(hidden=384, depth=12, heads=6, mlp_dim=1536),
    "b16": ViTConfig(hidden=768, depth=12, heads=12, mlp_dim=3072),
    # scikit-learn's 8x8 digits: 2x2 patches -> 16 tokens + [CLS].
    "digits": ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, hidden=64,
                        depth=4, heads=4, mlp_dim=128, dropout=0.1),
}


class ViT(nnx.Module):
  """Patch embedding (Conv) + [CLS] + learned positions + pre-norm encoder + head."""

  def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    p, d = cfg.patch_size, cfg.hidden
    self.embedding = nnx.Conv(cfg.channels, d, kernel_size=(p, p), strides=(p, p),
                              padding="VALID", dtype=cfg.dtype, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d)))
    self.pos_embedding = nnx.Param(
        jax.random.normal(rngs.params(), (1, cfg.num_patches + 1, d)) * 0.02)
    self.encoder = layers.Stack(cfg, lambda r: layers.PreNormBlock(cfg, rngs=r), rngs=rngs)
    self.encoder_norm = nnx.LayerNorm(d, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    self.head = nnx.Linear(d, cfg.num_classes, rngs=rngs)

  def __call__(self, images, key=None):
    """images: [batch, H, W, C] float -> logits [batch, num_classes] (float32).

    ``key``: dropout key (None: deterministic, e.g. evaluation).
    """
    x = self.embedding(images.astype(self.cfg.dtype))
    b = x.shape[0]
    x = x.reshape(b, -1, self.cfg.hidden)
    cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (b, 1, self.cfg.hidden))
    x = jnp.concatenate([cls, x], axis=1) + self.pos_embedding[...].astype(x.dtype)
    x = self.encoder(x, key)
    x = layers.apply_norm(self.encoder_norm, x, self.cfg.norm_mode, self.cfg.implementation)
    return self.head(x[:, 0].astype(jnp.float32))
