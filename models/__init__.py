"""Flax NNX models built on invact_jax (ViT; BERT/GPT-2/Llama-style text transformers), their
presets by name, hand-written reference layers, third-party models for the conversion, and the
planner's profiles of them.  Training (:mod:`models.training`) and benchmarks
(:mod:`models.benchmarks`) are packages of their own: they import the models, never the other
way round."""
