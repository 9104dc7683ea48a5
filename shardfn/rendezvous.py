"""Meeting the other ranks with a deadline, and leaving them without waiting forever.

torch's TCPStore client can wait without end on a peer that is not a store (a port taken by another program
that accepts and never answers), whatever its timeout. So the store is made in a helper thread that the caller
stops waiting for at the deadline, and the ranks then count themselves in on the store before the process group
forms: every failure to meet (a missing rank, a wrong port or address, a port taken) ends within the deadline
with a RuntimeError that says what was waited for.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

__all__ = ["check_in_at_exit", "meet", "note_crash"]

_JOINED, _LEFT, _CRASHED = "shardfn/joined", "shardfn/left", "shardfn/crashed"


def meet(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.Store:
    """The world's TCPStore (rank 0 serves it), once all ``world`` ranks have joined it, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    made: dict = {}

    def make():
        try:
            made["store"] = dist.TCPStore(host, port, world, rank == 0, datetime.timedelta(seconds=timeout_s),
                                          wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            made["error"] = e

    thread = threading.Thread(target=make, name="shardfn-rendezvous", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0))
    if "error" in made:
        raise made["error"]
    if "store" not in made:
        raise TimeoutError(f"no store answered at {host}:{port} (is another program listening on that port?)")
    store = made["store"]
    store.add(_JOINED, 1)
    while (joined := store.add(_JOINED, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{joined} of {world} ranks joined")
        time.sleep(0.01)
    return store


def note_crash(store: dist.Store) -> None:
    """Tell the other ranks this one is ending with an error, so none waits for it at exit."""
    try:
        store.set(_CRASHED, "1")
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that served it
        pass


def check_in_at_exit(store: dist.Store, world: int, timeout_s: float) -> bool:
    """Count this rank out; True once every rank has (then all may tear down together), False when a rank
    crashed or not all arrived within ``timeout_s``."""
    try:
        store.add(_LEFT, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(_LEFT, 0) < world:
            if store.check([_CRASHED]) or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that served it
        return False
