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


def pytest_terminal_summary(terminalreporter):
    """How many bodies ran again after a rank died by a signal (never after a timeout): said on every run."""
    from tests.launch import RERUNS

    terminalreporter.write_line(f"shardfn harness: {len(RERUNS)} rerun(s) after a rank died by a signal")
    for line in RERUNS:
        terminalreporter.write_line(f"  rerun: {line}")
