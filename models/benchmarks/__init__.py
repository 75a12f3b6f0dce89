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
* :mod:`.gpu_report`: the GPU report's sections; :mod:`.headline`: the README's table;
* :mod:`.profile`: where a step's time goes, per XLA operation (``jax.profiler``).
"""
import os
import platform

__all__ = ["host", "versions"]


def host() -> str:
  """The machine's CPU model and core count (``/proc/cpuinfo``; else ``platform``), for the
  benchmarks' JSON beside the device: XLA:CPU's timings and float32 roundings depend on it
  (the conversion zoo's gradient errors moved between an Intel Xeon and an AMD EPYC host with
  the same code, 2026-11-27)."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), model)
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} cores"


def versions(*packages: str) -> dict[str, str | None]:
  """The installed version of each of ``packages`` (None where one is not installed), for the
  benchmarks' JSON beside the device."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  out = {}
  for name in packages:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out
