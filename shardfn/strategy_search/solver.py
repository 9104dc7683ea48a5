"""Exact strategy choice: an integer program over node choices and edge resharding, solved by HiGHS.

Problem: decisions ``v = 0..V-1``, each picking one of ``k_v`` candidates with cost ``c_v[k]``; edges ``(u, v)``
with a cost matrix ``C_e[i, j]`` paid when ``u`` picks ``i`` and ``v`` picks ``j``. Minimise the total.

Integer program (each constraint names the code that adds it):

* ``x[v, k] in {0, 1}``, one per candidate ............................................ ``_Builder.decision``
* ``sum_k x[v, k] = 1``: every decision picks one candidate ............................ ``_Builder.decision``
* Edge costs are linearised on *groups*: candidates of ``u`` with identical rows of ``C_e`` form one group
  ``I``, candidates of ``v`` with identical columns one group ``J`` (so a 64 x 64 matrix of a matmul feeding a
  view usually shrinks to a few groups). For each group pair with positive cost ``C_e[I, J]``, a continuous
  ``z >= 0`` with ``z >= sum_{i in I} x[u, i] + sum_{j in J} x[v, j] - 1`` ........... ``_Builder.edge``
  Minimisation drives ``z`` to the product of the two indicators, so the objective is exact.

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

    def edge(self, u: int, v: int, matrix: np.ndarray) -> float:
        """Add edge terms; returns the constant part (the minimum of the matrix, always paid)."""
        base = float(matrix.min())
        m = matrix - base
        if not m.any():
            return base
        row_groups, col_groups = _groups(m, 0), _groups(m, 1)
        for I in row_groups:
            for J in col_groups:
                cost = float(m[I[0], J[0]])
                if cost <= 0:
                    continue
                z = self._var(cost, False)
                coeffs = {z: -1.0}
                for i in I:
                    coeffs[self.offsets[u] + int(i)] = 1.0
                for j in J:
                    coeffs[self.offsets[v] + int(j)] = 1.0
                self._row(coeffs, -np.inf, 1.0)
        return base


def solve(problem: Problem, time_limit_s: float = 60.0) -> Solution:
    sizes = [len(c) for c in problem.costs]
    if all(s == 1 for s in sizes):
        total = sum(float(c[0]) for c in problem.costs) + sum(float(m[0, 0]) for _, _, m in problem.edges)
        return Solution([0] * len(sizes), total, True, "all decisions fixed")
    b = _Builder()
    for costs in problem.costs:
        b.decision(np.asarray(costs, dtype=float))
    constant = sum(b.edge(u, v, np.asarray(m, dtype=float)) for u, v, m in problem.edges)
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
    choice = []
    for off, size in zip(b.offsets, sizes):
        choice.append(int(np.argmax(res.x[off : off + size])))
    objective = sum(float(problem.costs[v][k]) for v, k in enumerate(choice))
    objective += sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)
    optimal = res.status == 0
    return Solution(choice, objective, optimal, res.message if not optimal else "optimal")
