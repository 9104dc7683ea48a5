"""Training steps whose sequence length changes every step: shardfn against eager and torch.compile, in one run.

    python bench/changing_lengths.py [--world 4] [--steps 12] [--layers 2] [--dim 64] [--batch 2]
                                     [--lengths 16,64] [--pad-to 1] [--no-compile]

transformers' GPT-2 (random weights, dropout off), data parallel on ``--world`` gloo ranks (the script starts
them), each rank a slice of ``--batch`` rows; every step draws a new sequence length in ``--lengths`` (the same
draws on every rank and for every way), as a padding collator does. Three ways, taking turns step by step (a slow
spell of this shared machine falls on all alike), AdamW each:

    DDP                   torch's DistributedDataParallel, eager
    DDP + torch.compile   the same under torch.compile (its automatic dynamic shapes: it recompiles once, at the
                          second length, with the length as a symbol)
    shardfn               sf.shard(model, dataset_strategy="data_parallel"): the first length is captured and
                          planned alone, the second once for every length (the length traced as a symbol); each
                          new length after it is only traced into its per-rank graphs

Printed per way: the first step, the second (where both shardfn and torch.compile make their program for every
length), the median of the steps after those two, and how many captures (shardfn: each a capture and a plan) or
graphs (torch.compile's frame compilations) were made. Losses are asserted equal across the ways at every step.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from tests.harness import free_port  # noqa: E402


def _gpt2(args):
    import transformers as tf

    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=4, vocab_size=128,
                                            n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class _Way:
    def __init__(self, model, loss_scale: float):
        self.model, self.loss_scale = model, loss_scale
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        self.times, self.losses = [], []

    def step(self, ids):
        dist.barrier()
        t = time.perf_counter()
        loss = self.model(ids, labels=ids).loss
        (loss * self.loss_scale).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - t)
        self.losses.append(float(loss))


def worker(rank, args, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    model = _gpt2(args)
    sharded = sf.shard(copy.deepcopy(model), in_strategy=(None,), dataset_strategy="data_parallel")
    # shardfn's loss is the whole batch's mean, the same on every rank, and its gradients those of that loss; DDP
    # averages the ranks' gradients of their own means: the same step when every slice has the same length
    ways = {"DDP": _Way(nn.parallel.DistributedDataParallel(copy.deepcopy(model)), 1.0),
            "shardfn": _Way(sharded, 1.0)}
    if args.compile:
        ways["DDP + torch.compile"] = _Way(torch.compile(nn.parallel.DistributedDataParallel(copy.deepcopy(model))),
                                           1.0)
    draw = random.Random(0)
    low, high = args.lengths
    for _ in range(args.steps):
        length = -(-draw.randint(low, high) // args.pad_to) * args.pad_to
        torch.manual_seed(length)
        ids = torch.randint(0, 128, (args.batch * args.world, length))[args.batch * rank: args.batch * (rank + 1)]
        for way in ways.values():
            way.step(ids)
    # DDP's losses are this rank's slice's; shardfn's the whole batch's: compared as the mean over ranks
    ddp = torch.tensor(ways["DDP"].losses)
    dist.all_reduce(ddp)
    ddp /= args.world
    for name, way in ways.items():
        got = torch.tensor(way.losses)
        if name != "shardfn":
            dist.all_reduce(got)
            got /= args.world
        torch.testing.assert_close(got, ddp, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    engine = sf.engine_of(sharded)
    made = {"shardfn": engine.captures, "DDP": 0,
            "DDP + torch.compile": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
    if rank == 0:
        print(f"GPT-2 {args.layers} layers, dim {args.dim}, {args.world} gloo ranks x batch {args.batch}, "
              f"{args.steps} steps, lengths drawn in [{low}, {high}] padded to a multiple of {args.pad_to}, "
              f"torch {torch.__version__}")
        print(f"{'':22s} {'step 1 (s)':>10s} {'step 2 (s)':>10s} {'later (ms)':>11s} {'captures':>9s}")
        for name, way in ways.items():
            later = statistics.median(way.times[2:]) * 1e3
            print(f"{name:22s} {way.times[0]:10.2f} {way.times[1]:10.2f} {later:11.1f} {made[name] or '':>9}")
        base = statistics.median(ways["DDP"].times[2:])
        print("later steps against DDP: " + ", ".join(
            f"{name} {statistics.median(way.times[2:]) / base:.2f}x" for name, way in ways.items() if name != "DDP"))
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=(16, 64))
    p.add_argument("--pad-to", type=int, default=1, help="round each length up to a multiple of this (a padding "
                   "collator's pad_to_multiple_of): a few lengths that recur")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args()
    mp.start_processes(worker, args=(args, free_port()), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
