"""Dominated candidates: dropped exactly, before conditioning and the integer program.

Candidate ``i`` of a decision ``v`` *dominates* its candidate ``j`` where ``i`` costs no more than ``j`` whatever
``v``'s neighbours pick:

    c_v[i] - c_v[j] + sum over neighbours u of max_k (C_vu[i, k] - C_vu[j, k]) <= 0

Some best plan then never picks ``j`` (switching it to ``i`` raises nothing), so dropping ``j`` keeps the optimum
(neighbourhood substitutability, as constraint solvers call it). What pairwise elimination leaves of a transformer
layer (MLA's query and key parts, a MoE layer's router and experts: every decision with three neighbours) holds
hundreds of candidates a decision that no neighbour's choice makes best: DeepSeek-V3's residue keeps about a third
of its candidates, some decisions 10 of 342, and conditioning's min-plus products shrink by the cube of that.

It works on the solver's reducer (``solver._Reducer``: costs, adjacency, trail, ``op``, ``fix``), whose recovery
maps a restricted decision's choice back through the ``("restricted", v, kept, into)`` step this adds. Decisions the
budget weighs (``keep``) are left whole: a dominated candidate may weigh less.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .solver import _Reducer as Reducer

__all__ = ["drop_dominated", "restrict", "restricted"]

_BLOCK = 32  # candidates checked at once against those kept before them
_SAMPLE = 16  # columns of each edge a pair is screened on before all of them


def drop_dominated(red: Reducer, decisions, deadline: float = math.inf) -> None:
    """Drop the dominated candidates of ``decisions`` (those alive with neighbours, not kept), one pass (a second,
    on the neighbours of those that lost some, drops a tenth more in DeepSeek-V3's residue at twice the time). A
    decision left with one candidate is fixed. Stops at ``deadline`` (what is dropped by then is dropped
    exactly)."""
    for v in sorted(decisions):
        if time.perf_counter() > deadline:
            break
        if v not in red.alive or v in red.keep or not red.adj[v]:
            continue
        neighbours = sorted(red.adj[v])  # (one order in every identical layer: their arrays meet the same memo)
        kept, into = red.op(_undominated, red.costs[v], *(red.adj[v][u] for u in neighbours))
        if len(kept) == len(red.costs[v]):
            continue
        restrict(red, v, kept, into)
        if len(kept) == 1:
            red.fix(v, 0)


def restrict(red: Reducer, v: int, kept: np.ndarray, into: np.ndarray) -> None:
    """Keep ``v``'s candidates ``kept`` (``into``: each candidate's position among them, for :func:`restricted`)."""
    # (interned: a layer's result depends on the layer before it through their edge; once the layers' kept
    # candidates agree, their arrays are one object again, and the rest of the layers meet the memo)
    op = red.op
    red.costs[v] = op.intern(op(_taken, red.costs[v], kept))
    for u in red.adj[v]:
        red.adj[v][u] = op.intern(op(_taken, red.adj[v][u], kept))
        red.adj[u][v] = op.intern(op(_taken_columns, red.adj[u][v], kept))
    red.trail.append(("restricted", v, kept, into))


def _undominated(costs: np.ndarray, *edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidates no kept one dominates, in their order, and for every candidate the position among them of
    one that dominates it (itself where kept). Taken in order of cost plus each edge's mean: a dominating
    candidate comes no later than one it dominates, so each dropped candidate has a kept one that dominates it
    (rounding cannot drop them all)."""
    joined = np.concatenate(edges, axis=1)
    starts = np.cumsum([0] + [m.shape[1] for m in edges[:-1]])
    score = costs + sum(m.mean(axis=1) for m in edges)
    order = np.lexsort((np.arange(len(costs)), score))

    # a few columns of each edge first: the most an edge's difference reaches over them is no more than over all,
    # so a pair they show not dominating does not (a 4-D mesh's edges are 625 x 625: most pairs go on 16 columns)
    sample = [start + np.unique(np.linspace(0, m.shape[1] - 1, _SAMPLE).astype(int)) for start, m in zip(starts, edges)]
    sampled = joined[:, np.concatenate(sample)]
    sampled_starts = np.cumsum([0] + [len(s) for s in sample[:-1]])

    def screened(mine: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        step = costs[mine][:, None] - costs[block][None, :]
        rise = np.maximum.reduceat(sampled[mine][:, None, :] - sampled[block][None, :, :], sampled_starts, axis=2)
        return step, step + rise.sum(axis=2)  # (mine x block: the pairs above 0 do not dominate)

    def dominates(mine: np.ndarray, block: np.ndarray, step: np.ndarray, a: np.ndarray, b: np.ndarray):
        rise = np.maximum.reduceat(joined[mine[a]] - joined[block[b]], starts, axis=1)
        return step[a, b] + rise.sum(axis=1) <= 0  # (the pairs (mine[a], block[b]) over every column)

    def dominating(mine: np.ndarray, block: np.ndarray) -> np.ndarray:  # (mine x block): mine[a] dominates block[b]
        step, screen = screened(mine, block)
        a, b = np.nonzero(screen <= 0)
        out = np.zeros(step.shape, dtype=bool)
        out[a, b] = dominates(mine, block, step, a, b)
        return out

    def one_dominating(mine: np.ndarray, block: np.ndarray) -> np.ndarray:
        """For each of ``block``, the position in ``mine`` of one that dominates it, or -1: the one the screen
        likes best checked first (most often it is one), the others only where it is not."""
        step, screen = screened(mine, block)
        found = np.full(len(block), -1)
        best = screen.argmin(axis=0)
        b = np.flatnonzero(screen[best, np.arange(len(block))] <= 0)
        yes = dominates(mine, block, step, best[b], b)
        found[b[yes]] = best[b[yes]]
        screen[best, np.arange(len(block))] = np.inf
        a, b = np.nonzero((screen <= 0) & (found < 0)[None, :])
        if len(a):
            yes = dominates(mine, block, step, a, b)
            found[b[yes]] = a[yes]
        return found

    kept, by = [], {}
    for first in range(0, len(order), _BLOCK):  # (a block at once against those kept before it, then in order)
        block = order[first:first + _BLOCK]
        if kept:
            found = one_dominating(np.array(kept), block)
            for b in np.flatnonzero(found >= 0):
                by[int(block[b])] = kept[found[b]]
            block = block[found < 0]
            if not len(block):
                continue
        within = dominating(block, block)  # (the rest of the block, in order: each against those kept before it)
        mine: list[int] = []
        for i, j in enumerate(block):
            dominated = [x for x in mine if within[x, i]]
            if dominated:
                by[int(j)] = int(block[dominated[0]])
            else:
                mine.append(i)
        kept += [int(block[x]) for x in mine]
    kept = np.array(sorted(kept))
    position = {int(k): i for i, k in enumerate(kept)}
    into = np.array([position[by.get(j, j)] for j in range(len(costs))])
    return kept, into


def restricted(trail: list[tuple], choice: dict[int, int]) -> dict[int, int]:
    """``choice`` (candidates as the problem gives them) as the reducer whose ``trail`` this is has them: each
    decision it restricted at the candidate that dominates its choice (no costlier anywhere, the same weight)."""
    choice = dict(choice)
    for step in trail:
        if step[0] == "restricted" and step[1] in choice:
            choice[step[1]] = int(step[3][choice[step[1]]])
    return choice


def _taken(a: np.ndarray, kept: np.ndarray) -> np.ndarray:
    return a[kept]


def _taken_columns(m: np.ndarray, kept: np.ndarray) -> np.ndarray:
    return m[:, kept]
