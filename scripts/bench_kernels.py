#!/usr/bin/env python3
"""Kernel timing: forward, backward, fwd+bwd times and GB/s, jax.nn vs invact_jax backends.

  python scripts/bench_kernels.py                                  # 2^20..2^28, f32 + bf16
  python scripts/bench_kernels.py --min-log2 20 --max-log2 22 --implementations xla
  python scripts/bench_kernels.py --cost     # HLO ops of fwd+bwd and time vs jax.nn
  python scripts/bench_kernels.py --cost-split --activations silu --dtypes bfloat16
                                             # where that time goes (each pass; backward parts)

On a GPU this compares the XLA path, the Pallas kernels and jax.nn against the device copy
bandwidth; without one, Pallas runs in interpret mode (correctness only, its timings mean
nothing) and is left out unless named.  Prints a markdown table and writes JSON
(default bench/kernels.json) with the device, JAX version and date.
"""
from __future__ import annotations

import datetime
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import registry  # pylint: disable=import-outside-toplevel
  from models.experiments import op_speed  # pylint: disable=import-outside-toplevel
  from models.experiments import cli  # pylint: disable=import-outside-toplevel
  p = cli.parser(__doc__)
  p.add_argument("--activations", default="gelu_tanh,gelu_erf,silu")
  p.add_argument("--min-log2", type=int, default=20)
  p.add_argument("--max-log2", type=int, default=28)
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--implementations", default=None,
                 help="comma list of xla,pallas (default: xla, plus pallas on a GPU)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--inner", type=int, default=None,
                 help="calls per timed round (default 10 on a GPU, 1 elsewhere)")
  report = p.add_mutually_exclusive_group()
  report.add_argument("--cost", action="store_true",
                      help="instead: per activation x dtype, HLO ops of the fused forward+backward "
                      "and its time vs jax.nn (interleaved medians, --elements); writes "
                      "bench/activation_cost.{json,md}")
  report.add_argument("--cost-split", action="store_true",
                      help="instead: per non-monotone activation x dtype, the time of each pass alone "
                      "and of the backward with its bit unpacking, log, square roots or division "
                      "replaced by free stand-ins; writes bench/activation_cost_split.{json,md}")
  p.add_argument("--elements", type=int, default=1 << 23,
                 help="--cost, --cost-split: elements per call")
  p.add_argument("--out", type=pathlib.Path, default=None,
                 help="JSON path (default bench/kernels.json, bench/activation_cost.json or "
                 "bench/activation_cost_split.json)")
  args = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  impls = (args.implementations.split(",") if args.implementations
           else ["xla", "pallas"] if on_gpu else ["xla"])
  for a in args.activations.split(","):
    if a not in registry.ACTIVATIONS:
      print(f"error: unknown activation {a!r}; choose from {sorted(registry.ACTIVATIONS)}",
            file=sys.stderr)
      return 2
    if args.cost_split and not registry.ACTIVATIONS[a].nonmonotone:
      print(f"error: --cost-split times a fitted backward; --activations {a!r} has none (choose "
            f"from {sorted(n for n, e in registry.ACTIVATIONS.items() if e.nonmonotone)})",
            file=sys.stderr)
      return 2
  if not 3 <= args.min_log2 <= args.max_log2:
    print("error: need 3 <= --min-log2 <= --max-log2", file=sys.stderr)
    return 2
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
          "command": " ".join(sys.argv)}
  if args.cost:
    return _cost(args, meta, op_speed, tqdm)
  if args.cost_split:
    return _cost_split(args, meta, op_speed, tqdm)
  args.out = args.out or ROOT / "bench" / "kernels.json"
  sizes = [1 << k for k in range(args.min_log2, args.max_log2 + 1)]
  rows = []
  with tqdm(desc="bench", unit="row") as bar:
    def progress(msg):
      bar.set_postfix_str(msg)
      bar.update()
    for a in args.activations.split(","):
      rows += op_speed.measure(activation=a, sizes=sizes, dtypes=args.dtypes.split(","),
                                   implementations=impls, repeats=args.repeats,
                                   inner=args.inner or (10 if on_gpu else 1),
                                   progress=progress)
  print(op_speed.table(rows))
  op_speed.write_report(args.out, meta, [r.as_dict() for r in rows])
  return 0


def _cost(args, meta, op_speed, tqdm) -> int:
  names = args.activations.split(",")
  with tqdm(total=len(names) * len(args.dtypes.split(",")), desc="cost", unit="row") as bar:
    def progress(msg):
      bar.set_postfix_str(msg)
      bar.update()
    rows = op_speed.cpu_rows(names, args.dtypes.split(","), elements=args.elements,
                             rounds=args.repeats, progress=progress)
  return _write_table(args.out or ROOT / "bench" / "activation_cost.json", meta, rows,
                      op_speed.cpu_table(rows), op_speed)


def _cost_split(args, meta, op_speed, tqdm) -> int:
  names = args.activations.split(",")
  rows = []
  for name in tqdm(names, desc="cost split", unit="activation"):
    for dt in args.dtypes.split(","):
      rows += op_speed.cost_split(name, dt, elements=args.elements, rounds=args.repeats)
  return _write_table(args.out or ROOT / "bench" / "activation_cost_split.json", meta, rows,
                      op_speed.split_table(rows), op_speed)


def _write_table(out, meta, rows, md, op_speed) -> int:
  """Print ``md`` and write ``out`` (JSON) and its .md with the device/versions/command line."""
  print(md)
  op_speed.write_report(out, meta, rows, md,
                        f"{meta['platform']} ({meta['device']}), JAX {meta['jax']}, "
                        f"{meta['date']}; `{meta['command']}`")
  return 0


if __name__ == "__main__":
  sys.exit(main())
