"""Expert parallelism measured: a small Mixtral's training step and per-rank memory, side by side in one run.

    python bench/moe.py [--world 4] [--layers 2] [--hidden 64] [--ffn 1024] [--experts 8] [--batch 2] [--seq 32]
                        [--impl grouped_mm|batched_mm]

transformers' MixtralForCausalLM (grouped_mm experts, or --impl batched_mm; top-2 routing, no auxiliary loss so
that every way's loss is the same function of the batch), each rank a slice of the batch, AdamW. Each way runs in
its own fresh gloo ranks:

- shardfn, experts split: dataset_strategy="data_parallel", the experts' weights stored split over every rank on
  their expert dim (parameter_plan), the rest searched at level 2: each rank computes its experts' share (at
  this size the search gathers the tokens to the experts and reduce-scatters the results back);
- shardfn, tokens dispatched: the same, planned on links priced by their bytes alone (no latency), where the
  search sends each (token, slot) pair to its expert's rank and back (all_to_all; asserted from the plan);
- shardfn, experts replicated: the same with the experts' weights asked whole (data parallelism, as DDP);
- FSDP2: fully_shard on every decoder layer and the root (the experts gathered whole in each layer).

Per rank: the median step (forward, backward, optimizer) after two warm-up steps (shardfn plans in the first), and
the peak of tensor bytes alive during one more step (bench/fully_sharded.py's tracker: what
torch.cuda.max_memory_allocated reports on a GPU). The losses of every way are checked alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench._tensor_peak import TensorPeak, local  # noqa: E402
from tests.harness import free_port  # noqa: E402
from tests.moe_models import bytes_priced_over_latency  # noqa: E402

KINDS = ("shardfn, experts split", "shardfn, tokens dispatched", "shardfn, experts replicated", "FSDP2")


def _model(args):
    import transformers

    cfg = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                     vocab_size=args.vocab, num_local_experts=args.experts, num_experts_per_tok=2,
                                     experts_implementation=args.impl)
    return transformers.MixtralForCausalLM(cfg)


def _wrapped(model, which, args):
    import shardfn as sf

    if which == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    ways = 1 if which == "shardfn, experts replicated" else args.world
    experts = {f"model.layers.{i}.mlp.experts.{w}": (ways, 1, 1)
               for i in range(args.layers) for w in ("gate_up_proj", "down_proj")}
    return sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel", parameter_plan=experts, level=2)


def _experts_runs(model, ids) -> str:
    """How the plan runs the experts calls: "dispatch" (all_to_all), "local" (gathered tokens or whole)."""
    import shardfn as sf

    plan = sf.explain(model, ids, kwargs=dict(labels=ids, use_cache=False))
    return ",".join(sorted({n.run for n in plan.nodes.values() if n.op == "MoEExperts.apply"}))


def worker(rank, args, port, which, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import shardfn as sf

    sf.init()
    priced = contextlib.ExitStack()  # (held until the worker ends: its plan is made and explained here)
    if which == "shardfn, tokens dispatched":
        priced.enter_context(bytes_priced_over_latency())
    torch.manual_seed(0)
    model = _wrapped(_model(args), which, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    times, losses, peak = [], [], 0.0
    for step in range(args.steps + 3):  # two warm-up steps, the timed ones, then one under the tensor tracker
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, args.vocab, (args.batch * args.world, args.seq), generator=g)
        ids = ids[args.batch * rank: args.batch * (rank + 1)]
        tracker = contextlib.nullcontext()
        if step == args.steps + 2:
            state = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tracker = TensorPeak([local(p) for p in model.parameters()] + state)
        dist.barrier()
        start = time.perf_counter()
        with tracker:
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if 2 <= step < args.steps + 2:
            times.append(time.perf_counter() - start)
        if isinstance(tracker, TensorPeak):
            peak = tracker.peak / 2**20
        # shardfn's loss is the whole batch's; FSDP2's this rank's rows': their mean over the ranks is the same
        whole = local(loss).detach().clone()
        if which == "FSDP2":
            dist.all_reduce(whole)
            whole /= args.world
        losses.append(float(whole))
    runs = "" if which == "FSDP2" else _experts_runs(model, ids)
    assert which != "shardfn, tokens dispatched" or runs == "dispatch", "the plan did not dispatch the tokens"
    results[(which, rank)] = (statistics.median(times), peak, losses, runs)
    priced.close()
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--impl", default="grouped_mm", choices=("grouped_mm", "batched_mm"),
                   help="transformers' experts implementation")
    args = p.parse_args()
    results = mp.get_context("spawn").Manager().dict()
    for which in KINDS:
        mp.start_processes(worker, args=(args, free_port(), which, results), nprocs=args.world, join=True,
                           start_method="spawn")
    ms = {w: statistics.median(results[(w, r)][0] for r in range(args.world)) * 1e3 for w in KINDS}
    peak = {w: max(results[(w, r)][1] for r in range(args.world)) for w in KINDS}
    reference = results[(KINDS[0], 0)][2]
    for w in KINDS:  # AdamW's eps lets a sum of gradients and a mean drift apart slowly, not more
        for r in range(args.world):
            got = results[(w, r)][2]
            assert all(abs(a - b) <= 1e-4 * (k + 1) * max(1.0, abs(b)) for k, (a, b) in
                       enumerate(zip(got, reference))), (w, r, got, reference)
    print(f"Mixtral ({args.impl}), {args.layers} layers, hidden {args.hidden}, {args.experts} experts of {args.ffn} "
          f"(top 2), {args.world} gloo ranks, batch {args.batch} x {args.seq} per rank, AdamW; the same losses every "
          "step")
    for w in KINDS:
        runs = results[(w, 0)][3]
        print(f"  {w:<28} step {ms[w]:8.1f} ms   tensor peak {peak[w]:7.1f} MiB" +
              (f"   (experts run: {runs})" if runs else ""))
    for w in KINDS[:3]:
        print(f"  ratio {w} / FSDP2: step {ms[w] / ms['FSDP2']:.3f}, tensor peak {peak[w] / peak['FSDP2']:.3f}")
    print(f"  experts split / replicated: step {ms[KINDS[0]] / ms[KINDS[2]]:.3f}, "
          f"tensor peak {peak[KINDS[0]] / peak[KINDS[2]]:.3f}")
    print(f"  tokens dispatched / gathered (experts split): step {ms[KINDS[1]] / ms[KINDS[0]]:.3f}, "
          f"tensor peak {peak[KINDS[1]] / peak[KINDS[0]]:.3f}")


if __name__ == "__main__":
    main()
