"""Training state per rank and step time: DDP, torch's ZeroRedundancyOptimizer, FSDP2 and shardfn (data parallel,
sharded optimizer stages 1 and 2, level 1), side by side in one run; and bytes on the wire with and without a
mixed precision policy.

    python bench/sharded_optimizer.py [--world 2 4] [--layers 12] [--dim 256] [--steps 4]

A stack of GPT blocks (tests.models.GPTStack), each rank a slice of the batch, AdamW. Each way runs in its own
fresh gloo ranks: the median step (forward, backward, optimizer) after two warm-up steps, and the bytes one rank
holds of parameters, gradients (after backward) and optimizer states, from the tensors themselves (their local
pieces). All must train to the same losses. Then, from shardfn's plans (explain, 4 ranks): the bytes the
collectives of one step move at level 1, in fp32 and under MixedPrecisionPolicy(bf16, reduce fp32).
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
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402

WAYS = ("DDP", "ZeroRedundancyOptimizer", "FSDP2", "shardfn data parallel", "shardfn stage 1", "shardfn stage 2",
        "shardfn level 1")


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def worker(rank, args, world, port, way, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    x = torch.randn(args.batch * world, args.seq, args.dim)[args.batch * rank: args.batch * (rank + 1)]
    model = GPTStack(args.layers, args.dim, args.heads)
    grads_of = None
    if way in ("DDP", "ZeroRedundancyOptimizer"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if way == "DDP":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        scale = 1.0  # DDP averages the ranks' gradients
    elif way == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt, scale = torch.optim.AdamW(model.parameters(), lr=1e-4), 1.0
    else:
        level = 1 if way == "shardfn level 1" else 0
        model = sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel", level=level)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if "stage" in way:
            opt = sf.shard_optimizer(opt, model, stage=int(way[-1]))
            grads_of = opt.pieces  # stage 2's gradients live on the pieces
        scale = 1.0 / world  # shardfn's gradients are the ranks' sum: a mean loss per slice, summed
    times, losses, held = [], [], 0
    for step in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        loss = model(x).square().mean()
        (loss * scale).backward()
        if step == 1:  # parameters, their gradients (all there are, as backward left them), optimizer states
            params = list(model.parameters())
            grads = [t.grad for t in (*params, *(grads_of or ())) if t.grad is not None]
            # ZeroRedundancyOptimizer keeps its states in its local optimizer (.optim)
            inner = opt.optim if way == "ZeroRedundancyOptimizer" else opt
            states = [v for s in inner.state.values() for v in s.values()]
            held = _bytes(params) + _bytes(grads) + _bytes(states)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    results[(way, world, rank)] = (statistics.median(times), held, losses)
    dist.barrier()
    dist.destroy_process_group()


def wire_bytes(args) -> dict[str, int]:
    """Bytes one step's collectives move at level 1 (4 ranks), fp32 and under a bf16 policy (explain)."""
    import shardfn as sf
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with torch.device("meta"):
        model = GPTStack(args.layers, args.dim, args.heads)
    x = torch.empty(args.batch * 4, args.seq, args.dim, device="meta")
    out = {}
    for name, policy in (("fp32", None), ("bf16 (reduce fp32)", MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        plan = sf.explain(model, x, in_strategy=(None,), level=1, world_size=4, mp_policy=policy)
        out[name] = sum(c.nbytes for c in plan.collectives)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    for world in args.world:
        for way in WAYS:
            mp.start_processes(worker, args=(args, world, free_port(), way, results), nprocs=world, join=True,
                               start_method="spawn")
        reference = results[("DDP", world, 0)][2]
        for way in WAYS:  # every way trains to DDP's losses (AdamW's eps lets sums and means drift ~1e-5 a step)
            losses = results[(way, world, 0)][2]
            assert all(abs(u - v) <= 1e-4 * (k + 1) * max(1.0, abs(v)) for k, (u, v) in
                       enumerate(zip(losses, reference))), (way, losses, reference)
        print(f"{args.layers} GPT blocks, dim {args.dim}, {world} gloo ranks, batch {args.batch} x {args.seq} per "
              f"rank, AdamW; the same losses for every way")
        ddp_ms = statistics.median(results[("DDP", world, r)][0] for r in range(world)) * 1e3
        ddp_mib = max(results[("DDP", world, r)][1] for r in range(world)) / 2**20
        for way in WAYS:
            ms = statistics.median(results[(way, world, r)][0] for r in range(world)) * 1e3
            mib = max(results[(way, world, r)][1] for r in range(world)) / 2**20
            print(f"  {way:<24} step {ms:8.1f} ms ({ms / ddp_ms:5.2f}x DDP)   parameters + gradients + optimizer "
                  f"states {mib:7.1f} MiB per rank ({mib / ddp_mib:4.2f}x DDP)", flush=True)
    wire = wire_bytes(args)
    print("bytes one step's collectives move at level 1 on 4 ranks (shardfn's plan): "
          + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in wire.items())
          + f"; ratio {wire['bf16 (reduce fp32)'] / wire['fp32']:.2f}")


if __name__ == "__main__":
    main()
