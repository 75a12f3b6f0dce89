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

  def skip_interpreted_float16(self, dtype: str) -> None:
    """(CI time) In interpret mode, leave float16 to the compiled kernels: the interpreted
    kernel's float16 plumbing is bfloat16's (float32 math, a cast on load and store), and the
    XLA implementation's tests run float16 itself (its own fits, for the activations)."""
    if self.INTERPRET and dtype == "float16":
      self.skipTest("interpret mode: float16 runs compiled (bfloat16 covers the plumbing here)")

  @property
  def impl(self):
    if self.IMPLEMENTATION == "xla":
      return "xla"
    return invact_jax.Implementation(name=self.IMPLEMENTATION, interpret=self.INTERPRET)
