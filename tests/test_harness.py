"""The real-rank pool reports a rank that dies at once (not after the others' timeout) and starts afresh; a rank
killed by a signal gets one rerun on fresh ranks, said aloud, and a second crash fails. A launched run (mpirun,
torchrun) that ends in the same intermittent failure is run once more, alike; one whose ranks time out in a
collective is a failure (a hang the agreement should have prevented), never rerun."""

import os
import signal
import subprocess
import time

import pytest
import torch.distributed as dist

from tests.harness import RankPool
from tests.launch import RERUNS, succeeds


@pytest.fixture(autouse=True)
def _reruns_of_the_suite_only():
    """The reruns these tests cause on purpose are not the suite's: CI's count leaves them out."""
    before = len(RERUNS)
    yield
    del RERUNS[before:]


def _exit_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _rank():
    return dist.get_rank()


def test_a_dead_rank_is_reported_at_once_and_the_pool_restarts():
    pool = RankPool(2, timeout_s=120)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 3\) running _exit_on_rank_one"):
            pool.run(_exit_on_rank_one)
        assert time.monotonic() - start < 60
        assert pool.run(_rank) == [0, 1]
    finally:
        pool.close()


def _crash_on_rank_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_a_crashed_rank_is_rerun_once_then_fails():
    pool = RankPool(2, timeout_s=120)
    try:
        with pytest.warns(RuntimeWarning, match="rank 1 died") as warned, \
                pytest.raises(RuntimeError, match="rank 1 died"):
            pool.run(_crash_on_rank_one)  # crashes every time: the rerun crashes too, and that fails
        # the report quotes the dead rank's stderr: faulthandler's stack of where it was
        said = str(warned[0].message)
        assert "Fatal Python error: Segmentation fault" in said and "_crash_on_rank_one" in said, said
        assert pool.run(_rank) == [0, 1]
    finally:
        pool.close()


_STUCK = ("[rank1]: RuntimeError: [/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 300000ms "
          "for send operation to complete")


def _launches(*outcomes):
    """A stand-in launcher answering each run with the next (exit code, stderr); the scripts it was asked for."""
    asked, left = [], list(outcomes)

    def launch(script, *args, **kwargs):
        asked.append((script, args, kwargs))
        code, err = left.pop(0)
        return subprocess.CompletedProcess([script], code, stdout=f"out {len(asked)}", stderr=err)

    return launch, asked


@pytest.mark.parametrize("failure", ["mpirun noticed that process rank 3 with PID 7 on node x exited on signal 11 "
                                     "(Segmentation fault).", "Signal 11 (SIGSEGV) received by PID 7"])
def test_a_launch_that_ends_in_the_intermittent_failure_runs_once_more(failure):
    launch, asked = _launches((1, failure), (0, ""))
    with pytest.warns(RuntimeWarning, match="samples/x.py: .*; running it again"):
        assert succeeds(launch, "samples/x.py", 8, timeout=5) == "out 2"
    assert asked == [("samples/x.py", (8,), {"timeout": 5})] * 2

    launch, asked = _launches((1, failure), (1, failure))  # a second time fails the test
    with pytest.warns(RuntimeWarning), pytest.raises(AssertionError, match="exit 1"):
        succeeds(launch, "samples/x.py", 8)
    assert len(asked) == 2


@pytest.mark.parametrize("failure", ["[rank0]: ValueError: in_strategy[0] splits dim 0 of size 6 over 4", _STUCK])
def test_a_launch_that_fails_otherwise_is_not_run_again(failure):
    launch, asked = _launches((1, failure), (0, ""))
    with pytest.raises(AssertionError, match=r"errors:\n\[rank\d\]: \w+Error"):
        succeeds(launch, "samples/x.py", 4)
    assert len(asked) == 1
