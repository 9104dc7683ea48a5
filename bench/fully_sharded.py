"""Fully sharded data parallelism: shardfn at level 1 against FSDP2's fully_shard, side by side in one run.

    python bench/fully_sharded.py [--world 2] [--layers 4] [--dim 1024] [--steps 6] [--bf16] [--gpt2]

A stack of GPT blocks (tests.models.GPTBlock), each rank a slice of the batch, AdamW: shardfn with
dataset_strategy="data_parallel" at level=1 (the search minimises per-rank memory; parameters are gathered
again in backward, as FSDP does), shardfn with FSDP's layout asked for (every parameter split on dim 0, the rest
searched at level 2, parameters kept whole from forward to backward), and torch's FSDP2 (fully_shard on every
block and the root). Each runs twice in its own fresh gloo ranks:

- timing: the median step (forward, backward, optimizer) after two warm-up steps (shardfn plans in the first);
- memory, per rank, two measures: the peak of tensor bytes alive during one step (parameters, gradients,
  optimizer states, activations, collective buffers: every storage an op makes, freed when its last tensor
  goes; what torch.cuda.max_memory_allocated reports on a GPU), and the peak resident set during another step
  (the kernel's high-water mark VmHWM, reset as the step starts by writing 5 to /proc/self/clear_refs) above
  the resident set before the model was built: everything, shardfn's compiler state and imports included.
  glibc's malloc is told to return blocks of 64 KiB and more at once (MALLOC_MMAP_THRESHOLD_): with its
  default, blocks up to 32 MiB stay in its heap when freed, and the resident set shows the allocator's
  high-water mark rather than what is held.

``--gpt2``: transformers' GPT-2 instead (``--dim`` wide, ``--layers`` blocks, 4 heads, vocabulary 256, dropout
off; each rank ``--batch`` rows of ``--seq`` token ids, its loss on them), FSDP2 on each of its blocks.
``--bf16``: all three under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (shardfn's
``mp_policy``, FSDP2's ``mp_policy`` on every block and the root); losses then agree to bf16's precision.

Printed: median step and both memory measures for each, and the ratios against FSDP2, after checking that all
trained to the same losses.
"""

from __future__ import annotations

import argparse
import contextlib
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

from bench._tensor_peak import TensorPeak, local  # noqa: E402
from tests.harness import free_port  # noqa: E402
from tests.models import GPTStack  # noqa: E402


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS (Linux 4.0+)
        f.write("5")




def _model(args):
    """(model, its blocks: what FSDP2 wraps one by one)."""
    if not args.gpt2:
        model = GPTStack(args.layers, args.dim, args.heads)
        return model, model.blocks
    import transformers

    cfg = transformers.GPT2Config(n_embd=args.dim, n_layer=args.layers, n_head=4, vocab_size=256,
                                  n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    return model, model.transformer.h


def worker(rank, args, port, which, measure, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    torch.manual_seed(0)
    if args.gpt2:
        x = torch.randint(0, 256, (args.batch * args.world, args.seq))[args.batch * rank: args.batch * (rank + 1)]
    else:
        x = torch.randn(args.batch * args.world, args.seq, args.dim)[args.batch * rank: args.batch * (rank + 1)]
    before = _status_mib("VmRSS")
    model, blocks = _model(args)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    strategy = {"input_ids": None, "labels": None} if args.gpt2 else (None,)
    if which == "FSDP2":
        for block in blocks:
            fully_shard(block, **({"mp_policy": policy} if policy else {}))
        fully_shard(model, **({"mp_policy": policy} if policy else {}))
    elif which == "shardfn level 1":
        model = sf.shard(model, in_strategy=strategy, dataset_strategy="data_parallel", level=1, mp_policy=policy)
    else:  # FSDP's layout asked for: every parameter split on dim 0, the rest searched (level 2)
        plan = {n: (args.world,) + (1,) * (p.dim() - 1) for n, p in model.named_parameters()}
        model = sf.shard(model, in_strategy=strategy, dataset_strategy="data_parallel", parameter_plan=plan, level=2,
                         mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    # memory: two warm-up steps, then one step for the resident peak and one under the tensor tracker (slow)
    steps = args.steps + 2 if measure == "time" else 4
    times, losses, rss_peak, tensor_peak = [], [], 0.0, 0.0
    for step in range(steps):  # two warm-up steps (shardfn plans and traces in the first)
        tracker = contextlib.nullcontext()
        if measure == "memory" and step == 3:
            state = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tracker = TensorPeak([local(p) for p in model.parameters()] + state)
        dist.barrier()
        if measure == "memory" and step == 2:
            _reset_peak_rss()
        start = time.perf_counter()
        with tracker:
            loss = model(input_ids=x, labels=x).loss if args.gpt2 else model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
        if measure == "memory" and step == 2:
            rss_peak = _status_mib("VmHWM") - before
        if isinstance(tracker, TensorPeak):
            tensor_peak = tracker.peak / 2**20
        losses.append(float(loss.detach()))
    results[(which, measure, rank)] = (statistics.median(times), rss_peak, tensor_peak, losses)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bf16", action="store_true", help="a bf16 MixedPrecisionPolicy for all three")
    p.add_argument("--gpt2", action="store_true", help="transformers' GPT-2 (vocabulary 256) instead of GPT blocks")
    args = p.parse_args()
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    kinds = ("shardfn level 1", "shardfn FSDP plan", "FSDP2")
    for measure in ("time", "memory"):
        if measure == "memory":  # read by glibc as each rank starts (see the docstring)
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        for which in kinds:
            mp.start_processes(worker, args=(args, free_port(), which, measure, results), nprocs=args.world,
                               join=True, start_method="spawn")
    ms = {w: statistics.median(results[(w, "time", r)][0] for r in range(args.world)) * 1e3 for w in kinds}
    rss = {w: max(results[(w, "memory", r)][1] for r in range(args.world)) for w in kinds}
    tensors = {w: max(results[(w, "memory", r)][2] for r in range(args.world)) for w in kinds}
    for r, w, m in itertools.product(range(args.world), kinds, ("time", "memory")):  # each rank's slice's mean
        a, b = results[(w, m, r)][3], results[("FSDP2", "time", r)][3]
        # shardfn's gradients are the ranks' sum, FSDP2's their mean: AdamW's eps lets the losses drift apart
        # slowly (~1e-5 a step), not more
        tol = 2e-2 if args.bf16 else 2e-5  # (bf16: each way rounds its own sums)
        assert all(abs(u - v) <= tol * (k + 1) * max(1.0, abs(v)) for k, (u, v) in enumerate(zip(a, b))), \
            (w, r, a, b)
    kind = "GPT-2 (transformers)" if args.gpt2 else "GPT"
    print(f"{args.layers} {kind} blocks, dim {args.dim}, {args.world} gloo ranks, batch {args.batch} x {args.seq} "
          f"per rank, AdamW{', bf16 MixedPrecisionPolicy' if args.bf16 else ''}; the same losses for every step")
    for w in kinds:
        print(f"  {w:<17} step {ms[w]:8.1f} ms   tensor peak {tensors[w]:7.1f} MiB   RSS peak {rss[w]:7.1f} MiB")
    for w in kinds[:2]:
        print(f"  ratio {w} / FSDP2: step {ms[w] / ms['FSDP2']:.3f}, tensor peak {tensors[w] / tensors['FSDP2']:.3f}"
              f", RSS peak {rss[w] / rss['FSDP2']:.3f}")

if __name__ == "__main__":
    main()
