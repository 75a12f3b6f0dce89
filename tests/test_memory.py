"""Deterministic memory facts: residual sets and compiled temp-bytes ordering (CPU)."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory
from tests.ops.activations.cases import CASES, NONMONOTONE

B, D, H = 8, 64, 200  # H not a multiple of 8: the mask is ceil(H/8) = 25 bytes per row


def _mlp_loss(act):
  def loss(x, w1, w2):
    return jnp.sum(act(x @ w1) @ w2)
  return loss


def _args(dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k1, (B, D), dtype), jax.random.normal(k2, (D, H), dtype) * 0.1,
          jax.random.normal(k3, (H, D), dtype) * 0.1)


def _saved(act, dtype=jnp.float32):
  return [r for r in memory.residuals(_mlp_loss(act), *_args(dtype)) if not r.is_argument]


@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("_with_bit")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_inverted_keeps_one_hidden_array_plus_packed_mask(name, dtype):
  ours, ref = CASES[name].fn(), CASES[name].reference()
  saved = _saved(ours, dtype)
  print(f"\n{name}:\n" + memory.residual_table(saved))
  hidden = [r for r in saved if r.shape == (B, H)]
  masks = [r for r in saved if r.dtype == "uint8"]
  assert len(hidden) == 1 and hidden[0].dtype == str(np.dtype(dtype))
  if CASES[name].op.has_bit:
    assert len(masks) == 1 and masks[0].shape == (B, math.ceil(H / 8))
  else:
    assert not masks
  assert len(saved) == len(hidden) + len(masks)


@pytest.mark.parametrize("name", ["gelu_tanh", "gelu_erf", "silu", "mish"])
def test_jax_nn_keeps_several_hidden_arrays(name):
  ref = CASES[name].reference()
  hidden = [r for r in _saved(ref) if r.shape == (B, H)]
  print(f"{name}: jax.nn keeps {len(hidden)} hidden-size arrays")
  assert len(hidden) >= 3


def _scanned_grad(act, layers=4):
  def loss(x, ws):
    def layer(h, w):
      w1, w2 = w
      return h + act(h @ w1) @ w2, None
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.sum(h)
  return jax.grad(loss, argnums=1)


@pytest.mark.parametrize("name", ["gelu_tanh", "gelu_erf", "silu", "mish", "sigmoid", "tanh"])
def test_scanned_compiled_temp_bytes_lower_than_jax_nn(name):
  ours, ref = CASES[name].fn(), CASES[name].reference()
  L, Bt, Dm, Hm = 4, 64, 128, 512
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k1, (Bt, Dm))
  ws = (jax.random.normal(k2, (L, Dm, Hm)) * 0.05, jax.random.normal(k3, (L, Hm, Dm)) * 0.05)
  m_ours = memory.compiled(_scanned_grad(ours), x, ws)
  m_ref = memory.compiled(_scanned_grad(ref), x, ws)
  m_ckpt = memory.compiled(_scanned_grad(jax.checkpoint(ref)), x, ws)
  print(f"{name}: scanned x{L}, temp bytes: inverted {m_ours.temp}, "
        f"checkpoint(jax.nn) {m_ckpt.temp}, jax.nn {m_ref.temp}")
  assert m_ours.temp < m_ref.temp
  assert m_ours.temp <= m_ckpt.temp


def test_device_peak_explains_missing_stats_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  assert not memory.reports_peak()
  with pytest.raises(RuntimeError, match="reports no memory_stats"):
    memory.device_peak(lambda x: x * 2, jnp.ones(3))
