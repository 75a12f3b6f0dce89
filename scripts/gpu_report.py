#!/usr/bin/env python3
"""GPU report: kernel bandwidth, model peaks and step times, largest batch,
the planner's device check, the memory-time frontier against jax.checkpoint policies and
PyTorch + Liger; one command on one NVIDIA GPU.

  python scripts/gpu_report.py                         # everything, ~8 min on an H100
  python scripts/gpu_report.py --sections kernels,models
  python scripts/gpu_report.py --sections frontier --stacks llama    # one stack's frontier
  python scripts/gpu_report.py --dry-run               # CPU, tiny sizes (the test suite runs this)
  python scripts/gpu_report.py --docs bench/gpu_*.json     # docs/gpu-report.md's block (newest per device)

On the GPU machine (Python 3.12, JAX 0.11.2, nothing to download): ``pip install --no-deps -e .``
or ``PYTHONPATH=.``.  Writes ``<out-dir>/gpu_<device>_<date>.json`` and ``.md``; sections
already in that JSON are kept unless rerun (so the report may be collected over two calls).
Long sections print progress; each is bounded by the time budget.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import gpu_report  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--sections", default=None, help="comma list (default: all)")
  p.add_argument("--stacks", default=None,
                 help="frontier: comma list of stacks (default: llama3-1b,llama3-8b,llama,gpt2-medium,vit-l16)")
  p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise every path")
  p.add_argument("--budget-s", type=cli.positive_float, default=480.0,
                 help="wall-clock budget, seconds")
  p.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench")
  p.add_argument("--docs", type=pathlib.Path, nargs="+", default=None,
                 help="regenerate docs/gpu-report.md's report block from these report JSONs "
                      "and exit")
  args = p.parse_args(argv)
  if args.docs:
    return gpu_report.write_docs(args.docs, ROOT / "docs" / "gpu-report.md")
  return gpu_report.run(args)


if __name__ == "__main__":
  cli.finish(main)
