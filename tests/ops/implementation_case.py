"""The base of every op family's test base: which implementation a subclass tests, and the
skip for compiled kernels without a GPU (the ``INTERPRET = True`` subclass covers CPU)."""
import jax
from absl.testing import parameterized

import invact_jax


class ImplementationTestCase(parameterized.TestCase):
  IMPLEMENTATION = "xla"
  INTERPRET = False
  # Whether the kernels run as a host callback (Triton's interpreter): XLA cannot partition
  # one (jax-ml/jax#23620), so a mesh gathers its operands; values are still checked.
  HOST_CALLBACK = False

  def setUp(self):
    super().setUp()
    if self.IMPLEMENTATION != "xla" and not self.INTERPRET:
      if jax.default_backend() != "gpu":
        self.skipTest("compiled kernels need a GPU; the interpret-mode subclass covers CPU")
      ok, why = invact_jax.available(self.IMPLEMENTATION)
      if not ok:  # e.g. a GPU machine without jax-triton
        self.skipTest(why)

  @property
  def impl(self):
    if self.IMPLEMENTATION == "xla":
      return "xla"
    return invact_jax.Implementation(name=self.IMPLEMENTATION, interpret=self.INTERPRET)
