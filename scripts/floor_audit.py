"""Kept bytes per layer against the floor: a table and a JSON.

Per layer and token, in units of d elements of the compute dtype: compiled temp of the
gradient of a scanned stack (6 layers minus 2), the bytes autodiff keeps, and the floor
(invact_jax.floor_audit), for hand-written Llama / GPT-2 / BERT layers unconverted and
through invact_jax.invert, and for the project's models in their configurations; then kept /
floor of third-party models' whole gradients (those whose package is installed).  See
models/benchmarks/floor.py.

  python scripts/floor_audit.py --json bench/floor_cpu_2026-11-25.json
  python scripts/floor_audit.py --size test --dtypes float32      # seconds
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models import third_party  # noqa: E402
from models.benchmarks import floor  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--size", default="issue", choices=tuple(floor.SIZES),
                 help="layer sizes (d, heads, T, batch); third-party models use 'test' sizes")
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=("float32", "bfloat16"))
  p.add_argument("--models", nargs="*", default=list(floor.PROJECT_MODELS),
                 choices=floor.PROJECT_MODELS)
  p.add_argument("--third-party", nargs="*", default=list(third_party.ALL_MODELS),
                 choices=third_party.ALL_MODELS)
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  return floor.run(a)


if __name__ == "__main__":
  cli.finish(main)
