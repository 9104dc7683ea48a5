"""The solver is exact: on small random problems its objective equals brute-force enumeration."""

import itertools

import numpy as np
import pytest

from shardfn.strategy_search.solver import Infeasible, Problem, objective, solve


def _random_problem(rng, n, density, budget=False):
    costs = [rng.uniform(0, 10, size=rng.integers(2, 5)) for _ in range(n)]
    if n > 2:
        costs[rng.integers(n)] = rng.uniform(0, 10, size=1)  # a fixed decision
    edges = []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < density:
            m = rng.uniform(0, 10, size=(len(costs[u]), len(costs[v])))
            m[rng.random(m.shape) < 0.3] = 0.0  # zero-resharding pairs, as real plans have
            edges.append((u, v, m))
    if rng.random() < 0.5 and edges:  # a parallel edge
        u, v, m = edges[0]
        edges.append((u, v, rng.uniform(0, 3, size=m.shape)))
    weights = [rng.integers(0, 5, size=len(c)).astype(float) for c in costs] if budget else None
    limit = float(sum(w.mean() for w in weights)) if budget else None
    return Problem(costs, edges, (weights, limit) if budget else None)


def _brute_force(problem):
    best = np.inf
    for choice in itertools.product(*[range(len(c)) for c in problem.costs]):
        if problem.budget is not None:
            weights, limit = problem.budget
            if sum(weights[v][k] for v, k in enumerate(choice)) > limit + 1e-9:
                continue
        best = min(best, objective(problem, list(choice)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    problem = _random_problem(rng, n, density=float(rng.uniform(0.1, 0.6)))
    sol = solve(problem)
    assert sol.optimal
    assert sol.objective == pytest.approx(_brute_force(problem), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(15))
def test_matches_brute_force_with_budget(seed):
    rng = np.random.default_rng(100 + seed)
    problem = _random_problem(rng, int(rng.integers(2, 9)), density=0.4, budget=True)
    expected = _brute_force(problem)
    if expected == np.inf:
        with pytest.raises(Infeasible):
            solve(problem)
        return
    sol = solve(problem)
    weights, limit = problem.budget
    assert sum(weights[v][k] for v, k in enumerate(sol.choice)) <= limit + 1e-9
    assert sol.objective == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_chains_are_eliminated_exactly():
    rng = np.random.default_rng(7)
    n = 200
    costs = [rng.uniform(0, 1, size=16) for _ in range(n)]
    edges = [(i, i + 1, rng.uniform(0, 1, size=(16, 16))) for i in range(n - 1)]
    edges.append((0, n - 1, rng.uniform(0, 1, size=(16, 16))))  # a cycle: still exact
    sol = solve(Problem(costs, edges))
    assert sol.stats["ilp_decisions"] == 0
    # the cycle's optimum by enumerating the first decision and running the chain DP
    best = np.inf
    for k0 in range(16):
        acc = costs[0].copy() * np.inf
        acc[k0] = costs[0][k0]
        for i in range(n - 1):
            acc = (acc[:, None] + edges[i][2]).min(axis=0) + costs[i + 1]
        best = min(best, (acc + edges[-1][2][k0]).min())
    assert sol.objective == pytest.approx(best, rel=1e-12)
