"""The frontier's rows reported: their Pareto front, the markdown table, the headline rows
and the plot."""
from __future__ import annotations

import json
import jax.numpy as jnp

from models.benchmarks.frontier import model_stack, planning
from models.benchmarks.frontier.schema import Row


def pareto(rs: list[Row]) -> list[Row]:
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


def plan_note(r: Row) -> str:
  """A plan row's runs (or what invact_jax.plan chose) and its prediction (empty for other
  rows)."""
  if "plan_program" in r:
    kept = ", ".join(r["plan_keeps"]) or "nothing"
    choice = ("as written" if r.get("plan_as_written") else
              f"JAX's {r['plan_policy']}" if r.get("plan_policy") else f"keeps [{kept}]")
    program = "invert(loss)" if r["plan_program"] == "inverted" else "the loss as written"
    note = (f"invact_jax.plan of {program}: {choice}"
            + (f"; offload {', '.join(r['plan_offloads'])}" if r.get("plan_offloads") else ""))
  elif "runs" in r:
    note = " + ".join(f"{run[0]}×[{', '.join(run[1]) or 'nothing'}"
                      + (f"; offload {', '.join(run[2])}" if len(run) > 2 else "") + "]"
                      for run in r["runs"])
  else:
    return ""
  note += f"; predicted {r['predicted_bytes'] / 2**20:,.1f} MiB"
  if "prediction_error" in r:  # (at most that, where the bytes are the compile's peak)
    note += f" ({'≤ ' if compile_peak(r) else ''}{r['prediction_error']:+.1%})"
  if r.get("predicted_step_ms") is not None:
    note += f", {r['predicted_step_ms']:.1f} ms"
  return note


def per_token_layer(r: Row) -> float:
  """A row's activation bytes per token and layer, in units of ``d`` elements of its dtype
  (the floor of a pre-norm Llama layer is about 6 d + 2 ff; a language model's head counts
  in)."""
  s = model_stack.STACKS[r["model"]]
  layers = r.get("layers") or s.layers
  batch = r.get("batch") or s.batch
  itemsize = jnp.dtype(r.get("dtype", "bfloat16")).itemsize
  return r["activation_bytes"] / (batch * s.seq * layers * s.d * itemsize)


#: Committed device rows whose activation bytes are their process's compile's peak, not their
#: step's, by (date, model, configuration, invact, head, batch): rows measured before each row
#: compiled in a process of its own (:func:`~.measurement.isolated_row`).  A device
#: allocator's peak never resets and a compile for a GPU autotunes on the device, so a step
#: whose own peak lies under its compile's reported the compile's.  2026-11-29, H200, batch 3:
#: three invert rows of llama3-1b, predicted 4.45, 6.59 and 6.77 GiB by deviceless compile,
#: measured 8,408,260,508 bytes each — to the byte, which three programs' steps do not do and
#: one compile's buffers (the head's matmuls') do.  Their bytes bound the steps' from above.
COMPILE_PEAKS = frozenset({
    ("2026-11-29", "llama3-1b", "full", True, "invact", 3),
    ("2026-11-29", "llama3-1b", "save_qkv_proj", True, "invact", 3),
    ("2026-11-29", "llama3-1b", "program plan 10 %", True, "invact", 3)})


def compile_peak(r: Row) -> bool:
  """Whether row ``r``'s activation bytes are its compile's peak (:data:`COMPILE_PEAKS`; never
  a row that compiled in a process of its own, which carries ``compile_cache``)."""
  return "compile_cache" not in r and (
      r.get("date"), r.get("model"), r.get("configuration"), r.get("invact"), r.get("head"),
      r.get("batch")) in COMPILE_PEAKS


def markdown(rs: list[Row]) -> str:
  """The rows as a markdown table (``front``: on the model's Pareto front; ``d per
  token-layer``: :func:`per_token_layer`; ``≤``: the compile's peak bounds the step's,
  :func:`compile_peak`)."""
  lines = ["| model | framework | configuration | invact | head | activations MiB | "
           "d per token-layer | step ms | front | plan |",
           "|---|---|---|---|---|---:|---:|---:|---|---|"]
  for r in rs:
    head = r.get("head") or "—"
    if "error" in r:
      lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                   f"{'yes' if r['invact'] else 'no'} | {head} | — | — | — | {r['error']} | |")
      continue
    lines.append(f"| {r['model']} | {r['framework']} | {r['configuration']} | "
                 f"{'yes' if r['invact'] else 'no'} | {head} | "
                 f"{'≤ ' if compile_peak(r) else ''}{r['activation_bytes'] / 2**20:,.1f} | "
                 f"{per_token_layer(r):.1f} | {r['step_ms']:.1f} | "
                 f"{'*' if r.get('pareto') else ''} | {plan_note(r)} |")
  return "\n".join(lines)


def newest_per_model(paths) -> list:
  """Of frontier JSONs ``frontier_<device>_<date>.json`` (dry runs skipped), per device and
  model the rows of the newest file that measured the model (rows of one model are never
  mixed across runs: their step times compare only within a run).  Returns ``[(path,
  data)]``, ``data`` holding only the models taken from that file; newest first per device."""
  import pathlib  # pylint: disable=import-outside-toplevel
  by_device: dict = {}
  for p in sorted(map(pathlib.Path, paths)):
    by_device.setdefault(p.stem.rsplit("_", 1)[0], []).append(p)
  out = []
  for device in sorted(by_device):
    taken: set = set()
    for p in reversed(by_device[device]):
      data = json.loads(p.read_text())
      if data.get("dry") or data.get("deviceless"):
        continue
      models = {r["model"] for r in data["rows"] if "error" not in r} - taken
      if models:
        out.append((p, {**data, "rows": [r for r in data["rows"] if r["model"] in models]}))
        taken |= models
  return out


def headline_rows(data: dict, path: str) -> list[str]:
  """The README headline's rows from a frontier JSON (``path`` as linked): per model, the
  fastest JAX-only configuration and the fastest with invact whose activations fit 10 %, 25 %
  and 50 % of JAX default's and PyTorch + Liger's (the invact row's step against Liger's too),
  each where that row was measured; ``≤`` where the bytes are the compile's peak
  (:func:`compile_peak`: they fit where the bound does)."""
  ok = [r for r in data["rows"] if "error" not in r]
  source = f"[{path.rsplit('/', 1)[-1]}]({path}) · [docs](docs/gpu-report.md)"
  where = f"{data['device']}, JAX {data.get('versions', {}).get('jax', '?')}, {data['date']}"
  out = []
  for model in sorted({r["model"] for r in ok}):
    mine = [r for r in ok if r["model"] == model]
    default = planning.jax_row(mine, model, "default", False)
    budgets = [] if default is None else [
        (f"{f:.0%} of JAX default's", f * default["activation_bytes"]) for f in (0.1, 0.25, 0.5)]
    liger = next((r for r in mine if r["framework"] == "torch" and r["configuration"] == "liger"),
                 None)
    if liger is not None:
      budgets.append((f"PyTorch + Liger's ({liger['activation_bytes'] / 2**30:.2f} GiB, "
                      f"{liger['step_ms']:.1f} ms)", liger["activation_bytes"]))

    def best(invact, budget):  # a plan is invact's whatever configuration it chose
      fits = [r for r in mine if r["framework"] == "jax" and r["activation_bytes"] <= budget
              and (r["invact"] or r["configuration"].startswith("plan")) == invact]
      return min(fits, key=lambda r: r["step_ms"], default=None)

    def cell(r):
      return ("none fits" if r is None else
              f"{r['configuration']}: {r['step_ms']:.1f} ms, "
              f"{'≤ ' if compile_peak(r) else ''}{r['activation_bytes'] / 2**30:.2f} GiB")
    for label, budget in budgets:
      j, i = best(False, budget), best(True, budget)
      ratio = f" ({i['step_ms'] / j['step_ms']:.2f}×" if i and j else ""
      if i and liger is not None and budget == liger["activation_bytes"]:
        ratio += f"{'; ' if ratio else ' ('}{i['step_ms'] / liger['step_ms']:.2f}× Liger's"
      ratio += ")" if ratio else ""
      out.append(f"| frontier: {model}, fastest within {label} activations | {cell(j)} | "
                 f"{cell(i)}{ratio} | {where} | {source} |")
  return out


def plot(rs: list[Row], path) -> None:
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
