"""The activations under test, by name: (invact function, jax.nn reference, audit name)."""
import functools

import jax
import jax.numpy as jnp

import invact_jax

CASES = {
    "gelu_tanh": (functools.partial(invact_jax.gelu, approximate=True),
                  functools.partial(jax.nn.gelu, approximate=True)),
    "gelu_erf": (functools.partial(invact_jax.gelu, approximate=False),
                 functools.partial(jax.nn.gelu, approximate=False)),
    "silu": (invact_jax.silu, jax.nn.silu),
    "mish": (invact_jax.mish, jax.nn.mish),
    "sigmoid": (invact_jax.sigmoid, jax.nn.sigmoid),
    "tanh": (invact_jax.tanh, jnp.tanh),
    "softplus": (invact_jax.softplus, jax.nn.softplus),
    "elu": (invact_jax.elu, jax.nn.elu),
    "leaky_relu": (invact_jax.leaky_relu, jax.nn.leaky_relu),
    "relu": (invact_jax.relu, jax.nn.relu),
}
NONMONOTONE = ("gelu_tanh", "gelu_erf", "silu", "mish")
DTYPES = ("float32", "bfloat16", "float16")
