"""The activations under test, from the registry: one case per entry, plus parameter values
that make a monotone activation keep its bit (elu alpha < 0, leaky_relu slope <= 0)."""
import dataclasses
import functools

import invact_jax
from invact_jax.ops.activations import base, registry

DTYPES = ("float32", "bfloat16", "float16")
# Parameter values under which the output no longer tells the branch (a bit is kept).
_BIT_PARAMS = {"elu": (("alpha", -0.5),), "leaky_relu": (("negative_slope", -0.2),)}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str                 # case id
  entry: registry.Activation
  params: tuple = ()

  @property
  def op(self) -> base.Op:
    return base.Op(self.entry, self.params or self.entry.params)

  def fn(self, implementation=None):
    """``invact_jax.<public>`` with this case's selector and params bound."""
    return functools.partial(getattr(invact_jax, self.entry.public), **dict(self.entry.selector),
                             **dict(self.params), implementation=implementation)

  def reference(self):
    return functools.partial(self.entry.original, **dict(self.entry.selector), **dict(self.params))

  @property
  def audit_name(self):
    return self.entry.name


CASES = {n: Case(n, a) for n, a in registry.ACTIVATIONS.items()}
CASES.update({f"{n}_with_bit": Case(f"{n}_with_bit", registry.get(n), p)
              for n, p in _BIT_PARAMS.items()})
NONMONOTONE = registry.nonmonotone()
