"""Test harness: simulated ranks in one process, and a pool of real gloo ranks per test module.

Simulated: ``with simulated_world(8): ...`` (shardfn.runtime) runs 8 ranks in this process; :func:`on_rank`
reads one rank's value of a tensor made inside it.

Real: :class:`RankPool` starts N processes once, joins them into a gloo world, and runs module-level test
bodies ``body(*args)`` on every rank, returning each rank's result (or re-raising the first rank's error).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor


def on_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local value of a (D)Tensor made under LocalTensorMode."""
    if isinstance(t, DTensor):
        t = t.to_local()
    locals_ = getattr(t, "_local_tensors", None)
    return locals_[rank] if locals_ is not None else t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a rank killed by a signal (SIGSEGV, SIGABRT) shows where it was
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    while True:
        job = conn.recv()
        if job is None:
            break
        fn, args = job
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", traceback.format_exc()))
    import torch.distributed as dist

    dist.destroy_process_group()


class RankPool:
    """``world`` real gloo ranks, started once; ``run(fn, *args)`` calls ``fn(*args)`` on all of them. A pool
    whose rank died (a failed test) is started afresh for the next test."""

    def __init__(self, world: int, timeout_s: float = 300.0):
        self.world, self.timeout_s = world, timeout_s
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for c in self.conns:
            c.send((fn, args))
        results = []
        for rank, c in enumerate(self.conns):
            if not c.poll(self.timeout_s):
                self.close()
                raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s} s")
            try:
                results.append(c.recv())
            except EOFError:
                self.procs[rank].join(timeout=10)
                raise RuntimeError(f"rank {rank} died (exit code {self.procs[rank].exitcode}) running "
                                   f"{fn.__name__}{args}; its stack is above, on stderr") from None
        for rank, (status, value) in enumerate(results):
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
        return [value for _, value in results]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
