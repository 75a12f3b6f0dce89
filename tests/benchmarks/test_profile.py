"""models.benchmarks.profile: per-operation times from a jax.profiler trace."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.benchmarks import lm_head, profile


def _event(pid, tid, ts, dur, op, name=None, module="jit_step"):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name or op,
          "args": {"hlo_op": op, "hlo_module": module}}


def _process(pid, name):
  return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}


def test_only_innermost_events_count_and_a_device_is_preferred():
  host = [_process(1, "/host:CPU"), _event(1, 7, 0, 100, "while.1"),
          _event(1, 7, 10, 30, "dot.2"), _event(1, 7, 50, 40, "fusion.3"),
          _event(1, 8, 0, 20, "dot.2"), {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 500,
                                         "name": "python"}]
  rows = profile.ops_from_trace(host, steps=2)
  # the loop holds its body: only dot.2 (two threads) and fusion.3 count
  assert [(r["op"], r["ms"], r["calls"]) for r in rows] == [
      ("dot.2", 0.025, 1.0), ("fusion.3", 0.02, 0.5)]
  assert abs(sum(r["share"] for r in rows) - 1) < 1e-12
  gpu = host + [_process(2, "/device:GPU:0"), _event(2, 1, 0, 300, "dot.2", "sm90_gemm")]
  (row,) = profile.ops_from_trace(gpu, steps=1)
  assert row == {"op": "dot.2", "module": "jit_step", "ms": 0.3, "calls": 1.0, "share": 1.0,
                 "kernel": "sm90_gemm"}
  assert [r["op"] for r in profile.ops_from_trace(host, steps=1, top=1)] == ["dot.2"]
  with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
    profile.ops_from_trace(host, steps=0)


def test_op_times_of_a_compiled_step_names_its_operations():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 256)), jnp.float32)
  step = jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(x).compile()
  rows = profile.op_times(step, x, steps=2)
  assert rows and all(r["ms"] >= 0 and r["calls"] > 0 for r in rows), rows
  assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
  assert profile.table(rows[:2]).count("\n") == 3


def test_the_head_benchmark_profiles_each_jax_head():
  rs = lm_head.rows(64, 16, 256, dtypes=("float32",), repeats=1, torch=False,
                    names=("plain", "invact_jax"), profile=3)
  assert [r["head"] for r in rs] == ["plain", "invact_jax"]
  for r in rs:
    assert 1 <= len(r["profile"]) <= 3 and r["profile"][0]["ms"] >= r["profile"][-1]["ms"], r


def test_a_device_counts_every_kernel_of_a_command_buffer_by_its_own_name():
  """XLA:GPU's command buffers tag their kernels with the buffer's op; kernels of a CUDA graph
  may overlap: each counts, under its own name."""
  gpu = [_process(2, "/device:GPU:0"),
         _event(2, 1, 0, 300, "command_buffer_3", "nvjet_sm90_gemm"),
         _event(2, 1, 100, 50, "command_buffer_3", "loop_add_fusion"),  # overlaps the gemm
         _event(2, 1, 400, 300, "command_buffer_3", "nvjet_sm90_gemm")]
  rows = profile.ops_from_trace(gpu, steps=1)
  assert [(r["op"], r["kernel"], r["ms"], r["calls"]) for r in rows] == [
      ("command_buffer_3", "nvjet_sm90_gemm", 0.6, 2.0),
      ("command_buffer_3", "loop_add_fusion", 0.05, 1.0)]
  # a kernel no operation tags (Pallas's Triton kernel) counts where it runs on a stream;
  # a derived line of the device's (not a stream) does not
  streams = gpu + [{"ph": "M", "pid": 2, "tid": 1, "name": "thread_name",
                    "args": {"name": "Stream 7 (Compute)"}},
                   {"ph": "X", "pid": 2, "tid": 1, "ts": 800, "dur": 100, "name": "invact_head",
                    "args": {}},
                   {"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 900, "name": "XLA Modules",
                    "args": {}}]
  rows = profile.ops_from_trace(streams, steps=1)
  assert [(r["op"], r.get("kernel"), r["ms"]) for r in rows][1] == ("", "invact_head", 0.1)
  assert len(rows) == 3


def _torch_event(cat, name, ts, dur, tid=1, **args):
  return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
          "args": args}


def test_torch_kernels_sum_per_kernel_and_mark_the_annotated_head():
  events = [
      _torch_event("user_annotation", "head", 100, 50),
      _torch_event("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
      _torch_event("cuda_runtime", "cudaLaunchKernel", 120, 2, correlation=2),
      _torch_event("cuda_runtime", "cudaLaunchKernel", 130, 2, correlation=3),
      _torch_event("cuda_runtime", "cudaLaunchKernel", 125, 2, tid=2, correlation=4),
      _torch_event("kernel", "nvjet_gemm", 1000, 400, tid=7, correlation=1),
      _torch_event("kernel", "nvjet_gemm", 1500, 200, tid=7, correlation=2),
      _torch_event("kernel", "liger_cross_entropy_kernel", 1800, 100, tid=7, correlation=3),
      _torch_event("kernel", "_rms_norm_backward_kernel", 2000, 100, tid=7, correlation=4),
      _torch_event("gpu_memset", "Memset (Device)", 2200, 200, tid=7, correlation=9),
      _torch_event("cpu_op", "aten::mm", 0, 900)]
  rows = profile.torch_kernels(events, steps=2)
  by = {(r["kernel"], r["head"]): r for r in rows}
  assert by[("nvjet_gemm", False)]["ms"] == 0.2 and by[("nvjet_gemm", True)]["ms"] == 0.1
  assert by[("liger_cross_entropy_kernel", True)]["calls"] == 0.5
  # a launch on another thread is not inside that thread's annotation; an unmatched one neither
  assert not by[("_rms_norm_backward_kernel", False)]["head"]
  assert by[("Memset (Device)", False)]["ms"] == 0.1
  assert abs(sum(r["share"] for r in rows) - 1) < 1e-12 and rows[0]["kernel"] == "nvjet_gemm"
  assert [r["kernel"] for r in profile.torch_kernels(events, steps=1, top=1)] == ["nvjet_gemm"]
  with pytest.raises(ValueError, match="steps must be at least 1"):
    profile.torch_kernels(events, steps=0)


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "matmuls"), ("gemm_fusion_dot_43", "matmuls"),
    ("void cublasLt::splitKreduce_kernel<32, 16>", "matmuls"), ("dot.2", "matmuls"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "attention"),
    ("wrapped_convert_1", "copies and casts"), ("loop_dynamic_update_slice_fusion_5", "copies and casts"),
    ("memcpy128", "copies and casts"), ("Memset (Device)", "copies and casts"),
    ("loop_broadcast_fusion_4", "copies and casts"), ("wrapped_concatenate_1", "copies and casts"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies and casts"),
    ("void at::native::CatArrayBatchedCopy_vectorized<>", "copies and casts"),
    ("loop_convert_multiply_fusion", "elementwise and norms"),
    ("input_add_multiply_reduce_fusion_1", "elementwise and norms"),
    ("_rms_norm_backward_kernel", "elementwise and norms"),
    ("liger_cross_entropy_kernel", "elementwise and norms"),
    ("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>", "elementwise and norms"),
])
def test_kind_by_the_kernels_name(name, kind):
  assert profile.kind(name) == kind


def test_groups_split_calls_beyond_the_layers_and_follow_the_head_annotation():
  xla = [{"op": "command_buffer_1", "kernel": "nvjet_gemm", "ms": 17.0, "calls": 17.0},
         {"op": "command_buffer_2", "kernel": "wrapped_convert_1", "ms": 12.0, "calls": 12.0},
         {"op": "fusion.3", "ms": 3.0, "calls": 32.0}]
  g = profile.groups(xla, layers=16)
  assert g["matmuls"] == {"layers": 16.0, "outside": 1.0}       # 16 calls in, 1 beyond
  assert g["copies and casts"] == {"layers": 0.0, "outside": 12.0}  # 12 chunks of the head
  assert g["elementwise and norms"] == {"layers": 3.0, "outside": 0.0}
  assert g["attention"] == {"layers": 0.0, "outside": 0.0} and list(g) == list(profile.KINDS)
  torch = [{"kernel": "nvjet_gemm", "ms": 2.0, "calls": 48.0, "head": True},
           {"kernel": "nvjet_gemm", "ms": 5.0, "calls": 64.0, "head": False}]
  assert profile.groups(torch, layers=16)["matmuls"] == {"layers": 5.0, "outside": 2.0}
