"""Data parallelism, shardfn against DistributedDataParallel, side by side in one run.

    python bench/data_parallel.py [--world 2] [--layers 12] [--dim 256] [--steps 10] [--compile]

A 12-layer transformer (tests.models.GPTBlock stack), each rank a slice of the batch: shardfn with
dataset_strategy="data_parallel" and torch's DDP (default 25 MB buckets), AdamW; the same losses asserted, and
the median step time of each printed with their ratio (shardfn / DDP). The versions take turns step by step (a
slow spell of this shared machine falls on all alike). With --compile, also both compiled: shardfn with
SHARDFN_COMPILE=1 (Inductor on its per-rank graphs) and DDP under torch.compile (the first steps, not timed,
compile). The script starts its own gloo ranks.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402


class _Trainer:
    """One model and its AdamW: step() trains one step and records its time and loss."""

    def __init__(self, model, x):
        self.model, self.x = model, x
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        self.times, self.losses = [], []

    def step(self):
        dist.barrier()
        t = time.perf_counter()
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t)
        self.losses.append(loss.detach())


def worker(rank, args, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    model = GPTStack(args.layers, args.dim, args.heads)
    x = torch.randn(args.batch * args.world, args.seq, args.dim)[args.batch * rank: args.batch * (rank + 1)]
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    sharded = sf.shard(copy.deepcopy(model), in_strategy=(None,), dataset_strategy="data_parallel")
    runs = [("shardfn", sharded, "0"), ("DDP", ddp, "0")]
    if args.compile:
        runs += [("shardfn compiled", sf.shard(copy.deepcopy(model), in_strategy=(None,),
                                               dataset_strategy="data_parallel"), "1"),
                 ("DDP + torch.compile", torch.compile(nn.parallel.DistributedDataParallel(copy.deepcopy(model))),
                  "0")]
    trainers = {}
    for name, m, compile_ in runs:
        os.environ["SHARDFN_COMPILE"] = compile_  # read when a program is first made
        trainers[name] = _Trainer(m, x)
        for _ in range(2):  # warm up (shardfn plans, traces and compiles here)
            trainers[name].step()
    for _ in range(args.steps):  # the versions take turns step by step: a slow spell falls on all alike
        for t in trainers.values():
            t.step()
    results = {name: (t.times[2:], t.losses) for name, t in trainers.items()}
    # DDP's gradients are the ranks' mean, shardfn's their sum (the gradient of the sum of the ranks' losses):
    # AdamW's steps do not depend on that scale, so every version's losses are the same
    for name in results:
        torch.testing.assert_close(torch.stack(results[name][1]), torch.stack(results["DDP"][1]), rtol=1e-4,
                                   atol=1e-5, msg=lambda m: f"{name}: {m}")
    if rank == 0:
        ms = {k: statistics.median(v[0]) * 1e3 for k, v in results.items()}
        print(f"{args.layers} layers, dim {args.dim}, {args.world} gloo ranks, batch {args.batch} x {args.seq} "
              f"per rank: step " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), flush=True)
        print(f"ratio shardfn / DDP {ms['shardfn'] / ms['DDP']:.3f}" + (
            f", shardfn compiled / DDP + torch.compile {ms['shardfn compiled'] / ms['DDP + torch.compile']:.3f}"
            if args.compile else ""), flush=True)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="also both compiled (Inductor)")
    args = p.parse_args()
    mp.start_processes(worker, args=(args, free_port()), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
