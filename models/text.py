"""Text transformers (Flax NNX): BERT-style encoder, GPT-2-style and Llama-style decoders.

Each takes token ids [batch, seq] and returns logits [batch, seq, vocab] (float32); the
LM head is tied to the token embedding (``nnx.Embed.attend``).  ``loss(tokens, labels)``
gives the per-token cross-entropy and whether each prediction is right; with
``head_mode="chunked"`` (the default) it never materializes the logits
(``invact_jax.linear_cross_entropy`` on the final hidden states and the embedding table).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax
from flax import nnx

import invact_jax
from models import layers
from models import options


@dataclasses.dataclass(frozen=True)
class TextConfig(options.BlockOptions):
  """Decoder/encoder hyper-parameters; block options from ``layers.BlockOptions``."""
  family: str = "gpt2"   # "bert", "gpt2" or "llama"
  vocab: int = 50257
  max_len: int = 1024
  norm_eps: float = 1e-5

  def __post_init__(self):
    if self.family not in ("bert", "gpt2", "llama"):
      raise ValueError(f"family must be 'bert', 'gpt2' or 'llama', got {self.family!r}")
    super().__post_init__()


PRESETS = {
    "bert-base": TextConfig(family="bert", vocab=30522, max_len=512, activation="gelu_erf",
                            norm_eps=1e-12),
    "gpt2": TextConfig(family="gpt2"),
    # A few-layer GPT-2 for byte-level text on a CPU (training parity study); vocab from the data.
    "gpt2-tiny": TextConfig(family="gpt2", vocab=256, max_len=512, hidden=128, depth=2, heads=4,
                            mlp_dim=512, dropout=0.1),
    "llama-small": TextConfig(family="llama", vocab=32000, max_len=2048, hidden=768, depth=12,
                              heads=12, mlp_dim=2048, activation="silu", norm_eps=1e-6),
    "llama-1b": TextConfig(family="llama", vocab=32000, max_len=2048, hidden=2048, depth=16,
                           heads=16, mlp_dim=5632, activation="silu", norm_eps=1e-6),
}


class TextTransformer(nnx.Module):
  """Embeddings + ``depth`` blocks of the family + final norm + tied LM head."""

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.token_embedding = nnx.Embed(cfg.vocab, cfg.hidden, dtype=cfg.dtype, rngs=rngs)
    if cfg.family != "llama":
      self.position_embedding = nnx.Embed(cfg.max_len, cfg.hidden, dtype=cfg.dtype, rngs=rngs)
    if cfg.family == "bert":
      self.type_embedding = nnx.Embed(2, cfg.hidden, dtype=cfg.dtype, rngs=rngs)
      self.embedding_norm = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
      make = lambda r: layers.PostNormBlock(cfg, rngs=r)
    elif cfg.family == "gpt2":
      make = lambda r: layers.PreNormBlock(cfg, causal=True, rngs=r)
    else:
      make = lambda r: layers.LlamaBlock(cfg, rngs=r)
    self.blocks = layers.Stack(cfg, make, rngs=rngs)
    if cfg.family == "gpt2":
      self.final_norm = nnx.LayerNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)
    elif cfg.family == "llama":
      self.final_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens, key=None):
    """Logits [batch, seq, vocab] in float32."""
    return self.token_embedding.attend(self.hidden(tokens, key)).astype(jnp.float32)

  def loss(self, tokens, labels, key=None):
    """``(loss, correct)`` per position [batch, seq]: the cross-entropy of the next-token
    labels (float32) and whether the largest logit is the label's."""
    x = self.hidden(tokens, key)
    if self.cfg.head_mode == "chunked":
      return invact_jax.linear_cross_entropy(
          x, self.token_embedding.embedding[...], labels, vocab_axis=0, reduction="none",
          return_correct=True, implementation=None)
    logits = self.token_embedding.attend(x).astype(jnp.float32)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            jnp.argmax(logits, -1) == labels)

  def hidden(self, tokens, key=None):
    """The final hidden states [batch, seq, hidden] (what the LM head reads)."""
    n = tokens.shape[1]
    if n > self.cfg.max_len:
      raise ValueError(f"sequence length {n} exceeds max_len {self.cfg.max_len}")
    x = self.token_embedding(tokens)
    if self.cfg.family != "llama":
      x = x + self.position_embedding(jnp.arange(n))[None]
    if self.cfg.family == "bert":
      x = layers.apply_norm(self.embedding_norm, x + self.type_embedding(jnp.zeros_like(tokens)),
                            self.cfg.norm_mode, self.cfg.implementation)
    x = self.blocks(x, key)
    if self.cfg.family != "bert":
      x = layers.apply_norm(self.final_norm, x, self.cfg.norm_mode, self.cfg.implementation)
    return x
