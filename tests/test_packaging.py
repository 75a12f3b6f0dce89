"""Layout facts: the top-level packages (two in the wheel, a third in the checkout), the import
arrows, one activation list."""
import ast
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import invact_jax
from invact_jax.ops.activations import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_top_level_packages_resolve_to_this_repo():
  for name in ("invact_jax", "pallas_kernels", "models"):
    mod = importlib.import_module(name)
    assert pathlib.Path(mod.__file__).resolve().parent == ROOT / name, (name, mod.__file__)


def test_models_shadows_no_stdlib_module():
  assert "models" not in sys.stdlib_module_names


def test_the_wheel_adds_only_the_library_and_its_kernels(tmp_path):
  """A user's ``pip install`` puts ``invact_jax`` and ``pallas_kernels`` on the import path,
  never the checkout's ``models`` (the commonest module name in ML projects), scripts or
  tests."""
  src = tmp_path / "src"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".venv*", ".git", "bench", "runs", "*.egg-info", "build", "__pycache__", ".whl"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                  str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
  (wheel,) = (tmp_path / "dist").glob("*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {name.split("/")[0] for name in names}
  assert {t for t in top if not t.endswith(".dist-info")} == {"invact_jax", "pallas_kernels"}
  assert {"invact_jax/targets/h100.txtpb", "invact_jax/targets/h200.txtpb"} <= set(names)


def _imports(path):
  return re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), re.M)


def test_import_arrows_point_down():
  """scripts -> models.benchmarks -> models.training -> models -> invact_jax -> pallas_kernels,
  never back."""
  forbidden = {"pallas_kernels": ("invact_jax", "models"), "invact_jax": ("models",),
               "models": ("models.training", "models.benchmarks"),
               "models/training": ("models.benchmarks",)}
  for pkg, above in forbidden.items():
    for path in (ROOT / pkg).rglob("*.py"):
      if pkg == "models" and {"training", "benchmarks"} & set(path.relative_to(ROOT / pkg).parts):
        continue
      for mod in _imports(path):
        assert not any(mod == a or mod.startswith(a + ".") for a in above), (path, mod)


def test_library_tests_import_no_training_or_benchmark_code():
  """The library's own tests (tests/*.py, tests/ops, tests/convert, tests/planner) stand without the
  training and benchmark packages; the docs' test checks the figures those generate."""
  paths = [*(ROOT / "tests").glob("test_*.py"), *(ROOT / "tests" / "ops").rglob("*.py"),
           *(ROOT / "tests" / "convert").rglob("*.py"),
           *(ROOT / "tests" / "planner").rglob("*.py")]
  for path in paths:
    if path.name == "test_docs.py":
      continue
    for mod in _imports(path):
      assert not mod.startswith(("models.training", "models.benchmarks")), (path, mod)


def test_no_private_names_across_modules():
  pattern = re.compile(r"\b(?:benchmark|training|planning|op_speed|model_memory|trainer|trainer_lib|"
                       r"run_dir|loop|config|errors|checkpoints|data_lib|child|presets)\._[a-z]\w*")
  for path in list((ROOT / "models").rglob("*.py")) + list((ROOT / "scripts").glob("*.py")):
    assert not pattern.findall(path.read_text()), path


def test_only_the_registry_spells_out_the_activation_list():
  """Outside tests/, a file naming (nearly) every activation is the registry, the public
  functions written out over it (tests/ops/activations/test_api.py keeps the two in step), or
  generated."""
  names = [n for n in registry.ACTIVATIONS if n not in ("tanh", "relu")]  # common words too
  allowed = {ROOT / "invact_jax/ops/activations/registry.py",
             ROOT / "invact_jax/ops/activations/api.py",
             ROOT / "invact_jax/ops/activations/reference.py",
             ROOT / "invact_jax/ops/activations/_fits.py"}
  for path in ROOT.rglob("*.py"):
    if "tests" in path.parts or any(p.startswith(".venv") for p in path.parts) or path in allowed:
      continue
    text = path.read_text()
    found = [n for n in names if re.search(rf"\b{n}\b", text)]
    assert len(found) < len(names) - 2, (path, found)


def test_every_script_runs_from_a_checkout_without_makes_pth(tmp_path):
  """After ``pip install -e .`` alone (no .pth putting the checkout on the path, which only
  ``make`` writes), every script's ``--help`` works: each puts its own checkout first on the
  path (one line, its only edit of ``sys.path``) before importing ``models``."""
  code = f"""
import runpy, sys
root = {str(ROOT)!r}
for script in sys.argv[1:]:
  sys.path[:] = [p for p in sys.path if p.rstrip("/") != root]
  for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
    del sys.modules[name]
  sys.argv = [script, "--help"]
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    assert e.code in (0, None), (script, e.code)
  print("ok", script)
"""
  scripts = sorted(str(p) for p in (ROOT / "scripts").glob("*.py"))
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run([sys.executable, "-c", code, *scripts], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.count("ok ") == len(scripts)
  for path in scripts:
    text = pathlib.Path(path).read_text()
    edits = [line for line in text.splitlines() if "sys.path" in line]
    assert edits == ["sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  "
                     "# the checkout: models/"], (path, edits)


def test_submodules_reachable_after_import():
  code = ("import invact_jax; print(invact_jax.memory.__name__, invact_jax.planner.__name__, "
          "invact_jax.accuracy.__name__, invact_jax.registry.__name__, invact_jax.flax.__name__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["invact_jax.memory", "invact_jax.planner", "invact_jax.accuracy",
                                "invact_jax.ops.activations.registry", "invact_jax.flax"]
  assert {"memory", "planner"} <= set(dir(invact_jax))


def test_layout_page_names_every_module():
  layout = (ROOT / "docs" / "layout.md").read_text()
  for pkg in ("invact_jax", "pallas_kernels", "models", "scripts"):
    for path in (ROOT / pkg).rglob("*.py"):
      if path.name == "__init__.py":
        continue
      assert f"{path.stem}.py" in layout, f"docs/layout.md does not name {path.relative_to(ROOT)}"


def test_nothing_runs_a_script_as_a_child_process():
  """The experiment layer runs children as modules (``python -m``), never ``scripts/*.py``."""
  for pkg in ("invact_jax", "models"):
    for path in (ROOT / pkg).rglob("*.py"):
      text = path.read_text()
      assert '"scripts"' not in text and "scripts/" not in "".join(
          l for l in text.splitlines() if "subprocess" in l or "sys.executable" in l), path


def test_the_library_has_no_function_over_80_lines_and_a_short_program_module():
  """Facts a reader can check: every function in invact_jax/ fits on a screen, and
  convert/_program.py (tracing, options, the call) stays at most 400 lines."""
  long = []
  for path in (ROOT / "invact_jax").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.end_lineno - node.lineno + 1 > 80:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
  assert not long, long
  assert len((ROOT / "invact_jax/convert/_program.py").read_text().splitlines()) <= 400


def test_files_a_newcomer_can_hold_in_their_head():
  """No file in invact_jax/ or models/ over 600 lines, no class in invact_jax/ over 300, no
  function in models/ over 80 (invact_jax's: the test above)."""
  big = []
  for pkg in ("invact_jax", "models"):
    for path in (ROOT / pkg).rglob("*.py"):
      text = path.read_text()
      if len(text.splitlines()) > 600:
        big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
      for node in ast.walk(ast.parse(text)):
        size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and pkg == "invact_jax" and size > 300:
          big.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: {size}")
        if isinstance(node, ast.FunctionDef) and pkg == "models" and size > 80:
          big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {size}")
  assert not big, big


def test_every_non_trivial_private_function_says_what_it_does():
  """A private function of 8 lines or more in the library, the kernels or models/ has a
  docstring (a newcomer reads what it is for before how)."""
  missing = []
  for pkg in ("invact_jax", "pallas_kernels", "models"):
    for path in (ROOT / pkg).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.FunctionDef) and node.name.startswith("_")
            and not node.name.startswith("__") and node.name != "_"
            and node.end_lineno - node.lineno + 1 >= 8 and ast.get_docstring(node) is None):
          missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
  assert not missing, missing


def test_one_description_per_kind_in_the_layout():
  """memory imports nothing from convert (the floor audit is convert's); one planner package;
  the public API written out (no lazy ``__getattr__``, ``import_module`` or ``globals()`` in
  ``invact_jax/__init__.py`` or the ops' api modules); the frontier's blocks are the
  reference layers; no issue numbers in code."""
  memory_text = (ROOT / "invact_jax" / "memory.py").read_text()
  assert not re.search(r"^\s*(?:from|import)\s+invact_jax(?:\.convert\b|\s+import\s.*\bconvert\b)",
                       memory_text, re.M)
  assert not (ROOT / "invact_jax" / "program_planner.py").exists()
  assert (ROOT / "invact_jax" / "planner" / "__init__.py").exists()
  for path in [ROOT / "invact_jax" / "__init__.py", *(ROOT / "invact_jax" / "ops").rglob("api.py")]:
    text = path.read_text()
    assert not re.search(r"\bglobals\(\)|import_module|^def __getattr__", text, re.M), path
  # the frontier's layers are the reference layers (one description of a Llama layer)
  stack = (ROOT / "models" / "benchmarks" / "frontier" / "model_stack.py").read_text()
  assert "reference_layers.llama_layer" in stack and "silu" not in stack
  for pkg in ("invact_jax", "models", "scripts", "pallas_kernels", "tests"):
    for path in (ROOT / pkg).rglob("*.py"):
      assert not re.search(r"\b[Ii]ssue \d+|#\d\d\b", path.read_text()), path
