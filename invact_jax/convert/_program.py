"""``invert(fn)``: the program-level conversion.

``fn`` is traced to a jaxpr and flattened to a graph (:mod:`._graph`); the rule table
(:data:`._pass.RULES`: the LM head, norms, softmaxes, activation forms) finds every op by its
computation, whatever Python object the model called, and each match runs as a
``jax.custom_vjp`` whose forward is the *program's own equations* (so the forward output is bit
for bit the unconverted one, the LM head's chunked log-sum-exp aside) and whose residuals and
backward are invact_jax's; the floor pass (:mod:`._fusion`) then lets matmuls keep what their
neighbours keep.  Nested ``jit``, ``scan``, ``cond``, ``checkpoint`` and ``shard_map`` bodies
are converted through the same pass; what cannot be rewritten soundly (a match whose
intermediate values are used elsewhere, ``custom_jvp``/``custom_vjp`` functions — but a
call an LM head's cross-entropy is computed through, which the head takes whole —
``while`` loops) is left alone and reported.  ``fallback="temp"`` (:mod:`._fallback`) measures.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from invact_jax import targets
from invact_jax.convert import _fallback
from invact_jax.convert import graph as _graph
from invact_jax.convert import _pass
from invact_jax.convert._report import ConversionReport
from invact_jax.ops import _implementation
from invact_jax.ops.activations import api as _act_api
from invact_jax.ops.activations import registry
from invact_jax.ops.norms import api as _norm_api

__all__ = ["invert", "ConversionReport"]


def _names(only, norms: bool) -> frozenset:
  """The public names ``invert`` converts under ``only`` and ``norms`` (aliases as their function),
  or one line naming an unknown one."""
  public = tuple(registry.PUBLIC) + _pass.kinds()
  if only is None:
    names = set(registry.PUBLIC) | set(_pass.kinds(norms))
  else:
    only = (only,) if isinstance(only, str) else tuple(only)
    unknown = [n for n in only if n not in public]
    if unknown:
      raise ValueError(f"invact_jax.invert: argument `only`: cannot convert {unknown}; choose "
                       f"from {sorted(public)}")
    names = set(only)
  return frozenset(registry.PUBLIC[n][0].public if n in registry.PUBLIC else n for n in names)


def _is_array(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _trace(fn, args, kwargs):
  """``fn(*args, **kwargs)`` as a jaxpr of its array leaves: ``(closed, vals, leaves, dyn,
  out)``; ``dyn`` the leaves' positions that are arrays (traced), ``out`` how to rebuild the
  output (JAX arrays are the program's outputs; anything else — a NumPy array, which cannot
  depend on the traced inputs, a string, None in has_aux — is returned as the function
  returned it, its dtype included)."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  out = {}

  def flat(*vals):
    ls = list(leaves)
    for i, v in zip(dyn, vals):
      ls[i] = v
    a, k = jax.tree.unflatten(tree, ls)
    out_leaves, out_tree = jax.tree.flatten(fn(*a, **k))
    arrays = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.Array)]
    out.update(tree=out_tree, leaves=out_leaves, arrays=arrays)
    return [out_leaves[i] for i in arrays]
  vals = [leaves[i] for i in dyn]
  return jax.make_jaxpr(flat)(*vals), vals, leaves, dyn, out


def _rebuild(out: dict, outs):
  leaves = list(out["leaves"])
  for i, v in zip(out["arrays"], outs):
    leaves[i] = v
  return jax.tree.unflatten(out["tree"], leaves)


def _positions(closed, args, leaves, dyn, argnums) -> list:
  """The program inputs of the floating leaves of the positional arguments ``argnums``."""
  if max(argnums) >= len(args):
    raise ValueError(f"invact_jax.invert: argument `argnums`: {max(argnums)} is out of range "
                     f"for {len(args)} positional arguments")
  ends = np.cumsum([len(jax.tree.leaves(a)) for a in args])
  wanted = {j for k in argnums for j in range(ends[k] - len(jax.tree.leaves(args[k])), ends[k])}
  return [p for p, i in enumerate(dyn) if i in wanted and jnp.issubdtype(
      closed.in_avals[p].dtype, jnp.inexact)]


def _checked_options(fallback, argnums) -> tuple:
  """``argnums`` as a tuple, after one line for a ``fallback`` or ``argnums`` not of its kind."""
  if fallback not in (None, "temp"):
    raise ValueError(f"invact_jax.invert: argument `fallback`: expected None or 'temp', got "
                     f"{fallback!r}")
  argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  if not argnums or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in argnums):
    raise ValueError(f"invact_jax.invert: argument `argnums`: expected non-negative ints, "
                     f"got {argnums!r}")
  return argnums


class _Conversion:
  """One ``invert(fn, ...)``: its options, and ``fallback="temp"``'s choices per trace
  signature."""

  def __init__(self, fn, names, implementation, floor, fallback, argnums,
               measure_remat=True, device=None):
    self.fn, self.names, self.floor, self.fallback, self.argnums = (
        fn, names, floor, fallback, argnums)
    self.device = device
    self.measure_remat = measure_remat
    self.impls = {family: _implementation.resolve(implementation, op="invert",
                                                  implementations=table)
                  for family, table in (("activation", _act_api.IMPLEMENTATIONS),
                                        ("norm", _norm_api.IMPLEMENTATIONS))}
    self.cache: dict = {}

  def options(self, report: ConversionReport, choice: _fallback.Choice) -> _pass.Options:
    return _pass.Options(self.names, self.impls, report, bool(self.floor) and choice.floor,
                         choice.skip, choice.recompute, measure_remat=self.measure_remat)

  def choose(self, closed, args, leaves, dyn, report: ConversionReport) -> _fallback.Choice:
    """``fallback="temp"``'s choice for this trace signature (measured once), else none."""
    if self.fallback != "temp":
      return _fallback.Choice()
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
      # A shard_map body's program is not one that compiles on its own (its values vary over
      # the manual axes): nothing to measure, every site is converted; said.
      report.left_alone.append(("fallback", "", "fallback='temp' does not measure inside a "
                                "shard_map body: every site converted"))
      return _fallback.Choice()
    positions = _positions(closed, args, leaves, dyn, self.argnums)
    key = (str(closed), tuple(positions))
    if key not in self.cache:
      self.cache[key] = _fallback.choose(
          closed, positions, lambda c: self.options(ConversionReport(), c)) \
          if positions else _fallback.Choice()
    if self.floor and not self.cache[key].floor:
      report.left_alone.append(("floor pass", "", "its matmul fusions raised the gradient's "
                                "compiled temp above the unconverted program's even with "
                                "every site left alone (fallback='temp')"))
    return self.cache[key]

  def __call__(self, args, kwargs) -> tuple:
    """``(fn's output converted, the report)``, traced and measured for ``device`` (None: the
    current target)."""
    with targets.compiling_for(self.device):
      return self._converted(args, kwargs)

  def _converted(self, args, kwargs) -> tuple:
    """``fn``'s output converted and the report: ``fallback``'s choice, the pass, and, where
    converted ``jax.checkpoint`` bodies sit in a loop and the whole program's check says so, the
    pass again with them as written."""
    closed, vals, leaves, dyn, out = _trace(self.fn, args, kwargs)
    report = ConversionReport()
    choice = self.choose(closed, args, leaves, dyn, report)
    opts = self.options(report, choice)
    outs = _pass.run(_graph.flatten(closed), vals, opts)
    why = self.remat_check(closed, args, leaves, dyn, choice) if opts.remat_converted else ""
    if why:  # converted again, the checkpoint bodies as written
      report = ConversionReport()
      opts = dataclasses.replace(self.options(report, choice), remat_as_written=why)
      outs = _pass.run(_graph.flatten(closed), vals, opts)
    return _rebuild(out, outs), report

  def remat_check(self, closed, args, leaves, dyn, choice: _fallback.Choice) -> str:
    """Where the program's ``jax.checkpoint`` bodies in a loop are converted (each lowered its
    own gradient's temp, :func:`._pass._remat_body`), the whole program's gradient with respect
    to ``argnums`` compiled converted and as written (once per trace signature): the reason
    to leave the bodies as written where converting raised it (a scan of them can hold more
    than one call does: XLA schedules the loop's backward differently), else ``""``.  Not
    with ``fallback="temp"``, which measures the whole program already, nor inside a
    ``shard_map`` body (not a program of its own)."""
    if (self.fallback == "temp" or not self.measure_remat
        or getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())):
      return ""
    positions = _positions(closed, args, leaves, dyn, self.argnums)
    key = ("remat", str(closed), tuple(positions), targets.current().key)
    if key not in self.cache:
      graph, structs = _graph.flatten(closed), _graph.shape_structs(closed.in_avals)
      probe = self.options(ConversionReport(), choice)
      converted = jax.make_jaxpr(lambda *a: _pass.run(graph, a, probe))(*structs)
      self.cache[key] = ""
      if positions:
        ours, theirs = _fallback.gradient_temps((converted, closed), structs, positions)
        if ours > theirs:
          self.cache[key] = (
              "inside jax.checkpoint its policy decides what is kept: converting the "
              f"checkpoint bodies raised the program's gradient's compiled temp ({ours:,} vs "
              f"{theirs:,} bytes); left as written")
    return self.cache[key]


def invert(fn: Callable[..., Any], *, only: Iterable[str] | None = None, norms: bool = True,
           implementation: _implementation.ImplementationLike = None, floor: bool = True,
           fallback: Literal["temp"] | None = None,
           argnums: int | tuple[int, ...] = 0,
           device: str | targets.Target | None = None) -> Callable[..., Any]:
  """Program transformation: ``fn`` with its activations, norms and softmaxes inverted.

  The recommended way to apply invact_jax to code you did not write (see also
  :func:`invact_jax.inverted`, the attribute swap, for code that looks functions up by name).

  ``fn`` is traced; the activations (every :mod:`invact_jax` activation), LayerNorm/RMSNorm
  and last-axis softmax in the traced program are recognized by their computation (whatever
  Python object computed them: ``jax.nn`` functions, ``functools.partial`` objects, entries of
  a dict built at import, module fields, Flax/Equinox/transformers layers) and run as
  output-saving ``custom_vjp`` s.  The forward output is bit for bit the original one.
  Differentiate the converted function: ``jax.grad(invert(loss))``; array arguments are
  traced, other arguments are passed through as static values.

  Args:
    fn: the function to convert (typically the loss).
    only: public names to convert (``"gelu"``, ``"silu"``, ..., ``"layer_norm"``,
      ``"rms_norm"``, ``"softmax"``); default: all.
    norms: with ``only=None``, also convert norms and softmaxes (default True; False leaves
      them and converts the activations and the other rules' ops, the LM head's).
    implementation: the backward's implementation for activations and norms (None/"xla",
      "pallas", "triton"; see :class:`invact_jax.Implementation`).
    floor: also keep each tensor once (default True): a norm feeding matmuls keeps only
      ``xhat`` and ``rstd`` for both; a matmul whose operand is an elementwise function of
      values kept anyway (a GLU's product, a reshaped attention output, a bfloat16 value
      cast to float32) keeps those values instead.  False converts the ops alone.
    fallback: None (default) converts every site found; ``"temp"`` changes, site by site,
      the conversions that make the gradient's compiled temp larger than the unconverted
      program's (XLA can fuse a converted program worse, e.g. XLA:CPU with exact GELU): at
      each new trace signature it compiles the gradient with respect to ``argnums`` of the
      unconverted and the converted program (as one device's program), and while the
      converted one needs more, changes the sites whose change gives the least temp (each
      measured alone): an activation is recomputed from its input (``jax.checkpoint`` of
      its own equations: it keeps its input where inverting keeps its output and a bit per
      element), a norm or softmax is left alone; then recomputed activations are left
      alone too; at worst the floor pass is dropped (the program as it is).  Costs two
      compilations and up to three more per site, once per signature; the report names
      each site recomputed or left alone.  Inside a
      ``shard_map`` body it measures nothing and converts every site (the report says so):
      apply ``invert`` outside the ``shard_map`` there.
    argnums: the positional arguments the gradient is taken with respect to (their floating
      leaves), for ``fallback="temp"``.
    device: the target the converted program is for (:func:`invact_jax.targets.resolve`:
      ``"h100"``, ...; default: the current target, this machine unless the call is inside
      :func:`invact_jax.targets.compiling_for` or :func:`invact_jax.memory.compiled_for`):
      the compiles that decide (a ``jax.checkpoint`` body's check, ``fallback="temp"``)
      are that device's compiler's, and ``fn`` is traced as for it (its implementation
      choices: cuDNN's attention, the LM head's tiles).  A GPU is compiled for without one
      (docs/deviceless.md).

  Returns:
    The converted function; after each call (or trace) its ``last_report``
    (:class:`ConversionReport`) says what was converted and what was left alone, and why.

  Example:
    >>> import functools, jax, jax.numpy as jnp, invact_jax
    >>> act = functools.partial(jax.nn.gelu, approximate=False)   # captured: no attribute swap helps
    >>> def loss(w, x):
    ...   return jnp.sum(act(x @ w) ** 2)
    >>> inv = invact_jax.invert(loss)
    >>> g = jax.grad(inv)(jnp.ones((4, 8)), jnp.ones((2, 4)))
    >>> inv.last_report.replaced
    {'gelu': 1}
  """
  if not callable(fn):
    raise TypeError(f"invact_jax.invert: argument `fn` must be callable, got {type(fn).__name__}")
  if device is not None:
    targets.resolve(device)  # (a bad name is an error now, not at the first call)
  return _wrapped(fn, _Conversion(fn, _names(only, norms), implementation, floor, fallback,
                                  _checked_options(fallback, argnums), device=device))


def inverted_for_plan(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``invert(fn)`` as :func:`invact_jax.plan` takes it for an operator variant: the bodies
  of the program's ``jax.checkpoint`` s converted without compiling them both ways (the plan
  replaces the layer's policy, the premise of that measurement, and compiles the programs it
  compares)."""
  return _wrapped(fn, _Conversion(fn, _names(None, True), None, True, None, (0,),
                                  measure_remat=False))


def _wrapped(fn, conversion: _Conversion) -> Callable[..., Any]:
  """``fn`` converted per call by ``conversion``, its report as ``last_report`` and the original as
  ``invact_jax_original`` (what the floor audit measures against)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    out, wrapped.last_report = conversion(args, kwargs)
    return out

  wrapped.last_report = None
  wrapped.invact_jax_original = fn  # what the floor audit measures against
  return wrapped
