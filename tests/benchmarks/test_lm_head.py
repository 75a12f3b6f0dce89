"""The LM head benchmark (models/benchmarks/lm_head.py): rows, PyTorch's rows, the table."""
import json
import pathlib

import numpy as np
import pytest

from models.benchmarks import child
from models.benchmarks import lm_head
from models.benchmarks import lm_head_torch


def test_rows_measure_every_jax_head_without_a_logits_buffer_for_ours(monkeypatch):
  monkeypatch.setattr(lm_head_torch, "importable", lambda: False)
  # 512 tokens x 32768 entries: four chunks of the CPU's default 2^22 logits
  rs = lm_head.rows(512, 16, 32768, dtypes=("float32",), repeats=1,
                    names=("plain", "invact_jax", "invact_jax.invert(plain)"),
                    tiles=(("forward", 16, 1024),))
  by = {r["head"]: r for r in rs}
  assert set(by) == {"plain", "invact_jax", "invact_jax.invert(plain)",
                     "invact_jax forward 16x1024"}
  # an eighth of the default chunk's tokens, half its update tile: less temp
  assert by["invact_jax forward 16x1024"]["temp_bytes"] < by["invact_jax"]["temp_bytes"]
  assert by["plain"]["logits_buffer"] and not by["invact_jax"]["logits_buffer"]
  assert by["plain"]["temp_vs_plain"] == 1.0 and by["invact_jax"]["temp_vs_plain"] < 1.0
  assert all(r["framework"] == "jax" and r["grad_error"] < 1e-5 for r in rs), rs


def test_tokamax_installed_but_not_importable_is_an_error_row(monkeypatch):
  """tokamax present whose import fails (on the GPU machine without its xprof): its rows say
  so and the other rows are measured."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(lm_head_torch, "importable", lambda: False)
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name == "tokamax" else real(name, *a))
  monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax raises ImportError
  rs = lm_head.rows(64, 16, 256, dtypes=("float32",), repeats=1,
                    names=("plain", "tokamax chunked_xla"))
  by = {r["head"]: r for r in rs}
  assert "error" not in by["plain"], rs
  assert by["tokamax chunked_xla"]["error"].startswith("ModuleNotFoundError: import of tokamax"), rs


def test_a_float32_master_weight_with_bfloat16_hidden_states(monkeypatch):
  """``bfloat16/float32`` (mixed precision): the plain head casts the master weight to
  bfloat16 for its logits; ours takes it as it is (its default: gradients in the forward) and
  keeps no logits, with a gradient as close to float64 as the plain head's or closer;
  PyTorch's rows are for one-dtype heads only."""
  monkeypatch.setattr(lm_head_torch, "importable", lambda: pytest.fail("torch rows"))
  rs = lm_head.rows(512, 16, 32768, dtypes=("bfloat16/float32",), repeats=1,  # 4 chunks
                    names=("plain", "invact_jax", "invact_jax.invert(plain)"))
  by = {r["head"]: r for r in rs}
  assert {r["dtype"] for r in rs} == {"bfloat16/float32"} and set(by) == {
      "plain", "invact_jax", "invact_jax.invert(plain)"}
  assert by["plain"]["logits_buffer"]
  for name in ("invact_jax", "invact_jax.invert(plain)"):
    assert not by[name]["logits_buffer"] and by[name]["temp_vs_plain"] < 1.0, by[name]
    assert by[name]["grad_error"] <= 1.1 * by["plain"]["grad_error"], (by[name], by["plain"])


def test_torch_rows_get_the_same_head_and_their_own_baseline(monkeypatch):
  """PyTorch's children read the head the JAX rows measure (saved once); "vs plain" is
  against the same framework's plain head; rows without temp (a CPU) still tabulate."""
  seen = []

  def fake(module, spec, timeout_s):
    assert module == "models.benchmarks.lm_head_torch" and timeout_s > 0
    data = np.load(spec["path"])
    seen.append((spec["head"], data["x"].shape, data["w"].shape, data["labels"].shape))
    head = lm_head.make_head(64, 16, 512, np.float32)
    np.testing.assert_array_equal(data["x"], np.asarray(head.x))
    np.testing.assert_array_equal(data["labels"], np.asarray(head.labels))
    if spec["head"] == "torch Liger":
      return {"head": spec["head"], "error": "Liger-Kernel needs a CUDA GPU and liger-kernel"}
    return {"head": spec["head"], "time_s": 0.5, "grad_error": 1e-7, "loss": 6.2}
  monkeypatch.setattr(lm_head_torch, "importable", lambda: True)
  monkeypatch.setattr(child, "run_child", fake)
  rs = lm_head.rows(64, 16, 512, dtypes=("float32",), repeats=1, names=("plain",))
  assert [s[0] for s in seen] == list(lm_head_torch.HEADS)
  assert seen[0][1:] == ((64, 16), (16, 512), (64,))
  torch_plain = next(r for r in rs if r["head"] == "torch plain")
  assert torch_plain["framework"] == "torch" and torch_plain["time_vs_plain"] == 1.0
  jax_plain = next(r for r in rs if r["head"] == "plain")
  assert jax_plain["time_vs_plain"] == 1.0  # not against torch's 0.5 s
  table = lm_head.table(rs)
  assert "| float32 | torch plain | — | — | — | 0.500 | 1.00 | 1.0e-07 |" in table
  assert "| float32 | torch Liger | — | — | — | — | — | Liger-Kernel needs" in table
  assert json.dumps(rs)  # the benchmark's JSON


def test_an_unknown_torch_head_is_an_error_row_without_torch():
  row = lm_head_torch.measure({"head": "torch nope", "path": "-", "dtype": "float32",
                               "repeats": 1})
  assert "unknown head" in row["error"]
  assert lm_head.torch_rows(lm_head.make_head(8, 4, 16, np.float32), "float32", 1,
                            heads=()) == [] or lm_head_torch.importable()


def test_run_child_returns_the_last_json_line_or_the_error(tmp_path):
  ok = child.run_child("models.benchmarks.lm_head_torch",  # its __main__, no torch needed
                     {"head": "torch nope", "path": "-", "dtype": "float32", "repeats": 1}, 60.0)
  assert ok["head"] == "torch nope" and "unknown head" in ok["error"], ok
  bad = child.run_child("models.benchmarks.no_such_module", {}, 60.0)
  assert "No module named" in bad["error"]


def test_each_dtypes_rows_are_written_as_they_are_done(monkeypatch, tmp_path):
  """A run cut short (a device call's time limit) keeps the dtypes it finished, and says
  which it did not."""
  import argparse  # pylint: disable=import-outside-toplevel

  def rows(tokens, d, vocab, dtypes, repeats, tiles=(), profile=0, skip_below=(), **kw):
    assert kw == {"names": None, "pallas_blocks": ()}, kw
    if dtypes == ("bfloat16",):
      raise TimeoutError("cut short")
    return [{"dtype": dtypes[0], "head": "plain", "framework": "jax", "time_s": 1.0}]
  monkeypatch.setattr(lm_head, "rows", rows)
  out = tmp_path / "lm_head.json"
  a = argparse.Namespace(tokens=64, d=16, vocab=256, dtypes=["float32", "bfloat16"], repeats=1,
                         tiles=[], json=str(out), profile=0)
  with pytest.raises(TimeoutError):
    lm_head.run(a, ["--dtypes", "float32", "bfloat16"])
  saved = json.loads(out.read_text())
  assert [r["dtype"] for r in saved["rows"]] == ["float32"]
  assert saved["meta"]["unfinished"] == ["bfloat16"]


def test_the_fused_heads_block_sweep_names_its_rows_and_rejects_bad_blocks():
  """``--pallas-blocks ROWSxWARPS``: the fused kernels at each token block and warps (the GPU
  sweep), each a row of its own; a block that is no power of two is one line, exit 2."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  assert lm_head.parse_block("128x8") == (128, 8)
  for bad in ("96x4", "128", "64x3", "ax4"):
    with pytest.raises(ValueError, match="ROWSxWARPS"):
      lm_head.parse_block(bad)
  heads = lm_head.pallas_heads([(128, 8), (64, 4)])
  assert list(heads) == ["invact_jax pallas 128x8", "invact_jax pallas 64x4"]
  impl = heads["invact_jax pallas 128x8"].keywords["implementation"]
  assert (impl.name, impl.block_rows, impl.num_warps) == ("pallas", 128, 8)
  script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_lm_head.py"
  out = subprocess.run([sys.executable, str(script), "--pallas-blocks", "96x4"],
                       capture_output=True, text=True, check=False, timeout=120)
  assert out.returncode == 2 and "--pallas-blocks" in out.stderr, out
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
