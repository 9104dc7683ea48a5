"""Planning time for a Llama-3-8B-shaped decoder on a simulated 8 x 8 mesh (64 ranks, no processes).

    python bench/search_scale.py [--layers 1 8 16 32]

Only the token input's layout is given (batch over "dp"); every parameter and activation layout is searched.
Prints the cold-start time (the first plan in a process enumerates DTensor's rules for each distinct op), then
per depth: total planning seconds (capture + search), the decisions before and after exact elimination (what
is left goes to the ILP), and the time per layer, so growth with depth can be read off (the issue's target:
32 layers under 5 s, no worse than linear).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama import Config, Llama  # noqa: E402

import shardfn as sf  # noqa: E402
from shardfn.strategy_search import search as search_mod  # noqa: E402


def plan_once(layers: int, batch: int = 8, seq: int = 2048):
    with torch.device("meta"):
        model = Llama(Config(layers=layers))
    tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
    mesh = sf.Layout((8, 8), ("dp", "tp"))
    stats = {}
    real_solve = search_mod.solve

    def timed_solve(problem, *a, **k):
        sol = real_solve(problem, *a, **k)
        stats.setdefault("ilp", []).append(sol.stats)
        return sol

    search_mod.solve = timed_solve
    try:
        start = time.perf_counter()
        plan = sf.explain(model, tokens, in_strategy=(mesh("dp", "None"),), world_size=64, level=2,
                          device="cuda")
        total = time.perf_counter() - start
    finally:
        search_mod.solve = real_solve
    return plan, total, stats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 16, 32])
    args = parser.parse_args()
    start = time.perf_counter()
    plan_once(args.layers[-1])
    print(f"cold: the first plan in this process ({args.layers[-1]} layers) took {time.perf_counter() - start:.2f} s, "
          "including asking DTensor's rules about each distinct op once (cached for every later plan)")
    print(f"{'layers':>6} {'plan s':>8} {'s/layer':>8} {'decisions':>10} {'in ILP':>7} {'collectives':>12}")
    for n in args.layers:
        plan, total, stats = plan_once(n)
        last = stats["ilp"][-1]
        print(f"{n:>6} {total:>8.2f} {total / n:>8.3f} {last['decisions']:>10} {last['ilp_decisions']:>7} "
              f"{len(plan.collectives):>12}", flush=True)


if __name__ == "__main__":
    main()
