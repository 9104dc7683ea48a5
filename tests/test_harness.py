"""The real-rank pool reports a rank that dies at once (not after the others' timeout) and starts afresh; a rank
killed by a signal gets one rerun on fresh ranks, said aloud, and a second crash fails."""

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests.harness import RankPool


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
