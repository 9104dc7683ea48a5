"""The three objectives (``level``), each solved exactly by the solver where it finishes.

0: maximise the ratio of compute saved by sharding to communication time (Dinkelbach's method: each round an
   exact solve of max savings - lambda * comm, lambda the best ratio so far), then least time on ties;
1: minimise per-rank memory, then time;
2: minimise step time (compute + communication) within the device's memory.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import cost_model as cm
from .policy import LevelPolicy
from .pricing import Terms
from .solver import Infeasible, Problem, Solution, scaled_edges, solve

__all__ = ["solve_level"]


def solve_level(policy: LevelPolicy, t: Terms, profile: cm.DeviceProfile, time_limit_s: float,
                budget: float | None = None, optional: bool = False) -> Solution:
    """Choose candidates for the level's objective (``policy.objective``) (see the README's *Search* section); levels 0 and 2 within
    ``budget`` bytes of the pricing's memory estimate (the profile's memory where None). ``time_limit_s`` bounds
    all the level's solves together (0: exact elimination and the incumbent only)."""
    deadline = time.perf_counter() + time_limit_s  # (building the level's arrays counts in its time)
    budget = profile.memory_bytes if budget is None else budget
    unary_time = _each(lambda c, r: c + r, t.compute, t.reductions)
    upper_time = sum(float(c.max()) for c in unary_time) + _sum_of_max([m for _, _, m in t.edges]) + 1e-12

    def kept_split(edges, scale):
        # one gather of a value that must stay split, or one pair of choices no program runs, outweighs
        # everything the objective can gain elsewhere (each matrix scaled once: identical layers share them, and
        # so the solver hashes and eliminates each once)
        return edges + scaled_edges(t.violations + t.impossible, 10 * scale + 1)

    time_problem = Problem(unary_time, kept_split(t.edges, upper_time))
    if policy.objective == "time":  # (the fastest plan first: it is the answer where it fits)
        try:
            within = None if math.isinf(budget) else (t.memory, budget)  # (inf: the fastest plan, for its figures)
            sol = solve(Problem(time_problem.costs, time_problem.edges, within, t.edge_memory), _left(deadline),
                        optional)
        except Infeasible:
            raise ValueError(
                f"level={policy.level}: no plan fits the per-rank memory of the {profile.name} profile "
                f"({profile.memory_bytes / 2**30:.1f} GiB); use level=1 (least memory) or more ranks"
            ) from None
        return sol
    if policy.objective == "memory":
        eps = 1e-3 / upper_time  # all time together is worth less than a thousandth of a byte
        costs = _each(lambda mem, c: mem + eps * c, t.memory, unary_time)
        scale = sum(float(m.max()) for m in t.memory) + _sum_of_max([m for _, _, m in t.edge_memory]) + 1.0
        return solve(Problem(costs, kept_split(scaled_edges(t.edges, eps) + t.edge_memory, scale)),
                     _left(deadline))
    best = _best_ratio(t, unary_time, upper_time, kept_split, deadline, None)
    if t.memory_of(best.choice) > budget:  # the best ratio does not fit: the best that does
        try:
            best = _best_ratio(t, unary_time, upper_time, kept_split, deadline, budget)
        except Infeasible:
            raise ValueError(
                f"level={policy.level}: no plan fits the per-rank memory of the {profile.name} profile "
                f"({profile.memory_bytes / 2**30:.1f} GiB); use level=1 (least memory) or more ranks"
            ) from None
    return best


def _left(deadline: float) -> float:
    return max(deadline - time.perf_counter(), 0.0)


def _each(fn, *arrays: list[np.ndarray]) -> list[np.ndarray]:
    """``fn`` of each decision's arrays, computed once per tuple of arrays: identical layers share their pricing's
    arrays, and so share the result (the solver hashes each distinct array once: 11,049 new ones had taken a
    Llama-405B solve about a second before it began)."""
    done: dict[tuple[int, ...], np.ndarray] = {}
    out = []
    for operands in zip(*arrays):
        key = tuple(map(id, operands))
        if key not in done:
            done[key] = fn(*operands)
        out.append(done[key])
    return out


def _sum_of_max(matrices: list[np.ndarray]) -> float:
    """The sum of the matrices' maxima, each distinct matrix's taken once (identical layers' edges share theirs:
    Llama-405B's 13,080 edges hold 336, some of a million pairs each)."""
    most: dict[int, float] = {}
    for m in matrices:
        if id(m) not in most:
            most[id(m)] = float(m.max())
    return sum(most[id(m)] for m in matrices)


def _best_ratio(t: Terms, unary_time, upper_time: float, kept_split, deadline: float,
                budget: float | None) -> Solution:
    """Level 0 by Dinkelbach's rounds, within ``budget`` bytes of memory where one is given; past ``deadline``
    (perf_counter) the last round's plan, said to be stopped by the time limit."""
    eps = 1e-6 * max(sum(float(s.max()) for s in t.savings), 1e-12) / upper_time
    lam, best = 0.0, None
    for _ in range(50):
        costs = _each(lambda s, r, c: -s + lam * r + eps * c, t.savings, t.reductions, unary_time)
        scale = sum(float(np.abs(s).max()) for s in t.savings) + (lam + 1) * upper_time
        sol = solve(Problem(costs, kept_split(scaled_edges(t.edges, lam + eps), scale),
                            None if budget is None else (t.memory, budget), t.edge_memory),
                    _left(deadline))
        saved, comm = t.savings_of(sol.choice), t.comm_of(sol.choice)
        best = sol
        if comm <= 0 or saved - lam * comm <= 1e-9 * max(saved, 1e-12):
            break
        lam, last = saved / comm, lam
        if time.perf_counter() > deadline:
            # the ratio not proven the best; Dinkelbach's rounds give no bound: the gap said is the last round's gain
            best.optimal, best.timed_out = False, True
            best.gap = max(best.gap, (lam - last) / lam)
            break
    best.message = best.message if best.message != "optimal" else ""
    return best
