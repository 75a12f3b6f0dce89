"""Test-session setup: 8 virtual CPU devices for the sharding tests (before JAX starts)."""
import os

# The user's XLA_FLAGS, kept for pytest-xdist's workers (they inherit this process's changes).
_USER_XLA_FLAGS = os.environ.setdefault("INVACT_JAX_TEST_USER_XLA_FLAGS",
                                        os.environ.get("XLA_FLAGS", ""))
_BASE_XLA_FLAGS = _USER_XLA_FLAGS
if "--xla_force_host_platform_device_count" not in _BASE_XLA_FLAGS:
  _BASE_XLA_FLAGS = f"{_BASE_XLA_FLAGS} --xla_force_host_platform_device_count=8".strip()

# Cheap compiles: compiling is most of the suite's time.  The figures the tests check do not
# depend on how XLA:CPU turns the optimized HLO into machine code (buffer assignment, hence
# compiled temp bytes, and XLA's FLOP counts come before it), so the suite runs
#  - LLVM at -O0 (the planner's model compiled in 4.2 s instead of 7.0 s), and
#  - where jaxlib has the switch (0.10; 0.11.2 and 0.12 removed it, and an unknown flag in
#    XLA_FLAGS stops XLA), XLA:CPU's older elemental
#    emitters instead of its fusion emitters: a small ViT step compiles in 0.29 s instead of
#    0.79 s, and the suite took 6 m 47 s instead of 8 m 35 s (2 cores, JAX 0.10.2).
# What needs XLA's default code generation uses it: tests.jit for last-ulp comparisons of two
# compilations, and @pytest.mark.default_compiler for a test whose claim holds there only
# (e.g. that two programs train bit-identically); such a test runs in a process of its own
# (pytest_pyfunc_call below).  XLA_FLAGS set by the user are kept (e.g.
# --xla_backend_optimization_level=3); INVACT_JAX_TEST_DEFAULT_COMPILER=1 runs every test at
# XLA's default.
DEFAULT_COMPILER_ENV = "INVACT_JAX_TEST_DEFAULT_COMPILER"
_CHEAP = []
if os.environ.get(DEFAULT_COMPILER_ENV) != "1":
  if "--xla_backend_optimization_level" not in _USER_XLA_FLAGS:
    _CHEAP.append("--xla_backend_optimization_level=0")
  if "--xla_cpu_use_fusion_emitters" not in _USER_XLA_FLAGS:
    from importlib import metadata
    try:
      _jaxlib = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
      _jaxlib = (0, 0)
    if (0, 10) <= _jaxlib < (0, 11):
      _CHEAP.append("--xla_cpu_use_fusion_emitters=false")
  if "--xla_cpu_parallel_codegen_split_count" not in _USER_XLA_FLAGS:
    # LLVM code generation of one module in one piece instead of parts compiled on a thread
    # pool: the suite's programs are small, and the pool's start-up outweighed its parallelism
    # (tests/convert/test_program.py and tests/planner/test_api.py 108 s -> 102 s in one
    # process; 2 cores, JAX 0.10.2, 2026-11-27).
    _CHEAP.append("--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join([_BASE_XLA_FLAGS, *_CHEAP])

# Python tracebacks in MLIR locations only serve error messages.  XLA's call inliner copies
# every op's stack into inlined calls, and with pytest-xdist's deep worker stacks (JAX keeps
# 100 frames by default) compiling interpret-mode Pallas kernels under custom_partitioning
# took over 15 minutes instead of 1 s (XLA:CPU, JAX 0.10.2).  16 frames keep the user's part.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "16")

# Python's cyclic garbage collector at larger thresholds: tracing, lowering and compiling
# allocate millions of short-lived container objects, so at the default (700, 10, 10) a test
# process ran about 2,000 collections per test file, each traversing what was alive
# (tests/ops/activations/test_xla.py in one process: 1,960 collections, 2.6 s, at the default;
# 178, 1.0 s, here; test_program.py 46.7 -> 44.9 s and test_xla.py 61.0 -> 60.1 s, means of two
# interleaved runs, the same peak memory; 2 cores, JAX 0.10.2, 2026-11-30).  What was
# collected before the tests is frozen out of later collections (pytest_collection_finish).
# Cycles are still collected.
import gc  # noqa: E402  pylint: disable=wrong-import-position
gc.set_threshold(20_000, 20, 20)


def pytest_collection_finish(session):  # pylint: disable=unused-argument
  gc.collect()
  gc.freeze()


# One persistent XLA compilation cache per test run and xdist worker, shared with the scripts
# the worker's tests start (same HLO => same executable; many tests compile the same model step
# from fresh closures).  A new directory per run, removed at the end, so nothing carries over
# between runs; one per worker, because JAX writes entries without a lock when the cache has no
# size limit (so the two processes of a multi-process test each get a directory of their own:
# tests/training/test_distributed.py).  Every compilation is kept, however short: a script
# the tests start compiles ~60 small programs (parameter initialisation, optimizer set-up) that
# took 1.8 s of its 8.4 s when each launch compiled them again.  A cache directory the user set
# is left alone.
_OURS = "invact_jax_test_xla_cache_"
_CACHE = None
if _OURS in os.environ.get("JAX_COMPILATION_CACHE_DIR", _OURS):
  import tempfile
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
  _CACHE = os.path.join(tempfile.gettempdir(),
                        f"{_OURS}{_run}_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
  if _CACHE is not None:
    import shutil
    shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_configure(config):
  config.addinivalue_line("markers", "default_compiler: runs at XLA's default code generation "
                          "(a process of its own when the suite compiles cheaply; conftest.py)")


def pytest_pyfunc_call(pyfuncitem):
  """A ``default_compiler`` test, while this process compiles cheaply: run it in a child pytest
  at XLA's default and report its outcome as this test's."""
  if not _CHEAP or pyfuncitem.get_closest_marker("default_compiler") is None:
    return None
  import subprocess
  import sys
  import tempfile
  import xml.etree.ElementTree as ET
  import pytest
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("PYTEST_XDIST_") and k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(XLA_FLAGS=_BASE_XLA_FLAGS, **{DEFAULT_COMPILER_ENV: "1"})
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "report.xml")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}", pyfuncitem.nodeid],
                          cwd=str(pyfuncitem.config.rootpath), env=env, capture_output=True,
                          text=True, check=False)
    cases = list(ET.parse(report).iter("testcase")) if os.path.exists(report) else []
  if done.returncode == 0 and len(cases) == 1:
    skipped = cases[0].find("skipped")
    if skipped is not None:
      pytest.skip(skipped.get("message", "skipped in the default-compiler process"))
    return True
  pytest.fail(f"in a process at XLA's default compiler (exit {done.returncode}):\n"
              f"{done.stdout[-8000:]}\n{done.stderr[-2000:]}", pytrace=False)


# The longest files first: pytest-xdist (``--dist loadfile --no-loadscope-reorder``, the
# Makefile's) hands files out in this order, so no long file runs alone at the end while the
# other worker idles.  (Without the flag xdist >= 3.5 orders files by their number of tests:
# tests/training/test_distributed.py, 107 s in 9 tests, started 235 s into the run.)
# Every file of 4 s or more, by measured per-file time (the sum of its tests' ``--durations=0``
# lines in ``make test ARGS=--durations=0``), 2 cores, JAX 0.10.2, 2026-11-29.
_LONG_FILES = ("tests/training/test_distributed.py", "tests/ops/activations/test_xla.py",
               "tests/ops/activations/test_pallas.py", "tests/training/test_training.py",
               "tests/test_targets.py", "tests/convert/test_cross_entropy.py",
               "tests/planner/test_api.py", "tests/convert/test_program.py",
               "tests/benchmarks/test_frontier.py", "tests/ops/test_cross_entropy.py",
               "tests/models/test_models.py", "tests/ops/activations/test_triton.py",
               "tests/training/test_training_cli.py", "tests/convert/test_third_party.py",
               "tests/training/test_storage.py", "tests/ops/norms/test_pallas.py",
               "tests/training/test_recovery.py", "tests/training/test_permissions.py",
               "tests/ops/norms/test_triton.py", "tests/benchmarks/test_parity.py",
               "tests/benchmarks/test_frontier_deviceless.py",
               "tests/convert/test_keras_penzai.py", "tests/convert/test_algebra.py",
               "tests/ops/test_cross_entropy_pallas.py", "tests/ops/activations/test_fits.py",
               "tests/convert/test_attributes.py", "tests/benchmarks/test_gpu_report.py",
               "tests/benchmarks/test_plan_memory.py", "tests/benchmarks/test_plan_program.py",
               "tests/convert/test_fusion.py", "tests/test_memory.py",
               "tests/training/test_checkpoints.py", "tests/test_packaging.py",
               "tests/benchmarks/test_floor.py", "tests/benchmarks/test_invert_models.py",
               "tests/ops/test_softmax.py", "tests/benchmarks/test_lm_head.py",
               "tests/convert/test_deferred_softmax.py",
               "tests/ops/activations/test_accuracy.py", "tests/benchmarks/test_op_speed.py",
               "tests/ops/norms/test_xla.py")


# ``pytest -m gpu`` (``make gpu-test`` on a GPU machine): the tests whose outcome depends on the
# device -- the ops (compiled kernels run only on a GPU), memory and the models -- less the
# interpret-mode classes (CPU stand-ins for the kernels) and the slow ones; and the converted
# heads' tests of the program's bfloat16 logits (on a GPU the head takes them from its matmul).
_HEAD = "tests/convert/test_cross_entropy.py::test_"
_DEVICE_PATHS = ("tests/ops/", "tests/test_memory.py", "tests/models/", *(_HEAD + name for name in (
    "bfloat16_logits_cast_to_float32", "a_cross_entropy_the_program_computes_in_bfloat16",
    "on_a_gpu_the_head_takes_the_bfloat16_logits", "that_float32_arithmetic_changes_nothing",
    "a_bfloat16_cast_of_a_float32_weight", "the_head_keeps_the_programs_bfloat16_rounding",
    "where_xla_folds_the_programs_rounding")))


def _compiled_kernel_test(item) -> bool:
  """A test of a compiled kernel class (``IMPLEMENTATION`` not XLA, not ``INTERPRET``)."""
  cls = getattr(item, "cls", None)
  return (cls is not None and getattr(cls, "IMPLEMENTATION", "xla") != "xla"
          and getattr(cls, "INTERPRET", None) is False)


def pytest_collection_modifyitems(config, items):
  import pytest
  import jax
  if jax.default_backend() != "gpu":
    # Compiled kernels run only on a GPU (their interpret-mode subclasses cover the CPU):
    # deselected here rather than skipped one by one (3,700 skip reports cost the CPU suite
    # seconds of collection and reporting).
    kept, dropped = [], []
    for item in items:
      (dropped if _compiled_kernel_test(item) else kept).append(item)
    if dropped:
      config.hook.pytest_deselected(items=dropped)
      items[:] = kept
  for item in items:
    if (item.nodeid.startswith(_DEVICE_PATHS) and "Interpret" not in item.nodeid
        and item.get_closest_marker("slow") is None):
      item.add_marker(pytest.mark.gpu)
  rank = {f: i for i, f in enumerate(_LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
