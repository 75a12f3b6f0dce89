import pytest

from models.training import data as data_lib


@pytest.fixture(scope="module")
def digits():
  """The embedded digits dataset (seed 0)."""
  return data_lib.load_digits()
