"""Models: shapes, option parity (forward identical across activation impls), memory ordering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import text, vit
from models import presets
from models.benchmarks import model_memory as benchmark

SMALL_TEXT = dict(vocab=128, max_len=32, hidden=32, depth=2, heads=4, mlp_dim=64)
SMALL_VIT = dict(image_size=16, patch_size=4, channels=3, num_classes=5, hidden=32, depth=2,
                 heads=4, mlp_dim=64)



@pytest.fixture(autouse=True)
def _float32_matmuls():
  """These tests compare configurations to float32 rounding: no TF32 matmuls on a GPU."""
  with jax.default_matmul_precision("highest"):
    yield

def _forward(cfg, x):
  model = (vit.ViT if isinstance(cfg, vit.ViTConfig) else text.TextTransformer)(cfg, rngs=nnx.Rngs(0))
  return model(x)


@pytest.mark.parametrize("preset", ["bert-base", "gpt2", "llama-small"])
@pytest.mark.parametrize("scan", [False, True])
def test_text_models_identical_forward_across_activation_impls(preset, scan):
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
  outs = {impl: _forward(text.PRESETS[preset].replace(**SMALL_TEXT, activation_mode=impl,
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
  with pytest.raises(ValueError, match="activation_mode must be one of"):
    vit.PRESETS["digits"].replace(activation_mode="fast")
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
          for c in ("standard", "checkpointed", "inverted")}
  print(benchmark.table(list(rows.values())))
  temp = {c: r["compiled_temp_bytes"] for c, r in rows.items()}
  res = {c: r["residual_bytes_per_layer"] for c, r in rows.items()}
  if model.startswith("llama"):
    # SwiGLU: the product act(gate) * up keeps act's output whichever way the activation is
    # saved, so inverted = checkpointed + its bit mask (but no recompute in the backward).
    cfg = presets.model_config(model, **extra)
    mask = 4 * 32 * cfg.mlp_dim // 8  # batch * seq * mlp_dim / 8 bytes per layer
    assert temp["inverted"] < temp["standard"]
    assert temp["checkpointed"] < temp["standard"]
    assert temp["inverted"] <= temp["checkpointed"] + cfg.depth * mask
    assert res["inverted"] <= res["checkpointed"] + mask < res["standard"]
    return
  assert temp["inverted"] < temp["checkpointed"] < temp["standard"]
  assert res["inverted"] < res["checkpointed"] < res["standard"]


ALL = dict(norm_mode="fused", softmax_mode="inverted", dropout_mode="regenerate")


@pytest.mark.parametrize("preset,norm_mode", [("bert-base", "fused"), ("gpt2", "inverted"),
                                               ("gpt2", "fused"), ("llama-small", "fused")])
def test_output_saving_options_same_loss_and_gradients(preset, norm_mode):
  """The models' options: same parameters, same forward (to rounding), same gradients."""
  cfg = text.PRESETS[preset].replace(**SMALL_TEXT, dropout=0.1, scan_layers=True)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
  key = jax.random.key(3)

  def grads(c):
    model = text.TextTransformer(c, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    def loss(p):
      logits = nnx.merge(graphdef, p)(tokens, key)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.value_and_grad(loss)(params)

  l0, g0 = grads(cfg)
  l1, g1 = grads(cfg.replace(activation_mode="inverted", norm_mode=norm_mode,
                             softmax_mode="inverted", dropout_mode="bits"))
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  flat0, flat1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
  assert len(flat0) == len(flat1)
  # Relative to the largest gradient: some leaves are mathematically ~0 (rounding noise).
  scale = max(float(np.max(np.abs(np.asarray(a)))) for a in flat0)
  for a, b in zip(flat0, flat1):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-3, atol=1e-5 * scale)


def test_vit_fused_options_keep_flax_parameter_names():
  base = vit.PRESETS["digits"]
  names = lambda c: jax.tree.map(lambda a: a.shape, nnx.split(vit.ViT(c, rngs=nnx.Rngs(0)),  # noqa: E731
                                                                nnx.Param)[1])
  assert names(base) == names(base.replace(**ALL))
  with pytest.raises(ValueError, match="norm_mode must be one of"):
    base.replace(norm_mode="fast")


@pytest.mark.parametrize("model,extra", [
    ("vit-b16", SMALL_VIT | {"hidden": 64, "mlp_dim": 256, "dropout": 0.1,
                             "activation": "gelu_erf"}),
    ("llama-small", SMALL_TEXT | {"hidden": 64, "mlp_dim": 256, "dropout": 0.1}),
])
def test_inverted_all_memory_ordering(model, extra):
  rows = {c: benchmark.measure(model, "bfloat16", 4, c, seq_len=32, extra=extra)
          for c in ("standard", "inverted", "inverted-all")}
  temp = {c: r["compiled_temp_bytes"] for c, r in rows.items()}
  res = {c: r["residual_bytes_per_layer"] for c, r in rows.items()}
  assert temp["inverted-all"] < temp["inverted"] < temp["standard"]
  assert res["inverted-all"] < res["inverted"] < res["standard"]


def test_configuration_names_and_their_suffixes():
  from models import options
  with pytest.raises(ValueError, match="unknown configuration"):
    options.configuration("fastest")
  with pytest.raises(ValueError, match="unknown configuration 'jax-default'"):
    options.configuration("jax-default")  # the names of 0.1 are gone
  with pytest.raises(TypeError, match="activation_impl"):
    vit.PRESETS["digits"].replace(activation_impl="inverted")
  assert options.configuration("inverted-all", implementation="pallas") == {
      **options.CONFIGURATIONS["inverted-all"], "implementation": "pallas"}
  assert options.configuration("inverted", head_mode="standard")["head_mode"] == "standard"
  with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
    options.configuration("inverted", implementation="cuda")
  with pytest.raises(ValueError, match="unknown head_mode 'full'"):
    options.configuration("inverted", head_mode="full")
  with pytest.raises(ValueError, match="unknown configuration 'inverted\\+pallas'"):
    options.configuration("inverted+pallas")  # no grammar in names: separate fields


def test_implementation_field_reaches_every_op():
  """implementation="pallas" (interpret mode on CPU) runs the same model to rounding."""
  cfg = text.PRESETS["gpt2"].replace(**SMALL_TEXT, activation_mode="inverted", norm_mode="fused",
                                     softmax_mode="inverted")
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 128)
  outs = [_forward(cfg.replace(implementation=impl), tokens) for impl in (None, "pallas")]
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="implementation must be one of"):
    cfg.replace(implementation="cuda")


@pytest.mark.parametrize("preset", ["gpt2", "llama-small"])
def test_chunked_head_same_loss_and_gradients_without_the_logits(preset):
  """head_mode="chunked" (the default outside the standard configuration): the same
  per-token loss, correctness and gradients as with the logits materialized (the op's own
  tests check that no [tokens, vocab] buffer is compiled)."""
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
  labels = jnp.roll(tokens, -1, axis=1)
  out, grads = {}, {}
  for mode in ("standard", "chunked"):
    cfg = text.PRESETS[preset].replace(**SMALL_TEXT, head_mode=mode)
    graphdef, params = nnx.split(text.TextTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    per_token = jax.jit(lambda p: nnx.merge(graphdef, p).loss(tokens, labels))  # noqa: B023
    out[mode] = per_token(params)
    grads[mode] = jax.jit(jax.grad(lambda p: per_token(p)[0].mean()))(params)  # noqa: B023
  np.testing.assert_allclose(out["chunked"][0], out["standard"][0], rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(out["chunked"][1], out["standard"][1])
  for a, b in zip(jax.tree.leaves(grads["chunked"]), jax.tree.leaves(grads["standard"])):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
  with pytest.raises(ValueError, match="head_mode must be one of"):
    text.PRESETS[preset].replace(head_mode="fused")


def test_auto_attention_takes_cudnn_only_where_it_runs():
  """``attention="auto"``: cuDNN's flash attention on a GPU in 16 bits; the materialized
  ``"xla"`` path everywhere else, bit for bit."""
  from models import layers
  on_gpu = jax.default_backend() == "gpu"
  assert layers.cudnn_attention_runs(jnp.bfloat16, 64) == on_gpu
  assert not layers.cudnn_attention_runs(jnp.float32, 64)
  assert not layers.cudnn_attention_runs(jnp.bfloat16, 12)    # not a multiple of 8
  assert not layers.cudnn_attention_runs(jnp.bfloat16, 256)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
  cfg = text.PRESETS["gpt2"].replace(**SMALL_TEXT)
  assert cfg.attention == "auto"
  auto, xla = (_forward(cfg.replace(attention=a), tokens) for a in ("auto", "xla"))
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
