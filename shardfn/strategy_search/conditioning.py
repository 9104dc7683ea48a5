"""Cutset conditioning: exact elimination past the cycles pairwise elimination cannot open.

A decision of few candidates whose neighbourhood, once it is fixed, eliminates down to at most two changed
decisions is tried once per candidate; the least over its candidates is the block exactly, an edge (or a cost) on
what is left. It works on the solver's reducer (``solver._Reducer``: costs, adjacency, trail, ``fix``,
``local_copy``, ``eliminate``, ``drop``, ``add``), which calls :func:`condition_all` once its pairwise
eliminations are done.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .solver import _Reducer as Reducer

__all__ = ["CONDITION_SHARE", "condition_all"]

# Conditioning: a decision of at most this many candidates, in a cycle elimination cannot open (a MoE layer's
# router, experts and combine), is tried once per candidate, its neighbourhood (within these radii) eliminated each
# time, where that leaves at most two decisions changed
_CONDITION_MAX_CANDIDATES = 64
_CONDITION_RADII = (1, 2, 3)
CONDITION_SHARE = 0.75  # of a solve's time, at most


def condition_all(red: Reducer, deadline: float = math.inf) -> None:
    """Exact elimination past cycles (cutset conditioning, one decision at a time). For a decision ``x`` of few
    candidates whose neighbourhood, once ``x`` is fixed, eliminates down to at most two changed decisions ``a, b``
    (the block's boundary): each candidate ``k`` of ``x`` gives the block's cost as a matrix over ``a x b``; their
    least, elementwise, is the block exactly (whatever ``a`` and ``b`` pick, the best ``k`` is taken), an edge
    ``a - b`` that elimination then takes on. The runs' eliminations are memoised as elimination's are: where
    identical layers' blocks meet the same arrays, the work is shared (DeepSeek-V2-Lite's 26 MoE layers: the
    first three computed, the rest found). No block is started, nor finished, that would end past ``deadline``
    (what is left goes to the integer program)."""
    progress = True
    while progress:  # (a pass conditions every block it can, then elimination runs on: until no block is left)
        boundaries: set[int] = set()
        for x in sorted(red.alive - red.keep, key=lambda v: (len(red.costs[v]), v)):
            if len(red.costs[x]) > _CONDITION_MAX_CANDIDATES or time.perf_counter() > deadline:
                break
            if x in red.alive and red.adj[x]:
                boundaries |= _condition(red, x, deadline)
        # (elimination waits for the pass: a block's runs then meet the arrays of the block before it, shared by
        # identical layers, where elimination would have made new ones at the boundaries)
        red.eliminate(boundaries & red.alive)
        progress = bool(boundaries)


def _condition(red: Reducer, x: int, deadline: float) -> set[int]:
    """Condition on ``x`` (:func:`condition_all`) where some radius's block has a boundary of two at most: the
    boundary (empty where it fails, where the block was a whole part of the problem, or where its runs, timed by
    the first, would end past ``deadline``)."""
    ball = {x}
    for _ in _CONDITION_RADII:
        ball |= {u for v in ball for u in red.adj[v]}
        touched = ball | {u for v in ball for u in red.adj[v]}
        # (only the ball's interior is eliminated: a decision with a neighbour outside, the separator between
        # two layers, stays, and so does the work on its arrays)
        keep = frozenset(touched - {v for v in ball if red.adj[v].keys() <= ball}) | (red.keep & touched)
        runs = []
        for k in range(len(red.costs[x])):
            start = time.perf_counter()
            run = red.local_copy(touched, keep)
            run.fix(x, k)
            runs.append(run)
            if k == 0:
                boundary = sorted(v for v in touched & run.alive if _changed(red, run, v))
                if len(boundary) > 2:
                    break
                if time.perf_counter() + (len(red.costs[x]) - 1) * (time.perf_counter() - start) > deadline:
                    return set()
        else:
            if _merge_runs(red, boundary, runs):
                return set(boundary)
    return set()


def _changed(red: Reducer, run: Reducer, v: int) -> bool:
    mine, theirs = run.adj[v], red.adj[v]
    return run.costs[v] is not red.costs[v] or mine.keys() != theirs.keys() or \
        any(m is not theirs[u] for u, m in mine.items())


def _merge_runs(red: Reducer, boundary: list[int], runs: list[Reducer]) -> bool:
    """The block of ``runs`` (one per candidate of the decision conditioned on) as its least cost over
    ``boundary``: its decisions dropped from ``red``, the least added to the boundary (an edge, a cost or a
    constant), and the candidate that gives it kept for recovery. False (``red`` unchanged) where a cost is not
    finite (the difference of two infinities would be no cost)."""
    empty = np.zeros((0, 0))
    parts = [(0.0, *(red.costs[b] for b in boundary),
              red.adj[boundary[0]].get(boundary[1], empty) if len(boundary) == 2 else empty)]
    parts += [(run.constant, *(run.costs[b] for b in boundary),
               run.adj[boundary[0]].get(boundary[1], empty) if len(boundary) == 2 else empty) for run in runs]
    # (memoised on the arrays and the runs' own constants: identical layers' blocks give one result, whose
    # further elimination is shared too)
    least, table = red.op(_block_least, len(boundary), *(a for p in parts for a in p))
    if least is None:
        return False
    for v in runs[0].costs.keys() - runs[0].alive:  # (what the runs eliminated: a run holds what it touched)
        red.drop(v)
    if len(boundary) == 2:
        red.add(boundary[0], boundary[1], least)
    elif len(boundary) == 1:
        red.costs[boundary[0]] = red.costs[boundary[0]] + least
    else:
        red.constant += float(least)
    red.trail.append(("conditioned", tuple(boundary), table, [run.trail for run in runs]))
    red.shortlisted = red.shortlisted or any(run.shortlisted for run in runs)  # (a run past the limit: no bound)
    return True


def _block_least(n: int, *flat) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The least, over the runs, of what each run added to its ``n`` boundary decisions (their costs and the
    edge between two) and decided itself (its constant), and which run gives it; ``flat``: the reducer's (0,
    costs..., edge) then each run's (constant, costs..., edge). (None, None) where a value is not finite (the difference of two infinities would be no cost)."""
    width = n + 2
    before, runs = flat[:width], [flat[i:i + width] for i in range(width, len(flat), width)]
    values = []
    for run in runs:
        value = np.asarray(run[0] - before[0])
        for i in range(n):
            shape = [1] * n
            shape[i] = -1
            value = value + (run[1 + i] - before[1 + i]).reshape(shape)
        if n == 2 and run[3].size:  # (an edge the runs made, where there was none: the whole of it is theirs)
            value = value + (run[3] - (before[3] if before[3].size else 0.0))
        values.append(value)
    stack = np.stack(values)
    if not np.isfinite(stack).all():
        return None, None
    return stack.min(axis=0), stack.argmin(axis=0)
