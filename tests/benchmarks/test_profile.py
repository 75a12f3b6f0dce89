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
