import pytest
import torch

from tests.harness import RankPool


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def gloo4():
    """Four real gloo ranks for this test module."""
    pool = RankPool(4)
    yield pool
    pool.close()
