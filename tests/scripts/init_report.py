"""Prints what shardfn.init() found: launcher, rank, world size, backend; checks an all_reduce over the world; and,
at exit, how many threads the process has once shardfn's shutdown ran (gloo's workers must have ended there, not
in the interpreter's finalization, where they can abort the process)."""

import atexit
import contextlib
import os
import time

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.runtime import detect_launch


def _threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names


def _report_threads() -> None:
    # A thread that returned can stay listed a moment before the kernel reaps it: wait up to 3 s for the count to
    # fall back, then name what is left (a worker still alive here outlives shutdown, which the test catches)
    deadline = time.monotonic() + 3.0
    while len(_threads()) > len(_BEFORE) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _threads()
    print(f"threads at exit: {len(left)} (before init: {len(_BEFORE)}) {sorted(left)}", flush=True)


_BEFORE = _threads()
# atexit runs last-in first-out: this runs after the shutdown init() registers
atexit.register(_report_threads)

mesh = sf.init()  # held to the end, as a user's script holds it
again = sf.init()  # idempotent: the same world
assert again.size() == mesh.size()
t = torch.ones(1)
dist.all_reduce(t)
launch = detect_launch()
print(f"launcher={launch.launcher} rank={dist.get_rank()} world={mesh.size()} backend={dist.get_backend()} "
      f"sum={int(t.item())}", flush=True)
