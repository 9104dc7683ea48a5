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
            if _weight(problem, choice) > problem.budget[1] + 1e-9:
                continue
        best = min(best, objective(problem, list(choice)))
    return best


def _weight(problem, choice):
    weights, _ = problem.budget
    return sum(weights[v][k] for v, k in enumerate(choice)) + sum(m[choice[u], choice[v]]
                                                                  for u, v, m in problem.budget_edges)


def _solves_as_brute_force(problem):
    """The budgeted solve's objective is brute force's, within the budget; Infeasible where nothing keeps it."""
    expected = _brute_force(problem)
    if expected == np.inf:
        with pytest.raises(Infeasible):
            solve(problem)
        return
    sol = solve(problem)
    assert _weight(problem, sol.choice) <= problem.budget[1] + 1e-9
    assert sol.objective == pytest.approx(expected, rel=1e-9, abs=1e-9)


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
    _solves_as_brute_force(problem)


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


def _layered(layers, k=6, seed=3):
    """A chain of identical layers, each a diamond (entry -> two branches -> exit) that elimination must fold."""
    rng = np.random.default_rng(seed)
    unary = [rng.uniform(0, 1, size=k) for _ in range(3)]
    inside = [rng.uniform(0, 1, size=(k, k)) for _ in range(4)]
    between = rng.uniform(0, 1, size=(k, k))
    costs, edges = [rng.uniform(0, 1, size=k)], []
    for layer in range(layers):
        entry = len(costs) - 1
        a, b, out = entry + 1, entry + 2, entry + 3
        costs += [unary[0].copy(), unary[1].copy(), unary[2].copy()]  # equal, not the same objects
        edges += [(entry, a, inside[0].copy()), (entry, b, inside[1].copy()), (a, out, inside[2].copy()),
                  (b, out, inside[3] + 0.0)]
        if layer:
            edges.append((entry - 3, entry, between.copy()))  # a second tie to the layer before
    return Problem(costs, edges)


def test_identical_layers_are_eliminated_once_and_exactly(monkeypatch):
    import shardfn.strategy_search.solver as solver

    counted = {"link": 0}
    real_link = solver._link

    def counting(*a):
        counted["link"] += 1
        return real_link(*a)

    monkeypatch.setattr(solver, "_link", counting)
    links = {}
    for layers in (4, 32):
        counted["link"] = 0
        sol = solve(_layered(layers))
        assert sol.optimal and sol.stats["ilp_decisions"] == 0
        links[layers] = counted["link"]
    assert links[32] < 2 * links[4] + 2 * (32 - 4), links  # the layers' own folds are shared; only the chain grows
    # shared, and the same answer as computing every layer's eliminations anew
    problem = _layered(12)
    shared = solve(problem)
    monkeypatch.setattr(solver._Shared, "intern", lambda self, a: np.array(a, dtype=float))
    monkeypatch.setattr(solver._Shared, "__call__", lambda self, fn, *ops: fn(*ops))
    alone = solve(problem)
    assert shared.choice == alone.choice and shared.objective == pytest.approx(alone.objective, rel=1e-12)


def test_a_time_limit_returns_the_best_plan_found_with_its_gap():
    rng = np.random.default_rng(11)
    n, k = 40, 6  # dense: nothing eliminates, and HiGHS cannot prove the optimum in a few milliseconds
    costs = [rng.uniform(0, 1, size=k) for _ in range(n)]
    edges = [(u, v, rng.uniform(0, 1, size=(k, k))) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.5]
    sol = solve(Problem(costs, edges), time_limit_s=0.01)
    assert len(sol.choice) == n and all(0 <= c < k for c in sol.choice)
    assert sol.objective == pytest.approx(objective(Problem(costs, edges), sol.choice))
    assert sol.optimal or (sol.timed_out and sol.gap > 0)
    # never worse than the plan HiGHS starts from
    from shardfn.strategy_search.solver import _incumbent, _Reducer

    start = _incumbent(_Reducer(costs, edges))
    assert sol.objective <= objective(Problem(costs, edges), [start[v] for v in range(n)]) + 1e-9


def test_a_budget_on_a_deep_chain_is_kept_by_lagrangian_rounds_of_exact_elimination():
    rng = np.random.default_rng(5)
    n, k = 400, 8
    costs = [rng.uniform(0, 1, size=k) for _ in range(n)]
    weights = [rng.uniform(0, 1, size=k) for _ in range(n)]
    edges = [(i, i + 1, rng.uniform(0, 1, size=(k, k))) for i in range(n - 1)]
    free = solve(Problem(costs, edges))
    limit = 0.9 * sum(w[c] for w, c in zip(weights, free.choice))  # binding
    sol = solve(Problem(costs, edges, (weights, limit)))
    assert sum(w[c] for w, c in zip(weights, sol.choice)) <= limit
    assert sol.stats["lagrangian_rounds"] > 0 and sol.stats["ilp_decisions"] == 0
    assert sol.gap < 0.01 and not sol.timed_out


@pytest.mark.parametrize("joined", [False, True], ids=["apart", "a chain of layers"])
def test_identical_layers_under_a_budget_mix_their_choices(monkeypatch, joined):
    # One multiplier prices identical layers alike: every Lagrangian plan has all layers fast (over the budget)
    # or all lean, and the budget lies between. The best plan keeps some layers fast: found without the integer
    # program (which is made to fail here), equal to brute force.
    import shardfn.strategy_search.solver as solver

    def no_program(*args, **kwargs):
        raise AssertionError("the integer program ran")

    monkeypatch.setattr(solver, "_program", no_program)
    layers = 8
    costs, weights, edges = [], [], []
    for layer in range(layers):  # a layer: a value (fast: 1 s, 3 bytes; lean: 2 s, 1 byte) and its link onward
        costs += [np.array([1.0, 2.0]), np.array([0.0])]
        weights += [np.array([3.0, 1.0]), np.array([0.0])]
        edges.append((2 * layer, 2 * layer + 1, np.array([[0.0], [0.25]])))  # lean costs a little more onward
        if joined and layer:  # the values between layers agree in both plans: layers stay apart
            edges.append((2 * layer - 1, 2 * layer, np.array([[0.5, 0.5]])))
    limit = 3.0 * 3 + 1.0 * 5  # three layers fast, five lean
    problem = Problem(costs, edges, (weights, limit))
    sol = solve(problem)
    assert sum(w[c] for w, c in zip(weights, sol.choice)) <= limit
    assert sol.objective == pytest.approx(_brute_force(problem))
    assert sol.stats["mixed_parts"] == 5 and sol.gap < 1e-2 and not sol.timed_out


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_with_a_budget_weighing_pairs(seed):
    # a gathered copy's bytes depend on two choices (the value's layout and its reader's): the budget weighs pairs
    # too, on edges that cost something and on pairs that do not; the least weight is then no sum of minima
    rng = np.random.default_rng(300 + seed)
    problem = _random_problem(rng, int(rng.integers(3, 8)), density=0.4, budget=True)
    n = len(problem.costs)
    pairs = [(u, v) for u, v in itertools.combinations(range(n), 2) if rng.random() < 0.5] or [(0, 1)]
    problem.budget_edges = [(u, v, rng.integers(0, 6, size=(len(problem.costs[u]), len(problem.costs[v])))
                             .astype(float)) for u, v in pairs]
    problem.budget = (problem.budget[0], problem.budget[1] + 1.5 * len(pairs))  # (binding in most, over in some)
    _solves_as_brute_force(problem)


def _layouts_chain(rng, n: int, k: int) -> Problem:
    """A chain of values of ``k`` layouts each, moving a value between two layouts costing more than keeping it
    (as redistributions do), each layout's own cost random."""
    costs = [rng.uniform(0, 10, size=k) for _ in range(n)]
    edges = []
    for u in range(n - 1):
        m = rng.uniform(1, 3, size=(k, k))
        np.fill_diagonal(m, 0.0)
        edges.append((u, u + 1, m))
    return Problem(costs, edges)


def test_past_its_time_limit_elimination_keeps_a_shortlist_of_each_large_decision():
    # with no time left, a min-plus product of three decisions of more than solver._SHORTLIST candidates is taken
    # on the shortlists of those that cost least with their neighbours' best replies: fast, and the plan says it
    # is not proven (no bound known); with time, every candidate is eliminated exactly
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(3)
    problem = _layouts_chain(rng, 12, 2 * solver._SHORTLIST)
    exact = solve(problem, time_limit_s=60.0)
    assert exact.optimal and "shortlisted" not in exact.stats
    short = solve(problem, time_limit_s=0.0)
    assert short.stats["shortlisted"] == solver._SHORTLIST
    assert not short.optimal and short.timed_out and short.gap == float("inf") and short.bound == -float("inf")
    assert short.objective == pytest.approx(objective(problem, short.choice))
    assert exact.objective <= short.objective <= 1.05 * exact.objective


def test_a_product_forecast_to_end_past_the_limit_is_shortlisted_before_it_starts(monkeypatch):
    # the forecast (its elements at the rate measured so far), not the clock once the limit has passed, decides:
    # forecast past a limit still ahead, every large product is shortlisted; with no limit, none; and a product
    # computed already for an identical layer is forecast to cost nothing: identical links decide alike
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(5)
    problem = _layouts_chain(rng, 10, 2 * solver._SHORTLIST)
    problem.costs = [c / 10 for c in problem.costs]  # (below any move's cost: no candidate dominated)
    monkeypatch.setattr(solver._Shared, "link_seconds", lambda self, *operands: 3600.0)
    ahead = solve(problem, time_limit_s=60.0)
    assert ahead.stats["shortlisted"] == solver._SHORTLIST and not ahead.optimal
    assert "shortlisted" not in solve(problem, time_limit_s=float("inf")).stats
    monkeypatch.undo()
    # the rest of the elimination, shortlisted, is reserved too: a product forecast to end in time but whose tail
    # would not is shortlisted, and the tail's rate is measured where one ran
    monkeypatch.setattr(solver._Shared, "tail_seconds", lambda self, large: 3600.0 if large else 0.0)
    assert solve(problem, time_limit_s=60.0).stats["shortlisted"] == solver._SHORTLIST
    monkeypatch.undo()
    shared = solver._Shared()
    solver._unconstrained(problem.costs, problem.edges, 0.0, shared)
    assert shared._tail_decisions > 0 and shared.tail_seconds(2) == pytest.approx(
        2 * shared._tail_seconds / shared._tail_decisions)
    shared = solver._Shared()
    m = rng.uniform(0, 1, size=(4, 5))
    c_v, c_vw = rng.uniform(0, 1, size=5), rng.uniform(0, 1, size=(5, 3))
    assert shared.link_seconds(m, c_v, c_vw) == pytest.approx(4 * 5 * 3 * 1e-9)  # (no rate measured yet)
    shared(solver._link, m, c_v, c_vw)
    assert shared.link_seconds(m, c_v, c_vw) == 0.0
    assert shared.link_seconds(m.copy(), c_v, c_vw) > 0.0


def test_a_round_drops_what_it_computed_from_its_multiplier_and_keeps_the_rest():
    # what a Lagrangian round computes from its own arrays no later round meets: dropped at its end, so the
    # memory is taken again; what it computed from the problem's own arrays stays for the next round
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(6)
    shared = solver._Shared()
    edge, cost = shared.intern(rng.uniform(0, 1, size=(4, 5))), shared.intern(rng.uniform(0, 1, size=5))
    with shared.one_round():
        priced = shared.adopt(cost + 0.5)
        from_round = shared(solver._leaf, edge, priced)
        restricted = shared.intern(shared(solver._plus, from_round[0], from_round[0]))
        kept = shared(solver._leaf, edge, cost)
        assert shared(solver._leaf, edge, priced) is from_round
    assert shared(solver._leaf, edge, cost) is kept  # (memoised still: made of the problem's arrays alone)
    keys = set(shared._memo)
    assert keys == {shared._key(solver._leaf, (edge, cost))}
    assert id(priced) not in shared._interned and id(restricted) not in shared._interned
    assert all(x is not restricted for alike in shared._interned.values() if isinstance(alike, list)
               for x in alike)
    assert shared._round is None  # (outside a round nothing is marked)
    shared.adopt(cost * 2)
    assert shared._round is None


def test_a_shortlisted_budget_solve_keeps_the_budget():
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(4)
    base = _layouts_chain(rng, 8, 2 * solver._SHORTLIST)
    weights = [rng.uniform(0, 1, size=len(c)) for c in base.costs]
    free = solve(base)
    limit = 0.8 * sum(w[c] for w, c in zip(weights, free.choice))  # binding
    sol = solve(Problem(base.costs, base.edges, (weights, limit)), time_limit_s=0.0)
    assert sum(w[c] for w, c in zip(weights, sol.choice)) <= limit
    assert sol.stats["shortlisted"] == solver._SHORTLIST and not sol.optimal and sol.timed_out


def test_interning_finds_equal_arrays_and_keeps_apart_those_alike_only_where_hashed():
    # the hash reads a sample of a large array: arrays equal there but not elsewhere stay apart (compared whole),
    # equal ones made apart become one object, small ones are hashed whole
    from shardfn.strategy_search import solver

    shared = solver._Shared()
    a = np.arange(4 * solver._HASHED, dtype=float).reshape(8, -1)
    same, other = a.copy(), a.copy()
    other.reshape(-1)[1] += 0.5  # (between two sampled elements)
    assert shared.intern(a) is a and shared.intern(same) is a
    assert shared.intern(other) is other and shared.intern(other.copy()) is other
    assert shared.intern(a.reshape(-1)) is not a  # (another shape)
    small = np.array([1.0, 2.0])
    assert shared.intern(small.copy()) is shared.intern(small)


def test_a_budget_below_every_least_weight_is_refused_before_any_elimination(monkeypatch):
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(3)
    problem = _random_problem(rng, 6, 0.5, budget=True)
    weights, _ = problem.budget
    pairs = [(0, 1, np.full((len(weights[0]), len(weights[1])), 2.0))]
    least = sum(float(w.min()) for w in weights) + 2.0
    refused = Problem(problem.costs, problem.edges, (weights, least - 1.0), pairs)
    monkeypatch.setattr(solver, "_unconstrained", lambda *a, **k: pytest.fail("eliminated"))
    with pytest.raises(Infeasible):
        solve(refused)
    monkeypatch.undo()
    assert solve(Problem(problem.costs, problem.edges, (weights, least), pairs)).objective < np.inf


def test_an_integer_program_too_large_for_the_time_left_is_not_built(monkeypatch):
    # its columns are counted as it is built, and the building stops once they pass what HiGHS could presolve
    # in the time left (Llama-3-70B's 39 M columns had taken 45 s to build, then were dropped): the plan kept
    from shardfn.strategy_search import solver

    rng = np.random.default_rng(11)
    problem = _random_problem(rng, 40, 0.5)
    red = solver._Reducer(problem.costs, problem.edges)
    alive = sorted(red.alive)
    assert len(alive) > 10  # (dense: elimination leaves most to the program)
    start = solver._incumbent(red)
    built = []
    real_edge = solver._Builder.edge
    monkeypatch.setattr(solver._Builder, "edge", lambda self, *a, **k: built.append(a) or real_edge(self, *a, **k))
    monkeypatch.setattr(solver, "_PROGRAM_COLUMNS_PER_SECOND", 40)
    choice, optimal, gap, message = solver._program(red, alive, start, 1.0)
    assert (choice, optimal, message) == (start, False, "time limit")
    edges = sum(1 for u in alive for v in red.adj[u] if u < v)
    assert len(built) < edges / 4, (len(built), edges)
