"""Models: shapes, option parity (forward identical across activation impls), memory ordering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import benchmark, text, vit

SMALL_TEXT = dict(vocab=128, max_len=32, hidden=32, depth=2, heads=4, mlp_dim=64)
SMALL_VIT = dict(image_size=16, patch_size=4, channels=3, num_classes=5, hidden=32, depth=2,
                 heads=4, mlp_dim=64)


def _forward(cfg, x):
  model = (vit.ViT if isinstance(cfg, vit.ViTConfig) else text.TextTransformer)(cfg, rngs=nnx.Rngs(0))
  return model(x)


@pytest.mark.parametrize("preset", ["bert-base", "gpt2", "llama-small"])
@pytest.mark.parametrize("scan", [False, True])
def test_text_models_identical_forward_across_activation_impls(preset, scan):
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
  outs = {impl: _forward(text.PRESETS[preset].replace(**SMALL_TEXT, activation_impl=impl,
                                                       scan_layers=scan), tokens)
          for impl in ("standard", "checkpointed", "inverted")}
  assert outs["standard"].shape == (2, 16, 128)
  for impl in ("checkpointed", "inverted"):
    np.testing.assert_array_equal(np.asarray(outs[impl]), np.asarray(outs["standard"]))


@pytest.mark.parametrize("preset", ["ti16", "s16", "b16", "digits"])
def test_vit_presets_build(preset):
  cfg = vit.PRESETS[preset]
  small = cfg.replace(depth=1) if preset != "digits" else cfg
  shapes = nnx.eval_shape(lambda: vit.ViT(small, rngs=nnx.Rngs(0)))
  _, state = nnx.split(shapes)
  assert state["head"]["kernel"].shape == (cfg.hidden, cfg.num_classes)


def test_flax_standard_parameter_names():
  model = text.TextTransformer(text.PRESETS["llama-small"].replace(**SMALL_TEXT), rngs=nnx.Rngs(0))
  _, params = nnx.split(model, nnx.Param)
  block0 = params["blocks"]["blocks"][0]
  assert set(block0["mlp"]) == {"gate", "up", "down"} and set(block0["mlp"]["gate"]) == {"kernel"}
  assert set(block0["attention_norm"]) == {"scale"}


def test_bad_options_are_clear_errors():
  with pytest.raises(ValueError, match="activation_impl must be one of"):
    vit.PRESETS["digits"].replace(activation_impl="fast")
  with pytest.raises(ValueError, match="divisible by heads"):
    vit.PRESETS["digits"].replace(heads=3)
  with pytest.raises(ValueError, match="remat must be one of"):
    text.PRESETS["gpt2"].replace(remat="sometimes")


@pytest.mark.parametrize("model,extra", [
    ("vit-b16", SMALL_VIT | {"hidden": 64, "mlp_dim": 256}),
    ("gpt2", SMALL_TEXT | {"hidden": 64, "mlp_dim": 256}),
    ("bert-base", SMALL_TEXT | {"hidden": 64, "mlp_dim": 256}),
    ("llama-small", SMALL_TEXT | {"hidden": 64, "mlp_dim": 256}),
])
def test_memory_ordering_small_configs(model, extra):
  rows = {c: benchmark.measure(model, "float32", 4, c, seq_len=32, extra=extra)
          for c in ("jax-default", "checkpoint-activation", "inverted")}
  print(benchmark.table(list(rows.values())))
  temp = {c: r["compiled_temp_bytes"] for c, r in rows.items()}
  res = {c: r["residual_bytes_per_layer"] for c, r in rows.items()}
  if model.startswith("llama"):
    # SwiGLU: the product act(gate) * up keeps act's output whichever way the activation is
    # saved, so inverted = checkpointed + its bit mask (but no recompute in the backward).
    cfg = benchmark.model_config(model, **extra)
    mask = 4 * 32 * cfg.mlp_dim // 8  # batch * seq * mlp_dim / 8 bytes per layer
    assert temp["inverted"] < temp["jax-default"]
    assert temp["checkpoint-activation"] < temp["jax-default"]
    assert temp["inverted"] <= temp["checkpoint-activation"] + cfg.depth * mask
    assert res["inverted"] <= res["checkpoint-activation"] + mask < res["jax-default"]
    return
  assert temp["inverted"] < temp["checkpoint-activation"] < temp["jax-default"]
  assert res["inverted"] < res["checkpoint-activation"] < res["jax-default"]
