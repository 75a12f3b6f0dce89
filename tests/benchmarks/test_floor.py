"""The floor benchmark (models/benchmarks/floor.py): per layer and token, what the
hand-written layers and the project's models keep against the floor (residual sets, so no
compilation: the benchmark's compiled figures follow them in a scanned stack)."""
import functools

import jax.numpy as jnp
import pytest

import invact_jax
from models import reference_layers
from models.benchmarks import floor


@pytest.mark.parametrize("kind", sorted(reference_layers.HAND_LAYERS))
def test_hand_written_layers_through_invert_keep_the_floor(kind):
  build = functools.partial(lambda depth: floor.hand_stack(kind, depth, jnp.float32, "test"))
  default = floor.per_layer(build, compiled=False)
  inverted = floor.per_layer(build, invact_jax.invert, compiled=False)
  assert inverted["floor"] == default["floor"]
  assert inverted["kept"] == pytest.approx(inverted["floor"], abs=1e-9), inverted
  assert default["kept"] > 2 * default["floor"], default


@pytest.mark.parametrize("model", ["gpt2", "llama-small"])
def test_the_project_models_inverted_all_keep_the_floor(model):
  """The standard configuration's floor (attention probabilities materialized) is what the
  inverted-all model keeps: norms fused with their projections, the GLU's product
  recomputed."""
  standard = functools.partial(
      lambda depth: floor.model_stack(model, "standard", depth, jnp.float32, "test"))
  inverted = functools.partial(
      lambda depth: floor.model_stack(model, "inverted-all", depth, jnp.float32, "test"))
  row = floor.per_layer(inverted, floor_build=standard, compiled=False)
  assert row["kept"] == pytest.approx(row["floor"], abs=1e-9), row


def test_third_party_ratio():
  pytest.importorskip("equinox")
  row = floor.third_party_ratio("equinox")
  assert row["invert"] == 1.0 and row["invert_excess_bytes"] == 0, row
  assert row["default"] > 2.0, row
