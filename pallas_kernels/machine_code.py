"""The machine code of a compiled Triton kernel, read without a GPU (Triton's bundled
nvdisasm and cuobjdump), and the roofline it predicts on an H100."""
from __future__ import annotations

import pathlib
import re
import subprocess
import tempfile

__all__ = ["H100", "stats", "predict", "capture_ttir", "compile_ttir"]

#: The H100 SXM's figures the roofline uses.
H100 = {"sms": 132, "clock_hz": 1.755e9, "issue_per_sm_cycle": 4 * 32, "mufu_per_sm_cycle": 16,
        "hbm_bytes_per_s": 3.35e12}


def stats(cubin: bytes) -> dict:
  """Instructions (nvdisasm, NOPs excluded), MUFU instructions, registers and local-memory
  (spill) bytes per thread (cuobjdump) of one kernel's cubin, by opcode too."""
  import triton  # pylint: disable=import-outside-toplevel
  bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(path)], capture_output=True,
                          text=True, check=True).stdout
    res = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", str(path)],
                         capture_output=True, text=True, check=True).stdout
  ops: dict[str, int] = {}
  for line in sass.splitlines():
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if m and m.group(1) != "NOP":
      ops[m.group(1)] = ops.get(m.group(1), 0) + 1
  return {"instructions": sum(ops.values()), "mufu": ops.get("MUFU", 0),
          "registers": int(re.search(r"REG:(\d+)", res).group(1)),
          "local_bytes": int(re.search(r"LOCAL:(\d+)", res).group(1)), "by_opcode": ops}


def predict(per_elem_instr: float, per_elem_mufu: float, bytes_per_elem: float,
            hw: dict = H100) -> dict:
  """The fraction of ``hw``'s memory bandwidth a kernel reaches, from its instructions and MUFU
  instructions per element (issue and special-function throughput) against the bytes each
  element moves; and which of the three bounds it.

  Returns:
    ``{"fraction_of_bandwidth": ..., "bound": "memory" | "issue" | "MUFU"}``.
  """
  t_issue = per_elem_instr / (hw["sms"] * hw["issue_per_sm_cycle"] * hw["clock_hz"])
  t_mufu = per_elem_mufu / (hw["sms"] * hw["mufu_per_sm_cycle"] * hw["clock_hz"])
  t_mem = bytes_per_elem / hw["hbm_bytes_per_s"]
  return {"fraction_of_bandwidth": min(1.0, t_mem / max(t_issue, t_mufu)),
          "bound": "memory" if t_mem >= max(t_issue, t_mufu) else
                   ("issue" if t_issue >= t_mufu else "MUFU")}


def capture_ttir() -> list[str]:
  """Make Pallas lower for CUDA without a GPU (an sm_90 device assumed) and keep the Triton IR
  of each kernel it lowers from now on: the returned list grows as ``jax.export(...,
  platforms=["cuda"])`` lowers Pallas calls."""
  import types  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.triton import lowering  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.triton import pallas_call_registration as reg  # pylint: disable=import-outside-toplevel
  if hasattr(reg, "gpu_info_lib"):  # (JAX 0.12 asks the device; 0.10 falls back to 9.0 itself)
    reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability="9.0")
  captured: list[str] = []
  original = lowering.lower_jaxpr_to_triton_module

  def spy(*args, **kwargs):
    res = original(*args, **kwargs)
    captured.append(res.module.operation.get_asm(enable_debug_info=False))
    return res
  reg.lowering.lower_jaxpr_to_triton_module = spy
  return captured


def compile_ttir(ttir: str, num_warps: int, num_stages: int | None = None) -> bytes:
  """The sm_90 cubin of one kernel's Triton IR, compiled here (no GPU needed)."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
  with tempfile.TemporaryDirectory() as tmp:
    src = pathlib.Path(tmp) / "kernel.ttir"
    src.write_text(ttir)
    k = triton.compile(str(src), target=GPUTarget("cuda", 90, 32), options=options)
  return k.asm["cubin"]
