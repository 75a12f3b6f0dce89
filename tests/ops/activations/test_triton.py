"""The Triton implementation (raw Triton kernels through jax-triton): the shared base compiled
on a GPU (skipped without one) and in Triton's interpreter anywhere; kernel-only checks that
need no GPU: every generated kernel compiles for sm_90 without spills, and the source generator
spells what the tile math uses and refuses what it cannot spell.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
import tests
from invact_jax.ops.activations import base
from invact_jax.ops.activations import triton as triton_impl
from pallas_kernels import machine_code
from pallas_kernels import triton_elementwise
from pallas_kernels import triton_source
from tests.ops.activations import base as test_base
from tests.ops.activations.cases import CASES

pytest.importorskip("triton")


class TritonActivationTest(test_base.ActivationTestBase):
  IMPLEMENTATION = "triton"
  INTERPRET = False


class TritonActivationInterpretTest(TritonActivationTest):
  INTERPRET = True
  INTERPRET_MATH_IS_XLA = False  # NumPy's exp/tanh/log stand in for libdevice's
  HOST_CALLBACK = True
  # Triton's interpreter is slow: the generated code's kinds (tanh and a fitted backward with
  # a bit; logistic; expm1 with a parameter and a monotone bit); the compiled subclass runs
  # every case on a GPU, and test_kernels_compile_for_sm90_without_spills compiles the rest.
  CASE_NAMES = ("gelu_tanh", "silu", "elu_with_bit")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", ["gelu_tanh", "gelu_erf", "silu", "mish", "softplus", "relu",
                                  "elu_with_bit", "sparse_sigmoid"])
def test_kernels_compile_for_sm90_without_spills(name, dtype, monkeypatch, tmp_path):
  """triton.compile for GPUTarget("cuda", 90, 32) on any machine: no register spills (local
  memory), and the fitted backwards predicted at >= 85 % of H100 bandwidth by
  ``pallas_kernels.machine_code.predict``'s model (measured on an H100 2026-11-23:
  99-113 % of a device copy)."""
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # wherever HOME is read-only
  for pass_, (kname, src, sig, const, nbytes) in triton_impl.kernel_sources(
      CASES[name].op, dtype).items():
    asm = triton_elementwise.compile_for(kname, src, sig, const)
    st = machine_code.stats(asm["cubin"])
    per_elem, mufu = (st[k] * 128 / (8 * const["BR"]) for k in ("instructions", "mufu"))
    assert st["local_bytes"] == 0, (kname, st["local_bytes"], st["registers"])
    if pass_ == "backward" and name in ("gelu_tanh", "gelu_erf", "silu", "mish"):
      pred = machine_code.predict(per_elem, mufu, nbytes)["fraction_of_bandwidth"]
      assert pred >= 0.85, (kname, per_elem, pred)
    assert "ld.global" in asm["ptx"] and "st.global" in asm["ptx"]


def test_generated_math_is_the_registry_math():
  """The generated statements evaluate, as NumPy, to the tile function's XLA result."""
  op = CASES["gelu_tanh"].op
  fn = triton_source.tile_function(lambda y, b: op.derivative(y, b), [jnp.float32, jnp.bool_],
                                   names=["y", "b"])
  y = np.linspace(-0.17, 3.0, 64, dtype=np.float32).reshape(8, 8)
  b = (np.arange(64).reshape(8, 8) % 2 == 0) & (y < -0.1)
  ref = np.asarray(jax.jit(op.derivative)(jnp.asarray(y), jnp.asarray(b)))
  got = _run_numpy(fn, {"y": y, "b": b})
  np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)


def _run_numpy(fn, env):
  """Evaluate generated statements with a NumPy stand-in for ``tl``/``libdevice``."""
  import types  # pylint: disable=import-outside-toplevel

  def full(shape, value, dtype):
    del shape
    return np.asarray(value, dtype)

  class Tensor(np.ndarray):
    def to(self, dtype, bitcast=False):
      a = np.asarray(self)
      return (a.view(dtype) if bitcast else a.astype(dtype)).view(Tensor)

  dtypes = {"float32": np.float32, "int32": np.int32, "int1": np.bool_, "int16": np.int16,
            "float16": np.float16, "bfloat16": np.float32, "uint32": np.uint32}
  tl = types.SimpleNamespace(
      full=lambda s, v, d: full(s, v, d).view(Tensor), where=lambda c, a, b: np.where(c, a, b).view(Tensor),
      abs=lambda a: np.abs(a).view(Tensor),
      maximum=lambda a, b, propagate_nan=None: np.maximum(a, b).view(Tensor),
      minimum=lambda a, b, propagate_nan=None: np.minimum(a, b).view(Tensor),
      PropagateNan=types.SimpleNamespace(ALL=None), **dtypes)
  lib = types.SimpleNamespace(exp=np.exp, log=np.log, log1p=np.log1p, expm1=np.expm1,
                              tanh=np.tanh, sqrt=np.sqrt, floor=np.floor)
  scope = {"tl": tl, "libdevice": lib, "BR": 8}
  scope.update({k: np.asarray(v).view(Tensor) for k, v in env.items()})
  with np.errstate(all="ignore"):
    for line in fn.body:
      exec(line, scope)  # pylint: disable=exec-used
  return np.asarray(scope[fn.outputs[0]])


def test_unknown_primitive_is_named():
  with pytest.raises(NotImplementedError, match="primitive 'cumsum'"):
    triton_source.tile_function(lambda x: jnp.cumsum(x, axis=0), [jnp.float32])
  with pytest.raises(NotImplementedError, match="non-scalar constant"):
    triton_source.tile_function(lambda x: x * jnp.asarray(np.arange(8.0, dtype=np.float32)),
                                [jnp.float32])


def test_without_a_gpu_triton_says_what_to_use():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is here")
  with pytest.raises(RuntimeError, match="need a CUDA GPU .* use implementation='xla', or "
                     "'pallas'"):
    invact_jax.gelu(jnp.ones(8), implementation="triton")


def test_ragged_rows_are_masked_in_kernel():
  """Rows not a multiple of the block and a last axis not a multiple of 8 (interpreter)."""
  op = CASES["silu"].op
  x = jnp.asarray(np.random.default_rng(0).normal(0, 3, (37, 13)).astype(np.float32))
  kb = triton_impl.TritonActivation(interpret=True, block_rows=4)
  y, m = jax.jit(lambda x: kb.forward(op, x))(x)
  y_ref, m_ref = jax.jit(lambda x: base.XLA.forward(op, x))(x)
  np.testing.assert_array_equal(np.asarray(m), np.asarray(m_ref))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-7)
