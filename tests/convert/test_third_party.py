"""invact_jax.invert on unmodified third-party models (transformers' Flax BERT, GPT-2, ViT,
Llama; an Equinox block; a Flax NNX block), against the same models converted by hand."""
import pytest

from models import third_party


@pytest.mark.parametrize("name", third_party.MODELS)
def test_invert_matches_the_hand_converted_model(name):
  pytest.importorskip(third_party.requirement(name))
  row = third_party.compare(name, "test", unfused=True)
  assert row["forward_identical"], row
  # The bound, or the hand-converted model's own distance where that is larger (at the
  # test size ViT's is 1.2e-5: the inverted ops' backward, not the conversion).
  assert row["grad_rel_l2"] <= max(1e-5, 1.1 * row["grad_rel_l2_hand"]), row
  # The conversion alone (floor=False) keeps what the hand conversion keeps: compiled temp of
  # the gradient within 2 % of it.
  assert row["temp_invert_unfused"] <= 1.02 * row["temp_hand"], row
  # The floor pass keeps less than the hand conversion (the norms' outputs that feed matmuls
  # are recomputed from xhat); at this size (32 tokens, width 64) XLA:CPU's compiled temp may
  # grow by the recomputed output's one buffer (measured: +8 KiB for BERT, GPT-2 and ViT) and,
  # for the Equinox block, an 8-byte scalar (+8 B on JAX 0.10.2, +8 KiB + 8 B on JAX 0.12).
  assert row["kept_invert"] < row["kept_hand"], row
  hidden, _, _, seq, batch = third_party.SIZES["test"]
  one_buffer = (seq + (1 if name == "vit" else 0)) * batch * hidden * 4
  scalar = 8 if name == "equinox" else 0
  assert row["temp_invert"] <= row["temp_invert_unfused"] + one_buffer + scalar, row
  assert row["converted"] == third_party.expected(name, third_party.SIZES["test"][1]), row
  assert row["left_alone"] == [], row



def test_compile_seconds_time_a_new_conversion_each_try_without_the_persistent_cache():
  """``compare(timed=n)``'s figures: the loss's and a new ``invert``'s (so that its conversion
  is timed, not a cached one) seconds to the compiled gradient, n tries each, the persistent
  compilation cache off meanwhile and restored after."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import invact_jax  # pylint: disable=import-outside-toplevel
  loss = lambda w: jnp.sum(jax.nn.gelu(jnp.ones((4, 8)) @ w) ** 2)  # noqa: E731
  made, caches = [], []

  def converted():
    caches.append(jax.config.jax_enable_compilation_cache)
    made.append(invact_jax.invert(loss))
    return made[-1]
  before = jax.config.jax_enable_compilation_cache
  plain_s, invert_s = third_party.compile_seconds(loss, converted, (jnp.ones((8, 8)),), 2)
  assert plain_s > 0 and invert_s > 0
  assert len(made) == 2 and made[0] is not made[1] and all(m.last_report for m in made)
  assert caches == [False, False] and jax.config.jax_enable_compilation_cache == before
