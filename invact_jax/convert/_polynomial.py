"""Sparse linear combinations and polynomials as dicts, term -> coefficient: the arithmetic
both of convert's interpreters compute in (the norms' algebra, :mod:`._algebra_follow`, and
the LM head's loss follower, :mod:`._head_follow`).  A sum whose coefficient cancels to within
:data:`REL_TOL` of its terms drops the term.

A polynomial's monomial is a sorted tuple of ``(symbol, exponent)``; the norms' symbols are
:data:`X` (the statistic's input), its row moments :data:`M1`, :data:`M2`, row symbols
``("r", i)`` (``p^-1/2``), ``("q", i)`` (``1 / p``), ``("f", i)`` (``max(p, c)``) and
parameters ``("c", i)``."""
from __future__ import annotations

__all__ = ["REL_TOL", "TOL", "X", "M1", "M2", "add", "scale", "mono", "const", "mul", "syms",
           "is_row", "power", "by_x_power", "close"]

#: Relative: a coefficient cancelled to this share of its terms is zero.
REL_TOL = 1e-6
#: Absolute: a coefficient read as a number (0, 1, a smoothing, a factor) within this of it.
TOL = 1e-6
#: Terms a product may have (past it: not a polynomial the norms' test reads).
MAX_TERMS = 48
X, M1, M2 = ("x",), ("m1",), ("m2",)


def add(a: dict, b: dict, sign: float = 1.0) -> dict:
  """``a + sign * b``, terms that cancel dropped."""
  out = dict(a)
  for m, c in b.items():
    total = out.get(m, 0.0) + sign * c
    if abs(total) <= REL_TOL * max(abs(out.get(m, 0.0)), abs(c)):
      out.pop(m, None)
    else:
      out[m] = total
  return out


def scale(a: dict, c: float) -> dict:
  """``c * a`` (empty for ``c == 0``)."""
  return {m: v * c for m, v in a.items()} if c else {}


def close(a: dict, b: dict) -> bool:
  """Whether ``a`` and ``b`` have the same terms with coefficients within :data:`REL_TOL`
  (of 1 at least)."""
  if set(a) != set(b):
    return False
  return all(abs(a[m] - b[m]) <= REL_TOL * max(1.0, abs(b[m])) for m in a)


def mono(*pairs) -> tuple:
  """The monomial of ``(symbol, exponent)`` pairs, exponents of a symbol summed, zeros
  dropped."""
  out: dict = {}
  for s, e in pairs:
    out[s] = out.get(s, 0) + e
  return tuple(sorted((s, e) for s, e in out.items() if e))


def const(c: float) -> dict:
  """The constant polynomial ``c``."""
  return {(): float(c)} if c else {}


def mul(a: dict, b: dict) -> dict | None:
  """``a * b``; None past :data:`MAX_TERMS` terms."""
  out: dict = {}
  for ma, ca in a.items():
    for mb, cb in b.items():
      out = add(out, {mono(*ma, *mb): ca * cb})
  return out if len(out) <= MAX_TERMS else None


def syms(p: dict) -> set:
  """The symbols ``p`` holds."""
  return {s for m in p for s, _ in m}


def is_row(s) -> bool:
  """Whether symbol ``s`` is one value per row (a moment or a row symbol)."""
  return s in (M1, M2) or s[0] in ("r", "q", "f")


def power(p: dict, n: int) -> dict | None:
  """``p ** n``: a negative power only of a monomial of row symbols and constants."""
  if n == 0:
    return const(1.0)
  if n < 0:
    if len(p) != 1:
      return None
    (m, c), = p.items()
    if c == 0 or any(not is_row(s) for s, _ in m):
      return None
    return {mono(*((s, -e * -n) for s, e in m)): c ** n}
  out = const(1.0)
  for _ in range(n):
    out = mul(out, p)
    if out is None:
      return None
  return out


def by_x_power(p: dict) -> dict:
  """{power of x: the polynomial multiplying it}."""
  out: dict = {}
  for m, c in p.items():
    k = dict(m).get(X, 0)
    rest = tuple((s, e) for s, e in m if s != X)
    out.setdefault(k, {})[rest] = c
  return out
