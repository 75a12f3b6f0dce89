"""``invact_jax.plan``: the planner on a program it has never seen — its layer loop, its tensors
(the program's names or automatic ones), the plan's bytes and recompute against every choice
compiled, bad budgets, programs without or with nested loops, gradients unchanged."""
import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import memory, planner
from invact_jax.planner import api, apply, cost_model, layer_loop

D, B, T, W, H, F = 4, 2, 16, 32, 4, 64


def _params(key):
  ks = jax.random.split(key, 7)
  shapes = {"norm": (D, W), "q": (D, W, W), "k": (D, W, W), "v": (D, W, W), "o": (D, W, W),
            "up": (D, W, F), "gate": (D, W, F), "down": (D, F, W)}
  return {n: (jnp.ones(s) if n == "norm" else
              jax.random.normal(ks[i % 7], s) / math.sqrt(s[-2]))
          for i, (n, s) in enumerate(shapes.items())}


def _layer(names: bool):
  """A Llama-style layer written by hand: RMSNorm, attention, SwiGLU MLP (no remat)."""
  tag = (jax.ad_checkpoint.checkpoint_name if names else lambda x, n: x)

  def layer(h, p):
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["norm"]
    q, k, v = (tag(x @ p[n], n) for n in "qkv")
    split = lambda a: a.reshape(*a.shape[:2], H, W // H)  # noqa: E731
    s = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / math.sqrt(W // H)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), split(v)).reshape(h.shape)
    h = h + o @ p["o"]
    return h + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"], None
  return layer


def _loss(names=False):
  layer = _layer(names)

  def loss(params, x):
    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h * h)
  return loss


ARGS = (_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (B, T, W)))


def _loop(closed):
  """The program's layer loop as ``plan`` profiles it."""
  return layer_loop.read_by_the_backward(layer_loop.find_loops(closed)[1][0])  # pylint: disable=protected-access


def _grads(fn, *args):
  return jax.jit(jax.grad(fn))(*args)


def _assert_within_the_originals_error(fn, planned, *args):
  """Where the plan changes how XLA fuses the recomputed values the gradient moves by
  rounding: no further from float64 than twice the original's own distance."""
  with jax.enable_x64(True):
    wide = jax.tree.map(np.asarray, _grads(fn, *jax.tree.map(
        lambda a: np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        args)))
  for w, a, b in zip(*(jax.tree.leaves(g) for g in (wide, _grads(fn, *args),
                                                      _grads(planned, *args)))):
    floor = float(np.max(np.abs(np.asarray(a, np.float64) - w)))
    assert float(np.max(np.abs(np.asarray(b, np.float64) - w))) <= 2 * floor + 1e-12


def _temp(fn, *args):
  return memory.compiled(jax.value_and_grad(fn), *args).temp


@pytest.fixture(scope="module")
def generous():
  """The report of a plan whose budget is above the program as written."""
  return invact_jax.plan(_loss(), *ARGS, budget="1GiB").report


@pytest.fixture(scope="module")
def bounds():
  """The compiled temps of full remat and of the program as written."""
  loss = _loss()
  full = lambda params, x: jnp.mean(jax.lax.scan(jax.checkpoint(  # noqa: E731
      _layer(False), policy=jax.checkpoint_policies.nothing_saveable), x, params)[0] ** 2)
  return _temp(full, *ARGS), _temp(loss, *ARGS)


def test_automatic_names_are_the_matmuls_in_program_order_and_stable(generous):
  """The matmuls' outputs (``matmul_k``, in program order), then the operands the layer
  computes for them (``matmul_k_lhs``/``_rhs``: the norm's output, the softmax's
  probabilities, the SwiGLU product), each once (the norm's output feeds three matmuls)."""
  first = generous
  again = invact_jax.plan(_loss(), *ARGS, budget="1GiB").report
  names = [t.name for t in first.tensors]
  assert names == [t.name for t in again.tensors] and len(set(names)) == len(names)
  outputs = [n for n in names if n.count("_") == 1]
  assert outputs and all(n.startswith("matmul_") for n in outputs)
  assert [int(n.split("_")[1]) for n in outputs] == sorted(int(n.split("_")[1]) for n in outputs)
  operands = {n: t for n, t in zip(names, first.tensors) if n not in outputs}
  assert names == outputs + list(operands)
  assert all(n.rsplit("_", 1)[1] in ("lhs", "rhs") for n in operands)
  # the norm's output, read by the q, k, v, gate and up matmuls: one candidate, the first's
  assert operands["matmul_0_lhs"].shape == (B, T, W) and "matmul_1_lhs" not in operands
  assert any(t.shape == (B, H, T, T) for t in operands.values())  # the probabilities
  assert any(t.shape == (B, T, F) for t in operands.values())  # the SwiGLU product
  assert all(t.named_by == "invact_jax" and "planner/test_api.py" in t.where
             for t in first.tensors)
  assert "planner/test_api.py" in first.loop and first.depth == D


def test_the_programs_own_names_are_used_and_their_matmuls_not_named_again():
  report = invact_jax.plan(_loss(names=True), *ARGS, budget="1GiB").report
  by = {t.name: t for t in report.tensors}
  assert {"q", "k", "v"} <= set(by) and all(by[n].named_by == "program" for n in "qkv")
  # the q/k/v matmuls are the names' values: not candidates twice
  assert sum(t.shape == (B, T, W) and t.named_by == "invact_jax"
             for t in report.tensors) < len(report.tensors) - 3


def test_a_tensors_bytes_are_exactly_what_the_program_keeps_of_it(generous):
  """Each candidate is a residual of the unplanned program: its bytes per layer times the
  layers are one of the stacked residuals :func:`memory.residuals` lists (an einsum's output
  may be kept transposed)."""
  report = generous
  kept = {(tuple(sorted(r.shape[1:])), r.bytes) for r in memory.residuals(_loss(), *ARGS)
          if r.shape[:1] == (D,)}
  assert report.tensors
  for t in report.tensors:
    assert t.bytes == math.prod(t.shape) * np.dtype(t.dtype).itemsize
    assert (tuple(sorted(t.shape)), D * t.bytes) in kept, t


def _toy(h, w):
  """Three tensors the backward reads (the tanh's, sin's and GELU's inputs) and one it does
  not (the last matmul's output: the residual add's derivative needs nothing)."""
  a = jnp.tanh(h @ w[0])
  b = jnp.sin(a @ w[1])
  return h + jax.nn.gelu(b @ w[2]) @ w[3], None


def _toy_loss(ws, x):
  return jnp.mean(jax.lax.scan(_toy, x, ws)[0] ** 2)


TOY = (jax.random.normal(jax.random.key(2), (6, 4, 32, 32)) / 6,
       jax.random.normal(jax.random.key(3), (64, 32)))


def _matmul_outputs_only(monkeypatch):
  """The toy's candidates: its three matmul outputs (not the operands computed for the next
  matmul: the tanh's and sin's outputs), so that every choice can be compiled."""
  monkeypatch.setattr(layer_loop, "_operands", lambda *a: None)


def test_every_choice_compiled_is_near_its_prediction_and_plans_fit(monkeypatch):
  """A three-tensor layer, all eight keep/recompute choices compiled: each within 10 % of
  the profile's prediction; at budgets from keeping nothing to keeping everything the plan's
  compiled temp fits and is within 10 % of its prediction."""
  _matmul_outputs_only(monkeypatch)
  loop = _loop(jax.make_jaxpr(_toy_loss)(*TOY))
  names = [t.name for t in loop.tensors]
  assert names == ["matmul_0", "matmul_1", "matmul_2"]  # matmul_3's output is never read
  temps = {keep: _temp(apply.apply_plan(_toy_loss, keep, ()), *TOY)  # pylint: disable=protected-access
           for n in range(len(names) + 1) for keep in itertools.combinations(names, n)}
  profile = cost_model.layer_profile(loop, temps[()], None)  # pylint: disable=protected-access
  for keep, temp in temps.items():
    assert abs(profile.peak((keep,) * loop.length) / temp - 1) <= 0.10, (keep, temp)
  low, high = temps[()], temps[tuple(names)]
  for frac in (0.0, 0.3, 0.6, 1.0):
    budget = int(low + frac * (high - low))
    r = invact_jax.plan(_toy_loss, *TOY, budget=budget).report
    assert r.compiled_bytes <= budget and not r.as_written
    assert abs(r.predicted_bytes / r.compiled_bytes - 1) <= 0.10, r


def test_the_integer_program_matches_brute_force_over_keep_recompute_offload(monkeypatch):
  """The toy's profile (its FLOPs from XLA, a stand-in offload cost): at every budget the
  solver's choice costs what the cheapest of all 27 keep / recompute / offload assignments
  predicted to fit costs."""
  monkeypatch.setattr(cost_model, "_has_pinned_host", lambda: True)
  _matmul_outputs_only(monkeypatch)
  loop = _loop(jax.make_jaxpr(_toy_loss)(*TOY))
  rate = cost_model.offload_rate(None, host_bandwidth=1e9, flop_rate=4e9)  # pylint: disable=protected-access
  profile = cost_model.layer_profile(loop, 100_000, rate)  # pylint: disable=protected-access
  layers = loop.length
  assignments = []
  for what in itertools.product("kro", repeat=len(profile.tags)):
    keep = tuple(t for t, w in zip(profile.tags, what) if w == "k")
    off = tuple(t for t, w in zip(profile.tags, what) if w == "o")
    assignments.append((profile.peak((keep,) * layers, (off,) * layers),
                        profile.cost((keep,) * layers, (off,) * layers)))
  for budget in sorted({peak for peak, _ in assignments}):
    p = planner.solve([profile], budget, uniform=True)
    best = min(cost for peak, cost in assignments if peak <= budget)
    assert p.predicted_cost == pytest.approx(best), budget
  assert any(p.offload for p in [planner.solve([profile], b, uniform=True)
                                  for b, _ in assignments])


def test_gradients_are_the_originals_bit_for_bit(bounds, generous):
  low, _ = bounds
  everything = [t.name for t in generous.tensors]
  most = _temp(apply.apply_plan(_loss(), everything, ()), *ARGS)  # pylint: disable=protected-access
  planned = invact_jax.plan(_loss(), *ARGS, budget=(low + most) // 2)
  assert 0 < len(planned.report.keep) < len(planned.report.tensors)
  for a, b in zip(jax.tree.leaves(_grads(_loss(), *ARGS)), jax.tree.leaves(_grads(planned, *ARGS))):
    np.testing.assert_array_equal(a, b)
  assert float(jax.jit(planned)(*ARGS)) == float(jax.jit(_loss())(*ARGS))
  xs = jnp.stack([ARGS[1], 2 * ARGS[1]])  # under vmap too
  per_x = lambda f: jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(ARGS[0], xs)  # noqa: E731
  for a, b in zip(jax.tree.leaves(per_x(_loss())), jax.tree.leaves(per_x(planned))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("budget, message", [
    (0, "must be at least one byte"), (-5, "at least one byte"), (0.5, "at least one byte"),
    ("0.5", "at least one byte"), (float("nan"), "a finite number of bytes"),
    (float("inf"), "a finite number of bytes"), ("1e400", "a finite number of bytes"),
    ("300 parsecs", "not a byte count: '300 parsecs'"), ("", "not a byte count")])
def test_degenerate_budgets_are_one_line_errors(budget, message):
  with pytest.raises(ValueError, match=message) as e:
    invact_jax.plan(_loss(), *ARGS, budget=budget)
  assert "argument `budget`" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(TypeError, match="argument `budget`"):
    invact_jax.plan(_loss(), *ARGS, budget=True)


def test_any_size_of_integer_budget_is_taken_exactly():
  """A budget of 10**400 bytes (no float holds it) plans as any budget above every need:
  the program as written."""
  assert planner.parse_budget(10**400) == 10**400
  assert planner.parse_budget("3KiB") == 3072 and planner.parse_budget(2.7) == 2
  assert invact_jax.plan(_loss(), *ARGS, budget=10**400).report.as_written


def test_the_planned_function_takes_keywords_and_every_option_is_checked():
  def loss(ws, x, scale=1.0):
    return _loss()(ws, x) * scale
  planned = invact_jax.plan(loss, *ARGS, budget=10**9)
  assert float(planned(*ARGS, scale=2.0)) == float(loss(*ARGS, scale=2.0))
  for a, b in zip(jax.tree.leaves(jax.grad(planned)(*ARGS, scale=2.0)),
                  jax.tree.leaves(jax.grad(loss)(*ARGS, scale=2.0))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  for kwargs, error, name in ((dict(host_bandwidth=-1), ValueError, "host_bandwidth"),
                              (dict(flop_rate=float("nan")), ValueError, "flop_rate"),
                              (dict(convert="no"), TypeError, "convert"),
                              (dict(has_aux=1), TypeError, "has_aux"),
                              (dict(offload="yes"), TypeError, "offload")):
    with pytest.raises(error, match=f"argument `{name}`"):
      invact_jax.plan(loss, *ARGS, budget=10**9, **kwargs)


@pytest.mark.parametrize("where", ["cond", "scan"])
def test_a_loop_the_planner_cannot_reach_is_named(where):
  """A layer loop inside a lax.cond branch or another scan's body: the error says where it
  lies, not only that there is no layer loop."""
  inner = _loss()
  if where == "cond":
    def loss(ws, x):
      return jax.lax.cond(x.reshape(-1)[0] > 0, lambda: inner(ws, x), lambda: 0.0)
  else:
    def loss(ws, x):
      return jax.lax.scan(lambda c, _: (c + inner(ws, x), None), 0.0, None, length=1)[0]
  with pytest.raises(ValueError, match="lies inside a lax." + ("cond branch" if where == "cond"
                                                               else "scan's body")):
    invact_jax.plan(loss, *ARGS, budget=10**9)


def test_a_budget_below_keeping_nothing_names_the_minimum_and_above_runs_as_written(
    bounds, generous):
  _, high = bounds
  r = generous
  assert r.as_written and r.compiled_bytes == high and r.predicted_recompute_flops == 0
  assert r.minimum_bytes == _temp(apply.apply_plan(_loss(), (), ()), *ARGS)  # pylint: disable=protected-access
  with pytest.raises(planner.InfeasibleBudget,
                     match=f"minimum feasible budget is {r.minimum_bytes:,}"):
    invact_jax.plan(_loss(), *ARGS, budget=r.minimum_bytes - 1)
  assert planner.parse_budget("1.5 KiB") == 1536 and planner.parse_budget("2GB") == 2 * 10**9


def test_a_program_without_a_layer_loop_and_bad_arguments_say_so():
  with pytest.raises(ValueError, match="no layer loop in `fn`"):
    invact_jax.plan(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((4, 4)), jnp.ones((2, 4)),
                    budget="1MiB")
  with pytest.raises(ValueError, match="needs example arguments"):
    invact_jax.plan(_loss(), budget="1MiB")
  with pytest.raises(ValueError, match="argument `argnums`"):
    invact_jax.plan(_loss(), *ARGS, budget="1MiB", argnums=2)
  with pytest.raises(TypeError, match="argument `fn` must be callable"):
    invact_jax.plan(3, *ARGS, budget="1MiB")
  with pytest.raises(ValueError, match="argument `offload`: the device .* has no pinned_host"):
    invact_jax.plan(_loss(), *ARGS, budget="1MiB", offload=True)


def test_nested_scans_and_a_layers_own_remat(bounds):
  """The outer scan is the layer loop (an inner scan over the MLP's two halves stays inside
  it, as written); a jax.checkpoint the layer already has is replaced by the plan's."""
  low, high = bounds

  def halves(h, p):
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["norm"]
    scores = (x @ p["q"]) @ (x @ p["k"]).swapaxes(-1, -2) / math.sqrt(W)
    h = h + jax.nn.softmax(scores) @ (x @ p["v"]) @ p["o"]
    mlp = lambda c, q: (c + 0.5 * (jax.nn.silu(c @ q[0]) * (c @ q[1])) @ q[2], None)  # noqa: E731
    split = lambda a, axis: jnp.stack(jnp.split(a, 2, axis))  # noqa: E731
    return jax.lax.scan(mlp, h, (split(p["gate"], 1), split(p["up"], 1),
                                 split(p["down"], 0)))[0], None

  def nested(params, x):
    return jnp.mean(jax.lax.scan(halves, x, params)[0] ** 2)
  planned = invact_jax.plan(nested, *ARGS, budget=int(0.9 * _temp(nested, *ARGS)))
  assert planned.report.depth == D and not planned.report.other_loops
  _assert_within_the_originals_error(nested, planned, *ARGS)

  def remat(params, x):
    body = jax.checkpoint(_layer(False), policy=jax.checkpoint_policies.nothing_saveable)
    return jnp.mean(jax.lax.scan(body, x, params)[0] ** 2)
  r = invact_jax.plan(remat, *ARGS, budget=(low + high) // 2).report
  assert r.keep and r.compiled_bytes > _temp(remat, *ARGS)  # keeps what the remat recomputed


def test_a_layer_with_its_own_remat_runs_without_it_where_that_fits():
  def under(policy):
    def loss(ws, x):
      return jnp.mean(jax.lax.scan(jax.checkpoint(_toy, policy=policy), x, ws)[0] ** 2)
    return loss
  remat = under(jax.checkpoint_policies.nothing_saveable)
  unremated = _temp(under(jax.checkpoint_policies.everything_saveable), *TOY)
  # (the loop rewritten with no remat compiles to -7 % .. +7 % of it: JAX 0.12, 0.10)
  planned = invact_jax.plan(remat, *TOY, budget=2 * unremated)
  r = planned.report
  assert (r.policy, r.predicted_recompute_flops, r.recompute) == ("none", 0.0, ())
  assert r.compiled_bytes <= 2 * unremated and not r.as_written
  assert "no remat" in str(r)
  _assert_within_the_originals_error(remat, planned, *TOY)


def test_the_inverted_variant_converts_remat_bodies_without_compiling_them(monkeypatch):
  """``invert`` compiles a ``jax.checkpoint`` body's gradient both ways before converting it
  (under the user's policy); ``plan(convert=True)`` replaces that policy, so its inverted
  variant converts the body unmeasured."""
  from invact_jax.convert import _fallback, _program  # pylint: disable=import-outside-toplevel
  layer = jax.checkpoint(_layer(False), policy=jax.checkpoint_policies.nothing_saveable)

  def loss(params, x):
    return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)
  measured, real = [], _fallback._compiled_temp  # pylint: disable=protected-access
  monkeypatch.setattr(_fallback, "_compiled_temp",
                      lambda *a, **k: measured.append(1) or real(*a, **k))
  jax.make_jaxpr(invact_jax.invert(loss))(*ARGS)
  assert measured
  measured.clear()
  variant = _program.inverted_for_plan(loss)
  jax.make_jaxpr(variant)(*ARGS)
  assert not measured and {"rms_norm", "silu", "softmax"} <= set(variant.last_report.replaced)
  r = invact_jax.plan(loss, *ARGS, budget="1GiB", convert=True).report
  assert not measured and len(r.alternatives) == 1


def test_sharded_inputs_and_jit():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  x = jax.device_put(jnp.tile(ARGS[1], (4, 1, 1)), jax.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")))
  loss = _loss()
  planned = invact_jax.plan(loss, ARGS[0], x, budget=int(0.7 * _temp(loss, ARGS[0], x)))
  assert planned.report.keep and not planned.report.as_written
  _assert_within_the_originals_error(loss, planned, ARGS[0], x)


def test_a_layer_loop_inside_shard_map():
  """Data parallelism written with shard_map around the scanned layers (each device runs the
  loop on its share of the batch; the loss's mean is a pmean): the loop is found inside the
  shard_map, planned from one device's shapes, and re-made where it stands (its values vary
  over the mesh's axis); the plan fits and the gradient is the original's.  A loop whose layer
  holds a collective (it needs the mesh to trace) is no candidate."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  x = jax.device_put(jnp.tile(ARGS[1], (8, 1, 1)), jax.NamedSharding(mesh, P("data")))
  inner = _loss()

  def loss(params, x):
    return jax.shard_map(lambda p, x: jax.lax.pmean(inner(p, x), "data"), mesh=mesh,
                         in_specs=(P(), P("data")), out_specs=P())(params, x)
  planned = invact_jax.plan(loss, ARGS[0], x, budget=int(0.5 * _temp(loss, ARGS[0], x)))
  report = planned.report
  assert "inside a shard_map" in report.loop and report.depth == D, report
  assert report.keep and report.recompute and not report.as_written, report
  assert report.compiled_bytes <= report.budget
  assert _temp(planned, ARGS[0], x) == report.compiled_bytes
  _assert_within_the_originals_error(loss, planned, ARGS[0], x)

  def reduced_layer(h, p):  # a collective inside the layer (a global mean taken off)
    h, _ = _layer(False)(h, p)
    return h - jax.lax.pmean(jnp.mean(h), "data"), None

  def collective(params, x):
    def local(p, x):
      return jax.lax.pmean(jnp.mean(jax.lax.scan(reduced_layer, x, p)[0] ** 2), "data")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, x)
  with pytest.raises(ValueError, match="no layer loop .* inside a shard_map: its layer names the "
                     "mesh's axes \\(a collective"):
    invact_jax.plan(collective, ARGS[0], x, budget=10 ** 9)


def test_offloading_is_costed_where_the_device_has_host_memory(monkeypatch):
  """A stand-in device with pinned_host: each tensor's offload cost is its bytes at the given
  bandwidth in FLOPs of the given rate, and a tight budget offloads rather than recomputes
  where that is cheaper."""
  monkeypatch.setattr(cost_model, "_has_pinned_host", lambda: True)
  loop = _loop(jax.make_jaxpr(_loss())(*ARGS))
  rate = cost_model.offload_rate(None, host_bandwidth=1e9, flop_rate=1e3)  # pylint: disable=protected-access
  assert rate == 2.0 * 1e3 / 1e9
  profile = cost_model.layer_profile(loop, 10_000, rate)  # pylint: disable=protected-access
  assert profile.tag_offload_cost == tuple(rate * t.bytes for t in loop.tensors)
  p = planner.solve([profile], profile.base_bytes + max(profile.tag_bytes), uniform=True)
  assert p.offload and set(p.offload[0]) | set(p.keep[0])
  with pytest.raises(ValueError, match="argument `flop_rate` must be a positive number"):
    cost_model.offload_rate(None, host_bandwidth=1e9, flop_rate=-1.0)  # pylint: disable=protected-access


def test_of_two_layer_loops_the_heavier_is_planned_and_the_other_named():
  """An encoder-decoder: two scans over their own stacked parameters; the one whose tensors
  weigh more is planned, the other is named in the report and runs as written."""
  wide = jax.random.normal(jax.random.key(4), (3, 2, 32, 128)) / 8
  narrow = jax.random.normal(jax.random.key(5), (3, 2, 32, 32)) / 8

  def encoder(h, w):
    return h + jnp.tanh(h @ w[0]) @ w[0].T, None

  def decoder(h, w):
    return h + jnp.sin(h @ w[0]) @ w[1], None

  def loss(ws, x):
    h = jax.lax.scan(encoder, x, ws[0])[0]
    return jnp.mean(jax.lax.scan(decoder, h, ws[1])[0] ** 2)
  args = ((wide, narrow), jnp.ones((16, 32)))
  r = invact_jax.plan(loss, *args, budget="64MiB").report
  assert {t.shape for t in r.tensors} == {(16, 128)} and len(r.other_loops) == 1
  assert "planner/test_api.py" in r.other_loops[0]


def test_convert_plans_the_inverted_program_too_and_takes_it_where_only_it_fits():
  """A language model whose logits dominate: ``invert`` converts its head (no [tokens,
  vocabulary] logits), so under a budget below the original's least temp only the converted
  program fits, and ``convert=True`` takes it."""
  import optax  # pylint: disable=import-outside-toplevel
  # 512 tokens against a vocabulary of 16384: the converted head's chunks hold 256 tokens
  embed = jax.random.normal(jax.random.key(6), (16384, W)) / 8
  tokens = jax.random.randint(jax.random.key(7), (8, 65), 0, 16384)

  def lm(params, tokens):
    h = jax.lax.scan(_layer(False), params["embed"][tokens[:, :-1]], params["layers"])[0]
    logits = h @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  args = ({"layers": ARGS[0], "embed": embed}, tokens)
  # each program's least temp: its layers keeping nothing
  plain, inverted = (_temp(apply.apply_plan(f, (), ()), *args)  # pylint: disable=protected-access
                     for f in (lm, invact_jax.invert(lm)))
  assert inverted < plain
  budget = (inverted + plain) // 2
  with pytest.raises(planner.InfeasibleBudget):
    invact_jax.plan(lm, *args, budget=budget)
  planned = invact_jax.plan(lm, *args, budget=budget, convert=True)
  assert planned.report.configuration == "inverted" and planned.report.compiled_bytes <= budget
  assert str(planned.report).startswith("inverted: layer loop")
  assert planned.report.alternatives == (
      f"as written: infeasible: keeping nothing it needs {plain:,} B",)
  # the plan changes what the converted program recomputes, not what it computes
  _assert_within_the_originals_error(invact_jax.invert(lm), planned, *args)


@pytest.mark.parametrize("least, planned", [
    ({"as written": 900.0, "inverted": 950.0}, ["as written", "inverted"]),
    # the inverted step does more FLOPs recomputing nothing than the original's plan: not planned
    ({"as written": 900.0, "inverted": 1000.0}, ["as written"]),
    # planned from the least bound up: the original's bound is above the inverted plan's step
    ({"as written": 1090.0, "inverted": 950.0}, ["inverted"])])
def test_convert_chooses_the_program_whose_step_does_fewer_flops(monkeypatch, least, planned):
  """The converted program's backward computes differently (an inverse, a chunked head's
  recomputed logits), so ``convert=True`` compares the planned steps' FLOPs, not the
  recompute alone: found on the project's ViT-Ti, where the inverted program kept a matmul,
  recomputed less and still did 8 % more FLOPs than the original keeping nothing.  A program
  whose step recomputing nothing does at least the FLOPs of a plan already made is not
  planned (its compiles spared)."""
  def report(configuration, recompute, step):
    return planner.PlanReport(loop="l", depth=4, other_loops=(), tensors=(), keep=(), offload=(),
                         recompute=(), budget=10, predicted_bytes=9, compiled_bytes=9,
                         minimum_bytes=1, predicted_recompute_flops=recompute, rounds=1,
                         configuration=configuration, step_flops=step)
  asked = []

  def plan_one(fn, args, grad, budget, rate, configuration, with_step=False):
    asked.append((configuration, with_step))
    return {"as written": report("as written", 166.0, 1000.0),
            "inverted": report("inverted", 120.0, 1080.0)}[configuration]
  monkeypatch.setattr(api, "plan_loop", plan_one)
  monkeypatch.setattr(cost_model, "least_step_flops", lambda fn, args, grad, **_: least[
      "inverted" if hasattr(fn, "last_report") else "as written"])
  r = invact_jax.plan(_toy_loss, *TOY, budget=10, convert=True).report
  assert asked == [(c, True) for c in planned]
  chosen = "inverted" if planned == ["inverted"] else "as written"
  assert r.configuration == chosen and len(r.alternatives) == 1
  other = {"as written", "inverted"} - {chosen}
  skipped = other.pop() not in planned
  assert ("not planned" in r.alternatives[0]) == skipped and "not taken: " in str(r)
  asked.clear()
  r = invact_jax.plan(_toy_loss, *TOY, budget=10).report  # one program: no step to count
  assert asked == [("as written", False)] and r.alternatives == ()


def test_the_least_step_flops_bound_the_planned_steps_flops():
  """:func:`_least_step_flops` is a lower bound: the step recomputing nothing, every loop's
  body counted per iteration (the layers, and a chunked head's tiles: XLA's own count takes
  a loop's body once, which made the converted head look 2.3 times cheaper than the plain
  one in the test below)."""
  grad = jax.value_and_grad
  least = cost_model.least_step_flops(_loss(), ARGS, grad)  # pylint: disable=protected-access
  # (the layer re-bound under a remat saving everything: its residuals as JAX's remat picks
  # them, a few products of the norm's more than the program without remat: 0.9 %)
  assert least == pytest.approx(
      memory.jaxpr_flops(jax.make_jaxpr(grad(_loss()))(*ARGS), per_iteration=True), rel=0.02)
  for keep in ((), ("matmul_0",)):
    planned = apply.apply_plan(_loss(), keep, ())  # pylint: disable=protected-access
    assert least < memory.jaxpr_flops(jax.make_jaxpr(grad(planned))(*ARGS), per_iteration=True)


def test_a_layers_flops_from_its_linearization_are_its_gradients():
  """The FLOPs of a layer's forward and backward under each policy, counted on its
  linearization plus one measured transpose difference, are those of its traced gradient
  (a custom derivative's too: invert's layer)."""
  for fn in (_loss(), invact_jax.invert(_loss())):
    loop = _loop(jax.make_jaxpr(fn)(*ARGS))
    names = [t.name for t in loop.tensors]
    for keep, fixed in [((), None), ((names[0],), None), (tuple(names), None),
                        *[((), f) for f in [*planner.FIXED_POLICIES, "everything"]]]:
      assert cost_model.layer_flops(loop, keep, fixed) == pytest.approx(  # pylint: disable=protected-access
          cost_model.count_layer_flops(loop, keep, fixed, transposed=True), rel=1e-12)


def test_auxiliary_outputs_and_other_argnums(bounds):
  """A loss that also returns data (``has_aux``), differentiated w.r.t. its second argument."""
  low, high = bounds

  def loss(x, params):
    value = _loss()(params, x)
    return value, {"loss": value}
  args = (ARGS[1], ARGS[0])
  planned = invact_jax.plan(loss, *args, budget=(low + high) // 2, argnums=1, has_aux=True)
  assert planned.report.keep and planned.report.compiled_bytes <= (low + high) // 2
  (value, aux), _ = jax.jit(jax.value_and_grad(planned, argnums=1, has_aux=True))(*args)
  assert float(value) == float(aux["loss"]) == float(jax.jit(loss)(*args)[0])
  _assert_within_the_originals_error(lambda p, x: loss(x, p)[0],
                                     lambda p, x: planned(x, p)[0], ARGS[0], ARGS[1])


def test_a_figure_just_above_the_budget_is_measured_again_exactly(monkeypatch):
  """The measuring compile's figure is never below the default compile's; one above the
  budget by no more than ``memory.analysis_excess`` is measured again at the default's
  emitters, so that a budget equal to a compiled temp is judged as the default has it."""
  grad = jax.value_and_grad(_loss())
  temp = memory.analysed(grad, *ARGS).temp
  calls, real = [], memory.analysed
  monkeypatch.setattr(memory, "analysed",
                      lambda *a, exact=False: calls.append(exact) or real(*a, exact=exact))
  monkeypatch.setattr(memory, "analysis_excess", lambda t: 1024)
  assert cost_model.measured_temp(grad, ARGS, temp) == temp  # pylint: disable=protected-access
  assert cost_model.measured_temp(grad, ARGS, temp - 1024) == temp  # pylint: disable=protected-access
  assert cost_model.measured_temp(grad, ARGS, temp - 1025) == temp  # pylint: disable=protected-access
  assert calls == [False, False, True, False]


def _flash_loss(params, x):
  """The Llama-style stack with its attention a flash-style ``custom_vjp`` (the frontier's,
  cuDNN's form): q, k, v and o with the row log-sum-exp its backward reads."""
  from models import reference_layers  # pylint: disable=import-outside-toplevel

  def layer(h, p):
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["norm"]
    q, k, v = (jnp.reshape(x @ p[n], (*h.shape[:2], H, W // H)) for n in "qkv")
    h = h + reference_layers.flash_attention(q, k, v, True).reshape(h.shape) @ p["o"]
    return h + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"], None
  return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)


def test_a_custom_vjps_residuals_are_one_candidate_that_spares_its_forward():
  """The attention's output and its log-sum-exp, computed inside the custom_vjp's forward,
  are one candidate under the output's name (the bytes JAX saves of both); keeping it, the
  forward is not re-run in the backward (as without it, and under JAX's dots_no_batch);
  the planned gradients are the program's bit for bit."""
  loop = _loop(jax.make_jaxpr(_flash_loss)(*ARGS))
  attention = next(t for t in loop.tensors if t.name == "custom_vjp_0")
  assert attention.bytes == B * T * W * 4 + B * H * T * 4  # o and the float32 row lse
  every = [t.name for t in loop.tensors]
  without = [n for n in every if n != "custom_vjp_0"]
  flops = functools.partial(cost_model.layer_flops, loop)  # pylint: disable=protected-access
  # the forward's two matmuls (2 B T T W FLOPs each): re-run without it and under JAX's
  # dots_no_batch; with it only elementwise work (the norm's, SiLU's) is, less than one
  matmul = 2 * B * T * T * W
  assert flops(every) - flops((), "everything") < matmul
  assert min(flops(without), flops((), "dots_no_batch")) - flops(every) >= 2 * matmul
  planned = apply.apply_plan(_flash_loss, every, ())  # pylint: disable=protected-access
  for a, b in zip(jax.tree.leaves(_grads(planned, *ARGS)),
                  jax.tree.leaves(_grads(_flash_loss, *ARGS))):
    np.testing.assert_array_equal(a, b)


def test_a_custom_vjp_traced_inside_a_shard_map_is_named_as_why_its_loop_is_not_planned():
  """A layer whose custom_vjp was traced with the mesh's axes traces only with the mesh: the
  planner says so (it is no collective of the program's)."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  x = jax.device_put(jnp.tile(ARGS[1], (8, 1, 1)), jax.NamedSharding(mesh, P("data")))

  def loss(params, x):
    return jax.shard_map(lambda p, x: jax.lax.pmean(_flash_loss(p, x), "data"), mesh=mesh,
                         in_specs=(P(), P("data")), out_specs=P())(params, x)
  with pytest.raises(ValueError, match="inside a shard_map: its layer names the mesh's axes "
                     r"\(a collective, or a custom derivative traced with them\)"):
    invact_jax.plan(loss, ARGS[0], x, budget=10 ** 9)


def _xla_recompute(fn, args, depth: int) -> float:
  """XLA's count of what ``fn``'s compiled gradient step recomputes: its FLOPs less the step
  without remat's (a loop's body counted once, so times the layers)."""
  unremated = apply.apply_plan(fn, (), (), "none")  # pylint: disable=protected-access
  return depth * (memory.flops(jax.value_and_grad(fn), *args)
                  - memory.flops(jax.value_and_grad(unremated), *args))


def test_the_plan_is_never_worse_than_any_keep_set_or_fixed_policy(monkeypatch):
  """Brute force on the toy: every keep set and JAX's none / full / dots / dots_no_batch
  compiled; at four budgets between full remat and no remat the plan fits and recomputes (by
  XLA's count of its compiled step) no more than the best of them that fits, +1 % of full
  remat's recompute; and it predicts that recompute within 2 %."""
  _matmul_outputs_only(monkeypatch)
  loop = _loop(jax.make_jaxpr(_toy_loss)(*TOY))
  names = [t.name for t in loop.tensors]
  choices = {keep: apply.apply_plan(_toy_loss, keep, ())  # pylint: disable=protected-access
             for n in range(len(names) + 1) for keep in itertools.combinations(names, n)}
  choices.update({p: apply.apply_plan(_toy_loss, (), (), p)  # pylint: disable=protected-access
                  for p in ("none", *planner.FIXED_POLICIES)})
  costs = {c: (_temp(f, *TOY), _xla_recompute(f, TOY, loop.length)) for c, f in choices.items()}
  low, high, full = costs[()][0], costs["none"][0], costs[()][1]
  for frac in (0.2, 0.4, 0.6, 0.8):
    budget = int(low + frac * (high - low))
    planned = invact_jax.plan(_toy_loss, *TOY, budget=budget)
    recompute = _xla_recompute(planned, TOY, loop.length)
    best = min(f for t, f in costs.values() if t <= budget)
    assert planned.report.compiled_bytes <= budget
    assert recompute <= best + 0.01 * full, (frac, planned.report)
    assert planned.report.predicted_recompute_flops == pytest.approx(recompute, rel=0.02,
                                                                     abs=1e-3 * full)


def test_every_choice_weighed_is_reported_and_a_fixed_one_taken_where_it_recomputes_least(
    monkeypatch):
  """A solved plan that recomputes more than JAX's dots policy (the profile's gains made
  worthless) loses to dots where dots fits compiled: the report says so and lists every
  choice weighed."""
  real = cost_model.layer_profile  # pylint: disable=protected-access

  def worthless(*a, **k):
    p = real(*a, **k)
    return dataclasses.replace(p, tag_gain=(0.0,) * len(p.tags))
  monkeypatch.setattr(cost_model, "layer_profile", worthless)
  dots = _temp(apply.apply_plan(_loss(), (), (), "dots"), *ARGS)  # pylint: disable=protected-access
  r = invact_jax.plan(_loss(), *ARGS, budget=dots).report
  assert r.policy == "dots" and r.compiled_bytes == dots and not r.keep
  assert "JAX's dots policy fits and recomputes least" in str(r)
  labels = [c.split(":")[0] for c in r.compared]
  assert labels[0] == "plan" and {"none", "full", "dots", "dots_no_batch"} <= set(labels)
  assert any(c.startswith("dots: ") and c.endswith("taken") for c in r.compared)


def test_a_layer_without_maxtexts_names_has_no_preset_choices():
  """Only JAX's four policies are weighed for a layer without MaxText's names (the frontier's
  Llama, which has them: tests/benchmarks/test_plan_program.py)."""
  closed = jax.make_jaxpr(_loss(names=True))(*ARGS)
  loop = _loop(closed)
  labels = [c.label for c in cost_model.fixed_choices(loop)]  # pylint: disable=protected-access
  assert labels[:4] == ["none", "full", "dots", "dots_no_batch"] and len(labels) == 4


def test_a_plan_of_runs_of_layers_computes_the_originals_gradient():
  """A plan whose runs of layers keep different sets runs each run as its own scan over its
  slice of the stacked parameters (forward and reverse scans alike): the loss and gradient
  are the original's, to rounding."""
  names = [t.name for t in _loop(jax.make_jaxpr(_loss())(*ARGS)).tensors]
  runs = ((tuple(names[:2]), (), 2), ((), (), 2))
  planned = apply.apply_plan(_loss(), (), (), None, runs)  # pylint: disable=protected-access
  closed = jax.make_jaxpr(jax.grad(planned))(*ARGS)
  assert sum(e.primitive.name == "scan" for e in closed.jaxpr.eqns) >= 2
  assert float(jax.jit(planned)(*ARGS)) == pytest.approx(float(jax.jit(_loss())(*ARGS)),
                                                         rel=1e-6)
  _assert_within_the_originals_error(_loss(), planned, *ARGS)

  def backwards(params, x):  # the layers scanned last to first
    return jnp.mean(jax.lax.scan(_layer(False), x, params, reverse=True)[0] ** 2)
  planned = apply.apply_plan(backwards, (), (), None, runs)  # pylint: disable=protected-access
  _assert_within_the_originals_error(backwards, planned, *ARGS)
  report = dataclasses.replace(invact_jax.plan(_loss(), *ARGS, budget="1GiB").report,
                               as_written=False, runs=runs)
  assert "2 runs of layers (2, 2)" in str(report)
