#!/usr/bin/env python3
"""Fit the inverse-derivative approximations g(y, bit) ~ f'(f^-1(y)) and print the error table.

For each non-monotone activation (GELU erf/tanh, SiLU, Mish) the backward pass
needs f'(x) given only y = f(x) and one bit saying whether x < x_min.  We fit, in
float64, piecewise Chebyshev polynomials in well-conditioned variables:

* right branch (x >= x_min):  sigma = +sqrt(y - y_min) in [0, S_R]; beyond S_R, f' = 1
  to within the tolerance;
* left branch near the minimum: sigma = -sqrt(y - y_min) in [-s_c, 0];
* left tail (y in (y_c, 0)):   w = sqrt(-log(-y)), fitting the ratio r = f'(x) / y, so
  that g = y * r stays accurate as y -> 0^- (x -> -inf); for |y| below exp(-w_hi^2)
  the ratio is held at its end value (the absolute error |y| * dr is below tol/4).

sqrt(y - y_min) makes g analytic at the minimum (g ~ +-c*sigma), which is what makes
float32 evaluation reach the storage floor there.  Pieces are split adaptively until
the max error on a dense check grid is below ``--tol``.

Writes ``invact_jax/ops/activations/_fits.py`` (with ``--write``) and prints, per activation
and dtype, the storage floor and the library's error over the audit grid
(``invact_jax.accuracy``), failing (exit 1) if any entry exceeds 1.2x the floor.

  python scripts/fit_inverse.py --write     # refit, regenerate, print the table
  python scripts/fit_inverse.py             # print the table for the current fit
"""
from __future__ import annotations

import argparse
import json
import pathlib
import pprint
import sys

import numpy as np
from scipy import special
from numpy.polynomial import chebyshev as cheb

ROOT = pathlib.Path(__file__).resolve().parents[1]

from invact_jax import accuracy  # noqa: E402

OUT = ROOT / "invact_jax" / "ops" / "activations" / "_fits.py"


def _x_of(name, var_kind, v, x_min, y_min):
  """Float64 x on the branch implied by the variable."""
  if var_kind == "sigma_right":
    y = y_min + v * v
    return accuracy.inverse64(name, y, np.zeros(v.shape, bool))
  if var_kind == "sigma_left":
    y = y_min + v * v
    return accuracy.inverse64(name, y, np.ones(v.shape, bool))
  if var_kind == "sqrt_log_neg_y":
    y = -np.exp(-v * v)
    return accuracy.inverse64(name, y, np.ones(v.shape, bool))
  raise KeyError(var_kind)


def _target(name, var_kind, v, x_min, y_min):
  x = _x_of(name, var_kind, v, x_min, y_min)
  g = accuracy.derivative64(name, x)
  if var_kind == "sqrt_log_neg_y":
    return g / (-np.exp(-v * v))  # ratio f'(x) / y
  return g


def fit_pieces(name, var_kind, lo, hi, *, degree, tol, min_width=1e-3):
  """Adaptive piecewise Chebyshev interpolation of the target on [lo, hi]."""
  x_min, y_min = accuracy.branch_point64(name)
  pieces = []
  stack = [(lo, hi)]
  nodes = np.cos(np.pi * (np.arange(degree + 1) + 0.5) / (degree + 1))
  check = np.linspace(-1.0, 1.0, 801)
  while stack:
    a, b = stack.pop()
    mid, half = 0.5 * (a + b), 0.5 * (b - a)
    f_nodes = _target(name, var_kind, mid + half * nodes, x_min, y_min)
    coeffs = cheb.chebfit(nodes, f_nodes, degree)
    err = np.max(np.abs(cheb.chebval(check, coeffs)
                        - _target(name, var_kind, mid + half * check, x_min, y_min)))
    if err > tol and (b - a) > min_width:
      stack.append((mid, b))
      stack.append((a, mid))
    else:
      pieces.append((a, b, coeffs, err))
  pieces.sort(key=lambda p: p[0])
  return {
      "breaks": [float(pieces[0][0])] + [float(p[1]) for p in pieces],
      "coeffs": [[float(c) for c in p[2]] for p in pieces],
      "fit_error": float(max(p[3] for p in pieces)),
  }


def fit_activation(name, *, degree, tol):
  x_min, y_min = accuracy.branch_point64(name)
  # Right branch: where |f'(x) - 1| stays below tol/8 for all larger x, g == 1.
  xs = np.linspace(x_min, 60.0, 600_001)
  dev = np.abs(accuracy.derivative64(name, xs) - 1.0)
  bad = np.nonzero(dev > tol / 8)[0]
  x_r = xs[bad[-1] + 1]
  s_r = float(np.sqrt(accuracy.forward64(name, x_r) - y_min))
  right = fit_pieces(name, "sigma_right", 0.0, s_r, degree=degree, tol=tol)
  # Left branch near the minimum: one unit left of x_min.
  y_c = float(accuracy.forward64(name, x_min - 1.0))
  s_c = float(np.sqrt(y_c - y_min))
  left_near = fit_pieces(name, "sigma_left", -s_c, 0.0, degree=degree, tol=tol)
  # Left tail in w = sqrt(-log(-y)); below |y| = y_lo the ratio r = f'/y is held at
  # its end value: |y| * |r(y) - r(y_lo)| < y_lo * |x(y_lo)|-ish stays below tol / 4.
  y_lo = tol / 40.0
  left_tail = fit_pieces(name, "sqrt_log_neg_y", float(np.sqrt(-np.log(-y_c))),
                         float(np.sqrt(-np.log(y_lo))), degree=degree, tol=tol)
  y_min32 = np.float32(y_min)
  return {
      "x_min": x_min,
      "y_min": y_min,
      "y_min_hi32": float(y_min32),
      "y_min_lo32": float(np.float32(y_min - float(y_min32))),
      "x_min32": float(np.float32(x_min)),
      "sigma_right_end": s_r,
      "y_split": y_c,
      "right": right,
      "left_near": left_near,
      "left_tail": left_tail,
  }


ERFCX_BREAKS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.5)


def fit_erfcx(degree: int = 10) -> dict:
  """Piecewise Chebyshev fit of erfcx(a) = exp(a^2) erfc(a) in a on ``ERFCX_BREAKS``.

  The kernels' float32 erfc (Pallas Triton has no erf/erfc lowering) is
  erfc(a) = exp(-a^2) * erfcx(a); the variable is the exact input a, so no rounded
  intermediate is amplified (see ``invact_jax._activations.erfc_f32``).  Beyond 10.5,
  erfc(a) underflows float32.
  """
  n = 2000
  u = np.cos(np.pi * (np.arange(n) + 0.5) / n)
  coeffs, err = [], 0.0
  for lo, hi in zip(ERFCX_BREAKS[:-1], ERFCX_BREAKS[1:]):
    a = 0.5 * (lo + hi) + 0.5 * (hi - lo) * u
    r = special.erfcx(a)
    c = cheb.chebfit(u, r, degree)
    err = max(err, float(np.max(np.abs(cheb.chebval(u, c) / r - 1.0))))
    coeffs.append([float(v) for v in c])
  return {"breaks": list(ERFCX_BREAKS), "coeffs": coeffs, "max_rel_error": err}


def render_module(fits, degree, tol, erfcx) -> str:
  """The text of the generated module (tests check the committed file is this rendering)."""
  body = pprint.pformat(fits, width=100, sort_dicts=False)
  return ('"""GENERATED by scripts/fit_inverse.py --write; do not edit by hand.\n\n'
          f"Piecewise Chebyshev fits (degree {degree}, tol {tol:g}) of f'(f^-1(y)) per branch;\n"
          "see scripts/fit_inverse.py for the variables and invact_jax/ops/activations/math.py\n"
          'for their use.\n"""\n\n'
          f"DEGREE = {degree}\nTOL = {tol!r}\n\nFITS = {body}\n\n"
          "# erfcx(a) = exp(a^2) erfc(a), piecewise Chebyshev in a (the kernels' float32 erfc)\n"
          f"ERFCX = {pprint.pformat(erfcx, width=100, sort_dicts=False)}\n")


def fit_all(degree: int, tol: float, progress=print) -> dict:
  """Every non-monotone activation's fits (the FITS of the generated module)."""
  fits = {}
  for name in accuracy.NONMONOTONE:
    fits[name] = f = fit_activation(name, degree=degree, tol=tol)
    progress(f"fit {name:10s} pieces right/near/tail = {len(f['right']['coeffs'])}/"
             f"{len(f['left_near']['coeffs'])}/{len(f['left_tail']['coeffs'])}  "
             f"max fit err = {max(f[k]['fit_error'] for k in ('right', 'left_near', 'left_tail')):.2e}")
  return fits


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--write", action="store_true", help="refit and regenerate the coefficients")
  p.add_argument("--degree", type=int, default=12)
  p.add_argument("--tol", type=float, default=1e-6, help="max abs fit error per piece")
  p.add_argument("--dtypes", default="float32,bfloat16,float16")
  p.add_argument("--names", default=",".join(accuracy.NONMONOTONE + accuracy.MONOTONE))
  p.add_argument("--json", type=pathlib.Path, help="write the table as JSON here")
  args = p.parse_args(argv)

  if args.write:
    OUT.write_text(render_module(fit_all(args.degree, args.tol), args.degree, args.tol,
                                 fit_erfcx()))
    print(f"wrote {OUT.relative_to(ROOT)}")

  rows = []
  print(f"\n{'activation':11s} {'dtype':9s} {'floor':>9s} {'error':>9s} {'ratio':>6s}  {'worst x':>10s} {'points':>8s}")
  ok = True
  for name in args.names.split(","):
    for dtype in args.dtypes.split(","):
      r = accuracy.audit(name, dtype)
      rows.append(r)
      good = r.error <= 1.2 * r.floor and r.nonfinite == 0
      ok &= good
      print(f"{name:11s} {r.dtype:9s} {r.floor:9.2e} {r.error:9.2e} {r.ratio:6.3f}  {r.worst_x:10.4g} "
            f"{r.points:8d}{'' if good else '  <-- above 1.2x floor'}"
            f"{'' if not r.nonfinite else f'  ({r.nonfinite} non-finite)'}")
  if args.json:
    args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
  print("\nall entries <= 1.2x floor" if ok else "\nSOME ENTRIES EXCEED 1.2x FLOOR")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
