"""The XLA norms (the default): the shared base, plus argument checks."""
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import invact_jax
from tests.ops.norms import base


class XlaNormTest(base.NormTestBase):
  IMPLEMENTATION = "xla"


class NormErrorsTest(parameterized.TestCase):

  def test_errors_name_the_argument(self):
    with self.assertRaisesRegex(TypeError, "argument `x`"):
      invact_jax.layer_norm(jnp.ones((2, 4), jnp.int32))
    with self.assertRaisesRegex(ValueError, "argument `scale` must have shape"):
      invact_jax.layer_norm(jnp.ones((2, 4)), jnp.ones(3))
    with self.assertRaisesRegex(ValueError, r"argument `kernels\[0\]`"):
      invact_jax.layer_norm_dense(jnp.ones((2, 4)), None, None, [jnp.ones((3, 2))])
    with self.assertRaisesRegex(ValueError, "argument `biases`"):
      invact_jax.layer_norm_dense(jnp.ones((2, 4)), None, None, [jnp.ones((4, 2))], [])
    with self.assertRaisesRegex(TypeError, "invact_jax.layer_norm: argument `epsilon`"):
      invact_jax.layer_norm(jnp.ones((2, 4)), epsilon=jnp.ones(2))
    with self.assertRaisesRegex(TypeError, "invact_jax.rms_norm: argument `epsilon`.*traced"):
      jax.jit(lambda e: invact_jax.rms_norm(jnp.ones((2, 4)), epsilon=e))(1e-6)
    with self.assertRaisesRegex(ValueError, "argument `epsilon` must be finite and >= 0"):
      invact_jax.layer_norm(jnp.ones((2, 4)), epsilon=-1.0)
    with self.assertRaisesRegex(TypeError, "argument `dtype`"):
      invact_jax.layer_norm(jnp.ones((2, 4)), dtype=jnp.int8)
    with self.assertRaisesRegex(ValueError, "at least 1 dimension"):
      invact_jax.layer_norm(jnp.float32(1.0))

  def test_kernel_options_that_do_not_apply_are_refused(self):
    impl = invact_jax.Implementation(name="pallas", block_rows=64)
    with self.assertRaisesRegex(ValueError, r"invact_jax.layer_norm: Implementation option\(s\) "
                                r"\['block_rows'\] have no effect"):
      invact_jax.layer_norm(jnp.ones((2, 8)), implementation=impl)
    with self.assertRaisesRegex(ValueError, "not available for this op"):
      invact_jax.softmax(jnp.ones(3), implementation="pallas")

  def test_numpy_epsilon_accepted(self):
    x = jnp.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(invact_jax.layer_norm(x, epsilon=np.float32(1e-5)),
                                  invact_jax.layer_norm(x, epsilon=1e-5))
