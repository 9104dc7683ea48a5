"""A cached data-parallel training step of a small model: shardfn against DDP, and the collectives each makes.

    python bench/small_steps.py [--world 4] [--steps 30] [--layers 2] [--dim 64] [--batch 2] [--length 32]

transformers' GPT-2 (random weights, dropout off), data parallel on ``--world`` gloo ranks (the script starts
them), each rank ``--batch`` rows of one fixed length, so every shardfn step after the first runs its cached
program. shardfn and DDP (AdamW each) take turns step by step (a slow spell of this shared machine falls on both
alike); losses are asserted equal. Printed: each way's median step and their ratio, and the collectives one step
makes on each rank (counted by torch's profiler: every gloo collective, whoever issues it), by kind and size;
with --profile, where shardfn's steps spend their time in Python (cProfile, rank 0).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from bench.changing_lengths import _gpt2  # noqa: E402  (the same GPT-2)
from tests.harness import free_port  # noqa: E402


class _Way:
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        self.times, self.losses = [], []

    def step(self, ids):
        dist.barrier()
        t = time.perf_counter()
        loss = self.model(ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t)
        self.losses.append(float(loss))


def _collectives(way, ids) -> list[str]:
    """The gloo collectives one step makes on this rank, as the profiler records them (the barrier before the
    step left out)."""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        way.step(ids)
    found = []
    for e in prof.events():
        if e.name.startswith("gloo:") and "barrier" not in e.name:
            shapes = [s for s in (e.input_shapes or []) if s]
            found.append(f"{e.name[5:]} {shapes[0] if shapes else ''}")
    return found


def worker(rank, args, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    model = _gpt2(args)
    ways = {"DDP": _Way(nn.parallel.DistributedDataParallel(copy.deepcopy(model))),
            "shardfn": _Way(sf.shard(copy.deepcopy(model), in_strategy=(None,), dataset_strategy="data_parallel"))}
    torch.manual_seed(1)
    batch = torch.randint(0, 128, (args.batch * args.world, args.length))
    ids = batch[args.batch * rank: args.batch * (rank + 1)]
    for _ in range(args.steps + 2):
        for way in ways.values():
            way.step(ids)
    counted = {name: _collectives(way, ids) for name, way in ways.items()}
    # DDP's loss is this rank's slice's, shardfn's the whole batch's: compared as the mean over ranks (the same
    # steps: every slice has the same length)
    ddp = torch.tensor(ways["DDP"].losses)
    dist.all_reduce(ddp)
    torch.testing.assert_close(torch.tensor(ways["shardfn"].losses), ddp / args.world, rtol=1e-4, atol=1e-5)
    if rank == 0:
        ms = {name: statistics.median(way.times[2:]) * 1e3 for name, way in ways.items()}
        print(f"GPT-2 {args.layers} layers, dim {args.dim}, {args.world} gloo ranks x batch {args.batch} x "
              f"{args.length}, {args.steps} cached steps each, torch {torch.__version__}")
        for name in ways:
            kinds = collections.Counter(counted[name])
            print(f"{name:8s} step {ms[name]:6.1f} ms, {len(counted[name])} collectives: "
                  + ", ".join(f"{n} x {k}" if n > 1 else k for k, n in kinds.items()))
        print(f"ratio shardfn / DDP {ms['shardfn'] / ms['DDP']:.2f}", flush=True)
    if args.profile and rank == 0:  # where a shardfn step's Python time goes (rank 0; the others step along)
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(args.steps):
                ways["shardfn"].step(ids)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    elif args.profile:
        for _ in range(args.steps):
            ways["shardfn"].step(ids)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions of shardfn's "
                   "steps on rank 0")
    args = p.parse_args()
    mp.start_processes(worker, args=(args, free_port()), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
