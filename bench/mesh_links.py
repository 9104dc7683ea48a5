"""Where a plan's collectives run when mesh dims have different links (no processes: simulated worlds, meta).

    python bench/mesh_links.py            # Llama-3-8B (32 layers) on 8 x 8, 70B-shaped (2 layers) on 8 x 8 x 8
    python bench/mesh_links.py --quick    # the 8B rows only

transformers' LlamaForCausalLM with labels (the loss returned, no KV cache), level 2, device="cuda" (the H100
profile: NVLink within a node of 8, InfiniBand between nodes), the tokens' batch split over "dp" (and over "fsdp"
too in one 3-D row), every other layout searched.
Printed per plan: the planning seconds, each mesh dim's link, and per mesh dim the count and bytes of the
collectives (forward and backward), with the forward collectives inside the layers on their own line: the tensor
parallelism's activation all-reduces/gathers, which belong on the intra-node dim.
"""

import argparse
import collections
import math
import time
import warnings


def _plan(hidden, inter, heads, kv, layers, batch, dims, names, batch_axes):
    import torch
    import transformers

    import shardfn as sf

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                                   num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=128256,
                                   max_position_embeddings=8192)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, dtype=torch.long, device="meta")
    layout = sf.Layout(dims, names)
    start = time.perf_counter()
    entry = layout(batch_axes, "None")
    plan = sf.explain(model, ids, world_size=math.prod(dims), in_strategy={"input_ids": entry, "labels": entry},
                      kwargs=dict(labels=ids, use_cache=False), level=2, device="cuda")
    return plan, time.perf_counter() - start


def per_dim(plan, layers_only_forward=False):
    """{mesh dim name: [count, bytes]} of the plan's collectives (or the forward ones inside the layers)."""
    out = collections.defaultdict(lambda: [0, 0])
    for c in plan.collectives:
        if layers_only_forward:
            ends = [plan.nodes.get(n) for n in c.where.split(" -> ")]
            if c.phase != "forward" or not any(e is not None and e.module.startswith("model.layers.") for e in ends):
                continue
        key = "+".join(plan.mesh.names[d] for d in c.mesh_dims)
        out[key][0] += 1
        out[key][1] += c.nbytes
    return dict(out)


def report(title, plan, seconds):
    links = ", ".join(f"{n}={s} {l}" for n, s, l in zip(plan.mesh.names, plan.mesh.shape, plan.mesh.links))
    print(f"{title}: planned in {seconds:.2f} s; mesh {links}; comm {plan.cost.comm_s * 1e3:.2f} ms, "
          f"compute {plan.cost.compute_s * 1e3:.2f} ms")
    for label, rows in (("all collectives", per_dim(plan)), ("layers' forward", per_dim(plan, True))):
        text = "; ".join(f"{k}: {n} ({b / 2**20:.0f} MiB)" for k, (n, b) in sorted(rows.items()))
        print(f"  {label:<16} {text}")
    q = next(e for e in plan.inputs if e.name.endswith("layers.0.self_attn.q_proj.weight"))
    print(f"  q_proj.weight    {q.planned}; search {plan.search}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the 8B rows only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for batch in (8, 32):
        plan, s = _plan(4096, 14336, 32, 8, 32, (batch, 2048), (8, 8), ("dp", "tp"), "dp")
        report(f"Llama-3-8B config, 32 layers, batch {batch} x 2048, 8 x 8 (dp, tp), tokens over dp", plan, s)
    if args.quick:
        return
    for axes in (("dp", "fsdp"), "dp"):
        plan, s = _plan(8192, 28672, 64, 8, 2, (64, 4096), (8, 8, 8), ("dp", "fsdp", "tp"), axes)
        report(f"Llama-3-70B shape, 2 layers, batch 64 x 4096, 8 x 8 x 8 (dp, fsdp, tp), tokens over {axes}",
               plan, s)


if __name__ == "__main__":
    main()
