"""``invert(fn, fallback="temp")``: the sites whose conversion would raise the gradient's
compiled temp above the unconverted program's, found by compiling and measuring."""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from invact_jax import memory
from invact_jax import targets
from invact_jax.convert import graph as _graph
from invact_jax.convert import _pass

__all__ = ["Choice", "gradient_temp", "choose"]


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``fallback="temp"`` decided: sites left alone, activation sites recomputed from
  their input (``jax.checkpoint`` of their own equations), and whether the floor pass runs."""
  skip: frozenset = frozenset()
  recompute: frozenset = frozenset()
  floor: bool = True


def gradient_temps(programs, structs: list, positions) -> tuple[int, ...]:
  """:func:`gradient_temp` of each closed jaxpr in ``programs`` (as they are), the figures
  of the default compile's buffers: measured at :func:`memory.analysis_options`, and again at
  :func:`memory.exact_analysis_options` where two are :func:`memory.undecided`, so that
  their order is the default compile's.

  Each program is compiled in a thread of its own while the next one is traced (XLA's compile
  releases the GIL; the tracing, which reads thread-local settings, stays in this thread):
  on a GPT-2 layer, half of a measurement is tracing its gradient."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=len(programs)) as pool:
    lowered, pending = [], []
    for c in programs:
      lowered.append(_lowered_gradient(c, None, structs, positions, None))
      pending.append(pool.submit(_compiled_temp, lowered[-1], False))
    temps = tuple(f.result() for f in pending)
    if any(memory.undecided(a, b) for i, a in enumerate(temps) for b in temps[i + 1:]):
      temps = tuple(pool.map(lambda low: _compiled_temp(low, True), lowered))
  return temps


def gradient_temp(closed, graph: _graph.Graph, structs: list, positions,
                  opts: _pass.Options | None, exact: bool = False) -> int:
  """Compiled temp bytes of the pullback of ``closed`` (``graph``, its flattened form,
  converted with ``opts``; None: as it is) at ``structs`` with respect to its inputs at
  ``positions``, ones as the floating outputs' cotangents; at :func:`memory.analysis_options`
  (``exact``: :func:`memory.exact_analysis_options`)."""
  return _compiled_temp(_lowered_gradient(closed, graph, structs, positions, opts), exact)


def _lowered_gradient(closed, graph: _graph.Graph | None, structs: list, positions,
                      opts: _pass.Options | None):
  """The lowered pullback :func:`gradient_temp` measures (``graph`` read only with
  ``opts``)."""
  def f(a, *d):
    full = list(a)
    for i, v in zip(positions, d):
      full[i] = v
    outs = (jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *full) if opts is None
            else _pass.run(graph, full, opts))
    return [o for o in outs if jnp.issubdtype(o.dtype, jnp.inexact)]

  # The cotangents are arguments: as constants (ones) XLA folds the reductions of their
  # broadcasts at compile time, 3.5 s each for a GPT-2 layer's bias gradients.  Their shapes
  # are the program's outputs' (converting changes no output).
  cotangents = _graph.shape_structs([a for a in closed.out_avals
                                     if jnp.issubdtype(a.dtype, jnp.inexact)])

  def step(a, cts):
    _, pull = jax.vjp(lambda *d: f(a, *d), *[a[i] for i in positions])
    return pull(cts)  # the gradients alone, as jax.grad's
  # Measured as one device's program of the current target, outside the mesh the caller may
  # be tracing under (explicit shardings): the shardings are not part of the structs, and the
  # equations re-derive them from their inputs.
  target = targets.current().one()
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return target, target.lower(step, list(structs), cotangents)


def _compiled_temp(lowered, exact: bool) -> int:
  """The compiled temp of ``lowered`` (a ``(target, lowered)`` pair of
  :func:`_lowered_gradient`)."""
  target, lowered = lowered
  with targets.compiling_for(target):
    options = memory.exact_analysis_options() if exact else memory.analysis_options()
  analysis = target.compile(lowered, options).memory_analysis()
  return int(analysis.temp_size_in_bytes) if analysis is not None else 0


def choose(closed, positions, make_opts: Callable[[Choice], _pass.Options]) -> Choice:
  """The sites to change so that the gradient's compiled temp is at most the unconverted
  program's: none if inverting all of them already is; else each site's alternative (an
  activation recomputed from its input, another op left alone), in the order of the temp it
  gives when taken alone, until it is; then the recomputed activations left alone too, in the
  same order; at worst the program as it is (every site left alone, no floor pass)."""
  graph, structs = _graph.flatten(closed), _graph.shape_structs(closed.in_avals)

  def temp(choice: Choice | None, opts: _pass.Options | None = None, exact: bool = False) -> int:
    if choice is not None and opts is None:
      opts = make_opts(choice)
    return gradient_temp(closed, graph, structs, positions, opts, exact)
  original, exact_original = temp(None), []

  def fits(choice: Choice, opts: _pass.Options | None = None) -> bool:
    """Whether ``choice``'s temp is at most the original's, as the default compile has them
    (measured again exactly where the two lie within :func:`memory.analysis_excess`)."""
    t = temp(choice, opts)
    if not memory.undecided(t, original):
      return t <= original
    if not exact_original:
      exact_original.append(temp(None, exact=True))
    return temp(choice, exact=True) <= exact_original[0]  # (new options: a run numbers its sites)
  everything = make_opts(Choice())
  if fits(Choice(), everything):
    return Choice()
  recomputable = list(everything.recomputable)  # per site, counted by the measurement above

  def alternative(choice: Choice, i: int) -> Choice:
    if recomputable[i]:
      return dataclasses.replace(choice, recompute=choice.recompute | {i})
    return dataclasses.replace(choice, skip=choice.skip | {i})
  alone = {i: temp(alternative(Choice(), i)) for i in range(len(recomputable))}
  order = sorted(alone, key=lambda i: (alone[i], i))
  choice = Choice()
  for i in order:
    choice = alternative(choice, i)
    if fits(choice):
      return choice
  for i in (i for i in order if recomputable[i]):
    choice = dataclasses.replace(choice, skip=choice.skip | {i}, recompute=choice.recompute - {i})
    if fits(choice):
      return choice
  return Choice(frozenset(range(len(recomputable))), frozenset(), floor=False)
