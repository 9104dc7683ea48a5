"""Cutset conditioning is exact: layers elimination alone cannot open solve as brute force and the integer
program do, without the integer program."""

import numpy as np
import pytest

from shardfn.strategy_search import conditioning
from shardfn.strategy_search.solver import Problem, solve
from tests.strategy_search.test_solver import _brute_force


# One MoE layer as DeepSeek-V2-Lite's plan leaves it to the solver: every decision with three neighbours (its
# router, experts and combine tied in cycles), between the residual stream's decisions before and after it
_MOE_BLOCK = [("in", "a"), ("a", "b"), ("a", "g"), ("b", "f"), ("b", "c"), ("c", "d"), ("c", "e"), ("d", "e"),
              ("d", "h"), ("e", "f"), ("f", "g"), ("g", "h"), ("h", "out"), ("in", "out")]


def _moe_layers(layers, k, seed=5, identical=True):
    """A chain of ``layers`` such blocks, ``k`` candidates a decision; identical layers share their arrays."""
    rng = np.random.default_rng(seed)
    inner = "abcdefgh"

    def layer_arrays():
        return ({n: rng.uniform(0, 1, size=k) for n in inner + "o"},
                {e: rng.uniform(0, 1, size=(k, k)) for e in _MOE_BLOCK})

    shared = layer_arrays()
    costs, edges = [rng.uniform(0, 1, size=k)], []
    for _ in range(layers):
        unary, pairwise = shared if identical else layer_arrays()
        ids = {"in": len(costs) - 1}
        for n in inner + "o":
            ids["out" if n == "o" else n] = len(costs)
            costs.append(unary[n])
        edges += [(ids[u], ids[v], pairwise[u, v]) for u, v in _MOE_BLOCK]
    return Problem(costs, edges)


@pytest.mark.parametrize("identical", [True, False])
def test_layers_elimination_cannot_open_are_solved_exactly_by_conditioning(identical, monkeypatch):
    one = _moe_layers(1, 2, identical=identical)  # 10 decisions of 2 candidates: brute force
    sol = solve(one)
    assert sol.optimal and sol.stats["ilp_decisions"] == 0
    assert sol.objective == pytest.approx(_brute_force(one), rel=1e-12)
    deep = _moe_layers(3, 3, identical=identical)
    sol = solve(deep)
    assert sol.optimal and sol.stats["ilp_decisions"] == 0
    monkeypatch.setattr(conditioning, "_CONDITION_MAX_CANDIDATES", 0)  # without it: the integer program, proven optimal
    program = solve(deep)
    assert program.optimal and program.stats["ilp_decisions"] > 0
    assert sol.objective == pytest.approx(program.objective, rel=1e-9)


def three_neighbours_pairs(rng, n: int) -> list[tuple[int, int]]:
    """Random pairs of ``n`` decisions, each decision in three at least."""
    pairs = set()
    for v in range(n):
        while sum(v in p for p in pairs) < 3:
            u = int(rng.integers(n))
            if u != v:
                pairs.add(tuple(sorted((u, v))))
    return sorted(pairs)


def _three_neighbours_at_least(seed):
    """Every decision with three neighbours or more: nothing eliminates without conditioning."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(7, 11))
    costs = [rng.uniform(0, 1, size=int(rng.choice([2, 2, 3]))) for _ in range(n)]
    pairs = three_neighbours_pairs(rng, n)
    return Problem(costs, [(u, v, rng.uniform(0, 1, size=(len(costs[u]), len(costs[v])))) for u, v in pairs])


@pytest.mark.parametrize("seed", range(8))
def test_cycles_of_three_neighbours_match_brute_force(seed):
    # blocks whose boundary is two decisions with an edge between them or none (seed 2), one decision, or none
    problem = _three_neighbours_at_least(seed)
    sol = solve(problem)
    assert sol.optimal
    assert sol.objective == pytest.approx(_brute_force(problem), rel=1e-12)


def test_conditioning_starts_no_block_past_its_deadline():
    from shardfn.strategy_search.solver import _Reducer

    problem = _moe_layers(3, 3)
    assert not _Reducer(problem.costs, problem.edges).alive
    left = _Reducer(problem.costs, problem.edges, deadline=0.0).alive  # (past: for the integer program)
    assert len(left) == 3 * 8 + 2  # (each layer's eight inner decisions, and the stream between the layers)
