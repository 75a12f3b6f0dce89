"""What every op family shares: input checks, compute dtype, the first-order guard, vma.

One definition each, used by activations, norms, softmax and dropout, so an error names the
argument the same way everywhere and every family refuses higher-order derivatives alike.
"""
from __future__ import annotations

import functools
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _shapes

__all__ = ["FLOAT_DTYPES", "float_array", "float_dtype", "static_scalar", "static_axis",
           "compute_dtype", "first_order_only", "first_order_message", "cotangent_like",
           "varying_like", "explicit_sharding"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_FLOATS_TEXT = "float16, bfloat16, float32 or float64"


def float_dtype(fn: str, arg: str, dtype) -> np.dtype:
  """``dtype`` as a NumPy dtype; a TypeError naming ``fn``'s argument ``arg`` if not floating."""
  try:
    d = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a floating-point dtype "
                    f"({_FLOATS_TEXT}), got {dtype!r}") from e
  if d.name not in FLOAT_DTYPES:
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a floating-point dtype "
                    f"({_FLOATS_TEXT}), got {d}")
  return d


def float_array(fn: str, arg: str, x) -> jax.Array:
  """``x`` as a floating-point array, or a TypeError naming the argument.

  Python floats are accepted (as ``jax.nn`` does); Python ints, bools and complex numbers
  and integer/bool/complex arrays are refused rather than silently promoted.
  """
  if isinstance(x, (bool, int, complex)) and not isinstance(x, float):
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a floating-point array "
                    f"({_FLOATS_TEXT}), got Python {type(x).__name__}")
  if not hasattr(x, "dtype"):
    try:
      x = jnp.asarray(x)
    except TypeError as e:
      raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a floating-point array "
                      f"({_FLOATS_TEXT}), got {type(x).__name__}") from e
  if jnp.dtype(x.dtype).name not in FLOAT_DTYPES:
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a floating-point array "
                    f"({_FLOATS_TEXT}), got dtype {jnp.dtype(x.dtype)}")
  return jnp.asarray(x)


def static_scalar(fn: str, arg: str, value) -> float:
  """A concrete real number (Python or NumPy, or a concrete 0-d array) as a float.

  The backward passes are specialised on such options at trace time, so a traced value
  or a non-number is a TypeError naming the argument.
  """
  if isinstance(value, (bool, np.bool_)) or isinstance(value, (str, bytes)):
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a real number, got "
                    f"{type(value).__name__} {value!r}")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a concrete number (a Python or "
                    f"NumPy scalar), got a traced value; the backward pass is specialised on it "
                    f"at trace time, so pass it as a static value")
  try:
    arr = np.asarray(value)
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a real number, got "
                    f"{type(value).__name__}") from e
  if arr.shape != () or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be a real number (a scalar), got "
                    f"{type(value).__name__} of shape {arr.shape} and dtype {arr.dtype}")
  return float(arr)


def static_axis(fn: str, arg: str, axis, ndim: int) -> int:
  """An axis (Python or NumPy integer) normalized to ``[0, ndim)``; a clear error otherwise."""
  if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (numbers.Integral, np.integer)):
    raise TypeError(f"invact_jax.{fn}: argument `{arg}` must be an integer, got "
                    f"{type(axis).__name__} {axis!r}")
  a = int(axis)
  if not -ndim <= a < ndim:
    raise ValueError(f"invact_jax.{fn}: argument `{arg}` = {a} is out of range for an array "
                     f"with {ndim} dimensions")
  return a % ndim


def compute_dtype(dtype) -> np.dtype:
  """The dtype the backward math runs in: float64 for float64 data, float32 otherwise."""
  return np.dtype(np.float64) if jnp.dtype(dtype) == jnp.float64 else np.dtype(np.float32)


def first_order_message(name: str) -> str:
  return (f"invact_jax.{name}: higher-order derivatives are not supported. Its backward pass "
          "reconstructs the derivative from what the forward kept (the output, not the "
          "input; that is what saves the memory), and the derivative of that reconstruction "
          "is not the second derivative of the op. Use invact_jax."
          f"{name}_reference where you need second derivatives (e.g. Hessians); forward-mode "
          "jax.jvp is not supported either.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _guarded(name: str, fn: Callable[..., Any], *args):
  return fn(*args)


@_guarded.defjvp
def _guarded_jvp(name, fn, primals, tangents):
  del fn, primals, tangents
  raise NotImplementedError(first_order_message(name))


def first_order_only(name: str, fn: Callable[..., Any], *args):
  """``fn(*args)``, refusing to be differentiated (the one guard of every op's backward).

  Applied to what a backward pass computes from its residuals, so differentiating the
  backward (a second derivative) raises a NotImplementedError that says why, while a
  quantity with no tangent (e.g. relu's 0/1 derivative) passes as JAX's own would.
  """
  return _guarded(name, fn, *args)


def axis_size(name) -> int:
  """The size of the mesh axis (or tuple of axes) ``name`` inside ``shard_map``.

  Raises:
    NameError: ``name`` is not an axis of the enclosing ``shard_map`` (JAX's own error).
  """
  if hasattr(jax.lax, "axis_size"):
    return int(jax.lax.axis_size(name))
  return int(jax.lax.psum(1, name))  # JAX before axis_size: the size, as a Python int


#: ``a`` made varying over the manual mesh axes ``refs`` vary over (inside ``shard_map``, a
#: loop's initial carry must have its body's type); ``a`` itself elsewhere.
varying_like = _shapes.varying_like


def explicit_sharding(like, operand):
  """An ``out_sharding=`` with ``like``'s partition spec on ``operand``'s mesh when that mesh
  has explicit axes (where JAX needs it: a contraction over a sharded axis), else None."""
  mesh = getattr(getattr(jax.typeof(operand), "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ())
  if not getattr(mesh, "axis_names", ()) or not any("Explicit" in str(t) for t in types):
    return None
  spec = getattr(getattr(jax.typeof(like), "sharding", None), "spec", None)
  return jax.sharding.NamedSharding(mesh, spec if spec is not None else
                                    jax.sharding.PartitionSpec())


def cotangent_like(ct, primal):
  """``ct`` summed over the manual mesh axes it varies over and ``primal`` does not.

  Inside ``shard_map`` a replicated parameter (a norm's scale) gets per-shard gradient
  contributions; a custom_vjp backward must return them summed (as JAX's own transpose
  of the implicit broadcast does), with the parameter's type.
  """
  if ct is None:
    return None
  extra = tuple(sorted(_shapes.varying_axes(ct) - _shapes.varying_axes(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


def read_apart(tree):
  """``tree`` itself (its floating-point arrays read where XLA:CPU's fusion cannot recompute
  them; on other platforms as they are).

  A backward rule reads its residuals through this.  Otherwise XLA:CPU may fuse the cheap
  last step that produced a residual (an exact GELU's ``x * Phi(x)`` after its erfc pieces, a
  norm's ``xhat``) into the backward's own fusion, which then keeps that step's inputs alive
  until the backward instead of the residual (a hand-written exact-GELU MLP converted by
  ``invert``: 3.08 MB of compiled temp, 2.56 MB unconverted, 1.33 MB read apart).
  ``jax.lax.optimization_barrier`` does not stop it (XLA:CPU expands barriers before fusing);
  a conditional does, on a predicate XLA cannot fold and every device computes alike (a
  random generator's number, never equal to itself plus one), so that sharded residuals
  need no communication; the branch taken gives the arrays as they are.

  It costs XLA:CPU about 200 scalar HLO operations per backward (the generator) and the
  fusions across the read, so it is kept only where it measured lower training memory on
  XLA:CPU (2026-11-29, JAX 0.10.2): ``invert``'s units, where without it the conversion zoo's
  converted temps rose from 53-95 % of the original's to 78-108 % (float32) and from 72-96 %
  to 81-117 % (bfloat16), and the norms' backward (ViT-Ti/16 0.6 %, Llama-small 0.3 % less);
  not the activations' (their backward reads its residuals as they are: 2.3 % and 1.2 % less
  without it).  Other platforms are unaffected.
  """
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, v in enumerate(leaves) if isinstance(v, jax.Array) and v.size
           and jnp.issubdtype(v.dtype, jnp.floating)]
  if not where:
    return tree

  def on_cpu(*vals):
    # Never true (n == n + 1 in uint32 arithmetic), of a number XLA does not fold (a
    # generator's) and every device computes alike: no communication over sharded values.
    _, n = jax.lax.rng_bit_generator(jnp.zeros((4,), jnp.uint32), (), jnp.uint32)
    return jax.lax.cond(n == n + jnp.uint32(1),
                        lambda vs: tuple(v + jnp.zeros((), v.dtype) for v in vs),
                        lambda vs: tuple(vs), vals)
  read = jax.lax.platform_dependent(*[leaves[i] for i in where], cpu=on_cpu,
                                    default=lambda *vals: tuple(vals))
  for i, v in zip(where, read):
    leaves[i] = v
  return jax.tree.unflatten(treedef, leaves)
