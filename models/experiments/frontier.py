"""The memory-time frontier against what users run instead (issue 42): a section of the GPU
report.

A stack of hand-written transformer layers (:mod:`models.experiments.floor`'s Llama, GPT-2
and ViT-style blocks) under ``lax.scan``, each layer under a ``jax.checkpoint`` *policy*,
with and without invact_jax (``invert`` of the layer), and the same stack in PyTorch (eager,
``torch.utils.checkpoint``, Liger-Kernel, both, ``torch.compile``;
:mod:`models.experiments.frontier_torch`) where torch is importable.  Per row: the
activation bytes (GPU: the allocator's peak minus the parameters, inputs and gradients, one
process per row; CPU: XLA's compiled temp, or for torch the bytes its autograd saves) and
the median step time.

Policies: JAX's (``none``, ``full`` = nothing saveable, ``dots``, ``dots_no_batch``) and
MaxText's presets by ``checkpoint_name`` (the layers tag their projections as MaxText does:
``query_proj``, ``key_proj``, ``value_proj``, ``out_proj``, ``mlpwi_0``, ``mlpwi_1``,
``mlpwo``): ``minimal`` (every projection), ``save_qkv_proj``, ``save_dot_except_mlp``,
``save_out_proj``, and ``minimal_offloaded`` (the projections offloaded to ``pinned_host``)
where the device has memory kinds.

``python -m models.experiments.frontier SPEC_JSON`` measures one row in its own process (the
allocator's peak never resets) and prints it as the last line.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import invact_jax
from invact_jax import memory
from models.experiments import floor

__all__ = ["STACKS", "POLICIES", "Shape", "build", "measure", "child", "rows", "pareto",
           "markdown", "plot"]


@dataclasses.dataclass(frozen=True)
class Shape:
  """A stack's shape: ``kind`` (``llama``, ``gpt2``, ``vit``), width, heads, MLP width,
  layers, sequence, batch."""
  kind: str
  d: int
  heads: int
  ff: int
  layers: int
  seq: int
  batch: int

  @property
  def tokens(self) -> int:
    return self.seq * self.batch


#: Issue 42's stacks; "dry" ones run on a CPU in seconds (the test suite's).
STACKS = {
    "llama-7b": Shape("llama", 4096, 32, 11008, 4, 4096, 1),
    "llama": Shape("llama", 1024, 16, 2816, 12, 1024, 24),
    "gpt2-medium": Shape("gpt2", 1024, 16, 4096, 24, 1024, 8),
    "vit-l16": Shape("vit", 1024, 16, 4096, 24, 197, 64),
    "dry-llama": Shape("llama", 64, 4, 176, 2, 16, 2),
    "dry-gpt2": Shape("gpt2", 64, 4, 256, 2, 16, 2),
}

_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "mlpwi_0",
                "mlpwi_1", "mlpwi", "mlpwo")
_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")


def _offloaded():
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(_PROJECTIONS),
      offload_src="device", offload_dst="pinned_host")


#: policy name -> a ``jax.checkpoint`` policy (None: no remat), or a factory (offload).
POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS),
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names(*_QKV),
    "save_dot_except_mlp": jax.checkpoint_policies.save_only_these_names(*_QKV, "out_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
    "minimal_offloaded": _offloaded,
}


def has_memory_kinds() -> bool:
  """Whether the device can offload to ``pinned_host`` (a GPU; not XLA:CPU)."""
  try:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  except Exception:  # pylint: disable=broad-except
    return False
  return jax.default_backend() != "cpu" and "pinned_host" in kinds


# ------------------------------------------------------------------------ the layers
def _attention(q, k, v, causal: bool):
  """cuDNN's flash attention on a GPU in 16 bits; elsewhere the flash-style custom_vjp of
  :mod:`models.experiments.floor` (the same residuals: q, k, v, o, a row log-sum-exp)."""
  if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return floor.flash_attention(q, k, v, causal)


def _block(s: Shape):
  """``layer(p, x)`` of kind ``s.kind`` with MaxText's checkpoint names."""
  dh = s.d // s.heads

  def attention(p, h, causal, rotary):
    b, t, _ = h.shape
    split = lambda y: y.reshape(b, t, s.heads, dh)  # noqa: E731
    q = split(checkpoint_name(h @ p["wq"], "query_proj"))
    k = split(checkpoint_name(h @ p["wk"], "key_proj"))
    v = split(checkpoint_name(h @ p["wv"], "value_proj"))
    if rotary:
      q, k = floor.rope(q), floor.rope(k)
    o = _attention(q, k, v, causal).reshape(b, t, s.d)
    return checkpoint_name(o @ p["wo"], "out_proj")

  def llama(p, x):
    x = x + attention(p, floor.rms_norm(x, p["n1"]), True, True)
    h = floor.rms_norm(x, p["n2"])
    g = checkpoint_name(h @ p["wg"], "mlpwi_0")
    u = checkpoint_name(h @ p["wu"], "mlpwi_1")
    return x + checkpoint_name((jax.nn.silu(g) * u) @ p["wd"], "mlpwo")

  def gpt2(p, x, causal=True):
    x = x + attention(p, floor.layer_norm(x, p["g1"], p["b1"]), causal, False)
    h = floor.layer_norm(x, p["g2"], p["b2"])
    a = jax.nn.gelu(checkpoint_name(h @ p["w1"], "mlpwi") + p["c1"], approximate=True)
    return x + checkpoint_name(a @ p["w2"], "mlpwo") + p["c2"]

  if s.kind == "llama":
    return llama
  return gpt2 if s.kind == "gpt2" else (lambda p, x: gpt2(p, x, causal=False))


def build(s: Shape, policy: str, invact: bool, dtype) -> tuple[Callable, tuple]:
  """``(loss(params, x), (params, x))``: the stack under ``lax.scan``, each layer under
  ``jax.checkpoint(policy)``, invact_jax's ``invert`` of the layer inside it."""
  kind = "llama" if s.kind == "llama" else "gpt2"
  keys = jax.random.split(jax.random.key(0), s.layers)
  layers = [floor.init_layer(kind, s.d, s.ff, dtype, k) for k in keys]
  params = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  x = (jax.random.normal(jax.random.key(1), (s.batch, s.seq, s.d), jnp.float32)).astype(dtype)
  layer = _block(s)
  if invact:
    layer = invact_jax.invert(layer)
  pol = POLICIES[policy]
  if callable(pol) and pol is _offloaded:
    pol = pol()
  if policy != "none":
    layer = jax.checkpoint(layer, policy=pol, prevent_cse=False)

  def loss(params, x):
    h, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return loss, (params, x)


def _key(spec: dict) -> dict:
  """The fields that name a JAX row (``configuration`` "default": no remat)."""
  return {"model": spec["stack"], "framework": "jax", "invact": spec["invact"],
          "configuration": "default" if spec["policy"] == "none" else spec["policy"],
          "dtype": spec["dtype"]}


def measure(spec: dict) -> dict:
  """One row: ``spec`` = {stack, policy, invact, dtype, repeats}."""
  s = STACKS[spec["stack"]]
  loss, args = build(s, spec["policy"], spec["invact"], jnp.dtype(spec["dtype"]))
  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(*args).compile()
  row = _key(spec)
  if memory.reports_peak():
    peak = memory.device_peak(step, *args)
    # activations: the step's peak increase minus what it returns (the gradients: params'
    # size) — the inputs were resident before
    row["activation_bytes"] = peak["peak_increase"] - peak["output_bytes"]
    row["memory"] = "device peak"
  else:
    row["activation_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    row["memory"] = "compiled temp"
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(spec.get("repeats", 5)):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  row["step_ms"] = 1e3 * statistics.median(times)
  return row


def child(spec: dict) -> dict:
  """A row measured in this process (``python -m models.experiments.frontier``)."""
  try:
    return measure(spec)
  except Exception as e:  # pylint: disable=broad-except  # out of memory, unsupported, ...
    text = str(e).strip().splitlines()
    return {**_key(spec), "error": f"{type(e).__name__}: {text[0][:200] if text else ''}"}


def _in_child(module: str, spec: dict, timeout_s: float, env=None) -> dict:
  cmd = [sys.executable, "-m", module, json.dumps(spec)]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                         timeout=None if math.isinf(timeout_s) else max(timeout_s, 1.0))
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout_s:.0f} s"}
  lines = out.stdout.strip().splitlines()
  try:
    return json.loads(lines[-1])
  except (IndexError, ValueError):
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def rows(stacks, *, dtype: str = "bfloat16", policies=None, repeats: int = 5,
         in_process: bool = False, torch_variants=None, deadline: float = math.inf,
         progress: Callable[[str], None] = lambda _: None) -> list[dict]:
  """Every (stack, policy, invact) row, then the torch rows where torch is importable."""
  policies = [p for p in (policies or POLICIES) if p != "minimal_offloaded" or has_memory_kinds()]
  out = []
  for name in stacks:
    for policy in policies:
      for invact in (False, True):
        if time.time() > deadline:
          progress("frontier: out of time")
          return out
        spec = {"stack": name, "policy": policy, "invact": invact, "dtype": dtype,
                "repeats": repeats}
        progress(f"frontier {name} {policy}{' +invact' if invact else ''}")
        out.append(child(spec) if in_process else
                   {**_key(spec), **_in_child("models.experiments.frontier", spec,
                                              deadline - time.time())})
  from models.experiments import frontier_torch  # pylint: disable=import-outside-toplevel
  if frontier_torch.importable():
    for name in stacks:
      for variant in (frontier_torch.VARIANTS if torch_variants is None else torch_variants):
        if time.time() > deadline:
          return out
        progress(f"frontier {name} torch {variant}")
        spec = {"stack": name, "variant": variant, "dtype": dtype, "repeats": repeats,
                "shape": dataclasses.asdict(STACKS[name])}
        res = _in_child("models.experiments.frontier_torch", spec, deadline - time.time())
        out.append({"model": name, "framework": "torch", "configuration": variant,
                    "invact": False, "dtype": dtype, **res})
  return out


def pareto(rs: list[dict]) -> list[dict]:
  """``rs`` with ``pareto`` set: no other row of the model is at least as fast with at most
  as many activation bytes (and better in one)."""
  for r in rs:
    if "error" in r:
      r["pareto"] = False
      continue
    r["pareto"] = not any(
        o is not r and "error" not in o and o["model"] == r["model"]
        and o["activation_bytes"] <= r["activation_bytes"] and o["step_ms"] <= r["step_ms"]
        and (o["activation_bytes"] < r["activation_bytes"] or o["step_ms"] < r["step_ms"])
        for o in rs)
  return rs


def markdown(rs: list[dict]) -> str:
  lines = ["| model | framework | configuration | invact | activations MiB | step ms | front |",
           "|---|---|---|---|---:|---:|---|"]
  for r in rs:
    if "error" in r:
      lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                   f"{'yes' if r['invact'] else 'no'} | — | — | {r['error']} |")
      continue
    lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                 f"{'yes' if r['invact'] else 'no'} | {r['activation_bytes'] / 2**20:,.1f} | "
                 f"{r['step_ms']:.1f} | {'*' if r.get('pareto') else ''} |")
  return "\n".join(lines)


def plot(rs: list[dict], path) -> None:
  """Step time against activation memory per model, the Pareto front drawn."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  models = sorted({r["model"] for r in rs if "error" not in r})
  fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4.5),
                           squeeze=False)
  for ax, m in zip(axes[0], models):
    pts = [r for r in rs if r["model"] == m and "error" not in r]
    for r in pts:
      style = {"jax": "o", "torch": "s"}[r["framework"]]
      color = "C1" if r["invact"] else ("C2" if r["framework"] == "torch" else "C0")
      ax.scatter(r["activation_bytes"] / 2**20, r["step_ms"], marker=style, c=color)
      ax.annotate(r["configuration"] + ("+inv" if r["invact"] else ""),
                  (r["activation_bytes"] / 2**20, r["step_ms"]), fontsize=6)
    front = sorted((r for r in pts if r.get("pareto")), key=lambda r: r["activation_bytes"])
    ax.plot([r["activation_bytes"] / 2**20 for r in front], [r["step_ms"] for r in front],
            "k--", lw=1, label="Pareto front")
    ax.set_xlabel("activation MiB")
    ax.set_ylabel("step ms")
    ax.set_title(m)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(out_dir, *, device: str, date: str, dry: bool, deadline: float = math.inf,
        progress: Callable[[str], None] = lambda _: None) -> dict:
  """The frontier section: rows for issue 42's stacks (``dry``: one tiny stack, two policies,
  in this process), their Pareto front, ``frontier_<device>_<date>.json`` (``device``,
  ``rows``), ``.md`` and ``.png`` in ``out_dir``."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  stacks = ["dry-llama"] if dry else ["llama", "llama-7b", "gpt2-medium", "vit-l16"]
  rs = pareto(rows(stacks, dtype="float32" if dry else "bfloat16",
                   policies=["none", "full"] if dry else None, repeats=2 if dry else 7,
                   in_process=dry, torch_variants=("eager", "checkpoint") if dry else None,
                   deadline=deadline, progress=progress))
  out = pathlib.Path(out_dir) / f"frontier_{re.sub(r'[^a-z0-9]+', '-', device.lower())}_{date}"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps({"device": device, "date": date, "dry": dry,
                                                  "rows": rs}, indent=1))
  out.with_suffix(".md").write_text(markdown(rs) + "\n")
  if any("error" not in r for r in rs):
    plot(rs, out.with_suffix(".png"))
  return {"json": str(out.with_suffix(".json")), "rows": rs}


if __name__ == "__main__":
  print(json.dumps(child(json.loads(sys.argv[1]))))
