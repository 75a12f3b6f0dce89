"""Compile targets: naming them, compiling for a GPU without one (deviceless), and every
decision that compiles making it for the target (invact_jax.targets, docs/deviceless.md)."""
import importlib.resources
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import invact_jax
from invact_jax import memory, targets


def _h100():
  try:
    return targets.resolve("h100"), ""
  except RuntimeError as e:
    return None, str(e)


H100, WHY = _h100()
needs_cuda = pytest.mark.skipif(H100 is None, reason=f"no XLA:GPU compiler here: {WHY}")


def test_compiles_are_for_this_machine_unless_told():
  assert targets.platform() == jax.default_backend() == "cpu"
  assert not targets.current().deviceless
  with targets.compiling_for("cpu") as t:
    assert t is targets.current() and targets.platform() == "cpu"


@pytest.mark.parametrize("bad", ["h999", "v9z:2x2", "", "h100x0", "/no/such/file.txtpb",
                                 "gpu"])
def test_a_bad_target_is_one_line_naming_the_argument(bad):
  with pytest.raises(ValueError) as e:
    targets.resolve(bad)
  assert "argument `device`" in str(e.value) and "\n" not in str(e.value)


def test_a_target_is_a_name_a_file_or_a_target():
  with pytest.raises(TypeError, match="argument `device`"):
    targets.resolve(3)
  cpu = targets.resolve("cpu")
  assert targets.resolve(cpu) is cpu


def test_a_missing_compiler_is_one_line():
  """Where no CUDA plugin is found (INVACT_JAX_DEVICELESS set and empty: no deviceless
  directory), asking for an H100 says what to install, in one line."""
  code = ("import jax.numpy as jnp\nfrom invact_jax import memory\n"
          "try:\n  memory.compiled_for('h100', lambda a: a @ a, jnp.ones((4, 4)))\n"
          "except RuntimeError as e:\n  print('ERROR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "INVACT_JAX_DEVICELESS": ""}, check=True).stdout
  (line,) = out.strip().splitlines()
  assert line.startswith("ERROR target 'h100': no CUDA compiler") and "jax-cuda12-plugin==" in line


@needs_cuda
def test_named_gpu_targets():
  assert (H100.platform, H100.deviceless, len(H100.devices)) == ("gpu", True, 1)
  assert H100.device_kind == "NVIDIA H100 80GB HBM3" and H100.memory_bytes == 84942979072
  h200 = targets.resolve("h200")
  assert h200.device_kind == "NVIDIA H200" and h200.memory_bytes > 140 * 2**30
  eight = targets.resolve("h100x8")
  assert len(eight.devices) == 8 and len(eight.one().devices) == 1
  assert {d.process_index for d in eight.devices} == {0}  # one host


@needs_cuda
def test_a_target_config_file(tmp_path):
  path = tmp_path / "mine.txtpb"
  text = (importlib.resources.files("invact_jax.targets") / "h100.txtpb").read_text()
  path.write_text(text.replace('"NVIDIA H100 80GB HBM3"', '"NVIDIA H100 (mine)"'))
  t = targets.resolve(str(path))
  assert t.device_kind == "NVIDIA H100 (mine)" and t.platform == "gpu"


def _mlp(x, w1, w2):
  return jnp.sum(jnp.tanh(x @ w1).astype(jnp.float32) @ w2.astype(jnp.float32))


@needs_cuda
def test_compiled_for_is_a_direct_deviceless_compile():
  """The figure is XLA:GPU's own: the same as compiling with JAX's topology API by hand."""
  from jax.experimental import topologies
  args = (jnp.ones((512, 256), jnp.bfloat16), jnp.ones((256, 1024), jnp.bfloat16),
          jnp.ones((1024, 256), jnp.bfloat16))
  grad = jax.grad(_mlp, argnums=(0, 1, 2))
  ours = memory.compiled_for("h100", grad, *args)
  config = (importlib.resources.files("invact_jax.targets") / "h100.txtpb").read_text()
  topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                          target_config=config)
  mesh = topologies.make_mesh(topology, (1,), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  direct = jax.jit(grad).trace(*structs).lower().compile(
      compiler_options=dict(H100.compiler_options)).memory_analysis()
  assert ours.temp == direct.temp_size_in_bytes > 0
  assert ours.argument == direct.argument_size_in_bytes == sum(a.nbytes for a in args)
  # FLOPs: XLA's count of the GPU module, its cuBLAS calls counted from their shapes (XLA
  # counts nothing inside a library call), is XLA:CPU's count of the same gradient
  with targets.compiling_for("h100"):
    gpu = memory.flops(grad, *args)
  assert gpu == pytest.approx(memory.flops(grad, *args), rel=1e-3)
  assert gpu > 5 * 2 * 512 * 256 * 1024  # (five matmuls: the seed's product folded)


@needs_cuda
def test_cudnn_attention_flops_are_counted_from_its_shapes():
  q = jnp.ones((2, 256, 4, 64), jnp.bfloat16)
  k = jnp.ones((2, 512, 4, 64), jnp.bfloat16)
  fwd = lambda q, k, v: _attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
  per = 2 * 4 * 256 * 512 * 64
  with targets.compiling_for("h100"):
    assert memory.flops(fwd, q, k, k) == pytest.approx(4 * per, rel=0.01)
    assert memory.flops(jax.grad(fwd, argnums=(0, 1, 2)), q, k, k) == pytest.approx(
        14 * per, rel=0.01)


def _attention(q, k, v, implementation=None):
  """cuDNN's attention compiling for a GPU (as the project's models choose), else XLA's."""
  impl = implementation or ("cudnn" if targets.platform() == "gpu" else "xla")
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def _layer(h, p, attention=_attention):
  b, t, d = h.shape
  x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
                        + 1e-6).astype(h.dtype)
  q, k, v = (checkpoint_name(x @ p[n], n).reshape(b, t, 8, d // 8) for n in ("wq", "wk", "wv"))
  h = h + checkpoint_name(attention(q, k, v).reshape(b, t, d) @ p["wo"], "wo")
  x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)
                        + 1e-6).astype(h.dtype)
  g, u = checkpoint_name(x @ p["wg"], "wg"), checkpoint_name(x @ p["wu"], "wu")
  return h + (jax.nn.silu(g) * u) @ p["wd"], None


def _stack(layers=2, d=256, ff=704, t=256, b=2, dtype=jnp.bfloat16):
  keys = iter(jax.random.split(jax.random.key(0), 8))
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "wg": (d, ff), "wu": (d, ff),
            "wd": (ff, d)}
  params = {n: (jax.random.normal(next(keys), (layers, *s)) / np.sqrt(s[0])).astype(dtype)
            for n, s in shapes.items()}
  x = jax.random.normal(next(keys), (b, t, d)).astype(dtype)
  return params, x


def _loss(policy=None, attention=_attention):
  layer = lambda h, p: _layer(h, p, attention)  # noqa: E731
  layer = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def loss(params, x):
    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))
  return loss


@needs_cuda
def test_a_cudnn_attention_layer_compiles_for_the_h100():
  """Traced for the H100, the layer takes cuDNN's attention (a trace for the CPU first does
  not stand in for it: the target keys JAX's trace caches)."""
  params, x = _stack()
  step = jax.jit(jax.value_and_grad(_loss()))
  cpu_text = step.lower(params, x).compile().as_text()
  h100 = H100.compile(H100.lower(step, params, x))
  assert "__cudnn$fmha" not in cpu_text and "__cudnn$fmha" in h100.as_text()
  xla = lambda q, k, v: _attention(q, k, v, "xla")  # noqa: E731
  with targets.compiling_for("h100"):
    with_cudnn = memory.compiled(jax.value_and_grad(_loss()), *_stack(t=1024)).temp
    with_xla = memory.compiled(jax.value_and_grad(_loss(attention=xla)), *_stack(t=1024)).temp
  probabilities = 2 * 8 * 1024 * 1024 * 2  # one layer's bfloat16 [b, heads, t, t]
  assert with_cudnn + 2 * probabilities <= with_xla


@needs_cuda
def test_the_gpu_remat_figures_are_the_gpus():
  """On a scanned bfloat16 Llama stack, JAX's dots policy keeps far less than no remat in
  XLA:GPU's compile, and neither figure is XLA:CPU's (cuDNN's attention keeps no
  probabilities; XLA:CPU keeps 16-bit values in float32: the CPU's do not transfer)."""
  params, x = _stack(layers=4, t=512, b=4)
  dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  gpu = [memory.compiled_for("h100", jax.value_and_grad(_loss(p)), params, x).temp
         for p in (None, dots)]
  cpu = [memory.compiled(jax.value_and_grad(_loss(p)), params, x).temp for p in (None, dots)]
  assert gpu[1] / gpu[0] < 0.85
  assert gpu[0] < 0.5 * cpu[0] and gpu[1] < cpu[1]


@needs_cuda
def test_eight_gpus_take_a_cpu_meshs_sharding():
  """Parameters sharded over this machine's 8 (virtual) devices are compiled sharded over
  eight H100s: each device holds an eighth (per-device figures)."""
  params, x = _stack(layers=8, d=256)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
  sharded = jax.device_put(params, spec)
  whole = sum(a.nbytes for a in jax.tree.leaves(params))
  loss = _loss(attention=lambda q, k, v: _attention(q, k, v, "xla"))
  one = memory.compiled_for("h100x8", jax.value_and_grad(loss), sharded, x)
  assert one.argument == whole // 8 + x.nbytes
  assert one.temp < memory.compiled_for("h100", jax.value_and_grad(loss), params, x).temp
  with pytest.raises(ValueError, match="sharded over 8 devices"):
    memory.compiled_for("h100x4", jax.value_and_grad(loss), sharded, x)


@needs_cuda
def test_invert_measures_a_rematerialized_layer_for_the_target():
  """invert's checks of a jax.checkpoint body compile for the target (a cuDNN attention has
  no CPU lowering: measured on the CPU this failed), per call or as the current target: each
  body alone compiles to less converted, the scan of them to more on XLA:GPU (15.70 vs
  14.26 MB), so the bodies stay as written and the temp is the policy's."""
  params, x = _stack()
  loss = _loss(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  inv = invact_jax.invert(loss, device="h100")
  m = memory.compiled_for("h100", jax.value_and_grad(inv), params, x)
  assert 0 < m.temp <= memory.compiled_for("h100", jax.value_and_grad(loss), params, x).temp
  whys = [why for what, _, why in inv.last_report.left_alone if what == "silu"]
  assert inv.last_report.replaced.get("silu") == 1 or any(
      "raised the program's gradient's compiled temp" in w for w in whys), inv.last_report
  assert memory.compiled_for("h100", jax.value_and_grad(invact_jax.invert(loss)), params,
                             x).temp == m.temp
  with pytest.raises(ValueError, match="argument `device`"):
    invact_jax.invert(loss, device="h9")


@needs_cuda
def test_a_plan_for_the_h100_fits_there():
  """plan(device="h100") profiles, solves and checks with XLA:GPU: at 40 % of no remat's GPU
  temp, the plan compiled for the H100 fits (+1 %) and lies within 5 % of its prediction."""
  params, x = _stack(layers=4, t=512, b=4)
  loss = _loss()
  none = memory.compiled_for("h100", jax.value_and_grad(loss), params, x).temp
  budget = int(0.4 * none)
  planned = invact_jax.plan(loss, params, x, budget=budget, device="h100")
  compiled = memory.compiled_for("h100", jax.value_and_grad(planned), params, x).temp
  assert compiled == planned.report.compiled_bytes <= 1.01 * budget
  assert abs(planned.report.predicted_bytes / compiled - 1) <= 0.05
  # its recompute is XLA:GPU's count of the compiled steps (cuDNN's attention and cuBLAS's
  # matmuls counted from their calls' shapes), the loop's body once per layer
  with targets.compiling_for("h100"):
    xla = planned.report.depth * (memory.flops(jax.value_and_grad(planned), params, x)
                                  - memory.flops(jax.value_and_grad(loss), params, x))
  assert xla > 0 and planned.report.predicted_recompute_flops == pytest.approx(xla, rel=0.02)


@needs_cuda
def test_a_cudnn_attentions_flops_from_its_trace_are_the_compiled_calls():
  """:func:`memory.jaxpr_flops` counts cuDNN's attention equations (forward and backward) as
  :func:`memory.custom_call_flops` counts their calls in XLA:GPU's compiled module."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: _attention(q, k, v, "cudnn").astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  with targets.compiling_for("h100"):
    traced = memory.jaxpr_flops(jax.make_jaxpr(grad)(q, q, q))
    assert traced == pytest.approx(memory.flops(grad, q, q, q), rel=1e-6)
  assert traced >= 14 * 2 * 256 * 256 * 4 * 64  # 4 forward + 10 backward per B·N·T·S·H


@needs_cuda
def test_the_floor_audit_traces_for_the_target():
  params, x = _stack()
  audit = invact_jax.floor_audit(invact_jax.invert(_loss()), params, x, device="h100")
  assert any(role == "kernel residual" for _, role in audit.kept)  # cuDNN's attention
  cpu = invact_jax.floor_audit(invact_jax.invert(_loss()), params, x)
  assert not any(role == "kernel residual" for _, role in cpu.kept)


@needs_cuda
def test_the_lm_head_takes_the_targets_tiles():
  from invact_jax.ops.cross_entropy import base
  with targets.compiling_for("h100"):
    gpu = base.default_tiles(16384, 128256, "forward")
  assert gpu == base.default_tiles(16384, 128256, "forward", "gpu") != base.default_tiles(
      16384, 128256, "forward")


@needs_cuda
def test_jax_triton_is_unavailable_compiling_without_the_gpu():
  with targets.compiling_for("h100"):
    ok, why = invact_jax.available("triton")
    assert not ok and "attached" in why
    assert invact_jax.available("pallas") == (True, "")


def _v5e():
  try:
    return targets.resolve("v5e"), ""
  except RuntimeError as e:
    return None, str(e)


V5E, NO_TPU = _v5e()


@pytest.mark.skipif(V5E is None, reason=f"no XLA:TPU compiler here: {NO_TPU}")
def test_a_tpu_compiles_without_one():
  """A scanned SwiGLU stack on one v5e chip, its residuals in HBM (4096 tokens: a small
  program's buffers go to the core's VMEM, which memory_analysis() does not count)."""
  assert targets.resolve("v5e:2x2").device_kind == V5E.device_kind == "TPU v5 lite"
  assert len(targets.resolve("v5e:2x2").devices) == 4

  def layer(h, w):
    return h + jax.nn.silu(h @ w[0]) @ w[1], None

  def temp(policy):
    lay = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(ws, x):
      return jnp.sum(jax.lax.scan(lay, x, ws)[0].astype(jnp.float32) ** 2)
    ws = jax.ShapeDtypeStruct((8, 2, 1024, 1024), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    return memory.compiled_for("v5e", jax.grad(loss), ws, x).temp
  carries = 8 * 4096 * 1024 * 2
  none, nothing = temp(None), temp(jax.checkpoint_policies.nothing_saveable)
  assert none > 2 * nothing >= 2 * carries


@pytest.mark.skipif(V5E is None, reason=f"no XLA:TPU compiler here: {NO_TPU}")
def test_describing_a_tpu_leaves_the_environment_as_it_was(monkeypatch):
  """A process started after a TPU compile (a training run's workers) must not find libtpu
  through this one's environment and take itself for a TPU host."""
  for k in ("TPU_LIBRARY_PATH", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
    monkeypatch.delenv(k, raising=False)
  from invact_jax.targets import _compilers  # pylint: disable=import-outside-toplevel
  _compilers.tpu_topology("v5e:2x2")
  assert "TPU_LIBRARY_PATH" not in os.environ
  assert "ALLOW_MULTIPLE_LIBTPU_LOAD" not in os.environ
  # nor through the path a GPU compile puts the deviceless directory on: importing the
  # libtpu package would set TPU_LIBRARY_PATH (it lives apart, in deviceless/tpu)
  if H100 is not None:
    import importlib.util  # pylint: disable=import-outside-toplevel
    assert any("deviceless" in p for p in sys.path)
    assert importlib.util.find_spec("libtpu") is None
