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
import sys

from models.training import supervisor

if __name__ == "__main__":
  # One process of several: its supervisor runs this script again as the worker, and imports
  # nothing but the standard library (it starts at once and holds no JAX state).
  code = supervisor.early(sys.argv)
  if code is not None:
    sys.exit(code)
  from models.training import main  # pylint: disable=ungrouped-imports
  main.exit_with(main.main(doc=__doc__))
