"""MindSpore's shard-a-cell example: a Net of three BasicBlocks, two of them sharded in place, trained with AdamW.

    torchrun --nproc-per-node 8 samples/shard_cell.py
    mpirun -n 8 python samples/shard_cell.py
    python samples/shard_cell.py            # a world of one

block1 splits the batch (in_strategy ((8, 1),)) and keeps dense2.weight split (8, 1); block2 splits the feature
dim (in_strategy ((1, 8),)); block3 stays eager. On a world that is not a multiple of 8 the world size replaces 8.
Every rank trains the net and an unsharded copy identically, checks losses and final parameters match, and
prints the verdict.
"""

import copy

import torch
import torch.nn as nn
from _training import check_like_reference, train

import shardfn as sf


class BasicBlock(nn.Module):
    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.dense1 = nn.Linear(dim, hidden)
        self.gelu = nn.GELU()
        self.dense2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.dense2(self.gelu(self.dense1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1, self.block2, self.block3 = BasicBlock(), BasicBlock(), BasicBlock()

    def forward(self, x):
        return self.block3(self.block2(self.block1(x)))


def main():
    world = sf.init().size()
    n = 8 if world % 8 == 0 else world
    torch.manual_seed(0)  # the same model and data on every rank (full_batch)
    net = Net()
    reference = copy.deepcopy(net)
    x, target = torch.randn(16, 32), torch.randn(16, 32)

    net.block1 = sf.shard(net.block1, in_strategy=((n, 1),), parameter_plan={"dense2.weight": (n, 1)})
    net.block2 = sf.shard(net.block2, in_strategy=((1, n),))

    losses, ref_losses = train(net, x, target), train(reference, x, target)
    max_diff = check_like_reference(net, reference, losses, ref_losses, "shard_cell")

    rank = torch.distributed.get_rank()
    if rank == 0:
        print(sf.explain(net.block1, x))
    print(f"rank {rank}/{world}: shard_cell block1 ({n}, 1) + block2 (1, {n}) trains like eager "
          f"(final loss {float(losses[-1]):.6f}, max |param diff| {max_diff:.2e})", flush=True)


if __name__ == "__main__":
    main()
