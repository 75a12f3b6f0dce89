"""One run's model, optimizer and compiled steps (:class:`Trainer`): data parallelism or
FSDP over a mesh, the memory planner's plan where a budget is given, and the dropout key of
each step (``fold_in(key(seed + 1), step)``)."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import invact_jax
from invact_jax import memory, planner
from models import text, vit
from models.training import checkpoints
from models.training import config
from models.training import data as data_lib
from models.training import distributed
from models.training import errors


def dropout_key(seed: int, step: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed + 1), step)


def plan_loss(loss: Callable[..., Any], example_args: tuple, budget: int):
  """``loss`` (``(mean loss, accuracy)`` of ``(params, x, y, key)``) planned by
  :func:`invact_jax.plan` so that its gradient step's compiled temp fits ``budget`` bytes at
  ``example_args`` (one device's batch): what each layer of its scan keeps, recomputes or
  offloads, with ``invact_jax.invert`` of it as an operator variant; raises ConfigError if
  nothing fits (the message names the minimum)."""
  try:
    return invact_jax.plan(loss, *example_args, budget=budget, has_aux=True, convert=True)
  except planner.InfeasibleBudget as e:
    raise errors.ConfigError(f"--memory-budget: {e}") from None


@dataclasses.dataclass
class Trainer:
  """Model, optimizer and compiled steps for one config on a data-parallel mesh."""
  cfg: config.TrainConfig
  dataset: data_lib.Dataset
  devices: int | None = None  # data-parallel over the first N local devices (None: all)
  shard_params: bool = False  # FSDP: parameters and optimizer state split over the data axis

  def __post_init__(self):
    devs = jax.devices()  # every process's devices (multi-process: a global mesh)
    if self.devices is not None and jax.process_count() > 1:
      raise errors.ConfigError("devices: a multi-process run uses every process's devices")
    if self.devices is not None:
      if not 1 <= self.devices <= len(devs):
        raise errors.ConfigError(f"devices must be in [1, {len(devs)}], got {self.devices}")
      devs = devs[:self.devices]
    self.mesh = Mesh(np.array(devs), ("data",))
    config.validate(self.cfg, self.dataset, self.mesh.size)
    self.model_cfg = self.cfg.model_config(self.dataset)
    if self.cfg.memory_budget is not None:
      self.model_cfg = self.model_cfg.replace(scan_layers=True)  # the planner's layer loop
    module = text.TextTransformer if self.dataset.modality == "text" else vit.ViT
    model = module(self.model_cfg, rngs=nnx.Rngs(self.cfg.seed))
    self.graphdef, params = nnx.split(model, nnx.Param)
    self.objective = self._mean_loss
    self.plan = None
    if self.cfg.memory_budget is not None:
      self.objective = plan_loss(self._mean_loss, (params, *self._one_device_batch()),
                                 self.cfg.memory_budget)
      self.plan = self.objective.report
      # each process plans its own copy of the step: all must run the same program
      distributed.agree({k: getattr(self.plan, k) for k in (
          "configuration", "keep", "offload", "policy", "as_written")}, topic="plan",
          how="planned differently",
          advice="the planner measures by compiling: run every process on the same kind of "
                 "device and software")
    self.total = self.cfg.total_steps(self.dataset.x_train.shape[0])
    self.lr = config.schedule(self.cfg, self.total)
    self.tx = optax.adamw(self.lr, weight_decay=self.cfg.weight_decay)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    self.param_sharding = jax.tree.map(self._state_sharding, params)
    self.params = jax.device_put(params, self.param_sharding)
    opt_state = self.tx.init(self.params)
    self.opt_sharding = jax.tree.map(self._state_sharding, opt_state)
    self.opt_state = jax.device_put(opt_state, self.opt_sharding)
    self.step = 0
    # The state keeps its layout across steps (sharding propagation alone may pick another).
    self.train_step_fn = jax.jit(
        self._train_step_fn, donate_argnums=(0, 1),
        out_shardings=(self.param_sharding, self.opt_sharding, self.replicated, self.replicated))
    self._eval_step = jax.jit(self._eval_step_fn)

  def _state_sharding(self, leaf) -> NamedSharding:
    """Replicated, or with ``shard_params`` split over the data axis along the leaf's largest
    dimension that the mesh divides (FSDP / ZeRO-3: XLA gathers each weight where a step
    uses it and reduce-scatters its gradient; the batch stays split as before).  A leaf with
    no such dimension (a step counter) stays replicated."""
    shape = getattr(leaf, "shape", ())
    n = self.mesh.size
    dims = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not self.shard_params or n == 1 or not dims:
      return self.replicated
    axis = max(dims, key=lambda i: (shape[i], -i))
    return NamedSharding(self.mesh, P(*([None] * axis), "data"))

  def state_bytes_per_device(self) -> int:
    """Bytes of parameters + optimizer state one device holds."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.state()))

  # -- compiled functions
  def _loss(self, params, x, y, key):
    """(mean cross-entropy, accuracy) of one batch."""
    # FSDP: gather the weights, not the activations (left alone, sharding propagation may
    # split a layer's output features over the devices and all-gather its batch instead:
    # measured on the digits ViT, its input images, logits and attention scores).
    params = jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: self.replicated, params))
    return self.objective(params, x, y, key)

  def _mean_loss(self, params, x, y, key):
    """(mean cross-entropy, accuracy) of one batch, on one device (what a plan plans)."""
    loss, correct = self._losses(params, x, y, key)
    return loss.mean(), jnp.mean(correct)

  def _one_device_batch(self) -> tuple:
    """Shape structs of ``(x, y, key)`` for one device's share of a batch."""
    d, b = self.dataset, self.cfg.batch_size // self.mesh.size
    struct = lambda a: jax.ShapeDtypeStruct((b, *a.shape[1:]), a.dtype)  # noqa: E731
    return struct(d.x_train), struct(d.y_train), dropout_key(self.cfg.seed, 0)

  def _losses(self, params, x, y, key):
    """Per-example (per-position for text) cross-entropy and correctness; a text model's
    own ``loss`` (its head_mode: the logits never materialized when chunked)."""
    model = nnx.merge(self.graphdef, params)
    if hasattr(model, "loss"):
      return model.loss(x, y, key)
    logits = model(x, key)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y),
            jnp.argmax(logits, -1) == y)

  def _train_step_fn(self, params, opt_state, x, y, key):
    (loss, acc), grads = jax.value_and_grad(self._loss, has_aux=True)(params, x, y, key)
    grads = jax.lax.with_sharding_constraint(grads, self.param_sharding)  # reduce-scatter
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, acc

  def _eval_step_fn(self, params, x, y, valid):
    loss, correct = self._losses(params, x, y, None)
    valid = valid.reshape(valid.shape + (1,) * (y.ndim - 1))  # text: every position of a window
    return jnp.sum(jnp.where(valid, loss, 0.0)), jnp.sum(correct & valid)

  # -- host-side helpers
  def _sharded(self, shape, rows: Callable[[slice], np.ndarray]) -> jax.Array:
    """A global array split over the data axis; each process builds only the rows of its own
    devices (``rows(slice)``), so every process reads only its part of a global batch."""
    return jax.make_array_from_callback(
        tuple(shape), self.batch_sharding, lambda index: rows(index[0])[(slice(None),) + index[1:]])

  def batch(self, step: int):
    """The global batch of ``step`` (same data order for any number of processes/devices)."""
    b, d = self.cfg.batch_size, self.dataset
    idx = data_lib.batch_indices(self.cfg.seed, step, d.x_train.shape[0], b)
    shift = 0
    if d.modality == "image":
      shift = d.image_size // 8 if self.cfg.shift is None else self.cfg.shift
    offsets = data_lib.shift_offsets(shift, self.cfg.seed, step, b) if shift > 0 else None
    def x_rows(sl):
      x = d.x_train[idx[sl]]
      return x if offsets is None else data_lib.random_shift(x, shift, self.cfg.seed, step, offsets[:, sl])
    x = self._sharded((b, *d.x_train.shape[1:]), x_rows)
    y = self._sharded((b, *d.y_train.shape[1:]), lambda sl: d.y_train[idx[sl]])
    return x, y

  def train_step(self, step: int):
    x, y = self.batch(step)
    key = dropout_key(self.cfg.seed, step)
    self.params, self.opt_state, loss, acc = self.train_step_fn(self.params, self.opt_state, x, y, key)
    self.step = step + 1
    return loss, acc

  def gradients(self, step: int = 0):
    """(loss, gradient of the loss w.r.t. the parameters) on the batch and dropout key of
    ``step``, at the current parameters (no update)."""
    x, y = self.batch(step)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: self._loss(p, x, y, dropout_key(
        self.cfg.seed, step))[0]))
    return loss_and_grad(self.params)

  def activation_bytes(self) -> int:
    """Bytes autodiff keeps for the loss's backward besides its arguments (the activations),
    on the first batch."""
    x, y = self.batch(0)
    kept = memory.residuals(lambda p: self._loss(p, x, y, dropout_key(self.cfg.seed, 0))[0],
                            self.params)
    return sum(r.bytes for r in kept if not r.is_argument)

  def compiled_memory(self, measuring: bool = False) -> memory.CompiledMemory:
    """The train step's compiled memory (``measuring``: compiled as the planner measures,
    :func:`invact_jax.memory.analysed`: faster on XLA:CPU, the temp at most
    :func:`invact_jax.memory.analysis_excess` above the default compile's)."""
    x, y = self.batch(0)
    measure = memory.analysed if measuring else memory.compiled
    return measure(self.train_step_fn, self.params, self.opt_state, x, y,
                   dropout_key(self.cfg.seed, 0))

  def device_peak(self) -> dict[str, int]:
    """One train step on copies of the state, with the allocator's figures (GPU)."""
    x, y = self.batch(0)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the step donates its state)
    return memory.device_peak(self.train_step_fn, copy(self.params), copy(self.opt_state), x, y,
                              dropout_key(self.cfg.seed, 0))

  def evaluate(self) -> dict[str, float]:
    """Mean loss and accuracy over the test set (per image, or per byte of text)."""
    x, y = self.dataset.x_test, self.dataset.y_test
    b = self.cfg.batch_size
    loss_sum, correct = 0.0, 0
    for start in range(0, x.shape[0], b):
      xb, yb = x[start:start + b], y[start:start + b]
      valid = np.ones(b, bool)
      if xb.shape[0] < b:  # pad the last batch to keep one compiled shape
        pad = b - xb.shape[0]
        valid[b - pad:] = False
        xb = np.concatenate([xb, np.zeros((pad, *xb.shape[1:]), xb.dtype)])
        yb = np.concatenate([yb, np.zeros(pad, yb.dtype)])
      put = lambda a: self._sharded(a.shape, lambda sl, a=a: a[sl])  # noqa: E731
      l, c = self._eval_step(self.params, put(xb), put(yb), put(valid))
      loss_sum += float(l)
      correct += int(c)
    n = y.size  # images, or predicted bytes
    return {"test_loss": loss_sum / n, "test_acc": correct / n}

  # -- checkpoints (orbax)
  def state(self) -> dict[str, Any]:
    return {"params": self.params, "opt_state": self.opt_state}

  def restore(self, manager, workdir: pathlib.Path) -> int:
    """Restore the newest checkpoint that reads and verifies (:func:`checkpoints.restore`)."""
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state())
    step, restored = checkpoints.restore(manager, workdir, abstract)
    self.params, self.opt_state = restored["params"], restored["opt_state"]
    self.step = step
    return step
