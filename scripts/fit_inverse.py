#!/usr/bin/env python3
"""Fit the inverse-derivative approximations g(y, bit) ~ f'(f^-1(y)) and print the error table.

The fitting (its variables, pieces and tolerances) is :mod:`invact_jax.ops.activations.fitting`.
Writes ``invact_jax/ops/activations/_fits.py`` (with ``--write``) and prints, per activation
and dtype, the storage floor and the library's error over the audit grid
(``invact_jax.accuracy``), failing (exit 1) if any entry exceeds 1.2x the floor.

  python scripts/fit_inverse.py --write     # refit, regenerate, print the table
  python scripts/fit_inverse.py             # print the table for the current fit
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from invact_jax import accuracy  # noqa: E402
from invact_jax.ops.activations import fitting  # noqa: E402


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  names = accuracy.NONMONOTONE + accuracy.MONOTONE
  p.add_argument("--write", action="store_true", help="refit and regenerate the coefficients")
  p.add_argument("--degree", type=cli.positive_int, default=12)
  p.add_argument("--tol", type=cli.positive_float, default=1e-6, help="max abs fit error per piece")
  p.add_argument("--dtypes", type=cli.comma_list(("float32", "bfloat16", "float16")),
                 default=["float32", "bfloat16", "float16"])
  p.add_argument("--names", type=cli.comma_list(tuple(names)), default=list(names))
  p.add_argument("--json", type=cli.output_file, help="write the table as JSON here")
  args = p.parse_args(argv)
  if args.write:
    print(f"wrote {fitting.write_module(args.degree, args.tol)}")
  rows, table, ok = fitting.audit_table(args.names, args.dtypes)
  print("\n" + table)
  if args.json:
    args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
  print("\nall entries <= 1.2x floor" if ok else "\nSOME ENTRIES EXCEED 1.2x FLOOR")
  return 0 if ok else 1


if __name__ == "__main__":
  cli.finish(main)
