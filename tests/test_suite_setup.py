"""The suite's own set-up (conftest.py): cheap compiles, and tests that need XLA's default."""
import os

import pytest

_CHEAP = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


@pytest.mark.default_compiler
def test_a_default_compiler_test_runs_without_the_cheap_flags():
  flags = os.environ["XLA_FLAGS"].split()
  assert not set(_CHEAP) & set(flags), flags
  assert "--xla_force_host_platform_device_count=8" in flags


def test_other_tests_compile_cheaply_unless_told_otherwise():
  flags = os.environ["XLA_FLAGS"].split()
  if os.environ.get("INVACT_JAX_TEST_DEFAULT_COMPILER") == "1":
    assert not set(_CHEAP) & set(flags), flags
  else:
    assert any(f.startswith("--xla_backend_optimization_level=") for f in flags), flags
