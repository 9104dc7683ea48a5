"""Planning time at real scale, on models written elsewhere (no processes: simulated worlds, meta tensors).

    python bench/search_scale.py                 # every row below
    python bench/search_scale.py --quick         # the 8B rows only, up to 8 layers

Each row plans in a fresh process: "cold" is its first plan (capture, DTensor's rules asked about each distinct
op, the search), "warm" a second plan of the same call in that process (the rules cached). Level 2, only the
tokens' batch layout given (over "dp"); every parameter and activation layout is searched. Printed per row:
seconds cold and warm, the decisions, how many of them exact elimination left to the integer program, and the
plan's gap to the best bound (0: proven optimal).

Rows: transformers' LlamaForCausalLM at the Llama-3-8B config (1, 8, 16, 32 layers, batch 8 x 2048) on 8 x 8
ranks, at the Llama-3-70B config (1, 8, 80 layers, batch 64 x 4096) on 8 x 8 x 8, and a hand-written Llama-3-8B
(bench/llama.py: its own RoPE, GQA by repeat_interleave, SDPA) at 32 layers on 8 x 8, with the CPU profile too
(whose 16 GB makes the memory limit bind: the budgeted search). Targets on this 2-core machine: 8B, 32 layers:
10 s cold for transformers' model, 5 s for the hand-written one; 70B, 80 layers, 512 ranks: 60 s.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [
    ("hf-8b", 1, "8x8", "cuda"), ("hf-8b", 8, "8x8", "cuda"), ("hf-8b", 16, "8x8", "cuda"),
    ("hf-8b", 32, "8x8", "cuda"),
    ("hf-70b", 1, "8x8x8", "cuda"), ("hf-70b", 8, "8x8x8", "cuda"), ("hf-70b", 80, "8x8x8", "cuda"),
    ("own-8b", 32, "8x8", "cuda"), ("own-8b", 32, "8x8", "cpu"),
]


def _model(kind: str, layers: int):
    import torch

    if kind == "own-8b":
        sys.path.insert(0, HERE)
        from llama import Config, Llama

        with torch.device("meta"):
            return Llama(Config(layers=layers)), (8, 2048)
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind == "hf-8b":
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=8192)
        batch = (8, 2048)
    else:
        cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                          num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=8192)
        batch = (64, 4096)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg), batch


def _row(kind: str, layers: int, mesh: str, device: str) -> dict:
    """One row, in this process: a cold plan, then a warm one."""
    import torch

    import shardfn as sf

    model, batch = _model(kind, layers)
    dims = tuple(int(n) for n in mesh.split("x"))
    layout = sf.Layout(dims, ("dp", "tp", "cp")[:len(dims)])
    tokens = torch.zeros(batch, dtype=torch.long, device="meta")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        plan = sf.explain(model, tokens, in_strategy=(layout("dp", "None"),), world_size=math.prod(dims), level=2,
                          device=device)
        times.append(time.perf_counter() - start)
    return {"cold": times[0], "warm": times[1], "decisions": plan.search.get("decisions", 0),
            "ilp": plan.search.get("ilp_decisions", 0), "gap": plan.gap, "optimal": plan.optimal,
            "collectives": len(plan.collectives)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the 8B rows up to 8 layers")
    parser.add_argument("--row", nargs=4, help=argparse.SUPPRESS)  # kind layers mesh device: one row, as JSON
    args = parser.parse_args()
    if args.row:
        kind, layers, mesh, device = args.row
        print(json.dumps(_row(kind, int(layers), mesh, device)))
        return
    rows = [r for r in ROWS if r[0] == "hf-8b" and r[1] <= 8] if args.quick else ROWS
    print(f"{'model':<8} {'layers':>6} {'mesh':>7} {'profile':>7} {'cold s':>7} {'warm s':>7} {'decisions':>9} "
          f"{'to ILP':>6} {'gap':>6} {'collectives':>11}")
    for kind, layers, mesh, device in rows:
        out = subprocess.run([sys.executable, __file__, "--row", kind, str(layers), mesh, device],
                             capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if out.returncode != 0:
            print(f"{kind:<8} {layers:>6} {mesh:>7} failed:\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        profile = "h100" if device == "cuda" else "cpu"
        print(f"{kind:<8} {layers:>6} {mesh:>7} {profile:>7} {r['cold']:>7.2f} {r['warm']:>7.2f} {r['decisions']:>9} "
              f"{r['ilp']:>6} {r['gap']:>6.2%} {r['collectives']:>11}", flush=True)


if __name__ == "__main__":
    main()
