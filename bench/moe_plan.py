"""Mixtral-8x7B planned at real size: do the experts split, does the plan fit, how long does planning take?

    python bench/moe_plan.py [--mesh 8x8] [--batch 8] [--seq 4096] [--level 2]

transformers' MixtralForCausalLM (32 layers, 8 experts, top-2, fp32) on meta tensors, planned for ``device="cuda"``
(the H100 profile) on a mesh of ranks without processes (``sf.explain(world_size=...)``), the batch split over the
mesh's first dim. Prints the planning time (cold: capture and search in this process), the experts' layouts, the
plan's peak per rank and its estimated step, and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import transformers

import shardfn as sf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--level", type=int, default=2)
    a = ap.parse_args()
    shape = tuple(int(n) for n in a.mesh.split("x"))
    names = ("dp", "ep", "tp")[:len(shape)]
    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    ids = torch.zeros(a.batch, a.seq, dtype=torch.long, device="meta")
    mesh = sf.Layout(shape, names)
    start = time.perf_counter()
    plan = sf.explain(model, ids, world_size=int(torch.tensor(shape).prod()), level=a.level, device="cuda",
                      in_strategy={"input_ids": mesh(names[0], "None")}, kwargs=dict(labels=ids, use_cache=False))
    took = time.perf_counter() - start
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    split = sorted({names[m] for n in calls for m, p in enumerate(n.inputs[4]) if not p.is_replicate()})
    print(f"planned in {took:.1f} s (optimal: {plan.optimal}, gap {(plan.gap or 0):.2%}); process peak "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    runs = sorted({n.run for n in calls})
    print(f"experts calls: {len(calls)} (run: {', '.join(runs)}), expert weights used as {calls[0].inputs[4]}, "
          f"tokens {calls[0].inputs[0]}: "
          f"experts split over {split or 'nothing'}")
    print(f"peak {plan.cost.peak_bytes / 2**30:.1f} GiB a rank; step {plan.cost.compute_s * 1e3:.0f} ms compute + "
          f"{plan.cost.comm_s * 1e3:.0f} ms communication (estimated)")


if __name__ == "__main__":
    main()
