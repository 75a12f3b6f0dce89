"""Fault injection for the library's arguments: every public entry point, fed what an
adversarial user feeds it (wrong types, out-of-range values, shapes that do not fit, empty
inputs), raises one clear error naming the function and the argument — never a wrong number,
an IndexError from deep inside, or a silent fallback.  One row per kind of fault, so that the
next probe finds new kinds rather than new instances (the checkpoints' and the command line's
own fault tables: tests/training/test_checkpoints.py, tests/training/test_training_cli.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import invact_jax
from invact_jax import planner

X = jnp.ones((4, 8))
W = jnp.ones((8, 16))
LABELS = jnp.zeros((4,), jnp.int32)
KEY = jax.random.key(0)
lce = functools.partial(invact_jax.linear_cross_entropy, X, W, LABELS)


def _profile(name="a", **kw):
  return planner.LayerProfile(**{**dict(configuration=name, depth=2, base_bytes=100,
                                        tags=("t",), tag_bytes=(10,), tag_gain=(1.0,),
                                        full_cost=2.0), **kw})


CASES = {
    # the LM head
    "lce chunk_size 0": (lambda: lce(chunk_size=0), ValueError, "chunk_size"),
    "lce chunk_size negative": (lambda: lce(chunk_size=-4), ValueError, "chunk_size"),
    "lce chunk_size text": (lambda: lce(chunk_size="8"), ValueError, "chunk_size"),
    "lce vocab_chunk_size 0": (lambda: lce(vocab_chunk_size=0), ValueError, "vocab_chunk_size"),
    "lce reduction unknown": (lambda: lce(reduction="avg"), ValueError, "reduction"),
    "lce gradients unknown": (lambda: lce(gradients="sideways"), ValueError, "gradients"),
    "lce label_smoothing above 1": (lambda: lce(label_smoothing=1.5), ValueError,
                                    "label_smoothing"),
    "lce z_loss negative": (lambda: lce(z_loss=-1.0), ValueError, "z_loss"),
    "lce soft cap 0": (lambda: lce(logit_soft_cap=0.0), ValueError, "logit_soft_cap"),
    "lce float labels": (lambda: invact_jax.linear_cross_entropy(X, W, jnp.zeros(4)),
                         TypeError, "labels"),
    "lce labels of another length": (
        lambda: invact_jax.linear_cross_entropy(X, W, jnp.zeros((5,), jnp.int32)), ValueError,
        "labels"),
    "lce weight of another width": (
        lambda: invact_jax.linear_cross_entropy(X, jnp.ones((7, 16)), LABELS), ValueError, "w"),
    "lce return_correct not a bool": (lambda: lce(return_correct=1), TypeError,
                                      "return_correct"),
    # norms
    "layer_norm negative epsilon": (lambda: invact_jax.layer_norm(X, epsilon=-1e-6), ValueError,
                                    "epsilon"),
    "layer_norm scale of another width": (lambda: invact_jax.layer_norm(X, jnp.ones(7)),
                                          ValueError, "scale"),
    "layer_norm scalar input": (lambda: invact_jax.layer_norm(jnp.float32(1.0)), ValueError, "x"),
    "rms_norm integer input": (lambda: invact_jax.rms_norm(jnp.ones((2, 4), jnp.int32)),
                               TypeError, "x"),
    "rms_norm_dense no kernels": (lambda: invact_jax.rms_norm_dense(X, None, []), ValueError,
                                  "kernels"),
    # softmax
    "softmax no axis": (lambda: invact_jax.softmax(X, axis=()), ValueError, "axis"),
    "softmax repeated axis": (lambda: invact_jax.softmax(X, axis=(1, -1)), ValueError, "axis"),
    "softmax where not boolean": (lambda: invact_jax.softmax(X, where=jnp.ones((4, 8))),
                                  TypeError, "where"),
    "softmax where of another shape": (
        lambda: invact_jax.softmax(X, where=jnp.ones((3, 8), bool)), ValueError, "where"),
    # dropout
    "dropout rate 1": (lambda: invact_jax.dropout(X, 1.0, KEY), ValueError, "rate"),
    "dropout negative rate": (lambda: invact_jax.dropout(X, -0.1, KEY), ValueError, "rate"),
    "dropout unknown mode": (lambda: invact_jax.dropout(X, 0.1, KEY, mode="x"), ValueError,
                             "mode"),
    "dropout key not a key": (lambda: invact_jax.dropout(X, 0.1, "seed"), TypeError, "key"),
    # activations and implementations
    "gelu unknown implementation": (lambda: invact_jax.gelu(X, implementation="cuda"),
                                    ValueError, "implementation"),
    "Implementation block_rows not a power of two": (
        lambda: invact_jax.Implementation(name="pallas", block_rows=3), ValueError, "block_rows"),
    "gelu integer input": (lambda: invact_jax.gelu(jnp.ones(4, jnp.int32)), TypeError, "x"),
    # the program transformation
    "invert a non-callable": (lambda: invact_jax.invert(3), TypeError, "fn"),
    "invert unknown fallback": (lambda: invact_jax.invert(jnp.sum, fallback="memory"),
                                ValueError, "fallback"),
    "invert unknown name in only": (lambda: invact_jax.invert(jnp.sum, only=("gelu", "swishy")),
                                    ValueError, "only"),
    # the planner
    "solve a profile, not a sequence": (lambda: planner.solve(_profile(), 10**6), TypeError,
                                        "profiles"),
    "solve no profiles": (lambda: planner.solve([], 10**6), ValueError, "profiles"),
    "solve an infinite budget": (lambda: planner.solve([_profile()], float("inf")), ValueError,
                                 "budget"),
    "solve a budget of text": (lambda: planner.solve([_profile()], "1GB"), TypeError, "budget"),
    "solve two profiles with one name": (lambda: planner.solve([_profile(), _profile()], 10**6),
                                         ValueError, "configuration"),
    "solve a negative budget": (lambda: planner.solve([_profile()], -1), ValueError, "budget"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_argument_is_one_clear_error_naming_it(case):
  call, error, argument = CASES[case]
  with pytest.raises(error) as e:
    call()
  text = str(e.value)
  assert argument in text and "\n" not in text.strip(), (case, type(e.value).__name__, text)


def test_what_bad_arguments_are_not_errors_compute_what_the_reference_does():
  """Edge inputs that are not mistakes: zero tokens give the reference's zeros (before: an
  IndexError in the gradient), a chunk larger than the tokens is clamped, a generator of
  profiles is read once, a budget beyond any memory is no constraint, and a float64 NumPy
  output of an inverted function stays float64."""
  x0, labels0 = jnp.ones((0, 8)), jnp.zeros((0,), jnp.int32)
  g = jax.grad(lambda x, w: invact_jax.linear_cross_entropy(x, w, labels0, reduction="sum"),
               argnums=(0, 1))(x0, W)
  g_ref = jax.grad(lambda x, w: invact_jax.linear_cross_entropy_reference(
      x, w, labels0, reduction="sum"), argnums=(0, 1))(x0, W)
  for a, b in zip(g, g_ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(lce(chunk_size=1 << 20), invact_jax.linear_cross_entropy_reference(
      X, W, LABELS), rtol=1e-6)
  plan = planner.solve((p for p in [_profile("a"), _profile("b", base_bytes=90)]), 10**6)
  assert plan.configuration in ("a", "b")
  # A budget beyond any memory is no constraint (not an overflow): the unconstrained plan.
  huge, large = planner.solve([_profile()], 10**400), planner.solve([_profile()], 10**12)
  assert (huge.configuration, huge.keep, huge.predicted_bytes) == (
      large.configuration, large.keep, large.predicted_bytes)
  # A NumPy float64 output the function returns as it is stays float64 (before: float32).
  out = invact_jax.invert(lambda x: (jnp.sum(jax.nn.gelu(x)), np.arange(3.0)))(jnp.ones(3))
  assert isinstance(out[1], np.ndarray) and out[1].dtype == np.float64
