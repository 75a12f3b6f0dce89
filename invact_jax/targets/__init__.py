"""Compile targets: this machine, or a GPU or TPU compiled for without one (deviceless).

XLA compiles for a device that is not attached when it is given the device's description:
``"h100"``/``"h200"`` (the ``GpuTargetConfigProto`` files in this package), ``"h100x8"``
(eight of one host), a config file of your own, or a TPU slice (``"v5e:2x2"``).  The figures
such a compile reports (``memory_analysis()``, the optimized HLO) are the device compiler's
(docs/deviceless.md; the compilers are found as :mod:`._compilers` says).

Example:
  >>> from invact_jax import targets
  >>> targets.platform()          # compiles are for this machine unless told otherwise
  'cpu'
"""
from invact_jax.targets._compilers import DEVICELESS_ENV
from invact_jax.targets._target import GPUS
from invact_jax.targets._target import Platform
from invact_jax.targets._target import TPUS
from invact_jax.targets._target import Target
from invact_jax.targets._target import compiling_for
from invact_jax.targets._target import current
from invact_jax.targets._target import local
from invact_jax.targets._target import platform
from invact_jax.targets._target import resolve

__all__ = ["Target", "Platform", "resolve", "current", "platform", "compiling_for", "local",
           "GPUS", "TPUS", "DEVICELESS_ENV"]
