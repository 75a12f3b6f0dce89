"""The storage-floor audit: max |f'_approx(y, bit) - f'(x)| <= 1.2 x floor, per dtype."""
import numpy as np
from absl.testing import parameterized

from invact_jax import accuracy
from tests.ops.activations.base import audit
from tests.ops.activations.cases import DTYPES


class AccuracyTest(parameterized.TestCase):

  @parameterized.product(name=tuple(accuracy.NONMONOTONE + accuracy.MONOTONE), dtype=DTYPES)
  def test_error_within_floor(self, name, dtype):
    row = audit(name, dtype)
    print(f"{name} {dtype}: floor {row.floor:.3e} error {row.error:.3e} ratio {row.ratio:.3f}")
    self.assertEqual(row.nonfinite, 0)
    self.assertLessEqual(row.error, 1.2 * row.floor)
    # left out only where jax.nn's own output is not finite and the true one is: the
    # extremes of the grid (soft_sign's +-inf, squareplus's overflowing x**2), never more
    self.assertLessEqual(row.unsound, 8)

  def test_floor_detects_a_bad_inverse(self):
    # The audit must be able to fail: a slightly wrong derivative breaks the bound.
    row = accuracy.audit("silu", "float32",
                         approx=lambda y, x: accuracy.derivative64("silu", x.astype(np.float64)) + 1e-3)
    self.assertGreater(row.error, 1.2 * row.floor)
