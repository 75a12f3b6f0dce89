"""SASS statistics of a compiled Triton kernel, without a GPU (Triton's bundled tools)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import tempfile

__all__ = ["stats"]


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
