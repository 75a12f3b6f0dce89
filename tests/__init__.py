

def load_script(name: str):
  """``scripts/<name>.py`` as a module (the scripts are not a package)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
