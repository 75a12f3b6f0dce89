"""The kernels' SASS roofline table without a GPU (``scripts/sass_roofline.py``): every Pallas and
Triton kernel compiled for sm_90, its machine code counted (:mod:`pallas_kernels.machine_code`)."""
from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import sys

from pallas_kernels import machine_code
from pallas_kernels.machine_code import H100, predict, stats

__all__ = ["roofline"]


ROOT = pathlib.Path(__file__).resolve().parents[2]


NUM_WARPS = 4  # the kernels' default (pallas_kernels.elementwise.compiler_params)


_capture_ttir = machine_code.capture_ttir


def _sass_stats(ttir: str, num_warps: int) -> dict:
  return stats(machine_code.compile_ttir(ttir, num_warps))


def _triton_rows(name, op, dtype) -> list[dict]:
  """The raw Triton kernels of ``op`` (generated source, compiled with triton.compile)."""
  from invact_jax.ops.activations import triton as triton_impl  # pylint: disable=import-outside-toplevel
  from pallas_kernels import triton_elementwise  # pylint: disable=import-outside-toplevel
  out = []
  for pass_, (kname, src, sig, const, nbytes) in triton_impl.kernel_sources(op, dtype).items():
    asm = triton_elementwise.compile_for(kname, src, sig, const, num_warps=NUM_WARPS)
    st = stats(asm["cubin"])
    out.append(_row(name, "triton", dtype, pass_, nbytes, st, 32 * NUM_WARPS, 8 * const["BR"]))
  return out


def _row(activation, implementation, dtype, pass_, nbytes, st, threads, elements) -> dict:
  """One table row from a kernel's SASS stats (``threads`` per program on ``elements``)."""
  per_elem, mufu = st["instructions"] * threads / elements, st["mufu"] * threads / elements
  pred = predict(per_elem, mufu, nbytes)
  print(f"{activation} {dtype} {pass_} ({implementation}): {per_elem:.1f} instr/elem, "
        f"{st['registers']} regs, {pred['fraction_of_bandwidth']:.0%} of HBM "
        f"({pred['bound']}-bound)", flush=True)
  return {"activation": activation, "implementation": implementation, "dtype": dtype,
          "pass": pass_, "bytes_per_element": nbytes, "instructions_per_element": per_elem,
          "mufu_per_element": mufu, "registers": st["registers"],
          "local_bytes": st["local_bytes"], **pred, "by_opcode": st["by_opcode"]}


def _norm_rows(captured, widths, dtypes) -> list[dict]:
  """The row kernels of LayerNorm/RMSNorm (one program per row of ``n``; its loops run once
  for n <= 4096, so static SASS counts what a row executes): instructions per element =
  instructions x threads / n.  Bytes per element: forward reads x, writes z and xhat; backward
  reads xhat and dz, writes dx; plus the float32 rstd per row (rows stay in cache between the
  passes over them)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import export  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.norms import pallas as norm_pallas  # pylint: disable=import-outside-toplevel
  from pallas_kernels import norms  # pylint: disable=import-outside-toplevel
  kb = norm_pallas.PallasNorm(interpret=False)
  out = []
  for rms in (False, True):
    name = "rms_norm" if rms else "layer_norm"
    for n in widths:
      warps = norms._params(norms.chunk_for(n)).num_warps  # pylint: disable=protected-access
      for dt in dtypes:
        size = jnp.dtype(dt).itemsize
        x = jax.ShapeDtypeStruct((64, n), jnp.dtype(dt))
        vec = jax.ShapeDtypeStruct((n,), jnp.float32)
        r = jax.ShapeDtypeStruct((64, 1), jnp.float32)
        bias = None if rms else vec
        passes = {
            "forward": (lambda x, s, *b, rms=rms, dt=dt: kb.forward(
                rms, 1e-6, jnp.dtype(dt), x, s, b[0] if b else None),
                (x, vec) + (() if bias is None else (bias,)), 3 * size + 4 / n),
            "backward": (lambda xh, rs, dz, s, rms=rms, dt=dt: kb.backward_dx(
                rms, xh, rs, dz, s, jnp.dtype(dt)), (x, r, x, vec), 3 * size + 4 / n)}
        for pass_, (fn, avals, nbytes) in passes.items():
          captured.clear()
          export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
              export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)
          st = _sass_stats(captured[-1], warps)
          out.append(_row(f"{name} (n={n})", "pallas", dt, pass_, nbytes, st, 32 * warps, n))
  return out



def roofline(args: argparse.Namespace) -> int:
  """``scripts/sass_roofline.py``'s job for its parsed command line ``args``; the exit code."""
  try:
    import triton  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("error: needs the `triton` package (pip install triton)", file=sys.stderr)
    return 2
  captured = _capture_ttir()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import export  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import base, pallas, registry  # pylint: disable=import-outside-toplevel
  from models.benchmarks import op_speed  # pylint: disable=import-outside-toplevel

  rows_n, cols = 4096, 1024
  impls = args.implementations.split(",")
  kb = pallas.PallasActivation(interpret=False)
  rows = []
  for name in args.activations.split(","):
    entry = registry.get(name)
    op = base.Op(entry, entry.params)
    for dt in args.dtypes.split(","):
      itemsize = jnp.dtype(dt).itemsize
      x = jax.ShapeDtypeStruct((rows_n, cols), jnp.dtype(dt))
      m = jax.ShapeDtypeStruct((rows_n, cols // 8), jnp.uint8)
      passes = {"forward": (lambda x: kb.forward(op, x), (x,), 2 * itemsize + 1 / 8),
                "backward": (lambda y, m, dy: kb.backward(op, y, m, dy), (x, m, x),
                             3 * itemsize + 1 / 8)}
      if "triton" in impls:
        rows += _triton_rows(name, op, dt)
      if "pallas" not in impls:
        continue
      for pass_, (fn, avals, nbytes) in passes.items():
        captured.clear()
        export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)
        ttir = captured[-1]
        block = int(re.search(r"tensor<(\d+)x8x", ttir).group(1)) * 8  # elements per program
        st = _sass_stats(ttir, NUM_WARPS)
        rows.append(_row(name, "pallas", dt, pass_, nbytes, st, 32 * NUM_WARPS, block))
  rows += _norm_rows(captured, [int(w) for w in args.norm_widths.split(",") if w],
                     args.dtypes.split(","))
  lines = ["| activation | implementation | dtype | pass | SASS instr/elem | MUFU/elem | "
           "registers | spills (B) | B/elem | predicted % of HBM bandwidth |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['activation']} | {r['implementation']} | {r['dtype']} | {r['pass']} | "
                 f"{r['instructions_per_element']:.1f} | {r['mufu_per_element']:.1f} | "
                 f"{r['registers']} | {r['local_bytes']} | {r['bytes_per_element']:.3g} | "
                 f"{100 * r['fraction_of_bandwidth']:.0f} % ({r['bound']}) |")
  md = "\n".join(lines)
  print(md)
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "triton": triton.__version__, "target": "cuda sm_90 (GPUTarget('cuda', 90, 32))",
          "model": H100, "command": " ".join(sys.argv)}
  op_speed.write_report(
      args.out, meta, rows, md, f"Predicted from compiled SASS (no GPU): JAX {meta['jax']}, "
      f"Triton {meta['triton']}, {meta['target']}, {meta['date']}; model in "
      "scripts/sass_roofline.py.")
  return 0
