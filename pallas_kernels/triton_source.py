"""Triton source from a jaxpr: the tile math of the other implementations, as Triton code.

The raw Triton kernels (:mod:`pallas_kernels.triton_elementwise`) do not re-spell the math:
:func:`tile_function` traces the same plain-jnp tile function the XLA path and the Pallas
kernels run (``jax.make_jaxpr``) and writes one Triton statement per equation, with the
lowering Pallas-Triton uses for each primitive (libdevice ``__nv_*f`` for the
transcendentals, ``a / b`` for division, ``1 / (1 + exp(-x))`` for ``logistic``).  Every value is
a ``[BR, 8]`` tile (scalars and literals are splatted), so broadcasting never changes a value.
Two choices differ from Pallas on purpose: ``max``/``min`` propagate NaN as XLA does
(Pallas lowers them to ``maxnumf``/``minnumf``, which drop a NaN operand), and an unknown
primitive is an error naming it, never a guess.

Example:
  >>> import jax.numpy as jnp
  >>> from pallas_kernels import triton_source
  >>> print(triton_source.tile_function(lambda x: x * 2.0 + 1.0, [jnp.float32]).body[0])
  v0 = (x0 * tl.full([BR, 8], 2.0, tl.float32))
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.extend.core  # Literal
import jax.numpy as jnp
import numpy as np

__all__ = ["TileFunction", "tile_function", "triton_dtype", "cast", "pointer_type"]

_DTYPES = {"float64": "tl.float64", "float32": "tl.float32", "bfloat16": "tl.bfloat16",
           "float16": "tl.float16", "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16",
           "int8": "tl.int8", "uint32": "tl.uint32", "uint16": "tl.uint16", "uint8": "tl.uint8",
           "bool": "tl.int1"}
_INT_BITS = {"float64": ("tl.int64", np.int64), "float32": ("tl.int32", np.int32),
             "bfloat16": ("tl.int16", np.int16), "float16": ("tl.int16", np.int16)}


_SIGNATURE = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
              "int32": "i32", "uint8": "u8"}


def pointer_type(dtype) -> str:
  """The ``triton.compile`` signature spelling of a pointer to ``dtype`` (``"*bf16"``)."""
  return "*" + _SIGNATURE[jnp.dtype(dtype).name]


def triton_dtype(dtype) -> str:
  """The ``tl`` dtype spelling of a JAX/NumPy dtype."""
  name = jnp.dtype(dtype).name
  if name not in _DTYPES:
    raise TypeError(f"triton_source: dtype {name} has no Triton counterpart")
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class TileFunction:
  """Straight-line Triton statements computing ``outputs`` from ``inputs`` (variable names)."""
  inputs: tuple[str, ...]
  body: tuple[str, ...]
  outputs: tuple[str, ...]


def cast(expr: str, dtype) -> str:
  """``expr`` converted to ``dtype``; rounding casts go through ``to_dtype`` (bound by the
  kernel's launcher: ``x.to(dtype)`` compiled, round-to-nearest-even in Triton's interpreter,
  whose float32 -> bfloat16 conversion truncates)."""
  return f"to_dtype({expr}, {triton_dtype(dtype)})"


def _literal(value, dtype) -> str:
  """A Triton source literal of ``value`` in ``dtype`` broadcast to a [BR, 8] block
  (NaN and infinities from their bits)."""
  dt = jnp.dtype(dtype)
  tdt = triton_dtype(dt)
  if dt == jnp.bool_:
    return f"tl.full([BR, 8], {int(bool(value))}, tl.int1)"
  if jnp.issubdtype(dt, jnp.integer):
    return f"tl.full([BR, 8], {int(value)}, {tdt})"
  v = np.asarray(value, dt)
  if not np.isfinite(v.astype(np.float64)):  # NaN/inf: from their bits
    ibits, npint = _INT_BITS[dt.name]
    return f"tl.full([BR, 8], {int(v.view(npint))}, {ibits}).to({tdt}, bitcast=True)"
  return f"tl.full([BR, 8], {float(v)!r}, {tdt})"


def _is_int(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.integer)


def _is_bool(aval) -> bool:
  return aval.dtype == jnp.bool_


_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"
_UNARY = {"exp": "libdevice.exp({})", "log": "libdevice.log({})", "log1p": "libdevice.log1p({})",
          "expm1": "libdevice.expm1({})", "tanh": "libdevice.tanh({})",
          "sqrt": "libdevice.sqrt({})", "rsqrt": "libdevice.rsqrt({})",
          "floor": "libdevice.floor({})", "ceil": "libdevice.ceil({})",
          "exp2": "libdevice.exp2({})", "erf": "libdevice.erf({})", "erfc": "libdevice.erfc({})",
          "abs": "tl.abs({})", "neg": "(-{})", "copy": "{}", "copy_p": "{}",
          "logistic": "(1.0 / (1.0 + libdevice.exp(-{})))"}
_BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})",
           "max": "tl.maximum({}, {}, " + _NAN_ALL + ")",
           "min": "tl.minimum({}, {}, " + _NAN_ALL + ")",
           "eq": "({} == {})", "ne": "({} != {})", "lt": "({} < {})", "le": "({} <= {})",
           "gt": "({} > {})", "ge": "({} >= {})", "and": "({} & {})", "or": "({} | {})",
           "xor": "({} ^ {})", "shift_left": "({} << {})",
           "shift_right_arithmetic": "({} >> {})", "pow": "libdevice.pow({}, {})",
           "atan2": "libdevice.atan2({}, {})", "nextafter": "libdevice.nextafter({}, {})"}
_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
           "custom_vjp_call", "custom_vjp_call_jaxpr")


class _Emitter:

  def __init__(self):
    self.lines: list[str] = []
    self.count = 0

  def fresh(self) -> str:
    name = f"v{self.count}"
    self.count += 1
    return name

  def read(self, env, atom) -> str:
    if isinstance(atom, jax.extend.core.Literal):
      return _literal(atom.val, atom.aval.dtype)
    return env[atom]

  def jaxpr(self, jaxpr, consts, args) -> list[str]:
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
      if np.ndim(c) != 0:
        raise NotImplementedError(f"triton_source: a non-scalar constant {np.shape(c)} in the tile "
                                  "math (tables are not supported; write the math with scalars)")
      env[v] = _literal(c, v.aval.dtype)
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      ins = [self.read(env, a) for a in eqn.invars]
      outs = self.eqn(eqn, ins)
      env.update(zip(eqn.outvars, outs))
    return [self.read(env, a) for a in jaxpr.outvars]

  def assign(self, expr: str) -> str:
    name = self.fresh()
    self.lines.append(f"{name} = {expr}")
    return name

  def eqn(self, eqn, ins) -> list[str]:
    name, p = eqn.primitive.name, eqn.params
    avals = [a.aval for a in eqn.invars]
    if name in _INLINE:
      closed = p.get("jaxpr") or p.get("call_jaxpr") or p.get("fun_jaxpr")
      inner = getattr(closed, "jaxpr", closed)
      return self.jaxpr(inner, getattr(closed, "consts", ()), ins)
    if name == "call_hi_primitive":  # JAX 0.12's "hijax" ops (e.g. ldexp): their expansion
      closed = jax.make_jaxpr(p["_prim"].expand)(*avals)
      return self.jaxpr(closed.jaxpr, closed.consts, ins)
    out_aval = eqn.outvars[0].aval
    if name in _UNARY:
      return [self.assign(_UNARY[name].format(*ins))]
    if name == "div":
      op = "//" if _is_int(avals[0]) else "/"
      return [self.assign(f"({ins[0]} {op} {ins[1]})")]
    if name == "not":
      return [self.assign(f"({ins[0]} == 0)" if _is_bool(avals[0]) else f"(~{ins[0]})")]
    if name == "shift_right_logical":
      dt = jnp.dtype(avals[0].dtype)
      if jnp.issubdtype(dt, jnp.unsignedinteger):
        return [self.assign(f"({ins[0]} >> {ins[1]})")]
      u = triton_dtype(np.dtype(f"uint{dt.itemsize * 8}"))
      return [self.assign(f"(({ins[0]}.to({u}, bitcast=True) >> {ins[1]}.to({u}, bitcast=True))"
                          f".to({triton_dtype(dt)}, bitcast=True))")]
    if name in _BINARY:
      return [self.assign(_BINARY[name].format(*ins))]
    if name == "integer_pow":
      y = p["y"]
      if y == 0:
        return [self.assign(_literal(1, out_aval.dtype))]
      acc, base, k = None, ins[0], abs(y)
      while k:  # square-and-multiply, as XLA expands integer_pow
        if k & 1:
          acc = base if acc is None else self.assign(f"({acc} * {base})")
        k >>= 1
        if k:
          base = self.assign(f"({base} * {base})")
      return [acc if y > 0 else self.assign(f"(1.0 / {acc})")]
    if name == "clamp":  # clamp(lo, x, hi)
      return [self.assign(f"tl.minimum(tl.maximum({ins[1]}, {ins[0]}, {_NAN_ALL}), {ins[2]}, "
                          f"{_NAN_ALL})")]
    if name == "square":
      return [self.assign(f"({ins[0]} * {ins[0]})")]
    if name == "select_n":
      if len(ins) != 3:
        raise NotImplementedError(f"triton_source: select_n with {len(ins) - 1} cases")
      pred = ins[0] if _is_bool(avals[0]) else f"({ins[0]} != 0)"
      return [self.assign(f"tl.where({pred}, {ins[2]}, {ins[1]})")]
    if name == "convert_element_type":
      dt = jnp.dtype(p["new_dtype"])
      if dt == jnp.bool_:
        return [self.assign(f"({ins[0]} != 0)")]
      return [self.assign(cast(ins[0], dt))]
    if name == "bitcast_convert_type":
      return [self.assign(f"{ins[0]}.to({triton_dtype(p['new_dtype'])}, bitcast=True)")]
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
      return [ins[0]]  # every value is already a full tile
    if name == "is_finite":
      return [self.assign(f"(tl.abs({ins[0]}) < {_literal(np.inf, avals[0].dtype)})")]
    if name == "sign":
      z = _literal(0, avals[0].dtype)
      one = _literal(1, avals[0].dtype)
      return [self.assign(f"tl.where({ins[0]} > {z}, {one}, tl.where({ins[0]} < {z}, -{one}, "
                          f"{ins[0]}))")]
    if name in ("elementwise_inline_asm_p", "elementwise_inline_asm"):  # JAX 0.10 / 0.12
      (res,) = p["result_shape_dtypes"]
      return [self.assign(f"tl.inline_asm_elementwise({p['asm']!r}, {p['constraints']!r}, "
                          f"[{', '.join(ins)}], dtype={triton_dtype(res.dtype)}, is_pure=True, "
                          f"pack={p['pack']})")]
    raise NotImplementedError(f"triton_source: no Triton spelling for primitive {name!r} (add "
                              "it to pallas_kernels/triton_source.py)")


def tile_function(fn: Callable, dtypes: Sequence, *, names: Sequence[str] | None = None
                  ) -> TileFunction:
  """``fn``'s math (plain jnp, elementwise, on tiles of ``dtypes``) as Triton statements.

  Args:
    fn: the tile function; ``None`` arguments are not supported (close over them).
    dtypes: one dtype per argument.
    names: the Triton variable names of the arguments (default ``x0, x1, ...``).
  """
  names = tuple(names or (f"x{i}" for i in range(len(dtypes))))
  closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct((2, 8), d) for d in dtypes])
  em = _Emitter()
  outs = em.jaxpr(closed.jaxpr, closed.consts, list(names))
  return TileFunction(inputs=names, body=tuple(em.lines), outputs=tuple(outs))
