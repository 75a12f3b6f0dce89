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


def _default_compile_temp(fn, *args) -> int:
  """The temp of XLA's default compile, whatever the suite's XLA_FLAGS (conftest.py)."""
  options = {"xla_backend_optimization_level": 2}
  if jax.default_backend() == "cpu" and memory._has_fusion_emitter_switch():  # pylint: disable=protected-access
    options["xla_cpu_use_fusion_emitters"] = True
  return jax.jit(fn).lower(*args).compile(compiler_options=options).memory_analysis(
      ).temp_size_in_bytes


def test_analysed_compiles_cheaply_to_the_default_compiles_memory_figures():
  """The planner's and the fallback's measuring compiles (on CPU: LLVM at -O0 in one piece,
  and XLA:CPU's elemental emitters where jaxlib has the switch) assign the buffers as the
  default compile does: the same temp on a scanned MLP; on a small inverted bfloat16 GPT-2,
  never less and a few hundred bytes more (256 on 2026-11-27, JAX 0.10.2), far within
  ``memory.analysis_excess``."""
  x = jax.random.normal(jax.random.key(0), (64, 128))
  ws = (jnp.full((4, 128, 512), 0.05), jnp.full((4, 512, 128), 0.05))
  step = _scanned_grad(CASES["gelu_tanh"].reference())
  if jax.default_backend() == "cpu":
    assert memory.analysis_options()["xla_backend_optimization_level"] == 0
  assert memory.analysed(step, x, ws).temp == _default_compile_temp(step, x, ws) > 0
  from models import presets  # pylint: disable=import-outside-toplevel
  cfg = presets.model_config("gpt2", dtype="bfloat16", scan_layers=True, vocab=128, max_len=64,
                             hidden=64, depth=2, heads=4, mlp_dim=256)
  loss, *args = presets.loss_and_inputs(cfg, 2, 64, jax.random.key(0))
  grad = jax.value_and_grad(invact_jax.invert(loss))
  cheap, default = memory.analysed(grad, *args).temp, _default_compile_temp(grad, *args)
  print(f"small inverted GPT-2: {cheap:,} bytes measured, {default:,} by the default compile")
  assert default <= cheap <= default + 8 * 1024
  if not memory._has_fusion_emitter_switch():  # pylint: disable=protected-access
    assert cheap == default  # (jaxlib 0.12: one emitter, the same figure)


def test_device_peak_explains_missing_stats_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  assert not memory.reports_peak()
  with pytest.raises(RuntimeError, match="reports no memory_stats"):
    memory.device_peak(lambda x: x * 2, jnp.ones(3))


# ------------------------------------------------------------------------ floor audit
def test_floor_audit_of_an_mlp():
  """GELU's floor: its output and one bit per element.  JAX's own GELU keeps its internals
  too (excess); the inverted one is at the floor, every array with its role."""
  args = _args()
  loss = _mlp_loss(functools.partial(jax.nn.gelu, approximate=True))
  floor = [(i.what, i.shape, i.dtype) for i in invact_jax.floor_audit(loss, *args).floor]
  assert floor == [("gelu output", (B, H), "float32"), ("gelu bits", (B, 25), "uint8")]
  audit = invact_jax.floor_audit(invact_jax.invert(loss), *args)
  assert [role for _, role in audit.kept] == ["gelu output", "gelu bits"]
  assert audit.ratio == 1.0 and audit.excess_bytes == 0
  base = invact_jax.floor_audit(loss, *args)
  # jax.nn.gelu keeps its internals: five [B, H] float32 arrays on JAX 0.10, four on 0.12
  assert base.floor_bytes == audit.floor_bytes and base.excess_bytes >= 4 * B * H * 4
  assert "kept / floor = 1.00" in audit.table()


def test_floor_counts_each_matmul_input_once_in_its_narrowest_dtype():
  """A norm feeding three matmuls: its xhat once and a float32 statistic per row; a bfloat16
  value cast to float32 for a matmul counts in bfloat16; a softmax's shift and what only a
  stop_gradient reads count for nothing; x * constant keeps nothing."""
  def loss(g, w, x):
    z = invact_jax.layer_norm_reference(x, g, None)
    h = sum(z @ w[i] for i in range(3)).astype(jnp.bfloat16)
    e = jnp.exp(h - jax.lax.stop_gradient(jnp.max(h, axis=-1, keepdims=True)))
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.sum(jnp.tanh((p * 3.0).astype(jnp.float32) @ w[0].T))
  g, w, x = jnp.ones(D), jax.random.normal(jax.random.key(1), (3, D, D)), _args()[0]
  items = sorted((i.what, i.shape, i.dtype) for i in invact_jax.floor_audit(loss, g, w, x).floor)
  assert items == sorted([("layer_norm xhat", (B, D), "float32"),
                          ("layer_norm row statistic", (B,), "float32"),
                          ("softmax output", (B, D), "bfloat16"),
                          ("tanh output", (B, D), "float32")]), items


def test_floor_of_a_scanned_stack_counts_each_layer():
  """A scan body's floor counts once per iteration (the stacked shape); a custom_vjp function
  (here invact_jax's own GELU: its output and bits) counts its own residuals; the carry a
  layer's matmul reads is each iteration's own input (a scan keeps it per iteration, apart
  from the previous iteration's output)."""
  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (invact_jax.gelu(h @ w), None), x, ws)
    return jnp.sum(h)
  ws = jax.random.normal(jax.random.key(1), (3, D, D)) / 8
  items = {(i.what, i.shape) for i in invact_jax.floor_audit(loss, ws, _args()[0]).floor}
  assert items == {("kernel output", (3, B, D)), ("kernel residual", (3, B, D // 8)),
                   ("scan carry", (3, B, D))}, items


def test_floor_of_an_lm_head_is_its_input_and_a_statistic_per_token():
  import optax  # pylint: disable=import-outside-toplevel

  def loss(x, w, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()
  x, w = _args()[0], jax.random.normal(jax.random.key(2), (D, 512))
  y = jnp.arange(B) % 512
  floor = sorted((i.what, i.shape) for i in invact_jax.floor_audit(loss, x, w, y).floor)
  assert floor == [("linear_cross_entropy row statistic", (B,))], floor  # x is an argument
  audit = invact_jax.floor_audit(invact_jax.invert(loss), x, w, y)
  # the mean folded into the head: its gradients computed in the forward, nothing else kept
  assert audit.kept_bytes == 0 and audit.floor_bytes == 4 * B, audit.table()
  forward = invact_jax.convert.FORWARD_GRADIENT
  assert sorted(r.shape for r, role in audit.kept if role == forward) == [
      (B, D), (D, 512)], audit.table()
  assert audit.forward_gradient_bytes == 4 * (B * D + D * 512)
  per_token = invact_jax.floor_audit(invact_jax.invert(lambda x, w, y: jnp.max(
      optax.softmax_cross_entropy_with_integer_labels(x @ w, y))), x, w, y)
  # an unfoldable reduction (a max): the per-token head keeps its row statistic, no gradient
  assert per_token.forward_gradient_bytes == 0, per_token.table()
  assert "linear_cross_entropy row statistic" in {role for _, role in per_token.kept}


def test_floor_of_a_cond_counts_its_branches_and_nothing_to_keep_is_at_the_floor():
  """Autodiff of a cond keeps each branch's residuals: the floor counts every branch (before,
  none: kept/floor was 481x); a program that keeps nothing is at its (empty) floor."""
  def f(x, w, c):
    h = jax.lax.cond(c, lambda h: jax.nn.gelu(h) @ w.T, lambda h: jnp.tanh(h) @ w.T, x @ w)
    return jnp.sum(h)
  x, w = jnp.ones((16, 32)), jnp.ones((32, 64))
  audit = invact_jax.floor_audit(f, x, w, True)
  whats = {item.what for item in audit.floor}
  assert {"gelu output", "tanh output"} <= whats, whats
  assert audit.ratio < 5, audit.table()
  empty = invact_jax.floor_audit(lambda x: jnp.sum(x * 2.0), x)
  assert empty.kept_bytes == empty.floor_bytes == 0 and empty.ratio == 1.0


_X = jax.ShapeDtypeStruct((8, 128), jnp.float32)
_OPS = {
    "add": lambda x: x + x, "mul": lambda x: x * 2.0, "div": lambda x: x / (x + 1),
    "neg_abs": lambda x: -jnp.abs(x), "exp": jnp.exp, "log1p": jnp.log1p, "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid, "erf": jax.scipy.special.erf, "rsqrt": jax.lax.rsqrt,
    "square": lambda x: x ** 2, "cube": lambda x: x ** 3, "reciprocal": lambda x: x ** -1,
    "cast": lambda x: x.astype(jnp.bfloat16), "where": lambda x: jnp.where(x > 0, x, 0.0),
    "sum": lambda x: x.sum(-1), "max": lambda x: x.max(0), "moves": lambda x: jnp.pad(
        jnp.broadcast_to(x.T, (2, 128, 8)).reshape(256, 8)[3:40], 1),
    "dot": lambda x: x @ jnp.ones((128, 64)),
    "batched_dot": lambda x: jnp.einsum("bij,bjk->bik", x.reshape(2, 4, 128),
                                        jnp.ones((2, 128, 3))),
    "gelu": jax.nn.gelu, "softmax": jax.nn.softmax,
    "layer_norm": lambda x: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5),
}


@pytest.mark.parametrize("name", sorted(_OPS))
def test_jaxpr_flops_counts_as_xla_counts_the_lowered_program(name):
  """Each op's forward, and its backward for a given cotangent (a gradient's seed of ones is
  simplified away by XLA's cost analysis, not by JAX): equal up to a few operations on
  scalars (which XLA folds or counts differently)."""
  f = _OPS[name]
  assert abs(memory.jaxpr_flops(jax.make_jaxpr(f)(_X)) - memory.flops(f, _X)) <= 4
  ct = jax.eval_shape(f, _X)
  g = lambda x, ct: jax.vjp(f, x)[1](ct)  # noqa: E731
  assert abs(memory.jaxpr_flops(jax.make_jaxpr(g)(_X, ct)) - memory.flops(g, _X, ct)) <= 4


@pytest.mark.parametrize("policy", [None, "nothing_saveable", "checkpoint_dots",
                                    "dots_with_no_batch_dims_saveable"])
def test_jaxpr_flops_of_a_remat_layers_gradient_and_a_scan_are_xla_s(policy):
  """A Llama-style layer's gradient under JAX's policies (what the planner counts per
  candidate), scanned over 3 layers (a loop's body counted once, as XLA does)."""
  def layer(h, w):
    a = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    s = jax.nn.softmax(jnp.einsum("td,sd->ts", a @ w[0], a @ w[1]) / 8.0, -1)
    h = h + (s @ (a @ w[2])) @ w[3]
    return h + (jax.nn.silu(h @ w[0]) * (h @ w[1])) @ w[2].T, None
  body = layer if policy is None else jax.checkpoint(
      layer, policy=getattr(jax.checkpoint_policies, policy))
  loss = lambda x, w: jnp.sum(jax.lax.scan(body, x, w)[0] ** 2)  # noqa: E731
  args = (jax.ShapeDtypeStruct((16, 64), jnp.float32),
          jax.ShapeDtypeStruct((3, 4, 64, 64), jnp.float32))
  g = jax.value_and_grad(loss, argnums=(0, 1))
  assert memory.jaxpr_flops(jax.make_jaxpr(g)(*args)) == pytest.approx(
      memory.flops(g, *args), rel=1e-3)
  # per iteration: the FLOPs the unrolled loop runs (its forward; the gradients accumulate
  # the weights' slices differently)
  def unrolled(x, w):
    for i in range(w.shape[0]):
      x = body(x, w[i])[0]
    return jnp.sum(x ** 2)
  assert memory.jaxpr_flops(jax.make_jaxpr(loss)(*args), per_iteration=True) == (
      memory.jaxpr_flops(jax.make_jaxpr(unrolled)(*args)))
  assert memory.jaxpr_flops(jax.make_jaxpr(g)(*args), per_iteration=True) == pytest.approx(
      memory.jaxpr_flops(jax.make_jaxpr(jax.value_and_grad(unrolled, argnums=(0, 1)))(*args)),
      rel=0.02)
