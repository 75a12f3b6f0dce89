"""The program-level conversion (``invact_jax.invert``) on third-party models: a table.

For each model (transformers' Flax BERT, GPT-2, ViT, Llama; an Equinox block; a Flax NNX
block; keras-hub's Gemma, Llama, BERT, GPT-2 and ViT; penzai's Llama, stacked Llama, Gemma,
Gemma 2 and GPT-NeoX; see models/third_party.py): is the converted forward
bit-identical, the gradient's relative L2 distance to the unconverted one, the bytes
autodiff keeps and the compiled temp memory of the gradient, unconverted / by ``invert`` /
converted by hand (where the model has a hand conversion), what was converted, and the
seconds from the loss to its compiled gradient, unconverted and through ``invert``.
Models whose package is not installed are skipped with a line saying so (keras-hub:
``pip install --no-deps keras-hub kagglehub``).

  python scripts/invert_models.py                     # size "table" (the default)
  python scripts/invert_models.py --size zoo --models keras_vit penzai_gemma2 --json out.json
  python scripts/invert_models.py --size zoo --fallback temp   # temp never above the original
  python scripts/invert_models.py --under-remat full --dtype bfloat16   # the project's models
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models import third_party  # noqa: E402
from models.benchmarks import invert_models  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--models", nargs="+", default=list(third_party.ALL_MODELS),
                 choices=third_party.ALL_MODELS)
  p.add_argument("--size", default="table", choices=tuple(third_party.SIZES))
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--fallback", choices=("temp",),
                 help="invert's fallback: leave alone the sites that raise the compiled temp")
  p.add_argument("--compile-tries", type=cli.nonnegative_int, default=3,
                 help="time the gradient's compile unconverted and through invert (median "
                      "of this many tries each; 0: not timed)")
  p.add_argument("--under-remat", choices=("full", "dots", "dots_no_batch"),
                 help="instead: the project's GPT-2 and ViT-B/16 (batch 8, 256 tokens / 224 px) "
                      "with their scanned layers under this jax.checkpoint policy, as written "
                      "and through invert (its remat check included)")
  p.add_argument("--json", type=cli.output_file, help="also write the rows here")
  a = p.parse_args(argv)
  return invert_models.run(a)


if __name__ == "__main__":
  cli.finish(main)
