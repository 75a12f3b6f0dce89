"""The frontier's PyTorch rows: the same stacks and language models in PyTorch, one process
per row.

``python -m models.benchmarks.frontier_torch SPEC_JSON`` builds the stack of
``spec["shape"]`` (:class:`models.benchmarks.frontier.Shape`'s fields) and measures one
configuration (:data:`CONFIGURATIONS`): ``eager``; ``checkpoint`` (``torch.utils.checkpoint`` per layer); ``liger`` (Liger-
Kernel's fused RMSNorm / LayerNorm, SwiGLU and RoPE — what its Llama patch replaces in a
decoder layer — and, for a language model, its fused linear cross-entropy head, on a CUDA
GPU with liger-kernel importable); ``liger+checkpoint``; ``compile`` (``torch.compile``).
A language model (``vocab`` > 0) runs from the tokens through the embedding, the layers
(grouped-query attention where ``kv_heads`` is set), the final RMSNorm and the head (the
embedding table where ``tied``) to the mean cross-entropy, its parameters in the compute
dtype.  Attention is
``scaled_dot_product_attention`` (flash on a GPU).  The activation bytes are, on a GPU, the
allocator's peak during a step minus what was resident before it and the gradients; on a CPU,
the bytes autograd saves for the backward (``saved_tensors_hooks``, each storage once).  The
row is the last line printed.  Only this module imports torch.
"""
from __future__ import annotations

import importlib.util
import statistics
import time
from typing import NamedTuple


class Choices(NamedTuple):
  """What a PyTorch configuration turns on."""
  liger: bool = False        # Liger-Kernel's kernels (and its fused linear cross-entropy)
  checkpoint: bool = False   # torch.utils.checkpoint around each layer
  compile: bool = False      # torch.compile of the whole model


#: The PyTorch configurations by name.
CONFIGURATIONS: dict[str, Choices] = {
    "eager": Choices(), "checkpoint": Choices(checkpoint=True), "liger": Choices(liger=True),
    "liger+checkpoint": Choices(liger=True, checkpoint=True), "compile": Choices(compile=True)}


def importable() -> bool:
  return importlib.util.find_spec("torch") is not None


def _rope(q, k, liger: bool):
  """The rotary embedding of q and k [B, heads, T, dh] (halves rotated, as the JAX stack's;
  with Liger, its fused kernel on the same tables, doubled as Hugging Face's are)."""
  import torch  # pylint: disable=import-outside-toplevel
  t, dh = q.shape[2], q.shape[3]
  inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, device=q.device).float() / dh))
  ang = torch.arange(t, device=q.device).float()[:, None] * inv[None]
  cos, sin = ang.cos().to(q.dtype), ang.sin().to(q.dtype)  # [T, dh / 2]
  if liger:
    from liger_kernel.transformers import liger_rotary_pos_emb  # pylint: disable=import-outside-toplevel
    return liger_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None],
                                torch.cat([sin, sin], -1)[None])

  def one(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
  return one(q), one(k)


def _block(shape: dict, liger: bool):
  """The transformer block class of ``shape`` (Llama: RMSNorm, SwiGLU, rotary; GPT-2/ViT:
  LayerNorm, GELU), Liger's norms and MLP with ``liger``."""
  from torch import nn  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  d, heads, ff, kind = shape["d"], shape["heads"], shape["ff"], shape["kind"]
  kv_heads = shape.get("kv_heads") or heads
  kv = kv_heads * (d // heads)
  if liger:
    from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm  # pylint: disable=import-outside-toplevel
    from liger_kernel.transformers import LigerSwiGLUMLP  # pylint: disable=import-outside-toplevel

  class SwiGLU(nn.Module):
    def __init__(self):
      super().__init__()
      self.gate_proj = nn.Linear(d, ff, bias=False)
      self.up_proj = nn.Linear(d, ff, bias=False)
      self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
      return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      bias = kind != "llama"
      self.qkv = nn.Linear(d, d + 2 * kv, bias=bias)
      self.out = nn.Linear(d, d, bias=bias)
      if kind == "llama":
        norm = (lambda: LigerRMSNorm(d)) if liger else (lambda: nn.RMSNorm(d))
        if liger:
          cfg = type("Cfg", (), {"hidden_size": d, "intermediate_size": ff, "hidden_act": "silu"})
          self.mlp = LigerSwiGLUMLP(cfg)
        else:
          self.mlp = SwiGLU()
      else:
        norm = (lambda: LigerLayerNorm(d)) if liger else (lambda: nn.LayerNorm(d))
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(approximate="tanh"), nn.Linear(ff, d))
      self.n1, self.n2 = norm(), norm()

    def forward(self, x):
      b, t, _ = x.shape
      q, k, v = self.qkv(self.n1(x)).split([d, kv, kv], dim=-1)
      q = q.view(b, t, heads, d // heads).transpose(1, 2)
      k, v = (a.view(b, t, kv_heads, d // heads).transpose(1, 2) for a in (k, v))
      if kind == "llama":
        q, k = _rope(q, k, liger)
      if kv_heads != heads:
        k, v = (a.repeat_interleave(heads // kv_heads, dim=1) for a in (k, v))
      o = F.scaled_dot_product_attention(q, k, v, is_causal=kind != "vit")
      x = x + self.out(o.transpose(1, 2).reshape(b, t, d))
      return x + self.mlp(self.n2(x))
  return Block


def _model(shape: dict, choices: Choices, dtype, device, annotate: bool = False):
  """The stack (or language model) of ``shape`` in PyTorch under ``choices`` (checkpointed
  blocks, Liger's kernels and fused linear cross-entropy, torch.compile); with ``annotate``,
  the head's forward inside ``record_function("head")`` (for the profile)."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from torch import nn  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  d, vocab, liger = shape["d"], shape.get("vocab", 0), choices.liger
  block = _block(shape, liger)

  class StackModel(nn.Module):
    def __init__(self):
      super().__init__()
      self.blocks = nn.ModuleList(block() for _ in range(shape["layers"]))
      if vocab:
        self.embed = nn.Embedding(vocab, d)
        if liger:
          from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, LigerRMSNorm  # pylint: disable=import-outside-toplevel
          self.fused = LigerFusedLinearCrossEntropyLoss()
        self.norm = LigerRMSNorm(d) if liger else nn.RMSNorm(d)
        self.head = None if shape.get("tied", True) else nn.Linear(d, vocab, bias=False)

    def layers(self, x):
      for blk in self.blocks:
        if choices.checkpoint:
          from torch.utils.checkpoint import checkpoint  # pylint: disable=import-outside-toplevel
          x = checkpoint(blk, x, use_reentrant=False)
        else:
          x = blk(x)
      return x

    def forward(self, x):
      if not vocab:  # a stack: the mean square of its output
        return self.layers(x).float().pow(2).mean()
      h = self.norm(self.layers(self.embed(x[:, :-1])))
      w = self.embed.weight if self.head is None else self.head.weight  # [V, d]
      labels = x[:, 1:].reshape(-1)
      with torch.profiler.record_function("head") if annotate else contextlib.nullcontext():
        if liger:
          return self.fused(w, h.reshape(-1, d), labels)
        return F.cross_entropy((h @ w.T).float().reshape(-1, vocab), labels)
  model = StackModel().to(device=device, dtype=dtype)
  return torch.compile(model) if choices.compile else model


def measure(spec: dict) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  shape, name = spec["shape"], spec["configuration"]
  if name not in CONFIGURATIONS:
    return {"error": f"unknown configuration {name!r}; choose from {list(CONFIGURATIONS)}"}
  choices = CONFIGURATIONS[name]
  cuda = torch.cuda.is_available()
  if choices.liger and (not cuda or importlib.util.find_spec("liger_kernel") is None):
    return {"error": "Liger-Kernel needs a CUDA GPU and the liger-kernel package"}
  device = "cuda" if cuda else "cpu"
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec["dtype"]]
  torch.manual_seed(0)
  model = _model(shape, choices, dtype, device, annotate=bool(spec.get("profile")))
  if shape.get("vocab"):
    x = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), device=device)
  else:
    x = torch.randn(shape["batch"], shape["seq"], shape["d"], device=device, dtype=dtype)

  def step():
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss
  step()  # compile, allocate the gradients
  if cuda:
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    activation = torch.cuda.max_memory_allocated() - before - grads
    how = "device peak"
  else:
    free = {p.untyped_storage().data_ptr() for p in model.parameters()}
    free.add(x.untyped_storage().data_ptr())  # parameters and inputs: not activations
    seen, total = set(), [0]

    def pack(t):
      storage = t.untyped_storage()
      if storage.data_ptr() not in free and storage.data_ptr() not in seen:
        seen.add(storage.data_ptr())
        total[0] += storage.nbytes()
      return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
      step()
    activation, how = total[0], "saved tensors"
  times = []
  for _ in range(spec.get("repeats", 5)):
    if cuda:
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if cuda:
      torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
  row = {"activation_bytes": int(activation), "step_ms": 1e3 * statistics.median(times),
         "memory": how, "torch": torch.__version__}
  if spec.get("profile"):
    try:
      row["profile"] = _profile(step, spec["profile"], spec.get("trace_out"))
    except Exception as e:  # pylint: disable=broad-except  (the row's figures stand without it)
      from models.benchmarks import child  # pylint: disable=import-outside-toplevel
      row["profile_error"] = child.error_row(e)["error"]
  return row


def _profile(step, top: int, trace_out: str | None = None) -> list[dict]:
  """The ``top`` largest kernels of one ``step()`` under ``torch.profiler`` (after the timed
  steps: warm), :func:`models.benchmarks.profile.torch_kernels`; the head's forward
  annotated; the Chrome trace gzipped to ``trace_out`` where given."""
  import gzip  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from models.benchmarks import profile as op_profile  # pylint: disable=import-outside-toplevel
  activities = [torch.profiler.ProfilerActivity.CPU]
  if torch.cuda.is_available():
    activities.append(torch.profiler.ProfilerActivity.CUDA)
  with torch.profiler.profile(activities=activities) as prof:
    step()
    if torch.cuda.is_available():
      torch.cuda.synchronize()
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f:
      raw = f.read()
  if trace_out:
    with gzip.open(trace_out, "wb") as f:
      f.write(raw)
  return op_profile.torch_kernels(json.loads(raw)["traceEvents"], steps=1, top=top)


if __name__ == "__main__":
  from models.benchmarks import child  # pylint: disable=import-outside-toplevel
  child.child_main(measure)
