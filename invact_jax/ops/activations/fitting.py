"""How ``_fits.py`` is made: the inverse-derivative approximations g(y, bit) ~ f'(f^-1(y)),
fitted in float64 (needs SciPy: the ``scripts`` extra).

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

``scripts/fit_inverse.py`` runs it; ``tests/ops/activations/test_fits.py`` checks that the
committed module is its rendering and that refitting reproduces it.
"""
from __future__ import annotations

import pathlib
import pprint

import numpy as np
from scipy import special
from numpy.polynomial import chebyshev as cheb

from invact_jax import accuracy

#: The generated module this one writes (:func:`write_module`).
OUT = pathlib.Path(__file__).with_name("_fits.py")


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


def right_end(name, tol) -> float:
  """sigma = sqrt(y - y_min) beyond which |f'(x) - 1| < tol/8 for every larger x (g := 1)."""
  x_min, y_min = accuracy.branch_point64(name)
  xs = np.linspace(x_min, 60.0, 600_001)
  dev = np.abs(accuracy.derivative64(name, xs) - 1.0)
  x_r = xs[np.nonzero(dev > tol / 8)[0][-1] + 1]
  return float(np.sqrt(accuracy.forward64(name, x_r) - y_min))


def fit_activation(name, *, degree, tol):
  x_min, y_min = accuracy.branch_point64(name)
  # Right branch: where |f'(x) - 1| stays below tol/8 for all larger x, g == 1.
  s_r = right_end(name, tol)
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


# ------------------------------------------------------------ rational fits
#: Max absolute error of g per storage-dtype class.  The audit's floor is set by the rounding
#: of y near the minimum (float32 1.5e-4, float16 8e-3, bfloat16 2e-2): 16-bit classes keep
#: the fit error ~5 % of it, float32 stays at the level of a float32 derivative (2e-6).
RATIONAL_TOL = {"float32": 2e-6, "float16": 3e-4, "bfloat16": 1e-3}
RATIONAL_GRID = 600        # Chebyshev points of the minimax LP
RATIONAL_CHECK = 200_001   # points of the float32 acceptance check


def horner32(c, u):
  """sum_k c[k] u^k by Horner's rule in float32, as the kernels evaluate it."""
  u = np.asarray(u, np.float32)
  acc = np.full(u.shape, np.float32(c[-1]), np.float32)
  for k in range(len(c) - 2, -1, -1):
    acc = acc * u + np.float32(c[k])
  return acc


def minimax_rational(fn, n, *, weight=None, grid=RATIONAL_GRID, iters=40):
  """P/Q of degrees (n, n) in u on [-1, 1] (monomial, q[0] = 1) minimizing max w |fn - P/Q|.

  Differential correction (Cheney & Loeb): each step solves one linear program (HiGHS) for
  the P, Q that most reduce the weighted error of the current level with Q > 0 on the grid.
  Returns ``(error, p, q)`` in float64.
  """
  from scipy.optimize import linprog  # pylint: disable=import-outside-toplevel
  u = np.concatenate([np.cos(np.pi * (np.arange(grid) + 0.5) / grid), [-1.0, 1.0]])
  f = fn(u)
  wt = np.ones_like(u) if weight is None else weight(u)
  vp = vq = np.vander(u, n + 1, increasing=True)  # P and Q have the same degree
  sol = np.linalg.lstsq(np.hstack([vp, -f[:, None] * vq[:, 1:]]), f, rcond=None)[0]
  p, q = sol[:n + 1], np.concatenate([[1.0], sol[n + 1:]])
  if np.any(vq @ q <= 0):  # start from the polynomial fit instead
    p, q = np.polyfit(u, f, n)[::-1], np.eye(n + 1)[0]
  best = None
  for _ in range(iters):
    qv = vq @ q
    if np.any(qv <= 0):
      break
    err = float(np.max(wt * np.abs(f - (vp @ p) / qv)))
    if best is not None and err >= best[0] * (1 - 1e-9):
      break
    best = (err, p.copy(), q.copy())
    # minimize z:  +-(f Q - P) w - err Q <= z Q_k,  Q >= 1e-3
    qk = (qv / np.max(qv))[:, None]
    w = wt[:, None]
    a_ub = np.vstack([np.hstack([-w * vp, (w * f[:, None] - err) * vq, -qk]),
                      np.hstack([w * vp, (-w * f[:, None] - err) * vq, -qk]),
                      np.hstack([np.zeros_like(vp), -vq, np.zeros_like(qk)])])
    b_ub = np.concatenate([np.zeros(2 * len(u)), np.full(len(u), -1e-3)])
    bounds = [(None, None)] * (n + 1) + [(-1e3, 1e3)] * (n + 1) + [(None, None)]
    res = linprog(np.eye(2 * n + 3)[-1], A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0:
      break
    p, q = res.x[:n + 1] / res.x[n + 1], res.x[n + 1:2 * n + 2] / res.x[n + 1]
  return best


def _right_target(name, s):
  """g / s on the right branch as a function of s = sqrt(y - y_min) (g = 0 at s = 0, g ~ c s)."""
  _, y_min = accuracy.branch_point64(name)
  s = np.maximum(s, 1e-9)  # the limit at s = 0
  y = y_min + s * s
  return accuracy.derivative64(name, accuracy.inverse64(name, y, np.zeros(y.shape, bool))) / s


def _left_ratio(name, q):
  """g / (y q) on the left branch as a function of q = sqrt(-log(y / y_min))."""
  _, y_min = accuracy.branch_point64(name)
  q = np.maximum(q, 1e-9)  # the limit at q = 0
  y = y_min * np.exp(-q * q)
  g = accuracy.derivative64(name, accuracy.inverse64(name, y, np.ones(y.shape, bool)))
  return g / (y * q)


def _fit_side(fn, weight, tol, max_degree, min_degree=1):
  """The lowest-degree (n, n) fit, n >= ``min_degree``, whose float32 evaluation errs <= tol
  with Q > 0."""
  u = np.linspace(-1.0, 1.0, RATIONAL_CHECK)
  f, w = fn(u), (np.ones_like(u) if weight is None else weight(u))
  for n in range(min_degree, max_degree + 1):
    res = minimax_rational(fn, n, weight=weight)
    if res is None:
      continue
    _, p, q = res
    qv = horner32(q, u)
    err32 = float(np.max(w * np.abs(horner32(p, u).astype(np.float64) / qv - f)))
    if np.all(qv > 0) and err32 <= tol:
      return {"p": [float(c) for c in p], "q": [float(c) for c in q], "error": err32}
  raise RuntimeError(f"no rational fit of degree <= {max_degree} reaches {tol:g}")


def fit_rational(name, tol, *, max_degree=10, min_degrees=(1, 1)) -> dict:
  """One dtype class's fits of ``name``: the two branches' rationals and their domains
  (``min_degrees``: the (right, left) degrees the searches start at; default from 1).

  * right (x >= x_min): g = s P/Q(u), u = s / s_end * 2 - 1, s = sqrt(y - y_min) in
    [0, s_end]; beyond s_end, g = 1 (|f' - 1| < tol/8 there).
  * left (x < x_min): g = y q P/Q(u), u = q / q_end * 2 - 1, q = sqrt(-log(y / y_min)):
    g / (y q) is analytic in q (q ~ s near the minimum, q ~ |x| in the tail), and weighting
    the fit by |y| q bounds g's absolute error; beyond q_end (|y| < tol/40) it is held.
  The factors s and q make g exactly 0 at the minimum and relatively accurate near it, so
  that rounding differences between evaluations (FMA or not) stay at a few ulps of g.
  """
  _, y_min = accuracy.branch_point64(name)
  s_end = right_end(name, tol)
  q_end = float(np.sqrt(np.log(-y_min / (tol / 40.0))))
  right = _fit_side(lambda u: _right_target(name, (u + 1) * s_end / 2),
                    lambda u: (u + 1) * s_end / 2, tol, max_degree, min_degrees[0])
  left = _fit_side(lambda u: _left_ratio(name, (u + 1) * q_end / 2),
                   lambda u: -y_min * (u + 1) * q_end / 2 * np.exp(-((u + 1) * q_end / 2) ** 2),
                   tol, max_degree, min_degrees[1])
  return {"s_end": s_end, "q_end": q_end, "right": right, "left": left}


def fit_all_rational(progress=print) -> dict:
  """RATIONAL of the generated module: activation -> dtype class -> fits."""
  out = {}
  for name in accuracy.NONMONOTONE:
    out[name] = {}
    for cls, tol in RATIONAL_TOL.items():
      out[name][cls] = r = fit_rational(name, tol)
      progress(f"rational {name:10s} {cls:9s} right ({len(r['right']['p']) - 1},"
               f"{len(r['right']['q']) - 1}) err {r['right']['error']:.2e}  left "
               f"({len(r['left']['p']) - 1},{len(r['left']['q']) - 1}) err {r['left']['error']:.2e}")
  return out


ERFCX_C = 2.0       # t = a / (a + c) maps [0, inf) to [0, 1)
ERFCX_END = 10.5    # erfc(a) underflows float32 beyond
ERFCX_TOL = 3e-7    # relative, of the whole float32 evaluation below


def erfcx32(fit, a):
  """erfcx(a) = exp(a^2) erfc(a) in float32 as the kernels evaluate it (a >= 0):
  d = a + c, u = (k a - d) / d = 2 t / t_end - 1 with t = a / d, erfcx = P(u) / (Q(u) d).
  R(t) = erfcx(a) (a + c) is smooth and bounded on [0, 1), so neither the rounding of u nor
  the 1 / a decay of erfcx costs accuracy."""
  a = np.asarray(a, np.float32)
  d = a + np.float32(fit["c"])
  u = (a * np.float32(2.0 / fit["t_end"]) - d) / d
  return horner32(fit["p"], u) / (horner32(fit["q"], u) * d)


def fit_erfcx(tol: float = ERFCX_TOL, max_degree: int = 10) -> dict:
  """One minimax rational for the kernels' float32 erfc (Pallas Triton has no erf lowering):
  erfc(a) = exp(-a^2) erfcx(a) (``invact_jax.ops.activations.math.erfc_f32``).  The lowest
  degree whose float32 evaluation (:func:`erfcx32`) errs <= ``tol`` relative on [0, 10.5];
  beyond, erfc(a) underflows float32.  One rational, no piece selection: it costs ~25
  instructions per element instead of the ~300 of a selected piecewise fit.
  """
  c, t_end = ERFCX_C, ERFCX_END / (ERFCX_END + ERFCX_C)
  a_of = lambda u: c * ((u + 1) * t_end / 2) / (1 - (u + 1) * t_end / 2)  # noqa: E731
  target = lambda u: special.erfcx(a_of(u)) * (a_of(u) + c)  # noqa: E731
  a = np.linspace(0.0, ERFCX_END, RATIONAL_CHECK).astype(np.float32)
  truth = special.erfcx(a.astype(np.float64))
  for n in range(1, max_degree + 1):
    res = minimax_rational(target, n, weight=lambda u: 1.0 / target(u), grid=800)
    if res is None:
      continue
    fit = {"c": c, "a_end": ERFCX_END, "t_end": t_end, "p": [float(v) for v in res[1]],
           "q": [float(v) for v in res[2]]}
    err = float(np.max(np.abs(erfcx32(fit, a) / truth - 1.0)))
    if err <= tol:
      return {**fit, "max_rel_error": err}
  raise RuntimeError(f"no erfcx rational of degree <= {max_degree} reaches {tol:g}")


def render_module(fits, degree, tol, erfcx, rational) -> str:
  """The text of the generated module (tests check the committed file is this rendering)."""
  body = pprint.pformat(fits, width=100, compact=True, sort_dicts=False)
  return ('"""GENERATED by scripts/fit_inverse.py --write; do not edit by hand.\n\n'
          "RATIONAL: per storage-dtype class, one minimax rational per branch of f'(f^-1(y))\n"
          "(float32, float16 and bfloat16 outputs; invact_jax/ops/activations/rational.py).\n"
          f"FITS: piecewise Chebyshev fits (degree {degree}, tol {tol:g}) per branch, for float64\n"
          "outputs (invact_jax/ops/activations/_piecewise.py).  fitting.py documents\n"
          'the variables.\n"""\n\n'
          f"DEGREE = {degree}\nTOL = {tol!r}\n\nFITS = {body}\n\n"
          f"RATIONAL_TOL = {RATIONAL_TOL!r}\n\n"
          f"RATIONAL = {pprint.pformat(rational, width=100, compact=True, sort_dicts=False)}\n\n"
          "# erfcx(a) = exp(a^2) erfc(a) = P(u) / (Q(u) (a + c)), u = 2 a / ((a + c) t_end) - 1\n"
          "# (the kernels' float32 erfc; scripts/fit_inverse.py erfcx32)\n"
          f"ERFCX = {pprint.pformat(erfcx, width=100, compact=True, sort_dicts=False)}\n")


def fit_all(degree: int, tol: float, progress=print) -> dict:
  """Every non-monotone activation's fits (the FITS of the generated module)."""
  fits = {}
  for name in accuracy.NONMONOTONE:
    fits[name] = f = fit_activation(name, degree=degree, tol=tol)
    progress(f"fit {name:10s} pieces right/near/tail = {len(f['right']['coeffs'])}/"
             f"{len(f['left_near']['coeffs'])}/{len(f['left_tail']['coeffs'])}  "
             f"max fit err = {max(f[k]['fit_error'] for k in ('right', 'left_near', 'left_tail')):.2e}")
  return fits


def write_module(degree: int, tol: float, path: pathlib.Path = OUT) -> pathlib.Path:
  """Refit everything and write the generated module.

  Args:
    degree: the Chebyshev pieces' degree.
    tol: the pieces' largest absolute fit error.
    path: where to write (default: ``_fits.py`` beside this module).

  Returns:
    ``path``.
  """
  path.write_text(render_module(fit_all(degree, tol), degree, tol, fit_erfcx(), fit_all_rational()))
  return path


def audit_table(names, dtypes) -> tuple[list, str, bool]:
  """The library's error against the storage floor per activation and dtype.

  Args:
    names: activation names.
    dtypes: storage dtype names.

  Returns:
    ``(rows, text, ok)``: :func:`invact_jax.accuracy.audit`'s rows, the printed table, and
    whether every entry is within 1.2x its floor with no non-finite value.
  """
  rows, ok = [], True
  lines = [f"{'activation':11s} {'dtype':9s} {'floor':>9s} {'error':>9s} {'ratio':>6s}  "
           f"{'worst x':>10s} {'points':>8s}"]
  for name in names:
    for dtype in dtypes:
      r = accuracy.audit(name, dtype)
      rows.append(r)
      good = r.error <= 1.2 * r.floor and r.nonfinite == 0
      ok &= good
      lines.append(f"{name:11s} {r.dtype:9s} {r.floor:9.2e} {r.error:9.2e} {r.ratio:6.3f}  "
                   f"{r.worst_x:10.4g} {r.points:8d}{'' if good else '  <-- above 1.2x floor'}"
                   f"{'' if not r.nonfinite else f'  ({r.nonfinite} non-finite)'}")
  return rows, "\n".join(lines), ok
