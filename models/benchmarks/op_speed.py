"""Speed of the activation implementations: HLO op counts, timings, achieved GB/s.

The logic behind ``scripts/bench_kernels.py``.

* :func:`measure`: for each activation, size, dtype and implementation, the median time of
  forward, backward and forward+backward (jitted, ``block_until_ready``), calls interleaved
  round-robin with ``jax.nn`` and a device copy (``-x``, the bandwidth reference) so that
  drift hits every variant alike.  Bytes are the least each pass must move (bf16 forward:
  2 + 2 + 1/8 bytes per element; backward: 2 + 1/8 + 2 + 2), so GB/s compares with the copy's.
* :func:`hlo_ops`: instructions of the optimized HLO, the arithmetic cost proxy
  (every instruction except parameter, constant, broadcast, tuple, get-tuple-element,
  bitcast, copy, reshape and fusion; fused computations' bodies counted).
* :func:`cpu_rows`: per activation and dtype, HLO ops of the fused forward+backward
  (``jit(lambda x, dy: (y, vjp(dy)))``) and its time relative to ``jax.nn``'s.
* :func:`cost_split`: where that time goes: each pass alone, the backward with one of its
  expensive parts (bit unpacking, log, square roots, division) replaced by something free,
  and, for 16-bit outputs, the same backward as a gather from a table of its values over every
  bit pattern (:func:`lookup_table`; measured for comparison, not what the library runs).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import pathlib
import re
import statistics
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from invact_jax import bitpack
from invact_jax import Implementation, available
from invact_jax.ops.activations import rational
from invact_jax.ops.activations import api as activations_api
from invact_jax.ops.activations import base
from invact_jax.ops.activations import registry
from models import benchmarks

__all__ = ["Row", "measure", "table", "hlo_ops", "cpu_rows", "cpu_table", "write_report", "fwd_bwd",
           "interleaved", "cost_split", "split_table", "lookup_table", "table_backward"]

_SKIP = {"parameter", "constant", "broadcast", "tuple", "get-tuple-element", "bitcast", "copy",
         "reshape", "fusion"}
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^ ]+\s+([\w\-]+)\(")


def hlo_ops(fn: Callable, *args) -> tuple[int, dict[str, int]]:
  """(count, per-opcode counts) of the optimized HLO of ``jax.jit(fn)(*args)``, or of ``fn``
  itself when it is already a compiled executable."""
  compiled = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  ops = collections.Counter(m.group(1) for m in map(_INSTR.match, text.splitlines())
                            if m and m.group(1) not in _SKIP)
  return sum(ops.values()), dict(ops)


def op(name: str) -> base.Op:
  entry = registry.get(name)
  return base.Op(entry, entry.params)


def fwd_bwd(f: Callable) -> Callable:
  """``(x, dy) -> (f(x), vjp(dy))``: one jitted forward+backward, the benchmarked unit."""
  def both(x, dy):
    y, vjp = jax.vjp(f, x)
    return y, vjp(dy)[0]
  return both


def reference_fn(name: str) -> Callable:
  o = op(name)
  return o.forward


def inverted_fn(name: str, implementation="xla") -> Callable:
  o = op(name)
  impl = activations_api.resolve(implementation, op=o.public)
  return lambda x: base.apply(o, impl, x)


def interleaved(fns: dict[str, Callable], args, *, rounds: int = 20, inner: int = 3
                ) -> dict[str, float]:
  """Median seconds per call of each jitted fn (or compiled executable), calls interleaved
  round-robin."""
  jitted = {k: f if isinstance(f, jax.stages.Compiled) else jax.jit(f) for k, f in fns.items()}
  for f in jitted.values():
    jax.block_until_ready(f(*args))  # compile + warm up
  times = {k: [] for k in jitted}
  for _ in range(rounds):
    for k, f in jitted.items():
      t0 = time.perf_counter()
      for _ in range(inner):
        out = f(*args)
      jax.block_until_ready(out)
      times[k].append((time.perf_counter() - t0) / inner)
  return {k: statistics.median(v) for k, v in times.items()}


def _inputs(n: int, dtype):
  shape = (n // 1024, 1024) if n >= 1024 else (1, n)
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype) * 3
  dy = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
  return x, dy


def cpu_rows(names: Sequence[str], dtypes: Sequence[str] = ("float32", "bfloat16"), *,
             elements: int = 1 << 23, rounds: int = 15, implementation="xla",
             progress: Callable[[str], None] | None = None) -> list[dict]:
  """The op-speed table: HLO ops of forward + backward and time against jax.nn (interleaved
  medians)."""
  rows = []
  for name in names:
    for dt in dtypes:
      if progress:
        progress(f"{name} {dt}")
      x, dy = _inputs(elements, jnp.dtype(dt))
      ours, ref = (jax.jit(fwd_bwd(f)).lower(x, dy).compile()
                   for f in (inverted_fn(name, implementation), reference_fn(name)))
      n_ours, by_op = hlo_ops(ours, x, dy)
      n_ref, _ = hlo_ops(ref, x, dy)
      n_fwd, _ = hlo_ops(reference_fn(name), x)
      t = interleaved({"ours": ours, "ref": ref}, (x, dy), rounds=rounds)
      rows.append({"activation": name, "dtype": dt, "elements": int(x.size),
                   "hlo_ops": n_ours, "hlo_ops_jax_nn": n_ref, "hlo_ops_forward_jax_nn": n_fwd,
                   "hlo_by_op": by_op, "seconds": t["ours"], "seconds_jax_nn": t["ref"],
                   "time_ratio": t["ours"] / t["ref"]})
  return rows


class _Ablated:
  """``rational.evaluate``'s ``ops`` with some of sqrt/log/divide replaced by free stand-ins
  (wrong values; for timing what each part costs)."""

  def __init__(self, *, sqrt=True, log=True, divide=True):
    ident = lambda v: v  # pylint: disable=unnecessary-lambda-assignment
    self.sqrt = jnp.sqrt if sqrt else ident
    self.log = jnp.log if log else ident
    self.divide = jnp.divide if divide else jnp.multiply


#: The fit's backward variants of :func:`cost_split`: (unpack the bits?, ops for the fit).
_ABLATIONS = {
    "backward, no unpacking (bit = y < 0)": (False, _Ablated()),
    "backward, log -> identity": (True, _Ablated(log=False)),
    "backward, sqrt -> identity": (True, _Ablated(sqrt=False)),
    "backward, divide -> multiply": (True, _Ablated(divide=False)),
    "backward, none of log/sqrt/divide": (True, _Ablated(sqrt=False, log=False, divide=False)),
}


def lookup_table(o: base.Op, dtype) -> jax.Array:
  """The XLA backward's f'(f^-1(y)) for every bit pattern of the 16-bit ``dtype`` and both
  branch bits: float32 of shape (2 * 2^16,), entry ``bit * 2^16 + pattern``."""
  dt = jnp.dtype(dtype)
  if dt.itemsize != 2:
    raise ValueError(f"lookup_table: argument `dtype` must be a 16-bit float, got {dt.name}")
  y = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint16), dt)
  return jnp.concatenate([o.derivative(y, jnp.zeros(y.shape, bool)),
                          o.derivative(y, jnp.ones(y.shape, bool))])


def table_backward(table: jax.Array) -> Callable:
  """``(y, packed, dy) -> dx`` with g gathered from :func:`lookup_table`'s ``table``."""
  def bwd(y, packed, dy):
    bits = bitpack.unpack_bits(packed, y.shape)
    idx = (jax.lax.bitcast_convert_type(y, jnp.uint16).astype(jnp.int32)
           | (bits.astype(jnp.int32) << 16))
    g = table.at[idx].get(mode="promise_in_bounds")  # idx < 2^17 by construction
    return (dy.astype(g.dtype) * g).astype(dy.dtype)
  return bwd


#: :func:`cost_split`'s 16-bit rows: the backward as a table gather (not the library's path).
TABLE_FUSED = "ours forward + lookup-table backward, one jit"
TABLE_BACKWARD = "backward by lookup table (2 x 2^16 float32, same values)"


def cost_split(name: str, dtype: str, *, elements: int = 1 << 23, rounds: int = 15
               ) -> list[dict]:
  """Where the XLA path's time goes for the non-monotone activation ``name``: medians
  (interleaved) of jax.nn's forward and forward+backward, ours forward (y + packed bits),
  backward and forward+backward, and the fit's backward with parts replaced (see
  ``_ABLATIONS``; those variants compute wrong values and only time the rest).  For 16-bit
  ``dtype`` also the backward as a gather from :func:`lookup_table` (the same values), alone
  and after our forward in one jit."""
  o = op(name)
  if not o.activation.nonmonotone:
    raise ValueError(f"cost_split: argument `name` must be a non-monotone activation (its "
                     f"backward evaluates a fit), got {name!r}")
  x, dy = _inputs(elements, jnp.dtype(dtype))
  y, packed = base.XLA.forward(o, x)
  fit = rational.fit_for(name, y.dtype)

  def ablated(unpack, ops):
    def bwd(y, packed, dy):
      left = bitpack.unpack_bits(packed, y.shape) if unpack else y < 0
      g = rational.evaluate(fit, y.astype(jnp.float32), left, ops=ops)
      return (dy.astype(jnp.float32) * g).astype(dy.dtype)
    return bwd

  whole = {"jax.nn forward": lambda x, dy: o.forward(x),
           "jax.nn forward+backward": fwd_bwd(o.forward),
           "ours forward (y + packed bits)": lambda x, dy: base.XLA.forward(o, x),
           "ours forward+backward": fwd_bwd(inverted_fn(name))}
  parts = {"backward": lambda y, packed, dy: base.XLA.backward(o, y, packed, dy),
           **{k: ablated(*v) for k, v in _ABLATIONS.items()}}
  if jnp.dtype(dtype).itemsize == 2:
    by_table = table_backward(lookup_table(o, dtype))

    @jax.custom_vjp
    def inverted_by_table(x):
      return o.forward(x)

    def table_fwd(x):  # base.apply's residuals: y and the packed bits
      y, bits = base.XLA.forward(o, x)
      return y, (y, bits)
    inverted_by_table.defvjp(table_fwd, lambda res, dy: (by_table(*res, dy),))
    whole[TABLE_FUSED] = fwd_bwd(inverted_by_table)
    parts[TABLE_BACKWARD] = by_table
  times = {**interleaved(whole, (x, dy), rounds=rounds, inner=1),
           **interleaved(parts, (y, packed, dy), rounds=rounds, inner=1)}
  return [{"activation": name, "dtype": dtype, "elements": int(x.size), "pass": k,
           "seconds": times[k]} for k in [*whole, *parts]]


def split_table(rows: Sequence[dict]) -> str:
  lines = ["| activation | dtype | pass | ms |", "|---|---|---|---:|"]
  lines += [f"| {r['activation']} | {r['dtype']} | {r['pass']} | {r['seconds'] * 1e3:.2f} |"
            for r in rows]
  return "\n".join(lines)


def write_report(out, meta: dict, rows: list, md: str | None = None, note: str = "") -> None:
  """``out`` as ``{"meta", "rows"}`` JSON and, with ``md``, ``out.with_suffix(".md")`` holding
  the table and ``note`` (device, versions, date, command)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  if md is not None:
    out.with_suffix(".md").write_text(f"{md}\n\n{note}\n")
  print(f"wrote {out}")


def cpu_table(rows: Sequence[dict]) -> str:
  lines = ["| activation | dtype | HLO ops fwd+bwd (ours) | jax.nn | jax.nn forward alone "
           "| ms (ours) | ms (jax.nn) | time vs jax.nn |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['activation']} | {r['dtype']} | {r['hlo_ops']} | {r['hlo_ops_jax_nn']} | "
                 f"{r['hlo_ops_forward_jax_nn']} | {r['seconds'] * 1e3:.2f} | "
                 f"{r['seconds_jax_nn'] * 1e3:.2f} | {r['time_ratio']:.2f} |")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Row:
  activation: str
  implementation: str  # "jax.nn", "xla", "pallas", "triton", "copy"
  dtype: str
  elements: int
  pass_: str  # "fwd", "bwd", "fwd+bwd"
  seconds: float
  bytes: int

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["pass"] = d.pop("pass_")
    d["gbps"] = self.gbps
    return d


def measure(*, activation: str = "gelu_tanh", sizes: Sequence[int] = (1 << 20,),
            dtypes: Sequence[str] = ("float32", "bfloat16"),
            implementations: Sequence = ("xla", "pallas"), repeats: int = 20,
            inner: int = 1, progress: Callable[[str], None] | None = None) -> list[Row]:
  """Rows for every (size, dtype, implementation, pass); unavailable backends are skipped.

  ``implementations`` entries are names or :class:`invact_jax.Implementation` (e.g. with
  ``interpret=True`` to exercise a kernel without a GPU; its timings then mean nothing).
  """
  if activation not in registry.ACTIVATIONS:
    raise ValueError(f"argument `activation` must be one of {sorted(registry.ACTIVATIONS)}, "
                     f"got {activation!r}")
  o = op(activation)
  rows = []
  for n in sizes:
    if n < 8 or n % 8:
      raise ValueError(f"argument `sizes`: every size must be a positive multiple of 8, got {n}")
    for dt in dtypes:
      dtype = jnp.dtype(dt)
      item = dtype.itemsize
      mask = n // 8 if o.has_bit else 0
      x, dy = _inputs(n, dtype)
      fns, nbytes, args = {}, {}, {}

      def add(key, fn, a, b):
        fns[key], args[key], nbytes[key] = fn, a, b

      add(("copy", "fwd"), lambda x: -x, (x,), 2 * n * item)
      add(("jax.nn", "fwd"), o.forward, (x,), 2 * n * item)
      # x, dy in; y, dx out: the least any fused pair can move.
      add(("jax.nn", "fwd+bwd"), fwd_bwd(o.forward), (x, dy), 4 * n * item)
      for impl in implementations:
        name = impl.name if isinstance(impl, Implementation) else impl
        interpret = isinstance(impl, Implementation) and impl.interpret
        if not interpret and not available(name)[0]:
          continue
        im = activations_api.resolve(impl, op=o.public)
        y, m = jax.jit(lambda x, im=im: im.forward(o, x))(x)
        add((name, "fwd"), lambda x, im=im: im.forward(o, x), (x,), 2 * n * item + mask)
        add((name, "bwd"), lambda y, m, dy, im=im: im.backward(o, y, m, dy),
            (y, m, dy), 3 * n * item + mask)
        add((name, "fwd+bwd"), fwd_bwd(lambda x, im=im: base.apply(o, im, x)), (x, dy),
            4 * n * item + 2 * mask)
      if progress:
        progress(f"{activation} {dt} 2^{n.bit_length() - 1}")
      # Interleave per argument signature (one call set per distinct args tuple).
      times = {}
      groups = collections.defaultdict(dict)
      for key, a in args.items():
        groups[tuple(id(v) for v in a)][key] = fns[key]
      for group in groups.values():
        a = args[next(iter(group))]
        times.update(interleaved(group, a, rounds=repeats, inner=inner))
      for impl, pass_ in fns:  # rows in the order the variants were added
        rows.append(Row(activation, impl, dt, n, pass_, times[(impl, pass_)],
                        nbytes[(impl, pass_)]))
  return rows


def table(rows: Sequence[Row]) -> str:
  """Markdown table: time (ms) and GB/s per row, with the copy and jax.nn side by side."""
  lines = ["| activation | dtype | elements | implementation | pass | ms | GB/s |",
           "|---|---|---:|---|---|---:|---:|"]
  for r in rows:
    lines.append(f"| {r.activation} | {r.dtype} | 2^{r.elements.bit_length() - 1} | "
                 f"{r.implementation} | {r.pass_} | {r.seconds * 1e3:.3f} | {r.gbps:.1f} |")
  return "\n".join(lines)


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cost(args, meta, tqdm) -> int:
  """``--cost``: the CPU cost table of the activations' forward and backward, written to
  ``bench/activation_cost.json`` (or ``--out``); the exit code."""
  names = args.activations.split(",")
  with tqdm(total=len(names) * len(args.dtypes.split(",")), desc="cost", unit="row") as bar:
    def progress(msg):
      bar.set_postfix_str(msg)
      bar.update()
    rows = cpu_rows(names, args.dtypes.split(","), elements=args.elements,
                             rounds=args.repeats, progress=progress)
  return _write_table(args.out or ROOT / "bench" / "activation_cost.json", meta, rows,
                      cpu_table(rows))


def _cost_split(args, meta, tqdm) -> int:
  """``--cost-split``: where the XLA path's time goes per non-monotone activation
  (:func:`cost_split`), written to ``bench/activation_cost_split.json`` (or ``--out``); the
  exit code."""
  names = args.activations.split(",")
  rows = []
  for name in tqdm(names, desc="cost split", unit="activation"):
    for dt in args.dtypes.split(","):
      rows += cost_split(name, dt, elements=args.elements, rounds=args.repeats)
  return _write_table(args.out or ROOT / "bench" / "activation_cost_split.json", meta, rows,
                      split_table(rows))


def _write_table(out, meta, rows, md) -> int:
  """Print ``md`` and write ``out`` (JSON) and its .md with the device/versions/command line."""
  print(md)
  write_report(out, meta, rows, md,
                        f"{meta['platform']} ({meta['device']}), JAX {meta['jax']}, "
                        f"{meta['date']}; `{meta['command']}`")
  return 0



def benchmark(args: argparse.Namespace) -> int:
  """``scripts/bench_kernels.py``'s job for its parsed command line ``args``; the exit code."""
  import jax  # pylint: disable=import-outside-toplevel
  from invact_jax.ops.activations import registry  # pylint: disable=import-outside-toplevel
  on_gpu = jax.default_backend() == "gpu"
  impls = (args.implementations.split(",") if args.implementations
           else ["xla", "pallas"] if on_gpu else ["xla"])
  for a in args.activations.split(","):
    if a not in registry.ACTIVATIONS:
      print(f"error: unknown activation {a!r}; choose from {sorted(registry.ACTIVATIONS)}",
            file=sys.stderr)
      return 2
    if args.cost_split and not registry.ACTIVATIONS[a].nonmonotone:
      print(f"error: --cost-split times a fitted backward; --activations {a!r} has none (choose "
            f"from {sorted(n for n, e in registry.ACTIVATIONS.items() if e.nonmonotone)})",
            file=sys.stderr)
      return 2
  if not 3 <= args.min_log2 <= args.max_log2:
    print("error: need 3 <= --min-log2 <= --max-log2", file=sys.stderr)
    return 2
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
          "host": benchmarks.host(), "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
          "command": " ".join(sys.argv)}
  if args.cost:
    return _cost(args, meta, tqdm)
  if args.cost_split:
    return _cost_split(args, meta, tqdm)
  args.out = args.out or ROOT / "bench" / "kernels.json"
  sizes = [1 << k for k in range(args.min_log2, args.max_log2 + 1)]
  rows = []
  with tqdm(desc="bench", unit="row") as bar:
    def progress(msg):
      bar.set_postfix_str(msg)
      bar.update()
    for a in args.activations.split(","):
      rows += measure(activation=a, sizes=sizes, dtypes=args.dtypes.split(","),
                                   implementations=impls, repeats=args.repeats,
                                   inner=args.inner or (10 if on_gpu else 1),
                                   progress=progress)
  print(table(rows))
  write_report(args.out, meta, [r.as_dict() for r in rows])
  return 0
