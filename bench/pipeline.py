"""Pipeline schedules: GPipe and 1F1B against the same model unpipelined, side by side in one run.

    python bench/pipeline.py [--layers 8] [--dim 256] [--microbatches 4] [--steps 6]

A stack of GPT blocks (tests.models.GPTStack) on 4 gloo ranks, AdamW, an MSE loss on the output:
- "GPipe", "1F1B": two stages of layers/2 blocks, each on 2 ranks with Megatron tensor parallelism inside
  (sf.Layout(..., ranks=...)), run by sf.pipeline with that schedule over --microbatches micro-batches;
- "unpipelined": the whole stack as one shard call on the 4 ranks, data parallel 2 x Megatron tensor parallel 2.
Each runs in its own fresh ranks. Memory per rank: the peak resident set during the timed steps (the kernel's
high-water mark, reset before them) above what the process held before building the model. Printed: median step
time and peak memory per rank of each, their ratios to unpipelined, and explain()'s bubble fraction and memory
estimate, after checking that all three trained to the same losses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402

WORLD = 4


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set to the current one
        f.write("5")


def megatron(layout, blocks: int) -> dict:
    col, row, vec = layout("mp", "None"), layout("None", "mp"), layout("mp")
    plan = {}
    for i in range(blocks):
        p = f"blocks.{i}."
        plan.update({p + "attn.q.weight": col, p + "attn.q.bias": vec, p + "attn.k.weight": col,
                     p + "attn.v.weight": col, p + "attn.v.bias": vec, p + "attn.proj.weight": row,
                     p + "fc.weight": col, p + "fc.bias": vec, p + "out.weight": row})
    return plan


def worker(rank, args, port, which, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.dim)
    target = torch.randn(args.batch, args.seq, args.dim)
    before = _hwm_mib()
    model = GPTStack(args.layers, args.dim, args.heads)
    estimate = None
    if which == "unpipelined":
        mesh = sf.Layout((2, 2), ("dp", "mp"))
        model = sf.shard(model, in_strategy=(mesh("dp", "None", "None"),),
                         parameter_plan=megatron(mesh, args.layers))
        params = list(model.parameters())

        def step():
            loss = F.mse_loss(model(x), target)
            loss.backward()
            return loss
    else:
        half = args.layers // 2
        stages = []
        for s, ranks in enumerate(((0, 1), (2, 3))):
            part = GPTStack(0, args.dim, args.heads)
            part.blocks = model.blocks[s * half:(s + 1) * half]
            mesh = sf.Layout((2,), ("mp",), ranks=ranks)
            stages.append(sf.shard(part, in_strategy=(None,), parameter_plan=megatron(mesh, half)))
        pipe = sf.pipeline(stages, args.microbatches, schedule=which.lower(), loss_fn=F.mse_loss)
        params = [p for s in stages for p in s.parameters()]
        plan = pipe.explain(x)
        estimate = (plan.bubble_fraction, max(s.peak_bytes for s in plan.stages) / 2**20)

        def step():
            return pipe.step(x, target=target)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    times, losses = [], []
    for i in range(args.steps + 2):  # two warm-up steps (shardfn plans and traces in the first)
        if i == 2:
            _reset_hwm()
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
        losses.append(None if loss is None else float(loss.detach()))
    peak = _hwm_mib() - before
    results[(which, rank)] = (statistics.median(times), peak, losses, estimate)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    kinds = ("unpipelined", "GPipe", "1F1B")
    for which in kinds:
        mp.start_processes(worker, args=(args, free_port(), which, results), nprocs=WORLD, join=True,
                           start_method="spawn")
    ms = {w: statistics.median(results[(w, r)][0] for r in range(WORLD)) * 1e3 for w in kinds}
    mib = {w: max(results[(w, r)][1] for r in range(WORLD)) for w in kinds}
    reference = results[("unpipelined", 0)][2]
    for w in kinds[1:]:  # the last stage's ranks hold the pipeline's loss
        got = results[(w, WORLD - 1)][2]
        assert all(abs(u - v) <= 1e-4 * max(1.0, abs(v)) for u, v in zip(got, reference)), (w, got, reference)
    print(f"{args.layers} GPT blocks, dim {args.dim}, {WORLD} gloo ranks, batch {args.batch} x {args.seq}, AdamW; "
          f"pipelines: 2 stages x 2 ranks (Megatron TP inside), {args.microbatches} micro-batches; unpipelined: "
          f"DP 2 x TP 2; same losses for {args.steps + 2} steps")
    for w in kinds:
        line = f"  {w:<12} step {ms[w]:8.1f} ms   peak memory per rank {mib[w]:7.1f} MiB"
        estimate = results[(w, 0)][3]
        if estimate is not None:
            line += f"   explain: bubble {estimate[0]:.3f}, peak estimate {estimate[1]:.1f} MiB/rank"
        print(line)
    for w in kinds[1:]:
        print(f"  ratio {w} / unpipelined: step {ms[w] / ms['unpipelined']:.3f}, "
              f"memory {mib[w] / mib['unpipelined']:.3f}")
    print(f"  ratio 1F1B / GPipe: step {ms['1F1B'] / ms['GPipe']:.3f}, memory {mib['1F1B'] / mib['GPipe']:.3f}")


if __name__ == "__main__":
    main()
