"""Fully sharded data parallelism: shardfn at level 1 against FSDP2's fully_shard, side by side in one run.

    python bench/fully_sharded.py [--world 2] [--layers 4] [--dim 256] [--steps 10]

A stack of GPT blocks (tests.models.GPTBlock), each rank a slice of the batch, AdamW: shardfn with
dataset_strategy="data_parallel" at level=1 (the search minimises per-rank memory, so it may split more than
FSDP does, at a cost in time), shardfn with FSDP's layout asked for (every parameter split on dim 0, the rest
searched at level 2), and torch's FSDP2 (fully_shard on every block and the root). Each
runs in its own fresh gloo ranks. Memory per rank: the largest resident set sampled after each timed step's
forward, backward and optimizer step (activations, gradients, optimizer states held), above what the process
held before building the model; it includes what shardfn's first call (capture, planning, tracing) left in the
Python heap. Printed: median step time and memory per rank of each, their ratios (shardfn / FSDP2), after
checking that both trained to the same losses.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank, args, port, which, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    x = torch.randn(args.batch * args.world, args.seq, args.dim)[args.batch * rank: args.batch * (rank + 1)]
    before = _rss_mib()
    model = GPTStack(args.layers, args.dim, args.heads)
    if which == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif which == "shardfn level 1":
        model = sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel", level=1)
    else:  # FSDP's layout asked for: every parameter split on dim 0, the rest searched (level 2)
        plan = {n: (args.world,) + (1,) * (p.dim() - 1) for n, p in model.named_parameters()}
        model = sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel", parameter_plan=plan, level=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    times, losses, held = [], [], []
    for step in range(args.steps + 2):  # two warm-up steps (shardfn plans and traces in the first)
        timed = step >= 2
        dist.barrier()
        start = time.perf_counter()
        loss = model(x).square().mean()
        sampled = [_rss_mib()] if timed else []  # sampling costs microseconds
        loss.backward()
        sampled += [_rss_mib()] if timed else []
        opt.step()
        sampled += [_rss_mib()] if timed else []
        opt.zero_grad(set_to_none=True)
        if timed:
            times.append(time.perf_counter() - start)
            held += sampled
        losses.append(float(loss.detach()))
    results[(which, rank)] = (statistics.median(times), max(held) - before, losses)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    kinds = ("shardfn level 1", "shardfn FSDP plan", "FSDP2")
    for which in kinds:
        mp.start_processes(worker, args=(args, free_port(), which, results), nprocs=args.world, join=True,
                           start_method="spawn")
    ms = {w: statistics.median(results[(w, r)][0] for r in range(args.world)) * 1e3 for w in kinds}
    mib = {w: max(results[(w, r)][1] for r in range(args.world)) for w in ms}
    for r, w in itertools.product(range(args.world), kinds):  # each rank's losses (its slice's mean), per step
        a, b = results[(w, r)][2], results[("FSDP2", r)][2]
        assert all(abs(u - v) <= 1e-4 * max(1.0, abs(v)) for u, v in zip(a, b)), (w, r, a, b)
    print(f"{args.layers} GPT blocks, dim {args.dim}, {args.world} gloo ranks, batch {args.batch} x {args.seq} "
          f"per rank, AdamW; same losses for {args.steps + 2} steps")
    for w in ms:
        print(f"  {w:<16} step {ms[w]:8.1f} ms   memory per rank {mib[w]:7.1f} MiB")
    for w in kinds[:2]:
        print(f"  ratio {w} / FSDP2: step {ms[w] / ms['FSDP2']:.3f}, memory {mib[w] / mib['FSDP2']:.3f}")


if __name__ == "__main__":
    main()
