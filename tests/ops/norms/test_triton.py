"""Raw Triton norm kernels: the shared base and the kernel-vs-XLA-math checks of the Pallas
tests, compiled on a GPU (skipped without one) and in Triton's interpreter anywhere; every
kernel compiles for sm_90 on any machine, without spills."""
import pytest

pytest.importorskip("triton")

# pylint: disable=wrong-import-position
from pallas_kernels import machine_code
from pallas_kernels import norms
from pallas_kernels import triton_elementwise
from pallas_kernels import triton_norms
from tests.ops.norms import test_pallas


class TritonNormTest(test_pallas.PallasNormTest):
  IMPLEMENTATION = "triton"
  KERNELS = triton_norms


class TritonNormInterpretTest(TritonNormTest):
  INTERPRET = True
  HOST_CALLBACK = True


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("n", [768, 4096])
def test_norm_kernels_compile_for_sm90_without_spills(rms, dtype, n, monkeypatch, tmp_path):
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # wherever HOME is read-only
  chunk = norms.chunk_for(n)
  fwd = triton_elementwise.compile_for(
      triton_norms.norm_forward_kernel, None,
      {"x_ptr": f"*{dtype}", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "z_ptr": f"*{dtype}",
       "xhat_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "N": "constexpr", "CHUNK": "constexpr",
       "RMS": "constexpr", "HAS_SCALE": "constexpr", "HAS_BIAS": "constexpr",
       "EPS": "constexpr"},
      {"N": n, "CHUNK": chunk, "RMS": rms, "HAS_SCALE": True, "HAS_BIAS": not rms,
       "EPS": 1e-6}, num_warps=norms.warps_for(chunk))
  bwd = triton_elementwise.compile_for(
      triton_norms.norm_backward_kernel, None,
      {"xhat_ptr": f"*{dtype}", "rstd_ptr": "*fp32", "dz_ptr": f"*{dtype}",
       "scale_ptr": "*fp32", "dx_ptr": f"*{dtype}", "N": "constexpr", "CHUNK": "constexpr",
       "RMS": "constexpr", "HAS_SCALE": "constexpr"},
      {"N": n, "CHUNK": chunk, "RMS": rms, "HAS_SCALE": True},
      num_warps=norms.warps_for(chunk))
  for asm in (fwd, bwd):
    st = machine_code.stats(asm["cubin"])
    assert st["local_bytes"] == 0, st["registers"]
    assert "ld.global" in asm["ptx"] and "st.global" in asm["ptx"]
