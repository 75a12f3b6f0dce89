"""models.benchmarks.op_speed (the logic of scripts/bench_kernels.py) on tiny sizes."""
import json
import os
import pathlib

import pytest

import invact_jax
from models.benchmarks import op_speed
from tests import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_measure_rows_and_bytes():
  rows = op_speed.measure(activation="gelu_tanh", sizes=(1024,), dtypes=("bfloat16",),
                          implementations=("xla", invact_jax.Implementation(
                              name="pallas", interpret=True)), repeats=1)
  got = {(r.implementation, r.pass_): r for r in rows}
  assert set(got) == {("copy", "fwd"), ("jax.nn", "fwd"), ("jax.nn", "fwd+bwd"),
                      ("xla", "fwd"), ("xla", "bwd"), ("xla", "fwd+bwd"),
                      ("pallas", "fwd"), ("pallas", "bwd"), ("pallas", "fwd+bwd")}
  # bf16: forward moves 2 + 2 + 1/8 bytes per element, backward 2 + 1/8 + 2 + 2.
  assert got[("pallas", "fwd")].bytes == 1024 * 4 + 128
  assert got[("pallas", "bwd")].bytes == 1024 * 6 + 128
  assert all(r.seconds > 0 and r.gbps > 0 for r in rows)
  assert "| gelu_tanh | bfloat16 | 2^10 | pallas | bwd |" in op_speed.table(rows)


def test_hlo_op_count_sees_fused_bodies():
  import jax.numpy as jnp
  n, by_op = op_speed.hlo_ops(lambda x: jnp.sin(x) * 2.0 + 1.0, jnp.ones((8, 128)))
  assert by_op.get("sine") == 1 and n == sum(by_op.values()) >= 3


def test_measure_rejects_bad_arguments():
  with pytest.raises(ValueError, match="argument `activation`"):
    op_speed.measure(activation="swishy")
  with pytest.raises(ValueError, match="argument `sizes`"):
    op_speed.measure(sizes=(100,))


def test_script_writes_json(tmp_path):
  out = tmp_path / "k.json"
  assert load_script("bench_kernels").main([
      "--activations", "silu", "--min-log2", "10", "--max-log2", "10", "--dtypes", "float32",
      "--repeats", "1", "--out", str(out)]) == 0
  data = json.loads(out.read_text())
  assert data["meta"]["jax"] and data["meta"]["device"]
  # the host beside the device: XLA:CPU's timings and roundings depend on it
  from models import benchmarks  # pylint: disable=import-outside-toplevel
  assert data["meta"]["host"] == benchmarks.host() and benchmarks.host().endswith(
      f", {os.cpu_count()} cores")
  assert {row["implementation"] for row in data["rows"]} == {"copy", "jax.nn", "xla"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cost_split_times_every_pass_and_ablation(dtype):
  rows = op_speed.cost_split("silu", dtype, elements=1024, rounds=1)
  table = [op_speed.TABLE_FUSED] if dtype == "bfloat16" else []  # 16-bit patterns only
  assert [r["pass"] for r in rows] == [
      "jax.nn forward", "jax.nn forward+backward", "ours forward (y + packed bits)",
      "ours forward+backward", *table, "backward",
      *op_speed._ABLATIONS,  # pylint: disable=protected-access
      *(op_speed.TABLE_BACKWARD for _ in table)]
  assert all(r["seconds"] > 0 and r["elements"] == 1024 for r in rows)
  assert f"| silu | {dtype} | backward, log -> identity |" in op_speed.split_table(rows)


@pytest.mark.parametrize("name", ["silu", "gelu_erf", "mish"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_table_backward_gives_the_backward_values(name, dtype):
  """The gathered g is the fit's g: dx equal to the XLA backward's within one ulp of dx
  (the table is computed in its own jit, whose float32 rounding can differ by an ulp)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from invact_jax.ops.activations import base
  o = op_speed.op(name)
  x = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint16), jnp.dtype(dtype))
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(x.dtype)
  y, packed = jax.jit(lambda x: base.XLA.forward(o, x))(x)  # every pattern as input
  want = jax.jit(lambda *a: base.XLA.backward(o, *a))(y, packed, dy)
  got = jax.jit(op_speed.table_backward(op_speed.lookup_table(o, dtype)))(y, packed, dy)
  want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
  ok = np.isfinite(want)
  assert (np.isnan(want) == np.isnan(got)).all()
  assert (got[np.isinf(want)] == want[np.isinf(want)]).all()
  ulp = np.spacing(np.abs(np.where(ok, want, 0)).astype(jnp.dtype(dtype))).astype(np.float32)
  assert (np.abs(got - want)[ok] <= ulp[ok]).all()
  assert (got[ok] == want[ok]).mean() > 0.999


def test_cost_split_stand_ins_replace_only_what_they_name():
  import jax.numpy as jnp
  from invact_jax.ops.activations import rational
  fit = rational.fit_for("silu", jnp.bfloat16)
  y = jnp.linspace(-0.27, 4.0, 256, dtype=jnp.float32)
  left = y < 0  # each value on a branch that reaches it
  exact = rational.evaluate(fit, y, left)
  nothing = op_speed._Ablated()  # pylint: disable=protected-access
  assert jnp.isfinite(exact).all()
  assert (rational.evaluate(fit, y, left, ops=nothing) == exact).all()
  no_log = op_speed._Ablated(log=False)  # pylint: disable=protected-access
  assert not jnp.allclose(rational.evaluate(fit, y, left, ops=no_log), exact)


def test_cost_split_rejects_monotone_activations():
  with pytest.raises(ValueError, match="argument `name`"):
    op_speed.cost_split("relu", "float32", elements=1024)
  with pytest.raises(ValueError, match="argument `dtype`"):
    op_speed.lookup_table(op_speed.op("silu"), "float32")
  script = load_script("bench_kernels")
  assert script.main(["--cost-split", "--activations", "relu"]) == 2
  with pytest.raises(SystemExit) as exit_info:  # argparse: not allowed together
    script.main(["--cost", "--cost-split"])
  assert exit_info.value.code == 2
