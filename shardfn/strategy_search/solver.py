"""Exact strategy choice: variable elimination, then an integer program solved by HiGHS.

Problem: decisions ``v = 0..V-1``, each picking one of ``k_v`` candidates with cost ``c_v[k]``; edges ``(u, v)``
with a cost matrix ``C_e[i, j]`` paid when ``u`` picks ``i`` and ``v`` picks ``j``. Minimise the total,
optionally subject to a budget ``sum_v w_v[choice_v] <= B`` (level 2's memory limit).

Shrinking the problem, each step exact (``_Reducer``):

* an edge with a fixed endpoint (one candidate) becomes a cost on the other endpoint; parallel edges are summed;
* a decision with one neighbour ``u`` is eliminated: ``c_u[i] += min_j C[i, j] + c_v[j]``;
* a decision with two neighbours ``u, w`` (a link in a chain: elementwise ops, views, norms, the followers Alpa
  merges into their producer) is eliminated into one edge ``C'[i, k] = min_j C_uv[i, j] + c_v[j] + C_vw[j, k]``.

This is dynamic programming on the graph: chains and trees vanish, a transformer layer's residual stream and
attention fan-out collapse, and repeated layers cost one small matrix product each. Eliminated decisions are
recovered from their argmin tables after the rest is solved, so the result is optimal for the whole problem.
With a budget, elimination would lose the budget's terms, so the full program is solved instead.

Integer program on what remains (each constraint names the code that adds it):

* ``x[v, k] in {0, 1}``, one per candidate ............................................ ``_Builder.decision``
* ``sum_k x[v, k] = 1``: every decision picks one candidate ............................ ``_Builder.decision``
* Edge costs use *groups*: candidates of ``u`` with identical rows of ``C_e`` form a group ``I``, candidates
  of ``v`` with identical columns a group ``J``. A continuous ``y[e, I, J] >= 0`` per group pair carries
  ``C_e[I, J]``, tied to the choices by its marginals ................................ ``_Builder.edge``
  ``sum_J y[e, I, J] = sum_{i in I} x[u, i]`` and ``sum_I y[e, I, J] = sum_{j in J} x[v, j]``.
  With integral ``x`` the marginals force ``y`` to the product of the two indicators, so the objective is
  exact; unlike the ``z >= x + x - 1`` linearisation its relaxation is tight (the local polytope), which is
  what lets HiGHS close the gap quickly.
* ``sum_{v,k} w_v[k] x[v, k] <= B``: the budget, when given ......................... ``_Builder.budget``

A time limit returns the best solution HiGHS found and says so (:attr:`Solution.optimal` is False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

__all__ = ["Infeasible", "Problem", "Solution", "objective", "solve"]

# Eliminating a two-neighbour decision builds a k_u x k_v x k_w array; above this size it stays in the ILP.
_MAX_ELIMINATION_CELLS = 4_000_000


@dataclass
class Problem:
    costs: list[np.ndarray]  # per decision: cost of each candidate
    edges: list[tuple[int, int, np.ndarray]]  # (u, v, C[k_u, k_v])
    budget: tuple[list[np.ndarray], float] | None = None  # (weight of each candidate per decision, limit)


@dataclass
class Solution:
    choice: list[int]
    objective: float
    optimal: bool
    message: str
    stats: dict = field(default_factory=dict)


def _groups(matrix: np.ndarray, axis: int) -> list[np.ndarray]:
    """Indices along ``axis`` whose slices of ``matrix`` are identical, grouped."""
    rows = matrix if axis == 0 else matrix.T
    _, inverse = np.unique(rows, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [np.flatnonzero(inverse == g) for g in range(inverse.max() + 1)]


class _Reducer:
    """The problem as an adjacency structure, shrunk by exact eliminations."""

    def __init__(self, problem: Problem, eliminate: bool):
        self.costs = [np.asarray(c, dtype=float).copy() for c in problem.costs]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in self.costs]  # adj[u][v]: matrix oriented u x v
        for u, v, m in problem.edges:
            self._add(u, v, np.asarray(m, dtype=float))
        self.trail: list[tuple] = []  # eliminations, to undo in reverse
        self.alive = set(range(len(self.costs)))
        if eliminate:
            self._eliminate()

    def _add(self, u: int, v: int, m: np.ndarray) -> None:
        if len(self.costs[u]) == 1:
            self.costs[v] += m[0]
        elif len(self.costs[v]) == 1:
            self.costs[u] += m[:, 0]
        elif v in self.adj[u]:
            self.adj[u][v] = self.adj[u][v] + m
            self.adj[v][u] = self.adj[u][v].T
        else:
            self.adj[u][v] = m
            self.adj[v][u] = m.T

    def _drop(self, v: int) -> None:
        for u in self.adj[v]:
            del self.adj[u][v]
        self.adj[v] = {}
        self.alive.discard(v)

    def _eliminate(self) -> None:
        queue = sorted(self.alive, key=lambda v: len(self.adj[v]))
        while queue:
            nxt = []
            for v in queue:
                if v not in self.alive:
                    continue
                nbrs = list(self.adj[v])
                cv = self.costs[v]
                if len(nbrs) == 0:
                    self.trail.append(("free", v))
                    self.alive.discard(v)
                elif len(nbrs) == 1:
                    (u,) = nbrs
                    total = self.adj[u][v] + cv[None, :]
                    self.costs[u] += total.min(axis=1)
                    self.trail.append(("leaf", v, u, total.argmin(axis=1)))
                    self._drop(v)
                    nxt.append(u)
                elif len(nbrs) == 2:
                    u, w = nbrs
                    if len(self.costs[u]) * len(cv) * len(self.costs[w]) > _MAX_ELIMINATION_CELLS:
                        continue
                    total = self.adj[u][v][:, :, None] + cv[None, :, None] + self.adj[v][w][None, :, :]
                    table = total.argmin(axis=1)
                    self.trail.append(("link", v, u, w, table))
                    self._drop(v)
                    self._add(u, w, total.min(axis=1))
                    nxt += [u, w]
            queue = sorted(set(nxt) & self.alive, key=lambda v: len(self.adj[v]))

    def recover(self, choice: dict[int, int]) -> None:
        for step in reversed(self.trail):
            if step[0] == "free":
                choice[step[1]] = int(np.argmin(self.costs[step[1]]))
            elif step[0] == "leaf":
                _, v, u, table = step
                choice[v] = int(table[choice[u]])
            else:
                _, v, u, w, table = step
                choice[v] = int(table[choice[u], choice[w]])


class _Builder:
    def __init__(self):
        self.obj: list[float] = []
        self.integrality: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.offsets: dict[int, int] = {}

    def _var(self, cost: float, integer: bool) -> int:
        self.obj.append(cost)
        self.integrality.append(1 if integer else 0)
        return len(self.obj) - 1

    def _row(self, coeffs: dict[int, float], lo: float, hi: float) -> None:
        r = len(self.lo)
        for c, v in coeffs.items():
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(lo)
        self.hi.append(hi)

    def decision(self, v: int, costs: np.ndarray) -> None:
        first = len(self.obj)
        for c in costs:
            self._var(float(c), True)
        self.offsets[v] = first
        self._row({first + k: 1.0 for k in range(len(costs))}, 1.0, 1.0)

    def edge(self, u: int, v: int, matrix: np.ndarray) -> None:
        row_groups, col_groups = _groups(matrix, 0), _groups(matrix, 1)
        y = {}
        for a, rows in enumerate(row_groups):
            for b, cols in enumerate(col_groups):
                y[a, b] = self._var(float(matrix[rows[0], cols[0]]), False)
        for a, rows in enumerate(row_groups):
            coeffs = {y[a, b]: 1.0 for b in range(len(col_groups))}
            coeffs.update({self.offsets[u] + int(i): -1.0 for i in rows})
            self._row(coeffs, 0.0, 0.0)
        for b, cols in enumerate(col_groups):
            coeffs = {y[a, b]: 1.0 for a in range(len(row_groups))}
            coeffs.update({self.offsets[v] + int(j): -1.0 for j in cols})
            self._row(coeffs, 0.0, 0.0)

    def budget(self, weights: list[np.ndarray], limit: float, sizes: list[int]) -> None:
        coeffs = {}
        for v, off in self.offsets.items():
            for k in range(sizes[v]):
                if weights[v][k]:
                    coeffs[off + k] = float(weights[v][k])
        self._row(coeffs, -np.inf, limit)


def solve(problem: Problem, time_limit_s: float = 60.0) -> Solution:
    sizes = [len(c) for c in problem.costs]
    red = _Reducer(problem, eliminate=problem.budget is None)
    alive = sorted(red.alive)
    choice: dict[int, int] = {}
    optimal, message = True, "optimal"
    if alive:
        b = _Builder()
        for v in alive:
            b.decision(v, red.costs[v])
        for u in alive:
            for v, m in red.adj[u].items():
                if u < v:
                    b.edge(u, v, m)
        if problem.budget is not None:
            weights, limit = problem.budget
            b.budget(weights, limit, sizes)
        n = len(b.obj)
        a = coo_matrix((b.vals, (b.rows, b.cols)), shape=(len(b.lo), n)).tocsr()
        upper = np.where(np.array(b.integrality) == 1, 1.0, np.inf)
        res = milp(
            c=np.array(b.obj),
            constraints=LinearConstraint(a, np.array(b.lo), np.array(b.hi)),
            integrality=np.array(b.integrality),
            bounds=Bounds(np.zeros(n), upper),
            options={"time_limit": time_limit_s, "disp": False, "mip_rel_gap": 1e-9},
        )
        if res.x is None:
            if res.status == 2:
                raise Infeasible(res.message)
            raise RuntimeError(f"shardfn: the strategy search found no solution ({res.message})")
        for v in alive:
            off = b.offsets[v]
            choice[v] = int(np.argmax(res.x[off : off + sizes[v]]))
        optimal = res.status == 0
        message = "optimal" if optimal else res.message
    red.recover(choice)
    ordered = [choice[v] for v in range(len(sizes))]
    stats = {"decisions": len(sizes), "ilp_decisions": len(alive), "eliminated": len(red.trail)}
    return Solution(ordered, objective(problem, ordered), optimal, message, stats)


class Infeasible(RuntimeError):
    """No assignment satisfies the budget."""


def objective(problem: Problem, choice: list[int]) -> float:
    total = sum(float(problem.costs[v][k]) for v, k in enumerate(choice))
    return total + sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)
