"""Benchmarks and reports behind ``scripts/``: each module measures one thing and writes its
JSON/markdown; rows that need a fresh process run as ``python -m models.benchmarks.<name>``
through :mod:`.child`.

* :mod:`.op_speed`, :mod:`.sass`: op timings, HLO counts, bandwidth, SASS statistics;
* :mod:`.model_memory`: memory/time rows per model and configuration;
* :mod:`.floor`: hand-written layers' per-layer floor figures;
* :mod:`.parity`: standard vs inverted over seeds;
* :mod:`.plan_memory`, :mod:`.plan_program`: ``invact_jax.plan``'s memory-time frontier on
  the project's models and on third-party programs;
* :mod:`.lm_head`, :mod:`.lm_head_torch`: the LM head benchmark and its PyTorch rows;
* :mod:`.frontier`, :mod:`.frontier_torch`: the full-model memory-time frontier;
* :mod:`.gpu_report`: the GPU report's sections; :mod:`.headline`: the README's table.
"""
