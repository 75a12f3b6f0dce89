"""models.benchmarks.attention: grouped-query attention with its key/value heads as they are or
repeated, the same function timed both ways; the script's bad input is one line."""
import json
import pathlib
import subprocess
import sys
import types

import pytest

from models.benchmarks import attention, child

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_both_variants_compute_the_same_attention_and_its_gradients():
  shape = attention.Shape(batch=2, seq=16, heads=4, kv_heads=2, head_dim=8)
  rows = attention.jax_rows(shape, "float32", repeats=2, implementation="xla")
  assert [r["variant"] for r in rows] == list(attention.VARIANTS)
  for r in rows:
    assert "error" not in r, r
    assert r["ms"] > 0 and r["temp_bytes"] >= 0 and r["max_diff"] <= 1e-5, r
  data = {"meta": {"shape": {"batch": 2, "seq": 16, "heads": 4, "kv_heads": 2, "head_dim": 8,
                             "causal": True},
                   "command": "python scripts/bench_attention.py", "device": "cpu",
                   "versions": {"jax": "0"}, "date": "2026-11-29", "dtype": "float32",
                   "repeats": 2},
          "rows": rows + [{"framework": "torch", "variant": "torch grouped",
                           "implementation": "sdpa cudnn", "error": "RuntimeError: no kernel"}]}
  text = attention.markdown(data)
  assert "| jax | grouped | xla |" in text and "| 1.00 |" in text
  assert "| torch | torch grouped | sdpa cudnn | RuntimeError: no kernel |" in text


def test_a_shape_whose_heads_do_not_group_is_refused():
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    attention.Shape(batch=1, seq=8, heads=6, kv_heads=4, head_dim=8)


def test_a_pytorch_row_whose_process_died_keeps_its_key(monkeypatch):
  """PyTorch's rows run in child processes; one that died or timed out is an error row that
  still names its variant (the table shows it)."""
  monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
      cuda=types.SimpleNamespace(is_available=lambda: True)))
  specs = []
  monkeypatch.setattr(child, "run_child", lambda module, spec, timeout_s: specs.append(
      (module, spec)) or {"error": "timed out after 300 s"})
  shape = attention.Shape(batch=1, seq=8, heads=4, kv_heads=2, head_dim=8)
  rows = attention.torch_rows(shape, "bfloat16", repeats=3)
  assert rows == [{"framework": "torch", "variant": v, "implementation": "sdpa cudnn",
                   "error": "timed out after 300 s"} for v in attention.TORCH_VARIANTS]
  assert [m for m, _ in specs] == ["models.benchmarks.attention"] * 2
  assert specs[0][1] == {"shape": {"batch": 1, "seq": 8, "heads": 4, "kv_heads": 2,
                                   "head_dim": 8, "causal": True},
                         "dtype": "bfloat16", "variant": "torch grouped", "repeats": 3}


def test_the_script_writes_its_json(tmp_path):
  out = tmp_path / "a.json"
  run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--batch",
                        "1", "--seq", "16", "--heads", "4", "--kv-heads", "1", "--head-dim", "8",
                        "--repeats", "1", "--implementation", "xla", "--no-torch", "--json",
                        str(out)], capture_output=True, text=True, check=False, timeout=300)
  assert run.returncode == 0, run.stderr
  data = json.loads(out.read_text())
  assert data["meta"]["command"].startswith("python scripts/bench_attention.py --batch 1")
  assert "--json" not in data["meta"]["command"]
  assert [r["variant"] for r in data["rows"]] == list(attention.VARIANTS)


@pytest.mark.parametrize("args, message", [
    (["--heads", "6", "--kv-heads", "4"], "--kv-heads: must divide --heads"),
    (["--seq", "0"], "--seq"),
    (["--implementation", "flash"], "--implementation")])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"), *args],
                       capture_output=True, text=True, check=False, timeout=120)
  assert out.returncode == 2 and message in out.stderr and len(out.stderr.splitlines()) == 1, out
