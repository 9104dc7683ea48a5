"""Faults around the process group, as one rank of a small world: python runtime_faults.py CASE
  init          init only (the rendezvous under test), then report the world
  skip          rank 1 skips an all-reduce rank 0 makes (a collective whose peer never comes)
  crash         rank 1 raises right after init; rank 0 then waits on an all-reduce
  early         rank 0 ends at once; rank 1 works 2 s more, then ends
  control       an all-reduce on the control group
"""

import sys
import time

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.runtime import control_group

case = sys.argv[1]
sf.init()
rank = dist.get_rank()
print(f"rank {rank}: joined a world of {dist.get_world_size()}", flush=True)
start = time.monotonic()
if case == "skip" and rank == 0:
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the report is the test
        print(f"rank 0: collective failed after {time.monotonic() - start:.1f} s: {type(e).__name__}", flush=True)
elif case == "skip":
    time.sleep(8)
elif case == "crash":
    if rank == 1:
        raise RuntimeError("a fault on rank 1")
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        print(f"rank 0: collective failed after {time.monotonic() - start:.1f} s: {type(e).__name__}", flush=True)
elif case == "early" and rank == 1:
    time.sleep(2)
elif case == "control":
    t = torch.ones(1)
    dist.all_reduce(t, group=control_group())
    print(f"rank {rank}: control group sum {int(t.item())}", flush=True)
print(f"rank {rank}: done", flush=True)
