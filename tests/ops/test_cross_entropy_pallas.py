"""The LM head's fused Pallas kernels (implementation="pallas"): in interpret mode against the
XLA path and float64, lowered for CUDA and compiled for sm_90 without spills from any machine."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from pallas_kernels import cross_entropy as kernels
from pallas_kernels import machine_code
from tests.ops.activations.test_pallas import export_cuda

N, D, V = 40, 48, 300  # none a multiple of the tiles: every edge is padded
SMALL = invact_jax.Implementation(name="pallas", block_rows=16)


def _inputs(x_dtype=jnp.float32, w_dtype=jnp.float32, vocab_axis=-1, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (N, D)).astype(x_dtype)
  w = (jax.random.normal(k[1], (D, V)) / 7).astype(w_dtype)
  w = w if vocab_axis in (-1, 1) else w.T
  b = jax.random.normal(k[2], (V,))
  y = jax.random.randint(k[3], (N,), 0, V).at[:3].set(-100)
  return x, w, b, y


OPTIONS = {
    "plain": {},
    "everything": dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0),
    "sum": dict(ignore_index=-100, reduction="sum"),
    "none": dict(ignore_index=-100, reduction="none", logit_soft_cap=3.0),
}


@pytest.mark.parametrize("vocab_axis", [-1, 0])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_fused_kernels_compute_the_xla_paths_loss_and_gradients(name, vocab_axis):
  x, w, b, y = _inputs(vocab_axis=vocab_axis)
  kw = dict(OPTIONS[name], vocab_axis=vocab_axis)
  labels = jnp.where(y < 0, 0, y) if "ignore_index" not in kw else y

  def loss(impl):
    def f(x, w, b):
      out, correct = invact_jax.linear_cross_entropy(x, w, labels, bias=b, implementation=impl,
                                                     return_correct=True, **kw)
      return (out.sum() if kw.get("reduction") == "none" else out), correct
    return f
  (l1, c1), g1 = jax.value_and_grad(loss(SMALL), argnums=(0, 1, 2), has_aux=True)(x, w, b)
  (l2, c2), g2 = jax.value_and_grad(loss(None), argnums=(0, 1, 2), has_aux=True)(x, w, b)
  np.testing.assert_allclose(float(l1), float(l2), rtol=2e-6)
  np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))
  for a, c in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-7)


@pytest.mark.parametrize("wrap", ["sharded", "explicit", "shard_map"])
def test_tokens_split_over_devices_run_where_they_are(wrap):
  """Tokens split over 8 devices (jit with sharded arguments, a mesh with explicit axes, or
  inside ``shard_map``): the kernels run on each device's tokens, the weight's and bias's
  gradients each shard's sum added up; no token is gathered; the loss and gradients are the
  XLA path's on the same split (before: the kernel call gathered every token to each device,
  and inside ``shard_map`` it did not trace)."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (virtual) devices; conftest.py sets them")
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  x, w, b, y = _inputs()
  x, y = jnp.concatenate([x] * 2)[:64], jnp.concatenate([y] * 2)[:64]  # 8 tokens a device
  explicit = wrap == "explicit"
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      AxisType.Explicit if explicit else AxisType.Auto,))
  xd, yd = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
  kw = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3)

  def loss(impl):
    head = lambda x, w, b, y: invact_jax.linear_cross_entropy(  # noqa: E731
        x, w, y, bias=b, implementation=impl, **kw)
    if wrap != "shard_map":
      return head
    local = lambda x, w, b, y: jax.lax.pmean(head(x, w, b, y), "data")  # noqa: E731
    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                         out_specs=P())
  with jax.sharding.set_mesh(mesh) if explicit else contextlib.nullcontext():
    step = jax.jit(jax.value_and_grad(loss(SMALL), argnums=(1, 2)))
    text = step.lower(xd, w, b, yd).compile().as_text()
    l1, g1 = step(xd, w, b, yd)
    l2, g2 = jax.jit(jax.value_and_grad(loss(None), argnums=(1, 2)))(xd, w, b, yd)
  assert "all-gather" not in text and "all-reduce" in text, "tokens were gathered"
  np.testing.assert_allclose(float(l1), float(l2), rtol=2e-6)
  for a, c in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-7)


@pytest.mark.parametrize("vocab_axis", [1, 0])
def test_the_math_path_is_the_kernels_math(vocab_axis):
  """forward_math / backward_math (XLA over whole logits, where a kernel cannot run as one)
  give the kernels' statistics and gradients, the gradient filter dropping the same tiles."""
  x, w, b, y = _inputs(vocab_axis=-1 if vocab_axis == 1 else 0)
  labels = jnp.where(y < 0, -1, y)
  tiles = kernels.Tiles(block_t=16)
  kw = dict(vocab_axis=vocab_axis, scale=0.7, soft_cap=5.0, tiles=tiles)
  stats = kernels.forward(x, w, labels, b, interpret=True, **kw)
  math = kernels.forward_math(x, w, labels, b, **kw)
  for a, c in zip(stats, math):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-6, atol=2e-6)
  # the first block of 16 tokens weighs 1e6 times the others: a filter at 1e-4 drops the rest
  g = jnp.where(labels >= 0, jnp.where(jnp.arange(N) < 16, 1.0, 1e-6) / N, 0.0)
  every = None
  for skip in (None, 1e-4):
    bw = dict(kw, smoothing=0.1, z_loss=1e-3, skip_below=skip)
    grads = kernels.backward(x, w, labels, b, stats[0], g, interpret=True, **bw)
    math = kernels.backward_math(x, w, labels, b, stats[0], g, **bw)
    for a, c in zip(grads, math):
      np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-9)
    every = math if every is None else every
  dropped = np.asarray(every[0] - math[0])  # dx of the dropped tokens' tiles only
  assert np.all(dropped[:16] == 0) and np.any(dropped[16:] != 0)


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_sixteen_bit_tokens_are_no_further_from_float64_than_the_xla_path(w_dtype):
  """bfloat16 tokens with a float32 master weight (read and cast in the kernel) or a bfloat16
  one: the loss and gradients lie no further from a float64 computation of the same rounded
  operands than the XLA path's (which rounds the bias to bfloat16 per tile; the kernel adds
  it in float32)."""
  x, w, b, y = _inputs(jnp.bfloat16, w_dtype)
  kw = dict(ignore_index=-100, label_smoothing=0.1, logit_soft_cap=5.0)
  with jax.enable_x64(True):
    args64 = [np.asarray(a, np.float64) for a in (x, w.astype(jnp.bfloat16), b)]
    ref = jax.value_and_grad(lambda x, w, b: invact_jax.linear_cross_entropy_reference(
        x, w, y, bias=b, **kw), argnums=(0, 1, 2))(*args64)
  errors = {}
  for impl in (SMALL, None):
    got = jax.value_and_grad(lambda x, w, b: invact_jax.linear_cross_entropy(
        x, w, y, bias=b, implementation=impl, **kw), argnums=(0, 1, 2))(x, w, b)
    loss_err = abs(float(got[0]) - float(ref[0])) / abs(float(ref[0]))
    grad_err = [np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)
                for a, r in zip(got[1], ref[1])]
    errors["pallas" if impl else "xla"] = (loss_err, grad_err)
  assert errors["pallas"][0] <= errors["xla"][0] * 1.05 + 1e-7
  for p, q in zip(errors["pallas"][1], errors["xla"][1]):
    assert p <= q * 1.05 + 1e-7, errors


def test_labels_outside_the_vocabulary_are_the_xla_paths_nan():
  x, w, b, _ = _inputs()
  y = jnp.arange(N).at[5].set(V + 2)  # (under jit: concrete labels are checked at the call)
  got = jax.jit(lambda y: invact_jax.linear_cross_entropy(x, w, y, reduction="none",
                                                          implementation=SMALL))(y)
  want = jax.jit(lambda y: invact_jax.linear_cross_entropy(x, w, y, reduction="none"))(y)
  np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
  assert np.isnan(np.asarray(got)[5])


def test_the_gradient_filter_is_off_by_default_and_drops_only_tiles_below_it():
  """``skip_below``: a threshold under every entry changes nothing; one above every entry
  drops every tile's update (the loss is the forward's, unchanged)."""
  x, w, b, y = _inputs()
  y = jnp.where(y < 0, 0, y)

  def grads(impl):
    return jax.value_and_grad(lambda x, w: invact_jax.linear_cross_entropy(
        x, w, y, implementation=impl), argnums=(0, 1))(x, w)
  base = grads(SMALL)
  below = grads(invact_jax.Implementation(name="pallas", block_rows=16, skip_below=1e-30))
  above = grads(invact_jax.Implementation(name="pallas", block_rows=16, skip_below=1e30))
  assert float(below[0]) == float(base[0]) == float(above[0])
  for a, c in zip(below[1], base[1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-9)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in above[1])


@pytest.mark.parametrize("why, kwargs", [
    ("gradients='forward'", dict(gradients="forward")),
])
def test_what_the_kernels_do_not_run_is_one_line(why, kwargs):
  x, w, _, y = _inputs()
  with pytest.raises(ValueError, match=f"implementation='pallas' does not run {why}") as e:
    invact_jax.linear_cross_entropy(x, w, jnp.abs(y), implementation="pallas", **kwargs)
  assert "\n" not in str(e.value)


def test_the_kernel_options_are_checked():
  with pytest.raises(ValueError, match="argument `block_t`"):
    kernels.Tiles(block_t=24)
  with pytest.raises(ValueError, match="argument `skip_below`"):
    invact_jax.Implementation(name="pallas", skip_below=-1.0)
  with pytest.raises(ValueError, match="skip_below.*no effect"):
    invact_jax.gelu(jnp.ones(8), implementation=invact_jax.Implementation(name="pallas",
                                                                          skip_below=1e-6))


@pytest.mark.parametrize("dtype, w_dtype", [("bfloat16", "float32"), ("bfloat16", "bfloat16"),
                                            ("float32", "float32")])
def test_the_kernels_lower_for_cuda_and_compile_for_sm90_without_spills(dtype, w_dtype):
  """From any machine: both kernels lower to Triton for CUDA at the default tiles (64 tokens x
  128 entries, 64 of the contraction, 4 warps) and compile for sm_90 without spilling a
  register to local memory."""
  captured = machine_code.capture_ttir()
  x = jax.ShapeDtypeStruct((256, 512), jnp.dtype(dtype))
  w = jax.ShapeDtypeStruct((512, 1024), jnp.dtype(w_dtype))
  y = jax.ShapeDtypeStruct((256,), jnp.int32)
  f = jax.ShapeDtypeStruct((256,), jnp.float32)
  tiles = kernels.Tiles()
  fwd = export_cuda(lambda x, w, y: kernels.forward(x, w, y, tiles=tiles), x, w, y)
  bwd = export_cuda(lambda x, w, y, lse, g: kernels.backward(x, w, y, None, lse, g, tiles=tiles),
                    x, w, y, f, f)
  for exp in (fwd, bwd):
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
  assert len(captured) >= 2
  for ttir in captured[-2:]:
    st = machine_code.stats(machine_code.compile_ttir(ttir, tiles.num_warps, tiles.num_stages))
    assert st["local_bytes"] == 0, (st["registers"], st["local_bytes"])
