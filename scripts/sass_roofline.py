#!/usr/bin/env python3
"""Predicted H100 speed of the Pallas and raw Triton kernels, from their compiled SASS (no GPU).

Lowers each kernel (forward and backward, per activation and dtype, and the LayerNorm/RMSNorm
row kernels per width) through Pallas's Triton
path for ``cuda`` on any machine, compiles the Triton IR that Pallas emits with the ``triton``
package for ``GPUTarget("cuda", 90, 32)`` (its bundled ptxas), and counts the SASS
instructions (nvdisasm), registers and local-memory spills (cuobjdump).

Model (a prediction, not a measurement): every SM issues 4 warp-instructions per cycle, so an
H100 SXM (132 SMs, 1.755 GHz sustained) retires 132 * 4 * 32 * 1.755e9 = 2.97e13 thread-
instructions/s; MUFU (exp/log/sqrt/rcp) issue at 16 per SM per cycle.  A kernel moving B bytes
per element at 3.35 TB/s is memory-bound when its instructions per element fit under the
memory time:  predicted fraction of bandwidth = min(1, t_memory / max(t_issue, t_mufu)),
assuming perfect overlap of memory and issue (an upper bound on what the kernel can reach).

Needs ``triton`` (pip install triton; any OS, no GPU) and JAX with Pallas.  Uses JAX's private
Pallas-Triton lowering hooks (tested with JAX 0.12); prints a markdown table and writes JSON.

  python scripts/sass_roofline.py --out bench/sass_roofline.json
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: models/
from models import cli  # noqa: E402  (the standard library only)

if __name__ == "__main__":
  cli.stop_on_signals()  # a signal from here on, the imports below included: one line

from models.benchmarks import sass  # noqa: E402


ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  p = cli.parser(__doc__)
  p.add_argument("--activations", default="gelu_tanh,gelu_erf,silu,mish")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--norm-widths", default="768,4096",
                 help="row widths of the LayerNorm/RMSNorm kernels ('' to skip them)")
  p.add_argument("--implementations", default="pallas,triton",
                 help="activation kernels: Pallas's (the Triton IR it emits) and/or the raw "
                      "Triton kernels (invact_jax.ops.activations.triton)")
  p.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "sass_roofline.json")
  args = p.parse_args(argv)
  return sass.roofline(args)


if __name__ == "__main__":
  cli.finish(main)
