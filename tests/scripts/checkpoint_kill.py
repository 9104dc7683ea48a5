"""One rank of a small world that trains, saves checkpoint A, trains on, and saves B over it while a rank is
killed (SIGKILL) at one point of the second save: python checkpoint_kill.py POINT FOLDER
  none        nobody is killed
  own-group   nobody is killed; the process group is made with torch.distributed, not shardfn.init
  writing     rank 2, as it starts writing its files
  written     rank 2, once its files are written (before the metadata)
  metadata    rank 0, after DCP finished, before the switch
  switched    rank 0, right after the switch, before the old version is removed
Rank 0 writes the full model state before each save to FOLDER/A.pt and FOLDER/B.pt; the checkpoint is
FOLDER/ckpt.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import shardfn as sf
import shardfn.training.checkpoint as checkpoint
from tests.test_modules import GPT_PLANS
from tests.models import GPTBlock

point, folder = sys.argv[1], sys.argv[2]
if point == "own-group":
    dist.init_process_group("gloo")
sf.init()
rank = dist.get_rank()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm() -> None:
    """Make this rank die at ``point`` of the next save."""
    if point in ("writing", "written") and rank == 2:
        write = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if point == "writing":
                die()
            done = write(self, plan, planner)
            done.wait()
            die()

        FileSystemWriter.write_data = write_data
    elif point in ("metadata", "switched") and rank == 0:
        switch = checkpoint._switch

        def _switch(path, to):
            if point == "switched":
                switch(path, to)
            die()

        checkpoint._switch = _switch


torch.manual_seed(0)
model = sf.shard(GPTBlock(), **GPT_PLANS["tp"])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(seed):
    torch.manual_seed(seed)
    model(torch.randn(2, 8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def save(name):
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(folder, f"{name}.pt"))
    model_state, optim_state = get_state_dict(model, opt)
    sf.save({"model": model_state, "optim": optim_state}, os.path.join(folder, "ckpt"))


step(1)
save("A")
step(2)
arm()
save("B")
print(f"rank {rank}: saved", flush=True)
