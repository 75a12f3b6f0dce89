"""The generated fits are what scripts/fitting.py generates: the committed
module is the script's rendering of its own data, and refitting reproduces that data."""
import pathlib

import numpy as np

from invact_jax.ops.activations import _fits
from invact_jax.ops.activations import fitting

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_committed_module_is_the_scripts_rendering():
  text = (ROOT / "invact_jax" / "ops" / "activations" / "_fits.py").read_text()
  assert text == fitting.render_module(_fits.FITS, _fits.DEGREE, _fits.TOL, _fits.ERFCX,
                                          _fits.RATIONAL)


_U = np.linspace(-1.0, 1.0, 2001)


def _assert_close(a, b, path="", *, tol):
  """Refitted data ``a`` vs committed ``b``.  Coefficients are compared as the functions they
  make, against the fit's error budget ``tol``: the fits come from solvers (least squares,
  HiGHS LPs) whose builds stop at different last digits, so single coefficients may move
  while the function does not (measured on the GPU machine's SciPy: a rational moved by 1.8 %
  of its budget, a Chebyshev piece by 1e-15)."""
  if isinstance(a, dict) and {"p", "q"} <= a.keys():  # a rational P/Q in u on [-1, 1]
    fa = np.polyval(a["p"][::-1], _U) / np.polyval(a["q"][::-1], _U)
    fb = np.polyval(b["p"][::-1], _U) / np.polyval(b["q"][::-1], _U)
    assert len(a["p"]) == len(b["p"]) and len(a["q"]) == len(b["q"]), f"{path}: degree changed"
    diff = float(np.max(np.abs(fa - fb) / np.abs(fb)))
    assert diff <= 0.05 * tol, f"{path}: refitted P/Q differs by {diff:.2e} (budget {tol:.1e})"
    a, b = ({k: v for k, v in d.items() if k not in ("p", "q")} for d in (a, b))
  if isinstance(a, dict):
    assert a.keys() == b.keys(), path
    for k in a:
      if k == "coeffs":  # Chebyshev pieces: |T_k| <= 1, so sum |dc| bounds the change
        assert len(a[k]) == len(b[k]), f"{path}: number of pieces changed"
        for i, (ca, cb) in enumerate(zip(a[k], b[k])):
          diff = float(np.sum(np.abs(np.subtract(ca, cb))))
          assert diff <= 1e-3 * tol, f"{path}.coeffs[{i}]: refit differs by {diff:.2e}"
      else:
        _assert_close(a[k], b[k], f"{path}.{k}", tol=tol)
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b), path
    for i, (x, y) in enumerate(zip(a, b)):
      _assert_close(x, y, f"{path}[{i}]", tol=tol)
  elif path.endswith("error"):  # a recorded max error moves with the fit, within its budget
    assert abs(a - b) <= 0.05 * tol, f"{path}: {a:.3e} vs committed {b:.3e} (budget {tol:.1e})"
  else:  # domain ends, breaks
    np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-15, err_msg=path)


def test_refitting_reproduces_the_committed_fits():
  _assert_close(fitting.fit_all(_fits.DEGREE, _fits.TOL, progress=lambda m: None), _fits.FITS,
                tol=_fits.TOL)
  _assert_close(fitting.fit_erfcx(), _fits.ERFCX, "ERFCX", tol=fitting.ERFCX_TOL)


def test_refitting_reproduces_the_committed_rational_fits():
  """Per activation, dtype class and branch: the degree below the committed one misses the
  tolerance and the committed degree refits to the committed coefficients (the search from
  degree 1, ``fitting.fit_all_rational``, passes through both; starting one below keeps CI
  short: the low degrees fit fastest and fail as the one below does)."""
  for name, classes in _fits.RATIONAL.items():
    for cls, tol in _fits.RATIONAL_TOL.items():
      committed = classes[cls]
      degrees = tuple(max(1, len(committed[side]["q"]) - 2) for side in ("right", "left"))
      got = fitting.fit_rational(name, tol, min_degrees=degrees)
      for side, start in zip(("right", "left"), degrees):
        if start < len(committed[side]["q"]) - 1:  # the one below was tried, and failed
          assert len(got[side]["q"]) == len(committed[side]["q"]), (name, cls, side)
      _assert_close(got, committed, f"RATIONAL.{name}.{cls}", tol=tol)
  assert fitting.RATIONAL_TOL == _fits.RATIONAL_TOL


def test_erfcx_fit_meets_its_tolerance_as_the_kernels_evaluate_it():
  from scipy import special  # pylint: disable=import-outside-toplevel
  a = np.linspace(0.0, _fits.ERFCX["a_end"], 100_001).astype(np.float32)
  err = np.abs(fitting.erfcx32(_fits.ERFCX, a) / special.erfcx(a.astype(np.float64)) - 1)
  assert err.max() <= fitting.ERFCX_TOL
