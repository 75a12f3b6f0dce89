"""Memory/time rows for model x dtype x batch x configuration (``scripts/benchmark_memory.py``).

A *configuration* is a named set of config-field overrides (``models.options.CONFIGURATIONS``;
every memory option is a field), e.g. ``"inverted"`` = ``{"activation_mode": "inverted"}``.  Each row reports, for one gradient step
(``value_and_grad`` of the loss w.r.t. all parameters):

* ``residual_bytes_per_layer``: non-argument residuals autodiff keeps, per block (from a
  1- and a 2-block model: the difference);
* ``compiled_temp_bytes``: XLA ``memory_analysis().temp_size_in_bytes`` of the compiled step;
* ``device_peak_bytes``: ``peak_bytes_in_use`` (GPU; None on CPU);
* ``step_time_s``: median wall time of the compiled step (optional).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from invact_jax import memory
from models import options, text, vit

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


def _residual_bytes(cfg, batch, seq_len, depth):
  c = cfg.replace(depth=depth, scan_layers=False, remat="none")
  loss, params, x, y = loss_and_inputs(c, batch, seq_len, jax.random.key(0))
  return sum(r.bytes for r in memory.residuals(loss, params, x, y) if not r.is_argument)


def gradient_step(model: str, dtype: str, batch: int, configuration: str, *, seq_len: int = 512,
                  scan_layers: bool = True, extra: dict | None = None):
  """``(cfg, jit(value_and_grad(loss)), (params, x, y))`` of a model under a named configuration."""
  overrides = {**options.configuration(configuration), **(extra or {})}
  cfg = model_config(model, dtype=dtype, scan_layers=scan_layers, **overrides)
  loss, params, x, y = loss_and_inputs(cfg, batch, seq_len, jax.random.key(0))
  return cfg, jax.jit(jax.value_and_grad(loss)), (params, x, y)


def measure(model: str, dtype: str, batch: int, configuration: str, *, seq_len: int = 512,
            scan_layers: bool = True, time_steps: int = 0, extra: dict | None = None) -> dict:
  """One row (see module doc)."""
  cfg, step, (params, x, y) = gradient_step(model, dtype, batch, configuration, seq_len=seq_len,
                                            scan_layers=scan_layers, extra=extra)
  per_layer = _residual_bytes(cfg, batch, seq_len, 2) - _residual_bytes(cfg, batch, seq_len, 1)
  comp = memory.compiled(step, params, x, y)
  peak = None
  if memory.reports_peak():
    peak = memory.device_peak(step, params, x, y)["peak_bytes_in_use"]
  times = []
  if time_steps:
    exe = step.lower(params, x, y).compile()
    jax.block_until_ready(exe(params, x, y))
    for _ in range(time_steps):
      t0 = time.perf_counter()
      jax.block_until_ready(exe(params, x, y))
      times.append(time.perf_counter() - t0)
  return {
      "model": model, "activation": cfg.activation, "dropout": cfg.dropout, "dtype": dtype,
      "batch": batch,
      "seq_len": None if isinstance(cfg, vit.ViTConfig) else seq_len,
      "configuration": configuration, "scan_layers": scan_layers,
      "residual_bytes_per_layer": per_layer, "compiled_temp_bytes": comp.temp,
      "device_peak_bytes": peak, "step_time_s": statistics.median(times) if times else None,
      "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__,
  }


def table(rows: list[dict]) -> str:
  """Markdown table with each row's saving vs the standard (JAX default) row of its group."""
  group = lambda r: (r["model"], r["activation"], r.get("dropout"), r["dtype"], r["batch"],
                     r["scan_layers"])
  base = {group(r): r for r in rows
          if r["configuration"] == "standard"}
  out = ["| model | activation | dropout | dtype | batch | configuration | residual MiB/layer "
         "| compiled temp MiB | vs default | device peak MiB | step time (s) |",
         "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
  mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f}"
  for r in rows:
    b = base.get(group(r))
    rel = "" if b is None else f"{100 * (r['compiled_temp_bytes'] / b['compiled_temp_bytes'] - 1):+.1f}%"
    st = "n/a" if r["step_time_s"] is None else f"{r['step_time_s']:.3f}"
    out.append(f"| {r['model']} | {r['activation']} | {r.get('dropout', 0.0)} | {r['dtype']} | "
               f"{r['batch']} | {r['configuration']} | "
               f"{mib(r['residual_bytes_per_layer'])} | {mib(r['compiled_temp_bytes'])} | {rel} | "
               f"{mib(r['device_peak_bytes'])} | {st} |")
  return "\n".join(out)
