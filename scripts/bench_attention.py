#!/usr/bin/env python3
"""Grouped-query attention, forward + backward, with the key/value heads as they are or
repeated to the query heads first, JAX's and PyTorch's (models/benchmarks/attention.py).

  python scripts/bench_attention.py --implementation cudnn   # llama3-1b's, batch 3 (a GPU)
  python scripts/bench_attention.py --implementation cudnn --json bench/attention_<device>_<date>.json
  python scripts/bench_attention.py --batch 1 --seq 64 --implementation xla   # CPU, seconds
"""
import json
import os
import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = cli.parser(__doc__)
  p.add_argument("--batch", type=cli.positive_int, default=3)
  p.add_argument("--seq", type=cli.positive_int, default=8192)
  p.add_argument("--heads", type=cli.positive_int, default=32)
  p.add_argument("--kv-heads", type=cli.positive_int, default=8)
  p.add_argument("--head-dim", type=cli.positive_int, default=64)
  p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
  p.add_argument("--repeats", type=cli.positive_int, default=20)
  p.add_argument("--implementation", choices=("cudnn", "xla", "auto"), default="auto",
                 help="jax.nn.dot_product_attention's (auto: JAX's choice)")
  p.add_argument("--no-torch", action="store_true", help="leave PyTorch's rows out")
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  if a.heads % a.kv_heads:
    p.error(f"--kv-heads: must divide --heads ({a.heads}), got {a.kv_heads}")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (PyTorch's rows' memory)
  from models.benchmarks import attention  # pylint: disable=import-outside-toplevel
  shape = attention.Shape(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim)
  command = "python scripts/bench_attention.py " + shlex.join(
      x for i, x in enumerate(argv) if x != "--json" and (i == 0 or argv[i - 1] != "--json"))
  data = attention.run(shape, a.dtype, a.repeats,
                       None if a.implementation == "auto" else a.implementation,
                       not a.no_torch, command.strip())
  print(attention.markdown(data))
  if a.json:
    a.json.write_text(json.dumps(data, indent=1))
    print(f"wrote {a.json}")
  return 0


if __name__ == "__main__":
  cli.finish(main)
