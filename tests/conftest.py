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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks a test whose setup or call failed (for :func:`gloo4`'s fresh ranks after a failure)."""
    report = (yield).get_result()
    if report.failed:
        item.shardfn_failed = True


@pytest.fixture(scope="session")
def _gloo4_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture
def gloo4(_gloo4_pool, request):
    """Four real gloo ranks, started once for the whole session (a start of four ranks costs about 14 s of the
    suite's 2 cores; every module that used its own paid it again). A test that failed leaves nothing behind:
    its ranks are ended, and the next test's body runs on fresh ones (RankPool restarts a pool whose ranks are
    gone), as a pool per module did for the next module."""
    yield _gloo4_pool
    if getattr(request.node, "shardfn_failed", False):
        _gloo4_pool.close()


def pytest_terminal_summary(terminalreporter):
    """How many bodies ran again after a rank died by a signal (never after a timeout): said on every run."""
    from tests.launch import RERUNS

    terminalreporter.write_line(f"shardfn harness: {len(RERUNS)} rerun(s) after a rank died by a signal")
    for line in RERUNS:
        terminalreporter.write_line(f"  rerun: {line}")
