"""Recompute chosen by the search against torch.utils.checkpoint on every layer, under a memory that binds.

    python bench/recompute.py [--world 2] [--layers 4] [--dim 256] [--batch 4] [--seq 256] [--steps 4]
    python bench/recompute.py --gemma       # planning at real scale instead (below)

A stack of GPT blocks (tests.models.GPTStack), each rank a slice of the batch (data parallel), AdamW. The memory
is set by the profile (SHARDFN_PROFILE: the CPU profile with a hard memory halfway between the plan's peak with
every layer recomputed and without recompute), so the plan fits only by recomputing. Run side by side, each in
its own fresh gloo ranks:

- shardfn, the search deciding (recompute=None) under that memory: it recomputes the layers it must;
- shardfn with recompute=False (no memory limit: the plan that does not fit, for reference);
- shardfn with torch.utils.checkpoint around every block by hand (recompute=False, no memory limit);
- FSDP2 (fully_shard on every block and the root) with torch.utils.checkpoint around every block (eager).

Per rank: the median step (forward, backward, optimizer) after two warm-up steps (shardfn plans in the first),
and the peak of tensor bytes alive during one step (bench/fully_sharded.py's tracker: what
torch.cuda.max_memory_allocated reports on a GPU); shardfn's rows also print the plan's estimated peak. The
losses are checked alike.

``--gemma`` plans transformers' Gemma-2-9B config (42 layers, the loss returned) at batch 8 x 8192, tokens over
"dp" of 8 x 8 H100s (meta tensors, device="cuda": the 80 GB profile), at level 2 with recompute=False, then with
the search deciding, then at level 1; each in this process, with its seconds (capture included) and peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from bench._tensor_peak import TensorPeak, local  # noqa: E402
from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402

KINDS = ("shardfn, the search deciding", "shardfn, recompute=False", "shardfn, checkpoint every block",
         "FSDP2 + checkpoint every block")


def _model(args):
    return GPTStack(args.layers, args.dim, args.heads)


def worker(rank, args, port, which, profile, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if which == KINDS[0]:
        os.environ["SHARDFN_PROFILE"] = profile
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    x = torch.randn(args.batch * args.world, args.seq, args.dim)[args.batch * rank: args.batch * (rank + 1)]
    model, estimate, recomputed = _model(args), 0, 0
    fsdp = which == KINDS[3]
    for block in model.blocks:
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(block)
        if which in KINDS[2:]:  # torch.utils.checkpoint around every block, by hand
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
    if fsdp:
        fully_shard(model)
    else:
        model = sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel", level=2,
                         recompute=None if which == KINDS[0] else False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    times, losses, peak = [], [], 0
    for step in range(args.steps + 3):  # two warm-up steps (shardfn plans and traces in the first); the last
        tracker = None  # step under the tensor tracker (slow: not timed)
        if step == args.steps + 2:
            state = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tracker = TensorPeak([local(p) for p in model.parameters()] + state)
            tracker.__enter__()
        dist.barrier()
        start = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak = tracker.peak
        elif step >= 2:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    if not fsdp:
        plan = sf.explain(model, x)
        estimate, recomputed = plan.cost.peak_bytes, len(plan.recompute)
    results[(which, rank)] = (statistics.median(times), peak, estimate, recomputed, losses)
    dist.barrier()


def _budget(args) -> tuple[float, float, float]:
    """The plan's peak per rank without recompute and with every layer recomputed (simulated ranks, meta
    tensors), and the memory halfway between them."""
    import shardfn as sf

    with torch.device("meta"):
        model, x = _model(args), torch.empty(args.batch, args.seq, args.dim)
    kept, again = (sf.explain(model, x, world_size=args.world, in_strategy=(None,), dataset_strategy="data_parallel",
                              level=2, recompute=r).cost.peak_bytes for r in (False, True))
    return kept, again, (kept + again) / 2


def gemma() -> None:
    import shardfn as sf
    from transformers import Gemma2Config, Gemma2ForCausalLM

    class LossOnly(torch.nn.Module):  # the loss returned (the logits, 62.5 GiB whole, not)
        def __init__(self, model):
            super().__init__()
            self.m = model

        def forward(self, ids, labels):
            return self.m(ids, labels=labels).loss

    cfg = Gemma2Config(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, num_hidden_layers=42, vocab_size=256000, query_pre_attn_scalar=256,
                       layer_types=["sliding_attention", "full_attention"] * 21)
    with torch.device("meta"):
        model, tokens = LossOnly(Gemma2ForCausalLM(cfg)), torch.zeros(8, 8192, dtype=torch.long)
    layout = sf.Layout((8, 8), ("dp", "tp"))
    for level, recompute in ((2, False), (2, None), (1, None)):
        start = time.perf_counter()
        try:
            plan = sf.explain(model, tokens, tokens, in_strategy=(layout("dp", "None"),) * 2, world_size=64,
                              level=level, device="cuda", recompute=recompute)
        except ValueError as e:
            print(f"level {level}, recompute={recompute}: {time.perf_counter() - start:.1f} s, {str(e)[:160]}")
            continue
        again = sum(r.extra_s for r in plan.recompute)
        print(f"level {level}, recompute={recompute}: {time.perf_counter() - start:.1f} s, peak "
              f"{plan.cost.peak_bytes / 2**30:.1f} GiB a rank, step {plan.cost.total_s * 1e3:.0f} ms estimated "
              f"(recompute {again * 1e3:.0f} ms), {len(plan.recompute)} regions recomputed")
        print("  " + "\n  ".join(line for line in str(plan).splitlines() if line.startswith("recompute")))


def main():
    if "--gemma" in sys.argv:
        return gemma()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    from shardfn.strategy_search import cost_model as cm

    kept, again, budget = _budget(args)
    profile = os.path.join(tempfile.mkdtemp(), "profile.json")
    cm.save_profile(dataclasses.replace(cm.CPU, name="cpu (small memory)", memory_bytes=budget, memory_is_hard=True),
                    profile)
    results = mp.get_context("spawn").Manager().dict()
    for which in KINDS:
        mp.start_processes(worker, args=(args, free_port(), which, profile, results), nprocs=args.world, join=True,
                           start_method="spawn")
    for w in KINDS:  # shardfn's gradients are the ranks' sum, FSDP2's their mean: AdamW's eps lets them drift
        for r in range(args.world):
            a, b = results[(w, r)][4], results[(KINDS[3], r)][4]
            assert all(abs(u - v) <= 2e-5 * (k + 1) * max(1.0, abs(v)) for k, (u, v) in enumerate(zip(a, b))), \
                (w, r, a, b)
    MiB = 2**20
    print(f"{args.layers} GPT blocks, dim {args.dim}, {args.world} gloo ranks, batch {args.batch} x {args.seq} per "
          f"rank, AdamW; memory {budget / MiB:.1f} MiB a rank (plan without recompute {kept / MiB:.1f} MiB, every "
          f"layer recomputed {again / MiB:.1f} MiB); the same losses for every step")
    base = statistics.median(results[(KINDS[3], r)][0] for r in range(args.world))
    for w in KINDS:
        ms = statistics.median(results[(w, r)][0] for r in range(args.world))
        peak = max(results[(w, r)][1] for r in range(args.world))
        est, n = results[(w, 0)][2], results[(w, 0)][3]
        plan = f"   plan's peak {est / MiB:7.1f} MiB, {n} regions recomputed" if est else ""
        print(f"  {w:<32} step {ms * 1e3:8.1f} ms ({ms / base:.2f}x)   tensor peak {peak / MiB:7.1f} MiB{plan}")


if __name__ == "__main__":
    main()
