"""Prints what shardfn.init() found: launcher, rank, world size, backend; checks an all_reduce over the world."""

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.runtime import detect_launch

mesh = sf.init()
again = sf.init()  # idempotent: the same world
assert again.size() == mesh.size()
t = torch.ones(1)
dist.all_reduce(t)
launch = detect_launch()
print(f"launcher={launch.launcher} rank={dist.get_rank()} world={mesh.size()} backend={dist.get_backend()} "
      f"sum={int(t.item())}", flush=True)
