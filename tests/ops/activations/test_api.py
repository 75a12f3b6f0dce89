"""The public activations are written out (``def gelu``) and name exactly the registry's ops;
their signatures mirror ``jax.nn``'s plus ``implementation=``; the registry holds function
objects (no lookup by name)."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax.ops.activations import api, registry


def test_public_functions_and_registry_name_the_same_ops():
  assert set(api.OPS) == set(registry.PUBLIC)
  for name, (fn, ref) in api.OPS.items():
    assert getattr(invact_jax, name) is fn and getattr(invact_jax, f"{name}_reference") is ref
    assert fn.__name__ == name and fn.__module__ == api.__name__  # a real def, found by grep
    assert fn.__doc__ and "Args:" in fn.__doc__ and "Returns:" in fn.__doc__
    assert "jax.nn" in ref.__doc__


@pytest.mark.parametrize("name", sorted(registry.PUBLIC))
def test_signatures_mirror_jax_nn(name):
  fn, ref = api.OPS[name]
  original = registry.PUBLIC[name][0].original
  nn = inspect.signature(original).parameters
  ours = inspect.signature(fn).parameters
  assert list(ours) == [p for p in nn] + ["implementation"]
  for p in nn:
    assert ours[p].default == nn[p].default, (name, p)
  assert ours["implementation"].kind is inspect.Parameter.KEYWORD_ONLY
  assert list(inspect.signature(ref).parameters) == list(nn)


def test_registry_holds_function_objects():
  for a in registry.ACTIVATIONS.values():
    for f in (a.original, a.grad, a.forward64, a.derivative64):
      assert callable(f), a.name
    assert a.nonmonotone or callable(a.grad64), a.name


@pytest.mark.parametrize("bad", ["yes", None, 1, np.float32(1.0)])
def test_gelu_approximate_must_be_a_bool(bad):
  with pytest.raises(TypeError, match="invact_jax.gelu: argument `approximate` must be True or False"):
    invact_jax.gelu(jnp.ones(3), approximate=bad)


def test_numpy_bool_selects_like_a_python_bool():
  x = jnp.linspace(-2.0, 2.0, 5)
  assert bool(jnp.all(invact_jax.gelu(x, np.bool_(False)) == jax.nn.gelu(x, approximate=False)))
