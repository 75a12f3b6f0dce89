"""The LM head benchmark's PyTorch rows: one process per row.

``python -m models.benchmarks.lm_head_torch SPEC_JSON`` loads the head that
:func:`models.benchmarks.lm_head.torch_rows` saved (``spec["path"]``: an ``.npz`` with ``x``
[N, d], ``w`` [d, V] in float32 holding values exact in ``spec["dtype"]``, ``labels`` [N]) and
measures one head of the mean cross-entropy's value and gradients w.r.t. ``x`` and the
weight: ``torch plain`` (``x @ w.T`` in the inputs' dtype, ``F.cross_entropy`` on the logits
in float32: what users write) or ``torch Liger`` (Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss``, on a CUDA GPU with liger-kernel importable).  The weight
is held as [V, d] (``nn.Linear``'s layout).  Per row: ``temp_bytes`` (on a GPU the allocator's
peak during a step minus what was resident before it and the two gradients; on a CPU not
measured), whether a [N, V] buffer was allocated (peak temp ≥ one logits array in the dtype),
the median wall time over ``spec["repeats"]`` and the gradients' relative L2 distance to the
float64 formula computed here.  The row is the last line printed.  Only this module imports
torch.
"""
from __future__ import annotations

import importlib.util
import statistics
import time

HEADS = ("torch plain", "torch Liger")


def importable() -> bool:
  """Whether torch can be imported here (the rows need it)."""
  return importlib.util.find_spec("torch") is not None


def _loss_fn(head: str):
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  if head == "torch plain":
    return lambda x, w, labels: F.cross_entropy((x @ w.T).float(), labels)
  from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # pylint: disable=import-outside-toplevel
  fused = LigerFusedLinearCrossEntropyLoss()
  return lambda x, w, labels: fused(w, x, labels)


def _reference(x, w, labels):
  """float64 gradients of the plain formula."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  x64 = x.detach().double().requires_grad_(True)
  w64 = w.detach().double().requires_grad_(True)
  F.cross_entropy(x64 @ w64.T, labels).backward()
  out = [x64.grad, w64.grad]
  del x64, w64
  if torch.cuda.is_available():
    torch.cuda.empty_cache()
  return out


def measure(spec: dict) -> dict:
  """One row (see the module's docstring)."""
  head = spec["head"]
  if head not in HEADS:
    return {"head": head, "error": f"unknown head; choose from {list(HEADS)}"}
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  cuda = torch.cuda.is_available()
  if head == "torch Liger" and (not cuda or importlib.util.find_spec("liger_kernel") is None):
    return {"head": head, "error": "Liger-Kernel needs a CUDA GPU and liger-kernel"}
  device = "cuda" if cuda else "cpu"
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec["dtype"]]
  data = np.load(spec["path"])
  labels = torch.from_numpy(data["labels"].astype(np.int64)).to(device)
  x = torch.from_numpy(data["x"]).to(device=device, dtype=dtype).requires_grad_(True)
  w = torch.from_numpy(np.ascontiguousarray(data["w"].T)).to(device=device, dtype=dtype)
  w.requires_grad_(True)
  n, v = x.shape[0], w.shape[0]
  g64 = _reference(x, w, labels)
  loss_fn = _loss_fn(head)

  def step():
    x.grad = w.grad = None
    loss = loss_fn(x, w, labels)
    loss.backward()
    return loss
  loss = step()  # warm-up: kernels compiled, autotuned
  row = {"head": head, "loss": float(loss)}
  if cuda:
    torch.cuda.synchronize()
    x.grad = w.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (x, w))
    row["temp_bytes"] = int(torch.cuda.max_memory_allocated() - before - grads)
    row["logits_buffer"] = row["temp_bytes"] >= n * v * x.element_size()
    row["memory"] = "device peak"
  times = []
  for _ in range(spec["repeats"]):
    t0 = time.perf_counter()
    step()
    if cuda:
      torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
  row["time_s"] = statistics.median(times)
  num = sum(float(((a.grad.double() - b) ** 2).sum()) for a, b in zip((x, w), g64))
  den = sum(float((b ** 2).sum()) for b in g64)
  row["grad_error"] = (num / den) ** 0.5
  return row


if __name__ == "__main__":
  from models.benchmarks import child  # pylint: disable=import-outside-toplevel
  child.child_main(measure, key=lambda spec: {"head": spec.get("head")})
