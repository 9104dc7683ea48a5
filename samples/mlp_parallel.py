"""PaddlePaddle's semi-auto-parallel MLP: data parallel, tensor parallel (Megatron) and DP x TP with sf.Layout.

    torchrun --nproc-per-node 4 samples/mlp_parallel.py
    mpirun -n 8 python samples/mlp_parallel.py
    python samples/mlp_parallel.py          # a world of one: every configuration runs trivially

Each configuration shards a fresh copy of one seeded MLP, trains it 5 steps with AdamW next to an unsharded copy,
checks that losses and final parameters match, and every rank prints the verdict. DP x TP (dp = 2, tp = world / 2)
is skipped on worlds it does not fit.
"""

import copy

import torch
import torch.nn as nn
from _training import check_like_reference, train
from torch.distributed.tensor import DTensor

import shardfn as sf

BATCH, DIM, HIDDEN = 16, 64, 256


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(DIM, HIDDEN)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.linear2(self.relu(self.linear1(x)))


def configurations(world):
    yield "dp", dict(in_strategy=((world, 1),))
    # nn.Linear weight is (out, in): column parallel splits dim 0, row parallel dim 1
    yield "tp", dict(in_strategy=(None,), parameter_plan={
        "linear1.weight": (world, 1), "linear1.bias": (world,), "linear2.weight": (1, world)})
    if world == 1 or (world >= 4 and world % 2 == 0 and HIDDEN % (world // 2) == 0):
        dp = 2 if world > 1 else 1
        layout = sf.Layout((dp, world // dp), ("dp", "tp"))
        yield f"dp{dp} x tp{world // dp}", dict(in_strategy=(layout("dp", "None"),), parameter_plan={
            "linear1.weight": layout("tp", "None"), "linear1.bias": layout("tp"),
            "linear2.weight": layout("None", "tp")})
    else:
        yield "dp x tp", None


def main():
    world = sf.init().size()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same model and data on every rank (full_batch)
    seeded = MLP()
    x, target = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)

    for name, kwargs in configurations(world):
        if kwargs is None:
            print(f"rank {rank}/{world}: mlp {name} skipped (needs an even world of at least 4)", flush=True)
            continue
        reference = copy.deepcopy(seeded)
        model = sf.shard(copy.deepcopy(seeded), **kwargs)
        losses, ref_losses = train(model, x, target), train(reference, x, target)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        max_diff = check_like_reference(model, reference, losses, ref_losses, f"mlp {name}")
        print(f"rank {rank}/{world}: mlp {name} trains like single process "
              f"(final loss {float(losses[-1]):.6f}, max |param diff| {max_diff:.2e})", flush=True)


if __name__ == "__main__":
    main()
