#!/usr/bin/env python3
"""Train a ViT with standard or inverted activations (or both, side by side).

With no arguments: a small ViT on scikit-learn's 8x8 digits (shipped with the package,
nothing downloaded), inverted activations, on every local device.

  python scripts/train_vit.py                       # default job
  python scripts/train_vit.py --compare             # standard vs inverted, same seed
  python scripts/train_vit.py --data cifar10.npz --preset ti16 --dtype bfloat16
  python scripts/train_vit.py --resume              # continue the latest run

Several processes (one per host; each sees its local devices, the mesh spans all of them):

  python scripts/train_vit.py --coordinator host0:1234 --num-processes 2 --process-id 0 ...
  python scripts/train_vit.py --coordinator host0:1234 --num-processes 2 --process-id 1 ...
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)
from models.training import supervisor  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  # A signal from here on (JAX's import, loading the data) is one line; training takes its own.
  cli.stop_on_signals(" before training started: nothing was saved; run the same command again")
  # One process of several: its supervisor runs this script again as the worker, and imports
  # nothing but the standard library (it starts at once and holds no JAX state).
  code = supervisor.early(sys.argv)
  if code is not None:
    sys.exit(code)
  from models.training import main  # pylint: disable=ungrouped-imports
  cli.finish(lambda: main.main(doc=__doc__))
