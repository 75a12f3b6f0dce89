#!/usr/bin/env python3
"""The per-operation profile of a language model's training step on one GPU: invert's row,
JAX ``dots_no_batch``'s and PyTorch + Liger's (models/benchmarks/step_profile.py).

  python scripts/profile_step.py                        # llama3-1b, the batch the committed
                                                        # deviceless frontier fitted
  python scripts/profile_step.py --out-dir /tmp/p --budget-s 200
  python scripts/profile_step.py --from-traces bench/profile_nvidia-h200_2026-11-29.json
  python scripts/profile_step.py --docs     # regenerate docs/profile.md's tables
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--stack", default="llama3-1b")
  p.add_argument("--batch", type=cli.positive_int, default=None,
                 help="default: the committed deviceless frontier's for this device")
  p.add_argument("--repeats", type=cli.positive_int, default=5)
  p.add_argument("--budget-s", type=cli.positive_float, default=300.0)
  p.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench",
                 help="the profile JSON and its raw files (HLO, traces)")
  p.add_argument("--bench-dir", type=pathlib.Path, default=ROOT / "bench",
                 help="the committed deviceless frontier; the frontier JSON seeded here")
  p.add_argument("--from-traces", type=pathlib.Path, default=None, metavar="JSON",
                 help="recompute this profile JSON's JAX rows from the traces beside it, and exit")
  p.add_argument("--docs", action="store_true", help="regenerate docs/profile.md and exit")
  a = p.parse_args(argv)
  from models.benchmarks import step_profile  # pylint: disable=import-outside-toplevel
  if a.from_traces:
    if not a.from_traces.is_file():
      p.error(f"--from-traces: no such file {a.from_traces}")
    print(f"recomputed {step_profile.from_traces(a.from_traces)} rows of {a.from_traces}")
    return 0
  if a.docs:
    page = ROOT / "docs" / "profile.md"
    page.write_text(step_profile.render_docs(page.read_text(), ROOT))
    print(f"updated {page}")
    return 0
  from models.benchmarks.frontier import model_stack  # pylint: disable=import-outside-toplevel
  if a.stack not in model_stack.STACKS or not model_stack.STACKS[a.stack].vocab:
    p.error(f"--stack: a language model of {[k for k, v in model_stack.STACKS.items() if v.vocab]}, "
            f"got {a.stack!r}")
  return step_profile.run(a.stack, a.out_dir, a.bench_dir, batch=a.batch, repeats=a.repeats,
                          budget_s=a.budget_s)


if __name__ == "__main__":
  cli.finish(main)
