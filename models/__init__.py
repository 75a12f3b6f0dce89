"""Flax NNX model definitions (ViT, BERT/GPT-2/Llama-style text transformers) built on
invact_jax; experiment code lives in :mod:`models.experiments`."""
