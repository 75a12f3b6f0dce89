"""Raw Triton elementwise kernels (``jax_triton.triton_call``): forward + bit packing, and
backward from output + bits, with the same math and layouts as :mod:`.elementwise`.

The kernel bodies are generated: :mod:`.triton_source` writes the tile math of the XLA path
(the registry's plain-jnp functions) as Triton statements, and the templates below add the
loads, the bit packing (bit ``k`` of byte ``j`` is element ``8j + k`` of the last axis, the
layout of ``invact_jax.bitpack``) and the stores.  Unlike the Pallas kernels, partial blocks are
masked in-kernel, so only a last axis that is not a multiple of 8 is padded (a copy).

* :func:`forward`:  reads x once, writes y and the packed mask (bf16: 4.125 bytes/element);
* :func:`backward`: reads y, the mask and dy once, writes dx (bf16: ~6.1 bytes/element);
* :func:`compile_for` compiles a kernel for a GPU target without a GPU (``triton.compile``):
  registers, spills and SASS for tests and ``scripts/sass_roofline.py``.

``interpret=True`` runs the same generated kernels in Triton's interpreter on the host
(``jax.pure_callback``; NumPy stands in for libdevice, so transcendentals round as NumPy's):
slow, for tests on machines without a GPU.

Example (GPU):
  >>> import jax.numpy as jnp
  >>> from pallas_kernels import triton_elementwise as te
  >>> y, m = te.forward(jnp.tanh, lambda x: x < 0, jnp.ones((4, 64)))  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import hashlib
import linecache
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import elementwise
from pallas_kernels import triton_source

__all__ = ["forward", "backward", "forward_source", "backward_source", "compile_for", "launch"]

_PROLOGUE = """\
  pid = tl.program_id(0){wide}
  rows = pid * BR + tl.arange(0, BR)
  cols = tl.arange(0, 8)
  offs = rows[:, None] * 8 + cols[None, :]
  inb = rows[:, None] < M
"""


def _indent(lines) -> str:
  return "".join(f"  {line}\n" for line in lines)


def _wide(m: int) -> str:  # element offsets past int32
  return ".to(tl.int64)" if m * 8 >= 2**31 else ""


def forward_source(f: Callable, bit_fn: Callable | None, dtype, *, m: int, n: int, n8: int
                   ) -> tuple[str, str]:
  """``(kernel name, source)`` of the forward kernel for x of ``dtype`` viewed as ``[m, 8]``."""
  fy = triton_source.tile_function(f, [dtype], names=["x"])
  args = "x_ptr, y_ptr" + (", m_ptr" if bit_fn is not None else "")
  src = [f"def KERNEL({args}, M: tl.constexpr, BR: tl.constexpr):\n", _PROLOGUE.format(wide=_wide(m)),
         "  x = tl.load(x_ptr + offs, mask=inb, other=0)\n", _indent(fy.body),
         f"  tl.store(y_ptr + offs, {triton_source.cast(fy.outputs[0], dtype)}, mask=inb)\n"]
  if bit_fn is not None:
    fb = triton_source.tile_function(bit_fn, [dtype], names=["x"])
    src += [_indent(fb.body), f"  bits = {fb.outputs[0]}.to(tl.int32)\n"]
    if n != n8:  # a ragged last axis was padded: padding bits are 0, as in the XLA layout
      src.append(f"  col = (rows[:, None] % {n8 // 8}) * 8 + cols[None, :]\n"
                 f"  bits = tl.where(col < {n}, bits, 0)\n")
    # The 8 shifted bits of a row summed by a tree of splits (builtins only: tl.sum is a
    # jit function, which Triton's interpreter cannot call unless imported in its mode).
    src.append("  p = bits << cols[None, :]\n"
               "  a, c = tl.split(tl.reshape(p, [BR, 4, 2]))\n"
               "  a, c = tl.split(tl.reshape(a + c, [BR, 2, 2]))\n"
               "  a, c = tl.split(a + c)\n"
               "  tl.store(m_ptr + rows, (a + c).to(tl.uint8), mask=rows < M)\n")
  return _named("invact_triton_forward", "".join(src))


def backward_source(g_fn: Callable, dtype, dy_dtype, compute_dtype, has_bits: bool, *, m: int
                    ) -> tuple[str, str]:
  """``(kernel name, source)`` of the backward kernel: dx = dy * g_fn(y[, bits])."""
  g = triton_source.tile_function(g_fn, [dtype] + ([jnp.bool_] if has_bits else []),
                                  names=["y", "b"] if has_bits else ["y"])
  args = "y_ptr" + (", m_ptr" if has_bits else "") + ", dy_ptr, dx_ptr"
  src = [f"def KERNEL({args}, M: tl.constexpr, BR: tl.constexpr):\n", _PROLOGUE.format(wide=_wide(m)),
         "  y = tl.load(y_ptr + offs, mask=inb, other=0)\n"]
  if has_bits:
    src.append("  packed = tl.load(m_ptr + rows, mask=rows < M, other=0).to(tl.int32)\n"
               "  b = ((packed[:, None] >> cols[None, :]) & 1) == 1\n")
  cdt = triton_source.triton_dtype(compute_dtype)
  src += [_indent(g.body),
          f"  dy = tl.load(dy_ptr + offs, mask=inb, other=0).to({cdt})\n",
          f"  tl.store(dx_ptr + offs, {triton_source.cast(f'(dy * {g.outputs[0]})', dy_dtype)}, "
          "mask=inb)\n"]
  return _named("invact_triton_backward", "".join(src))


def _named(prefix: str, src: str) -> tuple[str, str]:
  name = f"{prefix}_{hashlib.sha1(src.encode()).hexdigest()[:12]}"
  return name, src.replace("def KERNEL(", f"def {name}(", 1)


class _NumpyLibdevice:
  """libdevice for Triton's interpreter: the same functions, evaluated by NumPy."""

  _FUNCTIONS = {"exp": np.exp, "log": np.log, "log1p": np.log1p, "expm1": np.expm1,
                "tanh": np.tanh, "sqrt": np.sqrt, "rsqrt": lambda a: 1 / np.sqrt(a),
                "floor": np.floor, "ceil": np.ceil, "exp2": np.exp2, "pow": np.power,
                "atan2": np.arctan2, "nextafter": np.nextafter}

  def __getattr__(self, name):
    import triton.language as tl  # pylint: disable=import-outside-toplevel
    from triton.runtime.interpreter import TensorHandle  # pylint: disable=import-outside-toplevel
    if name in ("erf", "erfc"):
      import scipy.special  # pylint: disable=import-outside-toplevel
      fn = getattr(scipy.special, name)
    else:
      fn = self._FUNCTIONS[name]

    def call(*args):  # in float64, rounded once: as accurate as libdevice's (<= 2 ulp) or better
      data = [a.handle.data for a in args]
      out = np.asarray(fn(*[d.astype(np.float64) for d in data])).astype(data[0].dtype)
      return tl.core.tensor(TensorHandle(out, args[0].handle.dtype), args[0].type)
    return call


def _to_dtype(x, dtype):  # compiled (wrapped in triton.jit by _mode_globals): Triton's own cast
  return x.to(dtype)


def _to_dtype_interpreted(x, dtype):
  """``x.to(dtype)`` in Triton's interpreter, with float32 -> bfloat16 rounded to nearest even
  as compiled code (and XLA) do; the interpreter's own conversion truncates (Triton 3.6)."""
  import triton.language as tl  # pylint: disable=import-outside-toplevel
  if not (dtype == tl.bfloat16 and x.dtype == tl.float32):
    return x.to(dtype)
  b = x.to(tl.uint32, bitcast=True)
  r = b + 0x7FFF + ((b >> 16) & 1)
  r = tl.where(x != x, b | 0x400000, r)  # NaN stays a (quiet) NaN
  return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _mode_globals(interpret: bool) -> dict:
  """What generated and hand-written kernels call besides ``tl``, per mode."""
  from triton.language.extra import libdevice  # pylint: disable=import-outside-toplevel
  if interpret:
    return {"libdevice": _NumpyLibdevice(), "to_dtype": _to_dtype_interpreted}
  return {"libdevice": libdevice, "to_dtype": _jit_to_dtype()}


@functools.lru_cache(maxsize=None)
def _jit_to_dtype():
  import triton  # pylint: disable=import-outside-toplevel
  import triton.language as tl  # pylint: disable=import-outside-toplevel
  _to_dtype.__annotations__ = {"dtype": tl.constexpr}
  return triton.jit(_to_dtype)


@functools.lru_cache(maxsize=None)
def _function(name: str, src: str, interpret: bool):
  """The kernel as a Python function (its source registered with linecache, as Triton reads it)."""
  import triton  # pylint: disable=import-outside-toplevel
  import triton.language as tl  # pylint: disable=import-outside-toplevel
  filename = f"<{name}{'_interpret' if interpret else ''}>"
  linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
  scope = {"tl": tl, "triton": triton, **_mode_globals(interpret)}
  exec(compile(src, filename, "exec"), scope)  # pylint: disable=exec-used
  fn = scope[name]
  if interpret:
    from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
    return InterpretedFunction(fn)
  return triton.jit(fn)


# No FMA contraction: the math rounds as written, as in the Pallas kernels and the XLA path
# (with Triton's default contraction the backward differed from the XLA path's by 2-8 ulp on
# an H100, 2026-11-23; without it, within one).
_FP_FUSION = False

# Triton's interpreter keeps its grid position and language patches in module globals: one
# kernel at a time (sharded arrays call back from several threads at once).
_INTERPRETER_LOCK = threading.Lock()


class _HostArray:
  """A NumPy array as the tensor Triton's interpreter expects (a pointer, a dtype, storage)."""

  def __init__(self, a: np.ndarray):
    self.a = a
    self.dtype = a.dtype

  def data_ptr(self):
    return self.a.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.a.shape

  def stride(self):
    return tuple(s // self.a.itemsize for s in self.a.strides)

  def new_empty(self, *args, **kwargs):
    del args, kwargs
    return self

  def set_(self, *args):
    del args
    return self

  def copy_(self, other):
    del other  # the interpreter wrote into this very buffer


@functools.lru_cache(maxsize=None)
def _python_kernel(fn: Callable, interpret: bool):
  """A kernel written as a plain Python function (``pallas_kernels.triton_norms``), with its
  module's globals plus ``libdevice``/``to_dtype`` bound per mode, and the module's ``HELPERS``
  jit-compiled (compiled mode) or plain (interpreter)."""
  import types  # pylint: disable=import-outside-toplevel
  import triton  # pylint: disable=import-outside-toplevel
  scope = {**fn.__globals__, **_mode_globals(interpret)}
  for helper in fn.__globals__.get("HELPERS", ()):  # the module's kernel helpers, per mode
    h = fn.__globals__[helper]
    h = types.FunctionType(h.__code__, scope, h.__name__, h.__defaults__, h.__closure__)
    scope[helper] = h if interpret else triton.jit(h)
  bound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
  bound.__annotations__ = fn.__annotations__
  if interpret:
    from triton.runtime.interpreter import InterpretedFunction  # pylint: disable=import-outside-toplevel
    return InterpretedFunction(bound)
  return triton.jit(bound)


def launch(kernel, inputs, out_shapes, *, grid: tuple, constexprs: dict, num_warps: int,
           interpret: bool):
  """Run a Triton kernel on JAX arrays: ``kernel`` is ``(name, source)`` of a generated one or
  a plain Python function; inputs then outputs are its pointer arguments, ``constexprs`` its
  compile-time ones.  Compiled: ``jax_triton.triton_call``; ``interpret``: Triton's
  interpreter in a host callback."""
  if isinstance(kernel, tuple):
    name, fn = kernel[0], _function(*kernel, interpret)
  else:
    name, fn = kernel.__name__, _python_kernel(kernel, interpret)
  if interpret:
    def host(*arrays):
      ins = [np.ascontiguousarray(a) for a in arrays]
      outs = [np.zeros(s.shape, s.dtype) for s in out_shapes]
      with _INTERPRETER_LOCK, np.errstate(all="ignore"):  # masked-off lanes hold 0 (log(0))
        fn[grid](*map(_HostArray, ins + outs), **constexprs)
      return tuple(outs)
    return jax.pure_callback(host, tuple(out_shapes), *inputs)
  import jax_triton  # pylint: disable=import-outside-toplevel
  outs = jax_triton.triton_call(*inputs, kernel=fn, out_shape=list(out_shapes), grid=grid,
                                num_warps=num_warps, num_stages=1, name=name,
                                enable_fp_fusion=_FP_FUSION, **constexprs)
  return tuple(outs) if isinstance(outs, (list, tuple)) else (outs,)


def _call(name: str, src: str, inputs, out_shapes, *, m: int, block_rows: int, num_warps: int,
          interpret: bool):
  return launch((name, src), inputs, out_shapes, grid=(-(-m // block_rows),),
                constexprs={"M": m, "BR": block_rows}, num_warps=num_warps, interpret=interpret)


def forward(f: Callable, bit_fn: Callable | None, x: jax.Array, *, block_rows: int | None = None,
            interpret: bool = False, num_warps: int = 4):
  """``(f(x), packed bit_fn(x))`` in one pass (the mask is None when ``bit_fn`` is None); both
  get the tile in x's dtype."""
  rows, shape, n8 = elementwise._as_rows(x)  # pylint: disable=protected-access
  m = rows.shape[0]
  if m == 0:
    y = f(x)
    return y, (None if bit_fn is None else
               jnp.zeros(elementwise._mask_shape(shape, n8), jnp.uint8))  # pylint: disable=protected-access
  n = 1 if len(shape) == 0 else shape[-1]
  name, src = forward_source(f, bit_fn, x.dtype, m=m, n=n, n8=n8)
  out_shapes = [jax.ShapeDtypeStruct((m, 8), x.dtype)]
  if bit_fn is not None:
    out_shapes.append(jax.ShapeDtypeStruct((m,), jnp.uint8))
  outs = _call(name, src, [rows], out_shapes, m=m,
               block_rows=block_rows or elementwise.block_rows_for(x.dtype, m),
               num_warps=num_warps, interpret=interpret)
  y = elementwise._from_rows(outs[0], shape, n8)  # pylint: disable=protected-access
  if bit_fn is None:
    return y, None
  return y, outs[1].reshape(elementwise._mask_shape(shape, n8))  # pylint: disable=protected-access


def backward(g_fn: Callable, y: jax.Array, packed: jax.Array | None, dy: jax.Array, *,
             compute_dtype=jnp.float32, block_rows: int | None = None, interpret: bool = False,
             num_warps: int = 4):
  """``dy * g_fn(y, bits)`` in one pass, bits unpacked from ``packed`` in-kernel; ``g_fn`` gets
  the tile of y in its storage dtype and returns f'(x) in ``compute_dtype``."""
  rows, shape, n8 = elementwise._as_rows(y)  # pylint: disable=protected-access
  m = rows.shape[0]
  if m == 0:
    return jnp.zeros_like(dy)
  dy_rows, _, _ = elementwise._as_rows(dy)  # pylint: disable=protected-access
  has_bits = packed is not None
  fn = g_fn if has_bits else (lambda y: g_fn(y, None))
  name, src = backward_source(fn, y.dtype, dy.dtype, compute_dtype, has_bits, m=m)
  inputs = [rows] + ([packed.reshape(-1)] if has_bits else []) + [dy_rows]
  (dx,) = _call(name, src, inputs, [jax.ShapeDtypeStruct((m, 8), dy.dtype)], m=m,
                block_rows=block_rows or elementwise.block_rows_for(y.dtype, m),
                num_warps=num_warps, interpret=interpret)
  return elementwise._from_rows(dx, shape, n8)  # pylint: disable=protected-access


def compile_for(name, src: str | None, signature: dict, constexprs: dict, *,
                capability: int = 90, num_warps: int = 4) -> dict:
  """Compile a kernel with ``triton.compile`` for ``GPUTarget("cuda", capability, 32)`` (no GPU
  needed: Triton bundles ptxas) and return its ``asm`` (``ttir`` ... ``ptx``, ``cubin``; SASS
  statistics of the cubin: :func:`pallas_kernels.machine_code.stats`).
  ``name, src``: a generated kernel; ``name`` alone (``src=None``): a Python kernel function."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel
  fn = _python_kernel(name, False) if src is None else _function(name, src, False)
  k = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs),
                     target=GPUTarget("cuda", capability, 32),
                     options={"num_warps": num_warps, "num_stages": 1,
                              "enable_fp_fusion": _FP_FUSION})
  return k.asm
