"""Layout/packaging facts: the three top-level packages are this project's."""
import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_top_level_packages_resolve_to_this_repo():
  for name in ("invact_jax", "pallas_kernels", "models"):
    mod = importlib.import_module(name)
    assert pathlib.Path(mod.__file__).resolve().parent == ROOT / name, (name, mod.__file__)


def test_models_shadows_no_stdlib_module():
  assert "models" not in sys.stdlib_module_names


def test_layering_pallas_kernels_imports_nothing_above():
  for path in (ROOT / "pallas_kernels").glob("*.py"):
    text = path.read_text()
    for upper in ("import invact_jax", "from invact_jax", "import models", "from models"):
      assert upper not in text, (path, upper)
