import pytest
import torch

from tests.harness import RankPool


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_real_world_left_behind(request):
    """A test that starts a real process group in the test process (a world of one: sf.shard outside a simulated
    world) leaves it for every later test, whose simulated worlds then fail: said at that test, and cleaned up."""
    yield
    import torch.distributed as dist

    from shardfn.runtime import is_simulated

    if dist.is_initialized() and not is_simulated() and dist.get_backend() != "fake":
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a real process group in the test process; run its body in "
                    "simulated_world(n) or in the rank pool")


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
