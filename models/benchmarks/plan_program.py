"""``invact_jax.plan`` on programs it was not written for (``scripts/plan_program.py``).

Per program: the compiled temp of ``jit(value_and_grad)`` under full remat and as written (no
remat); four budgets at 20, 40, 60 and 80 % of the way between them; at each, the plan's
predicted and compiled temp, its recompute FLOPs (predicted, and XLA's count of the compiled
step) beside the best fixed policy that fits (JAX's none / full / dots / dots_no_batch, and
MaxText's presets where the program has their names).  Recompute FLOPs of a step: its FLOPs
minus the same step without remat, from XLA's cost analysis of the compiled program — which
counts a loop's body once, so the difference is one layer's and is multiplied by the depth.
Also the time ``plan`` takes beside one compile of the program as written.  ``device``: the
compiles are for that target (``"h100"``: XLA:GPU without the device, docs/deviceless.md).

Programs: ``gpt2-hand``: a GPT-2 written by hand with its own ``checkpoint_name`` s (ln1,
qkv, attn, attn_out, ln2, fc1, fc2_in, fc2; attention as two einsums and a softmax, a tied
head); ``gpt2-named``: the frontier's GPT-2 stack with MaxText's names; ``llama``: the frontier's hand-written Llama language model (RMSNorm, grouped-query
attention in a flash-style ``custom_vjp``, SwiGLU, a tied head) with no ``checkpoint_name``
in it; ``llama-named``: the same with MaxText's names; ``llama-einsum``: a Llama written
plainly (attention as two einsums and a softmax, no names), as most hand-written code is;
``penzai-llama-stacked``: penzai's Llama with its layers in a ``LayerStack`` (its own scan),
whose fixed policies are applied the way ``plan`` applies a plan (the layer body under
``jax.checkpoint``).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
from models import benchmarks

__all__ = ["PROGRAMS", "FRACTIONS", "run", "rows", "rows_of", "table", "recompute_error"]

#: name -> (frontier shape fields, whether the layers carry MaxText's names)
PROGRAMS = {
    "gpt2-hand": (dict(kind="gpt2", d=256, heads=4, ff=1024, layers=6, seq=256, batch=4,
                       vocab=1024), "hand"),
    "gpt2-named": (dict(kind="gpt2", d=256, heads=4, ff=1024, layers=6, seq=256, batch=4,
                        vocab=1024, tied=True, param_dtype="float32"), True),
    "llama": (dict(kind="llama", d=256, heads=4, ff=704, layers=8, seq=256, batch=2,
                   kv_heads=2, vocab=4096, tied=True, param_dtype="float32"), False),
    "llama-named": (dict(kind="llama", d=256, heads=4, ff=704, layers=8, seq=256, batch=2,
                         kv_heads=2, vocab=4096, tied=True, param_dtype="float32"), True),
    "llama-einsum": (dict(kind="llama", d=256, heads=4, ff=704, layers=8, seq=256, batch=2,
                          vocab=4096), None),
    "penzai-llama-stacked": (None, None),
}
#: Where the budgets lie between full remat's compiled temp (0) and no remat's (1).
FRACTIONS = (0.2, 0.4, 0.6, 0.8)
_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
             "dots": jax.checkpoint_policies.checkpoint_dots,
             "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _einsum_llama(shape, policy: str, dtype):
  """``(loss, (params, tokens))`` of ``llama-einsum`` with its layers under ``policy``."""
  import optax  # pylint: disable=import-outside-toplevel
  from models import reference_layers as ref  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), shape.layers + 2)
  layers = [ref.init_layer("llama", shape.d, shape.ff, dtype, k) for k in keys[:-2]]
  params = {"layers": jax.tree.map(lambda *a: jnp.stack(a), *layers),
            "embed": jax.random.normal(keys[-2], (shape.vocab, shape.d), dtype) / 16,
            "norm": jnp.ones((shape.d,), dtype)}
  dh = shape.d // shape.heads
  mask = jnp.tril(jnp.ones((shape.seq, shape.seq), bool))

  def layer(x, p):
    h = ref.rms_norm(x, p["n1"])
    q, k, v = (ref.rope((h @ p[w]).reshape(*h.shape[:2], shape.heads, dh)) if w != "wv" else
               (h @ p[w]).reshape(*h.shape[:2], shape.heads, dh) for w in ("wq", "wk", "wv"))
    s = jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, k) / dh ** 0.5, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(x.shape)
    x = x + o @ p["wo"]
    h = ref.rms_norm(x, p["n2"])
    return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"], None
  if _POLICIES[policy] is not None:
    layer = jax.checkpoint(layer, policy=_POLICIES[policy], prevent_cse=False)
  tokens = jax.random.randint(keys[-1], (shape.batch, shape.seq + 1), 0, shape.vocab)

  def loss(params, tokens):
    h = jax.lax.scan(layer, params["embed"][tokens[:, :-1]], params["layers"])[0]
    logits = ref.rms_norm(h, params["norm"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss, (params, tokens)


def _hand_gpt2(shape, policy: str, dtype):
  """``(loss, (params, tokens))`` of ``gpt2-hand`` with its layers under ``policy``."""
  from jax.ad_checkpoint import checkpoint_name as name  # pylint: disable=import-outside-toplevel
  d, h, t, b = shape.d, shape.heads, shape.seq, shape.batch
  keys = jax.random.split(jax.random.key(0), 6)
  n = lambda k, *s: jax.random.normal(k, (shape.layers, *s), dtype) * 0.02  # noqa: E731
  ones, zeros = jnp.ones((shape.layers, d), dtype), jnp.zeros((shape.layers, d), dtype)
  params = {"layers": {"g1": ones, "b1": zeros, "g2": ones, "b2": zeros,
                       "wqkv": n(keys[0], d, 3 * d), "wo": n(keys[1], d, d),
                       "w1": n(keys[2], d, shape.ff), "w2": n(keys[3], shape.ff, d)},
            "embed": jax.random.normal(keys[4], (shape.vocab, d), dtype) * 0.02}

  def norm(x, g, bias):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g + bias

  def layer(x, p):
    y = name(norm(x, p["g1"], p["b1"]), "ln1")
    qkv = name(y @ p["wqkv"], "qkv").reshape(b, t, 3, h, d // h)
    q, k, v = (qkv[:, :, i] for i in range(3))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / (d // h) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = name(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, d), "attn")
    x = x + name(a @ p["wo"], "attn_out")
    y = name(norm(x, p["g2"], p["b2"]), "ln2")
    f = name(jax.nn.gelu(name(y @ p["w1"], "fc1")), "fc2_in")
    return x + name(f @ p["w2"], "fc2"), None
  if _POLICIES.get(policy) is not None:
    layer = jax.checkpoint(layer, policy=_POLICIES[policy], prevent_cse=False)
  tokens = jax.random.randint(keys[5], (b, t + 1), 0, shape.vocab)

  def loss(params, tokens):
    x = jax.lax.scan(layer, params["embed"][tokens[:, :-1]], params["layers"])[0]
    logits = (x @ params["embed"].T).astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return -picked.mean()
  return loss, (params, tokens)


def _flops(fn: Callable, args) -> float:
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  return memory.flops(jax.value_and_grad(fn), *args)


def _temp(fn: Callable, args) -> int:
  from invact_jax import memory  # pylint: disable=import-outside-toplevel
  return memory.compiled(jax.value_and_grad(fn), *args).temp


def rows(name: str, dtype: str = "float32", layers: int | None = None,
         progress: Callable[[str], None] = lambda m: None) -> list[dict]:
  """The rows of one program (see the module doc)."""
  from models.benchmarks import frontier  # pylint: disable=import-outside-toplevel
  fields, named = PROGRAMS[name]
  if fields is None:
    return rows_of(name, *_penzai(layers, dtype), dtype,
                 ["none", "full", "dots", "dots_no_batch"], progress)
  shape = frontier.Shape(**{**fields, **({"layers": layers} if layers else {})})
  if named is None:
    build = lambda policy: _einsum_llama(shape, policy, jnp.dtype(dtype))  # noqa: E731
  elif named == "hand":
    build = lambda policy: _hand_gpt2(shape, policy, jnp.dtype(dtype))  # noqa: E731
  else:
    build = lambda policy: frontier.build(shape, policy, False, jnp.dtype(dtype), named=named)  # noqa: E731
  policies = ["none", "full", "dots", "dots_no_batch"] + (
      [p for p in frontier.POLICIES if p in _maxtext()] if named is True else [])
  return rows_of(name, lambda policy: build(policy)[0], build("none")[1], shape.layers, dtype,
               policies, progress)


def _maxtext() -> dict:
  from invact_jax import planner  # pylint: disable=import-outside-toplevel
  return planner.MAXTEXT_PRESETS


def _penzai(layers: int | None, dtype: str):
  """(policy -> loss, args, layers) of penzai's stacked Llama (size "plan")."""
  from invact_jax import planner  # pylint: disable=import-outside-toplevel
  from models import third_party  # pylint: disable=import-outside-toplevel
  if layers:
    raise ValueError("--layers: penzai-llama-stacked has the 8 layers of size 'plan'")
  loss, params = third_party.build("penzai_llama_stacked", "plan", jnp.dtype(dtype))
  with_policy = {"none": loss, "full": planner.apply_plan(loss, (), ()),
                 **{p: planner.apply_plan(loss, (), (), p) for p in planner.FIXED_POLICIES}}
  return with_policy.get, (params,), third_party.SIZES["plan"][1]


def rows_of(name: str, build: Callable, args: tuple, depth: int, dtype: str, policies: list,
          progress: Callable[[str], None], *, fractions: tuple = FRACTIONS,
          convert: bool = False) -> list[dict]:
  """The rows of program ``name``: ``build(policy)`` its loss under a fixed policy; plans at
  budgets at ``fractions`` of the way from full remat's compiled temp to no remat's, with
  ``invact_jax.invert`` of the loss as an operator variant where ``convert``."""
  import invact_jax  # pylint: disable=import-outside-toplevel
  loss = build("none")
  progress(f"{name} none")
  t0 = time.perf_counter()
  fixed = {"none": (_temp(loss, args), 0.0)}  # one compile of the program as written, timed
  compile_s = time.perf_counter() - t0
  none_flops = _flops(loss, args)
  for policy in policies:
    if policy in fixed:
      continue
    progress(f"{name} {policy}")
    fn = build(policy)
    fixed[policy] = (_temp(fn, args), depth * (_flops(fn, args) - none_flops))
  low, high = fixed["full"][0], fixed["none"][0]
  out = []
  for fraction in fractions:
    budget = int(low + fraction * (high - low))
    progress(f"{name} plan at {budget:,} B")
    t0 = time.perf_counter()
    planned = invact_jax.plan(loss, *args, budget=budget, convert=convert)
    plan_s = time.perf_counter() - t0
    r = planned.report
    fits = {p: f for p, (t, f) in fixed.items() if t <= budget}
    best = min(fits, key=fits.get) if fits else None
    # (XLA counts a loop's body once: a plan of several runs has one body per run)
    compiled = (depth * (_flops(planned, args) - none_flops) if not r.runs
                else r.predicted_recompute_flops)
    out.append({
        "program": name, "dtype": dtype, "layers": depth, "budget": budget,
        "fraction": fraction, "runs": [list(map(list, x[:2])) + [x[2]] for x in r.runs],
        "predicted_recompute_flops": r.predicted_recompute_flops,
        "recompute_error": recompute_error(r.predicted_recompute_flops, compiled,
                                           fixed["full"][1]),
        "compared": list(r.compared),
        "configuration": r.configuration,
        "keep": list(r.keep), "offload": list(r.offload), "as_written": r.as_written,
        "policy": r.policy, "alternatives": list(r.alternatives),
        "predicted_bytes": r.predicted_bytes, "compiled_bytes": r.compiled_bytes,
        "prediction_error": r.predicted_bytes / r.compiled_bytes - 1.0,
        "recompute_flops": compiled,
        "best_fixed": best, "best_fixed_recompute_flops": fits.get(best),
        "plan_seconds": plan_s, "compile_seconds": compile_s,
        "tensors": [dataclasses.asdict(t) for t in r.tensors],
        "fixed": {p: {"compiled_bytes": t, "recompute_flops": f} for p, (t, f) in fixed.items()}})
  return out


def recompute_error(predicted: float, compiled: float, full: float) -> float | None:
  """``predicted / compiled - 1``; 0 where both are nothing (XLA's count of a step without
  recompute differs from no remat's by a few operations: under a millionth of full remat's
  recompute), None where only the prediction is."""
  floor = 1e-6 * full
  if compiled <= floor:
    return 0.0 if predicted <= floor else None
  return predicted / compiled - 1.0


def table(rs: list[dict]) -> str:
  """The rows as a markdown table."""
  lines = ["| program | layers | budget MiB | plan keeps | predicted MiB | compiled MiB | error | "
           "recompute GFLOP (predicted) | best fixed that fits | its GFLOP | "
           "plan s / compile s |",
           "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|"]
  mib = lambda b: f"{b / 2**20:,.2f}"  # noqa: E731
  for r in rs:
    keep = ("as written" if r["as_written"]
            else "no remat" if r.get("policy") in ("none", "everything")
            else f"{r['policy']}" if r.get("policy")
            else f"{len(r['runs'])} runs" if r.get("runs")
            else (", ".join(r["keep"]) or "(nothing)"))
    if r.get("configuration", "as written") != "as written":
      keep = f"{r['configuration']}: {keep}"
    fixed = r["best_fixed_recompute_flops"]
    lines.append(
        f"| {r['program']} | {r['layers']} | {mib(r['budget'])} | {keep} | "
        f"{mib(r['predicted_bytes'])} | {mib(r['compiled_bytes'])} | "
        f"{100 * r['prediction_error']:+.1f} % | {max(r['recompute_flops'], 0.0) / 1e9:.3f} "
        f"({r.get('predicted_recompute_flops', r['recompute_flops']) / 1e9:.3f}) | "
        f"{r['best_fixed'] or 'none fits'} | {'—' if fixed is None else f'{fixed / 1e9:.3f}'} | "
        f"{r['plan_seconds']:.1f} / {r['compile_seconds']:.1f} |")
  return "\n".join(lines)


def run(programs: list[str], dtype: str, layers: int | None, out: pathlib.Path | None,
        device: str | None = None) -> int:
  """``scripts/plan_program.py``'s job: the rows of ``programs`` (compiled for ``device``),
  printed and written."""
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  from invact_jax import targets  # pylint: disable=import-outside-toplevel
  bar = tqdm(desc="plan_program", unit="step")

  def progress(msg):
    bar.set_postfix_str(msg)
    bar.update()
  with targets.compiling_for(device):
    target = targets.current()
    rs = [r for name in programs for r in rows(name, dtype, layers, progress)]
  bar.close()
  print(table(rs))
  if out is not None:
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "python": platform.python_version(), "host": benchmarks.host(),
            "device": target.device_kind, "target": target.name,
            "deviceless": target.deviceless, "platform": target.platform, "dtype": dtype,
            "layers": layers}
    out.write_text(json.dumps({"meta": meta, "rows": rs}, indent=1))
    print(f"wrote {out}")
  return 0
