"""Experiment code behind ``scripts/``: training, data, comparisons, benchmarks, planning.

Kept apart from the model definitions (``models.vit``, ``models.text``, ``models.layers``):
it imports them and ``invact_jax``; nothing imports it but the scripts and tests.

* :mod:`.data`: the embedded digits dataset, ``.npz`` image datasets, the offline text corpus;
* :mod:`.training`: the ViT training loop (checkpoints, resume, data parallelism);
* :mod:`.compare`: standard vs inverted from the same seed;
* :mod:`.model_memory`: memory/time rows per model and configuration;
* :mod:`.plan_profiles`: profiling models for the memory planner and checking plans;
* :mod:`.op_speed`: op timings, HLO op counts and bandwidth of the implementations.
"""
