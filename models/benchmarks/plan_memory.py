"""The planner's memory-time frontier on the project's own models (``scripts/plan_memory.py``),
by the one planner path, :func:`invact_jax.plan`.

Per model (layers scanned, every block's tensors named with ``checkpoint_name``:
:data:`models.options.TAGS`): the compiled temp and recompute FLOPs of JAX's fixed policies
(none, full, dots, dots_no_batch) and of MaxText-style presets over the models' names
(:data:`PRESETS`), each applied to the layer loop the way ``plan`` applies a plan; then
``plan`` at ``points`` budgets evenly spaced from full remat's compiled temp to no remat's,
with ``invact_jax.invert`` of the model as an operator variant (``convert``).  The rows are
:func:`models.benchmarks.plan_program.rows_of`'s (its module doc says what each column is);
written as JSON, a markdown table and a PNG of recompute FLOPs against compiled temp.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import sys
from typing import Callable

from models import benchmarks, cli
from models.benchmarks import plan_program

__all__ = ["PRESETS", "Options", "program", "run"]

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: MaxText's remat presets as sets of the project's tensor names (models.options.TAGS).
PRESETS: dict[str, tuple[str, ...]] = {
    "save_qkv_proj": ("query", "key", "value"),
    "save_dot_except_mlp": ("query", "key", "value", "attn_context", "attn_out"),
    "minimal": ("query", "key", "value", "attn_context", "attn_out", "mlp_pre", "mlp_out"),
}


@dataclasses.dataclass(frozen=True)
class Options:
  """What :func:`run` plans and writes (``scripts/plan_memory.py``'s flags)."""
  models: str = cli.option("vit-b16,gpt2", "comma list of models (models.presets.MODELS)")
  dtype: str = cli.option("bfloat16", "compute dtype", choices=("float32", "bfloat16"))
  batch: int = cli.option(8, "batch size", parse=cli.positive_int)
  seq_len: int = cli.option(512, "text models' sequence length", parse=cli.positive_int)
  points: int = cli.option(4, "budgets from full remat's compiled temp to no remat's",
                           parse=cli.positive_int)
  depth: int | None = cli.option(None, "override the preset's depth", parse=cli.positive_int)
  image_size: int | None = cli.option(None, "ViT: override the image size", parse=cli.positive_int)
  patch_size: int | None = cli.option(None, "ViT: override the patch size", parse=cli.positive_int)
  convert: bool = cli.option(True, "also plan invact_jax.invert of the model (its activations, "
                             "norms, softmax and head: MONeT's operator variants)")
  out: pathlib.Path = cli.option(ROOT / "bench" / "plan_memory", "output prefix (.json, .md, .png)")
  replot: pathlib.Path | None = cli.option(
      None, "redraw the table and PNG from a JSON this script wrote (no compiling)")


def program(model: str, *, dtype: str, batch: int, seq_len: int,
            overrides: dict) -> tuple[Callable[[str], Callable], tuple, int, list[str]]:
  """``(build, args, depth, policies)`` of one project model: ``build(policy)`` its loss with
  the layer loop under a fixed policy (``"none"``: no remat) or a :data:`PRESETS` entry."""
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax import planner  # pylint: disable=import-outside-toplevel
  from models import options, presets  # pylint: disable=import-outside-toplevel
  # Names on (a plan keeping every name: the model's own remat, which a plan replaces).
  cfg = presets.model_config(model, dtype=dtype, scan_layers=True,
                             save_names=(options.TAGS,), **overrides)
  loss, params, x, y = presets.loss_and_inputs(cfg, batch, seq_len, jax.random.key(0))
  apply = planner.apply_plan
  fixed = {"none": apply(loss, (), (), "none"), "full": apply(loss, (), ()),
           **{p: apply(loss, (), (), p) for p in planner.FIXED_POLICIES},
           **{p: apply(loss, tags, ()) for p, tags in PRESETS.items()}}
  return fixed.__getitem__, (params, x, y), cfg.depth, list(fixed)


def _plot(results: dict, path: pathlib.Path) -> None:
  """Per model, the plans' recompute FLOPs against their compiled bytes, the fixed policies
  beside them, written to ``path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
  for ax, (m, rows) in zip(axes[0], results.items()):
    ax.plot([r["compiled_bytes"] / 2**20 for r in rows],
            [r["recompute_flops"] / 1e9 for r in rows], "o-", label="invact_jax.plan (compiled)")
    for policy, f in rows[0]["fixed"].items():
      ax.scatter([f["compiled_bytes"] / 2**20], [f["recompute_flops"] / 1e9], marker="s",
                 alpha=0.7, color="tab:gray")
      ax.annotate(policy, (f["compiled_bytes"] / 2**20, f["recompute_flops"] / 1e9),
                  xytext=(4, 4), textcoords="offset points", fontsize=7)
    ax.set(title=m, xlabel="compiled temp MiB (layers scanned)", ylabel="recompute GFLOP")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _cannot_write(paths: list[pathlib.Path]) -> str | None:
  """Why one of ``paths`` cannot be written (its directory made if missing), or None."""
  for path in paths:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      cli.output_file(str(path))
    except (OSError, argparse.ArgumentTypeError) as e:
      return f"cannot write {str(path)!r} ({e})"
  return None


def _replot(path: pathlib.Path) -> int:
  """``--replot``: the table and plot again from a JSON this script wrote (one line and exit
  code 2 where it is missing, incomplete or its plot cannot be written)."""
  if not path.is_file():
    print(f"error: --replot: no such file {str(path)!r}", file=sys.stderr)
    return 2
  try:
    results = json.loads(path.read_text())["results"]
    table = plan_program.table([r for rows in results.values() for r in rows])
  except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
    print(f"error: --replot: {str(path)!r} is not a complete JSON written by this script "
          f"({type(e).__name__}: {e})", file=sys.stderr)
    return 2
  why = _cannot_write([path.with_suffix(".png")])
  if why:
    print(f"error: --replot: {why} (the PNG is drawn beside the JSON)", file=sys.stderr)
    return 2
  print(table)
  _plot(results, path.with_suffix(".png"))
  print(f"wrote {path.with_suffix('.png')}")
  return 0


def run(args: Options) -> int:
  """``scripts/plan_memory.py``'s job for its parsed command line ``args``; the exit code."""
  from models import presets  # pylint: disable=import-outside-toplevel
  if args.replot is not None:
    return _replot(args.replot)
  outputs = {x: args.out.with_name(args.out.name + x) for x in (".json", ".md", ".png")}
  why = _cannot_write(list(outputs.values()))
  if why:  # before any compiling: nothing measured and then lost
    print(f"error: --out: {why}", file=sys.stderr)
    return 2
  models = args.models.split(",")
  for m in models:
    if m not in presets.MODELS:
      print(f"error: unknown model {m!r}; choose from {sorted(presets.MODELS)}", file=sys.stderr)
      return 2
  if args.points < 2:
    print("error: --points must be at least 2", file=sys.stderr)
    return 2
  overrides = {k: v for k, v in (("depth", args.depth), ("image_size", args.image_size),
                                  ("patch_size", args.patch_size)) if v is not None}
  import jax  # pylint: disable=import-outside-toplevel
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  bar = tqdm(desc="plan_memory", unit="step")

  def progress(msg):
    bar.set_postfix_str(msg)
    bar.update()
  results = {}
  for m in models:
    try:
      build, inputs, depth, policies = program(m, dtype=args.dtype, batch=args.batch,
                                               seq_len=args.seq_len, overrides=overrides)
    except (TypeError, ValueError) as e:
      print(f"error: model {m}: {e}", file=sys.stderr)
      return 2
    fractions = tuple(i / (args.points - 1) for i in range(args.points))
    results[m] = plan_program.rows_of(m, build, inputs, depth, args.dtype, policies, progress,
                                      fractions=fractions, convert=args.convert)
  bar.close()
  table = plan_program.table([r for rows in results.values() for r in rows])
  print(table)
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "python": platform.python_version(), "host": benchmarks.host(), "device": jax.devices()[0].device_kind,
          "platform": jax.default_backend(), "command": " ".join(sys.argv),
          **{k: getattr(args, k) for k in ("dtype", "batch", "seq_len", "points", "convert")},
          "overrides": overrides}
  outputs[".json"].write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  outputs[".md"].write_text(table + "\n")
  _plot(results, outputs[".png"])
  print(f"wrote {outputs['.json']}, .md, .png")
  return 0
