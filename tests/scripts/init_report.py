"""Prints what shardfn.init() found: launcher, rank, world size, backend; checks an all_reduce over the world; and,
at exit, how many threads the process has once shardfn's shutdown ran (gloo's workers must have ended there, not
in the interpreter's finalization, where they can abort the process)."""

import atexit
import os

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.runtime import detect_launch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


_BEFORE = _threads()
# atexit runs last-in first-out: this runs after the shutdown init() registers
atexit.register(lambda: print(f"threads at exit: {_threads()} (before init: {_BEFORE})", flush=True))

mesh = sf.init()  # held to the end, as a user's script holds it
again = sf.init()  # idempotent: the same world
assert again.size() == mesh.size()
t = torch.ones(1)
dist.all_reduce(t)
launch = detect_launch()
print(f"launcher={launch.launcher} rank={dist.get_rank()} world={mesh.size()} backend={dist.get_backend()} "
      f"sum={int(t.item())}", flush=True)
