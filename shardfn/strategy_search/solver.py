"""Exact strategy choice: an integer program over node choices and edge resharding, solved by HiGHS.

Problem: decisions ``v = 0..V-1``, each picking one of ``k_v`` candidates with cost ``c_v[k]``; edges ``(u, v)``
with a cost matrix ``C_e[i, j]`` paid when ``u`` picks ``i`` and ``v`` picks ``j``. Minimise the total.

Before the program is built (each step exact, in ``_reduce``):

* an edge with a fixed endpoint (one candidate) becomes a cost on the other endpoint;
* parallel edges between the same two decisions are summed into one.

Integer program (each constraint names the code that adds it):

* ``x[v, k] in {0, 1}``, one per candidate ............................................ ``_Builder.decision``
* ``sum_k x[v, k] = 1``: every decision picks one candidate ............................ ``_Builder.decision``
* Edge costs use *groups*: candidates of ``u`` with identical rows of ``C_e`` form a group ``I``, candidates
  of ``v`` with identical columns a group ``J``. A continuous ``y[e, I, J] >= 0`` per group pair carries
  ``C_e[I, J]``, tied to the choices by its marginals ................................ ``_Builder.edge``
  ``sum_J y[e, I, J] = sum_{i in I} x[u, i]`` and ``sum_I y[e, I, J] = sum_{j in J} x[v, j]``.
  With integral ``x`` the marginals force ``y`` to the product of the two indicators, so the objective is
  exact; unlike the ``z >= x + x - 1`` linearisation, the relaxation is tight (the local polytope), which is
  what lets HiGHS close the gap quickly.

A time limit returns the best solution HiGHS found and says so (:attr:`Solution.optimal` is False).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

__all__ = ["Problem", "Solution", "solve"]


@dataclass
class Problem:
    costs: list[np.ndarray]  # per decision: cost of each candidate
    edges: list[tuple[int, int, np.ndarray]]  # (u, v, C[k_u, k_v])


@dataclass
class Solution:
    choice: list[int]
    objective: float
    optimal: bool
    message: str


def _groups(matrix: np.ndarray, axis: int) -> list[np.ndarray]:
    """Indices along ``axis`` whose slices of ``matrix`` are identical, grouped."""
    rows = matrix if axis == 0 else matrix.T
    _, inverse = np.unique(np.round(rows, 15), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [np.flatnonzero(inverse == g) for g in range(inverse.max() + 1)]


class _Builder:
    def __init__(self):
        self.obj: list[float] = []
        self.integrality: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.offsets: list[int] = []

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

    def decision(self, costs: np.ndarray) -> None:
        first = len(self.obj)
        for c in costs:
            self._var(float(c), True)
        self.offsets.append(first)
        self._row({first + k: 1.0 for k in range(len(costs))}, 1.0, 1.0)

    def edge(self, u: int, v: int, matrix: np.ndarray) -> None:
        row_groups, col_groups = _groups(matrix, 0), _groups(matrix, 1)
        y = {}
        for a, I in enumerate(row_groups):
            for b, J in enumerate(col_groups):
                y[a, b] = self._var(float(matrix[I[0], J[0]]), False)
        for a, I in enumerate(row_groups):
            coeffs = {y[a, b]: 1.0 for b in range(len(col_groups))}
            for i in I:
                coeffs[self.offsets[u] + int(i)] = -1.0
            self._row(coeffs, 0.0, 0.0)
        for b, J in enumerate(col_groups):
            coeffs = {y[a, b]: 1.0 for a in range(len(row_groups))}
            for j in J:
                coeffs[self.offsets[v] + int(j)] = -1.0
            self._row(coeffs, 0.0, 0.0)


def _reduce(problem: Problem) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """Fold edges with a fixed endpoint into unary costs; sum parallel edges."""
    costs = [np.asarray(c, dtype=float).copy() for c in problem.costs]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in problem.edges:
        m = np.asarray(m, dtype=float)
        if len(costs[u]) == 1:
            costs[v] += m[0]
        elif len(costs[v]) == 1:
            costs[u] += m[:, 0]
        else:
            key, mat = ((u, v), m) if u < v else ((v, u), m.T)
            edges[key] = edges[key] + mat if key in edges else mat
    return costs, edges


def solve(problem: Problem, time_limit_s: float = 60.0) -> Solution:
    costs, edges = _reduce(problem)
    sizes = [len(c) for c in costs]
    if not edges:  # independent decisions: each takes its cheapest candidate
        choice = [int(np.argmin(c)) for c in costs]
        return Solution(choice, _objective(problem, choice), True, "optimal")
    b = _Builder()
    for c in costs:
        b.decision(c)
    for (u, v), m in edges.items():
        b.edge(u, v, m)
    n = len(b.obj)
    a = coo_matrix((b.vals, (b.rows, b.cols)), shape=(len(b.lo), n)).tocsr()
    upper = np.where(np.array(b.integrality) == 1, 1.0, np.inf)
    res = milp(
        c=np.array(b.obj),
        constraints=LinearConstraint(a, np.array(b.lo), np.array(b.hi)),
        integrality=np.array(b.integrality),
        bounds=Bounds(np.zeros(n), upper),
        options={"time_limit": time_limit_s, "disp": False},
    )
    if res.x is None:
        raise RuntimeError(f"shardfn: the strategy search found no solution ({res.message})")
    choice = [int(np.argmax(res.x[off : off + size])) for off, size in zip(b.offsets, sizes)]
    optimal = res.status == 0
    return Solution(choice, _objective(problem, choice), optimal, "optimal" if optimal else res.message)


def _objective(problem: Problem, choice: list[int]) -> float:
    total = sum(float(problem.costs[v][k]) for v, k in enumerate(choice))
    return total + sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)
