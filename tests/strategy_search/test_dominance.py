"""Dropping dominated candidates is exact: what is dropped is never needed, each dropped candidate maps to one that
costs no more anywhere, and problems with many dominated candidates solve as brute force does."""

import itertools

import numpy as np
import pytest

from shardfn.strategy_search import dominance, solver
from shardfn.strategy_search.solver import Problem, objective, solve
from tests.strategy_search.test_conditioning import three_neighbours_pairs
from tests.strategy_search.test_solver import _brute_force, _solves_as_brute_force


def _cyclic(seed, budget=False):
    """Every decision with three neighbours or more (nothing eliminates pairwise), half the candidates of each a
    copy of another made dearer (dominated) or a random one (perhaps dominated)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 9))
    pairs = three_neighbours_pairs(rng, n)
    sizes = [int(rng.choice([2, 3])) for _ in range(n)]
    costs = [rng.uniform(0, 1, size=k) for k in sizes]
    edges = [(u, v, rng.uniform(0, 1, size=(sizes[u], sizes[v]))) for u, v in pairs]
    # a dearer copy of candidate 0 of decision v: as candidate 0, plus a cost, in every edge too
    for v in range(n):
        costs[v] = np.append(costs[v], costs[v][0] + rng.uniform(0, 0.5))
        edges = [(a, b, np.vstack([m, m[0] + rng.uniform(0, 0.1)]) if a == v else
                  np.hstack([m, m[:, :1] + rng.uniform(0, 0.1)]) if b == v else m)
                 for a, b, m in edges]
    if not budget:
        return Problem(costs, edges)
    weights = [rng.integers(0, 3, size=len(c)).astype(float) for c in costs]
    for w in weights[::2]:  # (half the decisions weigh nothing that varies: their candidates may be dropped)
        w[:] = 1.0
    return Problem(costs, edges, (weights, float(sum(w.mean() for w in weights))))


def _reducer_without_conditioning(problem, monkeypatch):
    monkeypatch.setattr(solver, "condition_all", lambda red, deadline: None)
    return solver._Reducer(problem.costs, problem.edges)


@pytest.mark.parametrize("seed", range(12))
def test_dropped_candidates_are_dominated_by_the_one_they_map_to(seed):
    problem = _cyclic(seed)
    v = 0
    mine = [(u, m) for u, w, m in problem.edges if u == v] + [(w, m.T) for u, w, m in problem.edges if w == v]
    kept, into = dominance._undominated(problem.costs[v], *(m for _, m in mine))
    assert len(problem.costs[v]) - 1 not in kept  # (the dearer copy of candidate 0)
    for j in range(len(problem.costs[v])):
        i = kept[into[j]]
        assert j not in kept or i == j
        # whatever the neighbours pick, candidate i costs v no more than j
        for picks in itertools.product(*(range(m.shape[1]) for _, m in mine)):
            cost = lambda k: problem.costs[v][k] + sum(m[k, p] for (_, m), p in zip(mine, picks))  # noqa: E731
            assert cost(i) <= cost(j) + 1e-12


@pytest.mark.parametrize("seed", range(12))
def test_problems_with_dominated_candidates_solve_as_brute_force(seed, monkeypatch):
    problem = _cyclic(seed)
    red = _reducer_without_conditioning(problem, monkeypatch)
    dropped = [step for step in red.trail if step[0] == "restricted"]
    assert dropped  # (each decision has its dearer copy)
    monkeypatch.undo()
    sol = solve(problem)
    assert sol.optimal
    assert sol.objective == pytest.approx(_brute_force(problem), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_leaves_the_decisions_it_weighs_whole(seed, monkeypatch):
    problem = _cyclic(seed, budget=True)
    weights, _ = problem.budget
    keep = frozenset(v for v, w in enumerate(weights) if np.ptp(w) > 0)
    monkeypatch.setattr(solver, "condition_all", lambda red, deadline: None)
    red = solver._Reducer(problem.costs, problem.edges, keep=keep)
    assert {step[1] for step in red.trail if step[0] == "restricted"}.isdisjoint(keep)
    monkeypatch.undo()
    _solves_as_brute_force(problem)


@pytest.mark.parametrize("seed", range(6))
def test_a_plan_given_as_the_problem_has_it_maps_to_one_no_costlier(seed, monkeypatch):
    # (the budgeted integer program starts from the Lagrangian rounds' plan, given with every candidate)
    problem = _cyclic(seed)
    red = _reducer_without_conditioning(problem, monkeypatch)
    rng = np.random.default_rng(seed)
    plan = {v: int(rng.integers(len(c))) for v, c in enumerate(problem.costs)}
    mapped = dominance.restricted(red.trail, plan)
    back = dict(mapped)
    for step in reversed(red.trail):  # (the mapped candidates, as the problem numbers them)
        if step[0] == "restricted":
            back[step[1]] = int(step[2][back[step[1]]])
    assert objective(problem, [back[v] for v in range(len(plan))]) <= \
        objective(problem, [plan[v] for v in range(len(plan))]) + 1e-12
    assert all(0 <= mapped[v] < len(red.costs[v]) for v in red.alive)


def test_deepseek_like_layers_keep_a_fraction_of_their_candidates(monkeypatch):
    # MLA's query and key parts as DeepSeek-V3's plan leaves them: twin decisions, every one with three neighbours,
    # most candidates never best for any neighbour's choice (a costly layout costs more in every edge too)
    rng = np.random.default_rng(0)
    k, n = 40, 8
    base = rng.uniform(0, 1, size=(n, 4))
    costs = [np.concatenate([base[v], base[v][rng.integers(0, 4, size=k - 4)] + rng.uniform(0.5, 1, k - 4)])
             for v in range(n)]
    pairs = [(v, (v + 1) % n) for v in range(n)] + [(v, (v + n // 2) % n) for v in range(n // 2)]
    edges = []
    for u, v in pairs:
        m = rng.uniform(0, 0.2, size=(k, k))
        m[4:, :] += 0.3
        m[:, 4:] += 0.3
        edges.append((u, v, m))
    problem = Problem(costs, edges)
    red = solver._Reducer(problem.costs, problem.edges)
    assert not red.alive  # (what is left is small enough for conditioning to end it)
    restricted = [step for step in red.trail if step[0] == "restricted"]
    assert restricted and all(len(step[2]) <= 8 for step in restricted)
    sol = solve(problem)
    assert sol.optimal
    # the same problem without dropping or conditioning: the integer program proves the same optimum
    monkeypatch.setattr(solver, "drop_dominated", lambda red, decisions, deadline: None)
    monkeypatch.setattr(solver, "condition_all", lambda red, deadline: None)
    program = solve(problem)
    assert program.optimal and program.stats["ilp_decisions"] == n
    assert sol.objective == pytest.approx(program.objective, rel=1e-9)
