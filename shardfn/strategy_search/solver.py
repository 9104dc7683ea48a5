"""Strategy choice: exact variable elimination, then an integer program (HiGHS) on what elimination leaves.

Problem: decisions ``v = 0..V-1``, each picking one of ``k_v`` candidates with cost ``c_v[k]``; edges ``(u, v)``
with a cost matrix ``C_e[i, j]`` paid when ``u`` picks ``i`` and ``v`` picks ``j``. Minimise the total,
optionally subject to a budget ``sum_v w_v[choice_v] <= B`` (level 2's memory limit).

Shrinking the problem, each step exact (``_Reducer``):

* an edge with a fixed endpoint (one candidate) becomes a cost on the other endpoint; parallel edges are summed;
* a decision with one neighbour ``u`` is eliminated: ``c_u[i] += min_j C[i, j] + c_v[j]``;
* a decision with two neighbours ``u, w`` (a link in a chain: elementwise ops, views, norms, the followers Alpa
  merges into their producer) is eliminated into one edge ``C'[i, k] = min_j C_uv[i, j] + c_v[j] + C_vw[j, k]``
  (computed a row of ``u`` at a time, so no cap on the candidates' product is needed);
* a decision of few candidates in cycles none of these opens (a MoE layer: router, experts and combine, every
  decision with three neighbours) is decided once per candidate, its neighbourhood eliminated each time; where
  that leaves at most two decisions changed, the least over the candidates is the block exactly, an edge between
  those two (``conditioning.py``);
* a candidate costing no less than another of the same decision whatever the neighbours pick is dropped, before
  elimination and again on what it leaves (``dominance.py``): the min-plus products above shrink by the cube.

Near the solve's time limit one step is not exact: a product of three decisions of more than ``_SHORTLIST``
candidates each that would end past the limit with the rest of the elimination after it shortlisted (its
elements at the rate the products so far took, the large decisions left at the rate shortlisted tails took:
``_Shared.tail_seconds``; one computed for an identical layer already costs nothing and is taken as computed)
first keeps that many of each, those that cost least with their neighbours' best replies
(``_Reducer._shortlist``, restricted in the trail as dominance restricts); the plan then has no bound. Dominance
stops where that tail must start.

This is dynamic programming on the graph: chains and trees vanish, a transformer layer's residual stream and
attention fan-out collapse, and repeated layers cost one small matrix product each, so the work grows linearly
with depth. Eliminated decisions are recovered from their argmin tables after the rest is solved, so the result
is optimal for the whole problem.

What elimination leaves (a *residue*: decisions tied together in a pattern no chain or tree covers) goes to an
integer program (each constraint names the code that adds it):

* ``x[v, k] in {0, 1}``, one per candidate ............................................ ``_Builder.decision``
* ``sum_k x[v, k] = 1``: every decision picks one candidate ............................ ``_Builder.decision``
* Edge costs use *groups*: candidates of ``u`` with identical rows of ``C_e`` form a group ``I``, candidates
  of ``v`` with identical columns a group ``J``. A continuous ``y[e, I, J] >= 0`` per group pair carries
  ``C_e[I, J]``, tied to the choices by its marginals ................................ ``_Builder.edge``
  ``sum_J y[e, I, J] = sum_{i in I} x[u, i]`` and ``sum_I y[e, I, J] = sum_{j in J} x[v, j]``.
  With integral ``x`` the marginals force ``y`` to the product of the two indicators, so the objective is
  exact; unlike the ``z >= x + x - 1`` linearisation its relaxation is tight (the local polytope), which is
  what lets HiGHS close the gap quickly.
* ``sum_{v,k} w_v[k] x[v, k] + sum_{e,I,J} W_e[I, J] y'[e, I, J] <= B``: the budget, when the program is asked
  to keep it; a pair's weight (``W_e``: a gathered copy kept for backward) on its own edge variables ``y'``, tied
  to the choices as ``y`` is and grouped by ``W_e`` ................................. ``_Builder.budget``

HiGHS starts from an incumbent (``_incumbent``: the residue's busiest decision fixed to its locally best
candidate, then elimination again, until nothing is left), so it always holds a plan, and it stops at the time
limit with the best plan found and its gap to the best bound (:attr:`Solution.gap`); it never ends without one.

A budget (``_with_budget``) is kept by Lagrangian relaxation: ``min f(x) + mu (w(x) - B)`` is an unconstrained
problem, solved exactly as above for each ``mu``: ``mu`` grows until a plan keeps the budget, then each next
``mu`` is where the two plans bracketing it cost alike (``_crossing``), until a solve finds no plan cheaper
there (the dual's maximum: the best Lagrangian bound). One ``mu`` prices identical layers alike, so
its plans switch every layer at once and the budget often lies between two of them: the last plan
over the budget and the best within are mixed, the parts where they differ switched by least cost per byte
until the plan fits (``_mixed``). The best plan within the budget is returned with its gap to the best
Lagrangian bound. Only where that gap is not closed does the integer program run on the whole problem (with the
budget row, from that plan), within the time limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import highspy
import numpy as np
import torch

from .conditioning import CONDITION_SHARE, condition_all
from .dominance import drop_dominated, restrict, restricted

__all__ = ["Infeasible", "Problem", "Solution", "objective", "scaled_edges", "solve"]

log = logging.getLogger("shardfn")

# Relative gap under which a plan counts as optimal (HiGHS's own tolerance, and the budget's multiplier)
_GAP = 1e-9
# A budgeted plan within this relative gap of the Lagrangian bound is taken without the integer program
_BUDGET_GAP = 1e-2
# The multiplier's rounds stop once their plans, mixed (``_mixed``), are within this relative gap of the bound
_MIXED_GAP = 1e-3
# Rounds of a growing multiplier without a plan within the budget after which the least weight is found exactly
_LEAST_WEIGHT_AFTER = 8
# Candidates a decision keeps where elimination runs past the time limit (a product of three 1,296-candidate
# decisions of a 4-D mesh takes a second; of three of these, a millisecond)
_SHORTLIST = 64
# Seconds a large decision's elimination takes once shortlisted, before a tail is measured (Llama-405B's tails on
# this project's machine: 90-170 us a decision, its identical layers' memo hits included)
_TAIL_SECONDS = 2e-4
# Elements of an array the solver's interning hashes (evenly spaced); arrays alike there are compared whole
_HASHED = 4096
# Columns of an integer program HiGHS presolves in a second on this project's machine (2.37 M took 22 s, probing
# past its time limit): a program larger than the time left allows is not started
_PROGRAM_COLUMNS_PER_SECOND = 100_000


@dataclass
class Problem:
    costs: list[np.ndarray]  # per decision: cost of each candidate
    edges: list[tuple[int, int, np.ndarray]]  # (u, v, C[k_u, k_v])
    budget: tuple[list[np.ndarray], float] | None = None  # (weight of each candidate per decision, limit)
    # the budget's weights on pairs of choices: (u, v, W[k_u, k_v]), counted with the decisions' own
    budget_edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)


@dataclass
class Solution:
    choice: list[int]
    objective: float
    optimal: bool
    message: str
    stats: dict = field(default_factory=dict)
    gap: float = 0.0  # relative distance to the best lower bound known (0: proven optimal)
    timed_out: bool = False  # the time limit ended the search: the best plan found, not a proven one
    bound: float = -np.inf  # a lower bound on the objective (the objective itself where optimal)


def _groups(matrix: np.ndarray, axis: int) -> list[np.ndarray]:
    """Indices along ``axis`` whose slices of ``matrix`` are identical, grouped."""
    rows = matrix if axis == 0 else matrix.T
    _, inverse = np.unique(rows, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    return np.split(order, bounds)


def scaled_edges(edges, factor: float, shared: "_Shared | None" = None) -> list:
    """``edges`` with each matrix times ``factor``; a matrix several edges share (identical layers') is scaled
    once, and stays shared: the solver hashes it and eliminates through it once. With ``shared`` (a budget's
    rounds) the matrices are interned first and each scaled one is adopted unhashed (:meth:`_Shared.adopt`)."""
    done: dict[int, np.ndarray] = {}
    scaled = []
    for u, v, m in edges:
        m = shared.intern(m) if shared is not None else m
        if id(m) not in done:
            done[id(m)] = factor * m if shared is None else shared.adopt(factor * m)
        scaled.append((u, v, done[id(m)]))
    return scaled


def _large(costs) -> int:
    """How many of these decisions have more candidates than a shortlist keeps (a product of three may need one)."""
    return sum(1 for c in costs if len(c) > _SHORTLIST)


def _link(c_uv: np.ndarray, c_v: np.ndarray, c_vw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``min_j C_uv[i, j] + c_v[j] + C_vw[j, k]`` and its argmin, a few rows of ``u`` at a time (bounded memory).
    torch's min gives the least value and its first index in one pass (numpy's argmin, then a gather: two)."""
    ku, kv, kw = c_uv.shape[0], c_v.shape[0], c_vw.shape[1]
    left = torch.from_numpy(np.asarray(c_uv + c_v[None, :], dtype=np.float64))
    # (k, j): the minimum runs along contiguous memory, several times faster
    right = torch.from_numpy(np.ascontiguousarray(c_vw.T, dtype=np.float64))
    rows = max(1, 2_000_000 // max(kv * kw, 1))
    best = np.empty((ku, kw))
    table = np.empty((ku, kw), dtype=_index_dtype(kv))
    for start in range(0, ku, rows):
        least, where = torch.min(left[start:start + rows, None, :] + right[None, :, :], dim=2)
        best[start:start + rows], table[start:start + rows] = least.numpy(), where.numpy()
    return best, table


def _leaf(c_uv: np.ndarray, c_v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = c_uv + c_v[None, :]
    return total.min(axis=1), total.argmin(axis=1).astype(_index_dtype(len(c_v)))


def _index_dtype(candidates: int) -> type:
    """The narrowest integer that numbers ``candidates``: the argmin tables a solve keeps to recover its choices
    (Llama-405B's level 2: 281 -> 71 MB)."""
    return np.int16 if candidates <= np.iinfo(np.int16).max else np.int32


class _Shared:
    """The reducer's arithmetic, memoised by the identity of its operands. Arrays of equal content are one object
    (:meth:`intern`), so identical layers, whose costs and edges are equal, go through their elimination on the
    same objects: each step is computed for the first of them and its result shared by the rest."""

    def __init__(self):
        # content -> array, and id -> (array, its interned one). One per solve, shared by its reducers (the
        # Lagrangian rounds: their edges are the same objects, hashed once, and what the budget does not weigh is
        # eliminated, conditioned and checked for dominance once for every round)
        self._interned: dict = {}
        self._memo: dict = {}
        # seconds per element of the link products computed so far (:meth:`link_seconds`' forecast)
        self._link_elements, self._link_seconds = 0, 0.0
        # seconds a reducer took from its first shortlist to the end of its elimination, and the large decisions
        # it had left then (:meth:`tail_seconds`' forecast)
        self._tail_decisions, self._tail_seconds = 0, 0.0
        # ids of the arrays of the open Lagrangian round (its multiplier's, and what was computed from them), and
        # its memo keys: no later round meets them (:meth:`one_round`)
        self._round: set[int] | None = None
        self._round_keys: list = []

    @contextlib.contextmanager
    def one_round(self):
        """A Lagrangian round: what it computes from its multiplier's arrays is dropped when it ends, and the
        memory taken again by the next round (each round's had stayed to the end of the solve: Llama-405B's first
        solve grew the process by 1 GB, memory first touched, 30-60 us a page on this project's machine)."""
        self._round, self._round_keys = set(), []
        try:
            yield
        finally:
            gone = self._round
            for key in self._round_keys:
                del self._memo[key]
            for key, value in list(self._interned.items()):
                if isinstance(value, list):  # (content -> its arrays)
                    value[:] = [x for x in value if id(x) not in gone]
                elif key in gone or id(value[1]) in gone:  # (id -> (array, its interned one))
                    del self._interned[key]
            self._round, self._round_keys = None, []

    def intern(self, a: np.ndarray) -> np.ndarray:
        seen = self._interned.get(id(a))
        if seen is not None and seen[0] is a:
            return seen[1]
        b = np.asarray(a, dtype=float)
        # keyed by a hash of a sample of at most _HASHED elements, its equals found by comparing them whole: an
        # array unlike the others is never read whole here (hashing Llama-405B's edge matrices, some of a million
        # pairs, whole had taken most of a level-1 solve's second before its elimination)
        flat = b.reshape(-1)
        sample = flat[::-(-flat.size // _HASHED)] if flat.size > _HASHED else flat
        key = (b.shape, hashlib.blake2b(np.ascontiguousarray(sample).tobytes(), digest_size=16).digest())
        alike = self._interned.setdefault(key, [])
        found = next((x for x in alike if x is b or np.array_equal(x, b)), None)
        if found is None:
            alike.append(b)
            found = b
            if self._round is not None and id(a) in self._round:
                self._round.add(id(b))
        self._interned[id(a)] = (a, found)  # (keeping ``a``: its id stays its own)
        return found

    def adopt(self, a: np.ndarray) -> np.ndarray:
        """``a`` (float, computed from interned arrays alone) interned as itself, unhashed: an array of equal
        content made otherwise stays another object (the memo misses between them, nothing more)."""
        self._interned[id(a)] = (a, a)
        if self._round is not None:
            self._round.add(id(a))
        return a

    def _key(self, fn, operands) -> tuple:
        return (fn, *(id(o) if isinstance(o, np.ndarray) else o for o in operands))

    def __call__(self, fn, *operands):
        key = self._key(fn, operands)
        hit = self._memo.get(key)
        if hit is None:  # the operands are kept with the result: their ids stay theirs
            start = time.perf_counter()
            hit = self._memo[key] = (fn(*operands), operands)
            if self._round is not None and any(id(o) in self._round for o in operands
                                               if isinstance(o, np.ndarray)):
                self._round_keys.append(key)
                self._round.update(id(r) for r in (hit[0] if isinstance(hit[0], tuple) else (hit[0],))
                                   if isinstance(r, np.ndarray))
            if fn is _link:
                self._link_elements += operands[0].size * operands[2].shape[1]
                self._link_seconds += time.perf_counter() - start
        return hit[0]

    def link_seconds(self, c_uv: np.ndarray, c_v: np.ndarray, c_vw: np.ndarray) -> float:
        """The forecast seconds of ``_link`` on these operands: none where it is memoised, else its elements at
        the rate measured so far (a nanosecond each before any)."""
        if self._key(_link, (c_uv, c_v, c_vw)) in self._memo:
            return 0.0
        rate = self._link_seconds / self._link_elements if self._link_elements else 1e-9
        return c_uv.size * c_vw.shape[1] * rate

    def tail_seconds(self, large: int) -> float:
        """The forecast seconds of eliminating ``large`` decisions of more than :data:`_SHORTLIST` candidates
        each once they are shortlisted (each its shortlist found and a product on it, or a memo hit for an
        identical layer): at the rate the tails so far took per decision, before any at :data:`_TAIL_SECONDS`."""
        if self._tail_decisions:
            return large * self._tail_seconds / self._tail_decisions
        return large * _TAIL_SECONDS

    def tail_taken(self, large: int, seconds: float) -> None:
        self._tail_decisions += large
        self._tail_seconds += seconds


def _plus(a, b):
    return a + b


def _plus_row(c, m):
    return c + m[0]


def _plus_column(c, m, k=0):
    return c + m[:, k]


def _plus_diagonal(c, m):
    return c + np.diag(m)


def _transposed(m):
    return m.T


class _Reducer:
    """The problem as an adjacency structure, shrunk by exact eliminations. ``keep`` decisions are never
    eliminated (those a budget weighs: eliminating them would lose their weights)."""

    def __init__(self, costs: list[np.ndarray], edges, keep: frozenset[int] = frozenset(),
                 shared: _Shared | None = None, deadline: float = math.inf, limit: float = math.inf):
        self.op = _Shared() if shared is None else shared
        # past ``limit`` a product too large for the time is taken on the few candidates each of its decisions
        # would pick at its neighbours' best replies (:meth:`_shortlist`): the plan is then no longer proven best
        self.limit, self.shortlisted = limit, False
        self.costs = [self.op.intern(c) for c in costs]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in self.costs]  # adj[u][v]: matrix oriented u x v
        for u, v, m in edges:
            self.add(u, v, self.op.intern(m))
        self.trail: list[tuple] = []  # eliminations, to undo in reverse
        self.alive = set(range(len(self.costs)))
        self.keep = keep
        self.constant = 0.0  # the cost of what was decided outright (a decision fixed, or left with no edge)
        # dominance and conditioning leave elimination its shortlisted tail before the limit (a 4-D mesh's
        # decisions: dominance had taken three quarters of the time, then elimination shortlisted all it met)
        large = _large(self.costs)
        deadline = min(deadline, limit - self.op.tail_seconds(large))
        # dominated candidates dropped before elimination (its min-plus products shrink by the cube: DeepSeek-V3's
        # half as long) and again on what it leaves (its edges are sums over paths: more is dominated there)
        for _ in range(2):
            drop_dominated(self, set(self.alive), deadline)
            self.eliminate(self.alive)
        condition_all(self, deadline)

    def add(self, u: int, v: int, m: np.ndarray) -> None:
        op = self.op
        if u == v:
            self.costs[u] = op(_plus_diagonal, self.costs[u], m)
        elif len(self.costs[u]) == 1:
            self.costs[v] = op(_plus_row, self.costs[v], m)
        elif len(self.costs[v]) == 1:
            self.costs[u] = op(_plus_column, self.costs[u], m)
        else:
            if v in self.adj[u]:
                m = op(_plus, self.adj[u][v], m)
            self.adj[u][v] = m
            self.adj[v][u] = op(_transposed, m)

    def drop(self, v: int) -> None:
        for u in self.adj[v]:
            del self.adj[u][v]
        self.adj[v] = {}
        self.alive.discard(v)

    def eliminate(self, start) -> None:
        op = self.op
        queue = sorted(start, key=lambda v: (len(self.adj[v]), v))
        tail = None  # (the clock and the large decisions left at the first shortlist)
        while queue:
            # the decisions whose products may need a shortlist: the rest of the elimination past that point
            # takes about their tail each (:meth:`_Shared.tail_seconds`), reserved before the limit
            large = _large(self.costs[v] for v in self.alive if v not in self.keep)
            nxt, touched = [], set()
            for v in queue:
                if v not in self.alive or v in self.keep:
                    continue
                if v in touched:
                    # changed in this pass: left to the next, so each pass eliminates decisions whose neighbours
                    # are as they were; a chain of identical layers then contracts by halves, each pass's links
                    # alike (one memo hit after the first) instead of one new product per layer
                    nxt.append(v)
                    continue
                nbrs = list(self.adj[v])
                cv = self.costs[v]
                if len(nbrs) == 0:  # (its cost final: its best candidate taken now)
                    self.trail.append(("fixed", v, int(np.argmin(cv))))
                    self.constant += float(cv.min())
                    self.alive.discard(v)
                elif len(nbrs) == 1:
                    (u,) = nbrs
                    best, table = op(_leaf, self.adj[u][v], cv)
                    self.costs[u] = op(_plus, self.costs[u], best)
                    self.trail.append(("leaf", v, u, table))
                    self.drop(v)
                    nxt.append(u)
                    touched.add(u)
                elif len(nbrs) == 2:
                    u, w = sorted(nbrs)  # (the same orientation in every layer: the operands are the same objects)
                    # a product that would end past the limit with the shortlisted tail after it (one computed
                    # for an identical layer already costs nothing and is taken as computed)
                    if len(cv) * len(self.costs[u]) * len(self.costs[w]) > _SHORTLIST ** 3:
                        forecast = op.link_seconds(self.adj[u][v], cv, self.adj[v][w])
                        now = time.perf_counter()
                        if forecast and now + forecast + op.tail_seconds(large) > self.limit:
                            tail = tail or (now, large)
                            for x in (v, u, w):
                                self._shortlist(x)
                            cv = self.costs[v]
                        large -= 1
                    best, table = op(_link, self.adj[u][v], cv, self.adj[v][w])
                    self.trail.append(("link", v, u, w, table))
                    self.drop(v)
                    self.add(u, w, best)
                    nxt += [u, w]
                    touched.update((u, w))
            queue = sorted(set(nxt) & self.alive, key=lambda v: (len(self.adj[v]), v))
        if tail is not None:
            op.tail_taken(tail[1], time.perf_counter() - tail[0])

    def _shortlist(self, x: int) -> None:
        """Keep ``x``'s :data:`_SHORTLIST` candidates that cost least with each neighbour's best reply (the rest
        are not proven worse: the plan is the best on what is kept)."""
        if len(self.costs[x]) <= _SHORTLIST or x in self.keep:
            return
        neighbours = sorted(self.adj[x])  # (one order in every identical layer: their arrays meet the same memo)
        kept, into = self.op(_best_replied, self.costs[x], *(self.adj[x][u] for u in neighbours),
                             *(self.costs[u] for u in neighbours))
        restrict(self, x, kept, into)
        self.shortlisted = True

    def fix(self, v: int, k: int) -> None:
        """Decide ``v`` (its candidate ``k``): its edges become costs of its neighbours, which may then go."""
        nbrs = list(self.adj[v])
        for u in nbrs:
            self.costs[u] = self.op(_plus_column, self.costs[u], self.adj[u][v], k)
        self.constant += float(self.costs[v][k])
        self.trail.append(("fixed", v, k))
        self.drop(v)
        self.eliminate(nbrs)

    def copy(self) -> "_Reducer":
        other = object.__new__(_Reducer)
        other.op = self.op
        other.costs = list(self.costs)  # arrays are replaced, never written in place
        other.adj = [dict(a) for a in self.adj]
        other.trail = list(self.trail)
        other.alive = set(self.alive)
        other.keep = self.keep
        other.constant = self.constant
        other.limit, other.shortlisted = self.limit, self.shortlisted
        return other

    def local_copy(self, touched: set[int], keep: frozenset[int]) -> "_Reducer":
        """A copy of the decisions ``touched`` alone (their costs and adjacency in dicts: a copy costs what it
        holds, not the whole problem), for eliminations that stay within them: ``keep``, never eliminated, holds
        each of them with a neighbour outside. Its trail is empty and its constant its own decisions' only."""
        other = object.__new__(_Reducer)
        other.op, other.trail, other.keep, other.constant = self.op, [], keep, 0.0
        other.limit, other.shortlisted = self.limit, False
        other.costs = {v: self.costs[v] for v in touched}
        other.adj = {v: dict(self.adj[v]) for v in touched}
        other.alive = touched & self.alive
        return other

    def recover(self, choice: dict[int, int]) -> None:
        _recover(self.trail, choice)


def _recover(trail: list[tuple], choice: dict[int, int]) -> None:
    """Each eliminated decision's candidate, from those of the decisions it was eliminated into (in reverse)."""
    for step in reversed(trail):
        if step[0] == "fixed":
            choice[step[1]] = step[2]
        elif step[0] == "restricted":  # (its dominated candidates dropped: the index among those it had before)
            choice[step[1]] = int(step[2][choice[step[1]]])
        elif step[0] == "leaf":
            _, v, u, table = step
            choice[v] = int(table[choice[u]])
        elif step[0] == "link":
            _, v, u, w, table = step
            choice[v] = int(table[choice[u], choice[w]])
        else:  # "conditioned": the block's trail of the candidate its boundary's choices make best
            _, boundary, table, trails = step
            k = int(table[tuple(choice[b] for b in boundary)])
            _recover(trails[k], choice)


def _best_replied(costs: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The :data:`_SHORTLIST` candidates whose cost, with each neighbour's best reply to it, is least (``arrays``:
    the edges, then the neighbours' costs), in their order; and each candidate's position among them (a dropped
    one's: the best kept one's)."""
    half = len(arrays) // 2
    score = costs.copy()
    for m, c in zip(arrays[:half], arrays[half:]):
        score += (m + c[None, :]).min(axis=1)
    kept = np.sort(np.argsort(score, kind="stable")[:_SHORTLIST])
    into = np.full(len(costs), int(np.argmin(score[kept])))
    into[kept] = np.arange(len(kept))
    return kept, into


def _incumbent(red: _Reducer) -> dict[int, int]:
    """A good plan for what elimination left, fast: fix the decision with the most neighbours to the candidate
    best for it and its neighbours' best replies, eliminate exactly again, repeat until none is left."""
    red = red.copy()
    red.keep = frozenset()
    mine = len(red.trail)  # (the choices are wanted as ``red`` has the candidates: its own trail is not undone)
    while red.alive:
        v = max(red.alive, key=lambda x: (len(red.adj[x]), -len(red.costs[x]), -x))
        score = red.costs[v].copy()
        for u, m in red.adj[v].items():  # m: v x u
            score += (m + red.costs[u][None, :]).min(axis=1)
        red.fix(v, int(np.argmin(score)))
    choice: dict[int, int] = {}
    _recover(red.trail[mine:], choice)
    return choice


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
        self.edge_vars: list[tuple[int, int, list, list, dict]] = []  # (u, v, row groups, col groups, y)

    def _var(self, cost: float, integer: bool) -> int:
        self.obj.append(cost)
        self.integrality.append(1 if integer else 0)
        return len(self.obj) - 1

    def _row(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        r = len(self.lo)
        self.rows.extend([r] * len(cols))
        self.cols.extend(cols)
        self.vals.extend(vals)
        self.lo.append(lo)
        self.hi.append(hi)

    def decision(self, v: int, costs: np.ndarray) -> None:
        first = len(self.obj)
        self.obj.extend(float(c) for c in costs)
        self.integrality.extend([1] * len(costs))
        self.offsets[v] = first
        self._row(list(range(first, first + len(costs))), [1.0] * len(costs), 1.0, 1.0)

    def edge(self, u: int, v: int, matrix: np.ndarray, weight: bool = False) -> list[tuple[int, float]]:
        """The edge's variables, costing ``matrix``; or, a ``weight`` (the budget's on a pair), costing nothing:
        then its variables and their weights are returned for the budget row."""
        row_groups, col_groups = _groups(matrix, 0), _groups(matrix, 1)
        first = len(self.obj)
        reps_r = [g[0] for g in row_groups]
        reps_c = [g[0] for g in col_groups]
        block = matrix[np.ix_(reps_r, reps_c)]
        self.obj.extend((0.0 * block if weight else block).ravel().tolist())
        self.integrality.extend([0] * block.size)
        nb = len(col_groups)
        for a, rows in enumerate(row_groups):
            ys = list(range(first + a * nb, first + (a + 1) * nb))
            xs = [self.offsets[u] + int(i) for i in rows]
            self._row(ys + xs, [1.0] * len(ys) + [-1.0] * len(xs), 0.0, 0.0)
        for b, cols in enumerate(col_groups):
            ys = list(range(first + b, first + len(row_groups) * nb, nb))
            xs = [self.offsets[v] + int(j) for j in cols]
            self._row(ys + xs, [1.0] * len(ys) + [-1.0] * len(xs), 0.0, 0.0)
        self.edge_vars.append((u, v, row_groups, col_groups, first))
        return list(zip(range(first, first + block.size), block.ravel().tolist())) if weight else []

    def budget(self, weights: list[np.ndarray], limit: float, sizes: list[int],
               pairs: list[tuple[int, int, np.ndarray]] = ()) -> None:
        cols, vals = [], []
        for u, v, m in pairs:
            for col, w in self.edge(u, v, m, weight=True):
                if w:
                    cols.append(col)
                    vals.append(w)
        for v, off in self.offsets.items():
            for k in range(sizes[v]):
                if weights[v][k]:
                    cols.append(off + k)
                    vals.append(float(weights[v][k]))
        self._row(cols, vals, -np.inf, limit)

    def values(self, choice: dict[int, int]) -> np.ndarray:
        """The variables' values for a choice of every decision in the program."""
        x = np.zeros(len(self.obj))
        for v, off in self.offsets.items():
            x[off + choice[v]] = 1.0
        for u, v, row_groups, col_groups, first in self.edge_vars:
            a = next(i for i, g in enumerate(row_groups) if choice[u] in g)
            b = next(j for j, g in enumerate(col_groups) if choice[v] in g)
            x[first + a * len(col_groups) + b] = 1.0
        return x


_BANNER_SHOWN = [False]


def _highs() -> highspy.Highs:
    """A silent HiGHS. Its first construction in a process prints a banner on the C stdout, which a library must
    not: that one is made with the stdout file descriptor pointed at /dev/null."""
    quiet = contextlib.nullcontext() if _BANNER_SHOWN[0] else _c_stdout_silenced()
    with quiet:
        h = highspy.Highs()
    _BANNER_SHOWN[0] = True
    h.silent()
    return h


@contextlib.contextmanager
def _c_stdout_silenced():
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _program(red: _Reducer, alive: list[int], start: dict[int, int], time_limit_s: float,
             budget: tuple[list[np.ndarray], float, list] | None = None) -> tuple[dict[int, int], bool, float, str]:
    """HiGHS on the decisions ``alive`` (their costs and edges in ``red``), from the plan ``start``. Returns the
    choice of each, whether it is proven optimal, the relative gap, and HiGHS's word for how it ended (only a
    time limit keeps a feasible problem from being solved: "time limit")."""
    b, most = _Builder(), _PROGRAM_COLUMNS_PER_SECOND * time_limit_s  # (more: HiGHS's presolve alone would outlast
    # the time left; the building stops there, as it takes about as long: Llama-3-70B's 39 M columns took 45 s)
    for v in alive:
        b.decision(v, red.costs[v])
    for u in alive:
        if len(b.obj) > most:
            break
        for v, m in red.adj[u].items():
            if u < v:
                b.edge(u, v, m)
    if budget is not None and len(b.obj) <= most:
        weights, limit, pairs = budget
        b.budget(weights, limit, [len(c) for c in red.costs], pairs)
    n = len(b.obj)
    if n > most:
        log.info("search: the integer program's %d columns or more are too many for %.1f s: the plan found by "
                 "elimination and fixing is kept", n, time_limit_s)
        return dict(start), False, float("inf"), "time limit"
    order = np.lexsort((np.array(b.rows), np.array(b.cols)))  # column-wise
    cols = np.array(b.cols)[order]
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, len(b.lo)
    lp.col_cost_ = np.array(b.obj)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.where(np.array(b.integrality) == 1, 1.0, highspy.kHighsInf)
    lp.row_lower_ = np.where(np.isfinite(b.lo), b.lo, -highspy.kHighsInf)
    lp.row_upper_ = np.where(np.isfinite(b.hi), b.hi, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(cols, np.arange(n + 1)).astype(np.int32)
    lp.a_matrix_.index_ = np.array(b.rows, dtype=np.int32)[order]
    lp.a_matrix_.value_ = np.array(b.vals)[order]
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in b.integrality]
    h = _highs()
    h.setOptionValue("time_limit", float(max(time_limit_s, 1e-3)))
    h.setOptionValue("mip_rel_gap", _GAP)
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    x0 = b.values(start)
    h.setSolution(n, np.arange(n, dtype=np.int32), x0)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    x = np.asarray(h.getSolution().col_value) if info.primal_solution_status == 2 else None
    if x is None or len(x) != n:
        if status == highspy.HighsModelStatus.kInfeasible:
            raise Infeasible("no assignment satisfies the budget")
        return dict(start), False, float("inf"), "time limit"
    choice = {v: int(np.argmax(x[b.offsets[v]: b.offsets[v] + len(red.costs[v])])) for v in alive}
    optimal = status == highspy.HighsModelStatus.kOptimal
    gap = 0.0 if optimal else float(info.mip_gap)
    return choice, optimal, gap, "optimal" if optimal else "time limit"


def _residue_terms(red: _Reducer, alive: list[int], choice: dict[int, int]) -> tuple[float, float]:
    """The value of ``choice`` on what elimination left, and the bound each term gives alone (every cost and edge
    at its least): the bound where no time is left for the integer program's own."""
    edges = [(u, v, m) for u in alive for v, m in red.adj[u].items() if u < v]
    value = sum(float(red.costs[v][choice[v]]) for v in alive) + sum(float(m[choice[u], choice[v]])
                                                                      for u, v, m in edges)
    bound = sum(float(red.costs[v].min()) for v in alive) + sum(float(m.min()) for _, _, m in edges)
    return value, bound


def _unconstrained(costs, edges, time_limit_s: float, shared: _Shared | None = None) -> Solution:
    start = time.perf_counter()
    # (conditioning may take three quarters of the time: what it leaves, the integer program the rest)
    red = _Reducer(costs, edges, shared=shared, deadline=start + CONDITION_SHARE * time_limit_s,
                   limit=start + time_limit_s)
    alive = sorted(red.alive)
    choice: dict[int, int] = {}
    optimal, gap, message = True, 0.0, "optimal"
    if alive:
        choice, optimal, gap, message = _incumbent(red), False, float("inf"), "time limit"
        left = start + time_limit_s - time.perf_counter()
        if left > 0:
            log.info("search: %d decisions of %d left after exact elimination; integer program (limit %.1f s)",
                     len(alive), len(costs), left)
            choice, optimal, gap, message = _program(red, alive, choice, left)
        if not optimal:  # the gap in absolute terms: HiGHS's (relative to what it solved) or the simplest bound
            value, bound = _residue_terms(red, alive, choice)
            gap = value - max(bound, value - gap * abs(value) if gap < float("inf") else bound)
    if red.shortlisted:  # (no bound: what the shortlists dropped is not priced)
        optimal, gap, message = False, float("inf"), "time limit"
    red.recover(choice)
    ordered = [choice[v] for v in range(len(costs))]
    stats = {"decisions": len(costs), "ilp_decisions": len(alive), "eliminated": len(red.trail),
             "seconds": time.perf_counter() - start, **({"shortlisted": _SHORTLIST} if red.shortlisted else {})}
    f = objective(Problem(costs, edges), ordered)
    bound = f if optimal else f - gap
    return Solution(ordered, f, optimal, message, stats, 0.0 if optimal else max(gap, 0.0) / max(abs(f), 1e-30),
                    timed_out=message == "time limit", bound=bound)


def _with_budget(problem: Problem, time_limit_s: float, optional: bool = False) -> Solution:
    """The budget by Lagrangian relaxation (its multiplier grown, then set where its bracket's plans cross),
    then, where a gap is left, the integer program with the budget row, from the best plan found."""
    (weights, limit), pairs = problem.budget, problem.budget_edges
    weights = [np.asarray(w, dtype=float) for w in weights]
    deadline = time.perf_counter() + time_limit_s
    shared = _Shared()  # the rounds' arrays, hashed once, and what they compute alike, computed once
    least = _least_weight(weights, pairs, limit)

    def at(mu: float, seconds: float = math.inf) -> Solution:  # (the time left, or ``seconds`` of it)
        with shared.one_round():
            return _unconstrained(_priced(problem.costs, weights, mu, shared),
                                  problem.edges + scaled_edges(pairs, mu, shared),
                                  max(min(seconds, deadline - time.perf_counter()), 0.0), shared)

    def weight(sol: Solution) -> float:
        return _weight(weights, pairs, sol.choice)

    large = _large(problem.costs)

    def time_up() -> bool:  # (no solve can end in time: its elimination shortlisted from the start, at the least)
        return time.perf_counter() + shared.tail_seconds(large) >= deadline

    # half the time, less where the second solve would not have its shortlisted elimination: a plan over the
    # budget takes a second solve at least
    left = deadline - time.perf_counter()
    first = at(0.0, min(left / 2, left - shared.tail_seconds(large)))
    if weight(first) <= limit:
        return first
    best, bound, over = None, first.bound, first

    def take(mu: float, sol: Solution) -> bool:
        nonlocal best, bound, over
        w = weight(sol)
        bound = max(bound, sol.bound - mu * limit)  # (a Lagrangian bound from the inner solve's own bound)
        if w <= limit:
            f = objective(problem, sol.choice)
            if best is None or f < best.objective:
                best = Solution(sol.choice, f, False, "", sol.stats, timed_out=sol.timed_out)
        else:
            over = sol
        return w <= limit

    # the multiplier's scale: the fastest plan's cost per byte it is over the budget (a hundredth of the budget at
    # least), a price at which shedding the excess may cost as much as the plan, then up by 8x until a plan keeps
    # the budget, then set where the bracket's two plans cost alike until no cheaper plan is found there or the
    # gap closes (the 70B's budget was kept at about twice that price; a millionth of the cost per byte of the
    # budget took it 9 rounds to reach)
    lo, hi = 0.0, max(abs(first.objective), 1e-30) / max(weight(first) - limit, 1e-2 * limit, 1e-30)
    rounds, top, taken = 0, at(hi), False  # ``top``: the plan at ``hi`` (within the budget); ``over``: at ``lo``
    while not take(hi, top):  # (past the deadline, bigger steps to a plan within the budget)
        if optional and time.perf_counter() > deadline:
            raise Infeasible("no plan within the budget found in the time given")
        lo, hi = hi, hi * (8 if time.perf_counter() < deadline else 64)
        rounds += 1
        if not taken and (rounds == _LEAST_WEIGHT_AFTER or time.perf_counter() > deadline):
            if least is None:  # (no pairs: the least weight is each decision's least)
                least = _unconstrained(weights, [], 0.0)
            taken = take(math.inf, least)  # (a plan within it: the bracket's upper end, should none come sooner)
        if best is not None and rounds >= 4 * _LEAST_WEIGHT_AFTER:  # (only the least weight's plan keeps it)
            hi, top = math.inf, least
            break
        top = at(hi)
    best, gap = _mixed_in(problem, weights, limit, over, best, bound)
    while rounds < 40 and not time_up() and hi > lo * (1 + 1e-2) and gap > _MIXED_GAP:
        ends = (_line(problem, weights, pairs, over), _line(problem, weights, pairs, top))
        mid = _crossing(lo, hi, *ends)
        sol = at(mid)
        rounds += 1
        within = take(mid, sol)
        best, gap = _mixed_in(problem, weights, limit, over, best, bound)
        if any(_same_line(_line(problem, weights, pairs, sol), end) for end in ends):
            break  # (no plan below both lines where they cross: that is the dual's maximum, its bound taken)
        lo, hi, top = (lo, mid, sol) if within else (mid, hi, top)
    best.stats = {**best.stats, "lagrangian_rounds": rounds}
    return _closed(problem, weights, limit, best, gap, time_up(), optional, deadline, shared)


def _closed(problem: Problem, weights: list[np.ndarray], limit: float, best: Solution, gap: float, late: bool,
            optional: bool, deadline: float, shared: _Shared) -> Solution:
    """The Lagrangian rounds' ``best`` plan, ``gap`` from their bound: proven where the gap closed, taken as it is
    where it is small, ``late`` (no round could end by the deadline) or ``optional`` (its plan is compared with
    one found already, and the integer program's elimination and fixing are not cut at the limit), else the
    integer program from it."""
    if gap <= _GAP:
        best.optimal, best.gap, best.message = True, 0.0, "memory limit binding"
        return best
    if gap <= _BUDGET_GAP or late or optional:
        best.gap, best.message = gap, f"memory limit binding: within {gap:.2%} of the best bound"
        best.timed_out = best.timed_out or late
        return best
    return _budget_program(problem, weights, limit, best, gap, deadline, shared)


def _priced(costs: list[np.ndarray], weights: list[np.ndarray], mu: float, shared: _Shared) -> list[np.ndarray]:
    """``c + mu * w`` per decision, computed once per pair of arrays of equal content (identical layers share
    theirs), each taken by ``shared`` as its own: made of interned arrays, it needs no hash of its own (each
    round's were 0.6-1 s of a Llama-405B round). Where ``w`` is zero it is ``c``, the same in every round (what
    the budget does not weigh is eliminated once for all rounds: the memo's)."""
    done: dict[tuple[int, int], np.ndarray] = {}
    priced = []
    for c, w in zip(costs, weights):
        c, w = shared.intern(c), shared.intern(w)  # (the same objects every round: hashed in the first)
        if (id(c), id(w)) not in done:  # (one the budget does not weigh is the same object every round)
            done[id(c), id(w)] = shared.adopt(c + mu * w) if w.any() else c
        priced.append(done[id(c), id(w)])
    return priced


def _line(problem: Problem, weights, pairs, sol: Solution) -> tuple[float, float]:
    """(objective, weight) of a plan: its Lagrangian value at ``mu`` is ``objective + mu * (weight - B)``."""
    return objective(problem, sol.choice), _weight(weights, pairs, sol.choice)


def _same_line(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(abs(x - y) <= 1e-9 * max(abs(x), abs(y), 1e-30) for x, y in zip(a, b))


def _crossing(lo: float, hi: float, over: tuple[float, float], within: tuple[float, float]) -> float:
    """The next multiplier: where the Lagrangian values of the plan at ``lo`` (over the budget) and the plan at
    ``hi`` (within it) are equal, the dual's highest point were they its only pieces (Kelley's cutting planes in
    one dimension: one new piece a round, where bisection halves a bracket whose end it cannot see). The
    geometric midpoint where that point is not strictly inside the bracket (rounding, or an inexact solve)."""
    (f_over, w_over), (f_within, w_within) = over, within
    mid = (f_within - f_over) / (w_over - w_within) if w_over > w_within else math.nan
    if lo < mid < hi:
        return mid
    return (lo * hi) ** 0.5 if lo > 0 and hi < math.inf else (hi / 8 if hi < math.inf else lo * 8)


def _budget_program(problem: Problem, weights: list[np.ndarray], limit: float, best: Solution, gap: float,
                    deadline: float, shared: _Shared) -> Solution:
    """The integer program on the whole problem with the budget row, from ``best`` (the Lagrangian rounds' plan,
    ``gap`` from their bound): decisions the budget does not weigh are still eliminated."""
    pairs = problem.budget_edges
    varying = [(u, v, m) for u, v, m in pairs if np.ptp(m) > 0]
    keep = frozenset(v for v, w in enumerate(weights) if np.ptp(w) > 0) | {x for u, v, _ in varying for x in (u, v)}
    offset = sum(float(w.min()) for v, w in enumerate(weights) if v not in keep) + \
        sum(float(m.min()) for _, _, m in pairs if np.ptp(m) == 0)
    red = _Reducer(problem.costs, problem.edges, keep=keep, shared=shared,
                   deadline=time.perf_counter() + CONDITION_SHARE * max(deadline - time.perf_counter(), 0.0),
                   limit=deadline)
    alive = sorted(red.alive)
    start = restricted(red.trail, dict(enumerate(best.choice)))  # (as the reducer has the candidates)
    choice, optimal, ilp_gap, message = _program(red, alive, start, max(deadline - time.perf_counter(), 0.0),
                                                 ([w if v in keep else np.zeros_like(w) for v, w in
                                                   enumerate(weights)], limit - offset, varying))
    red.recover(choice)
    ordered = [choice[v] for v in range(len(problem.costs))]
    f = objective(problem, ordered)
    if f > best.objective:  # HiGHS found nothing better than the start
        ordered, f = best.choice, best.objective
    optimal = optimal and not red.shortlisted
    gap = 0.0 if optimal else min(gap, ilp_gap)
    return Solution(ordered, f, optimal, message, {**best.stats, "ilp_decisions": len(alive)}, gap,
                    timed_out=not optimal)


def _least_weight(weights: list[np.ndarray], pairs, limit: float) -> Solution | None:
    """The least weight's plan, exactly (memory alone eliminates fast, its layouts tie; None without pairs: each
    decision's least), first: a try that cannot fit says so (:class:`Infeasible`) before any round (Llama-405B's
    recompute tries had spent 8.6 s on two rounds to learn it), and before any elimination where each decision's
    and pair's least alone exceed the budget."""
    if _least_bound(weights, pairs) > limit * (1 + 1e-12):
        raise Infeasible("no assignment satisfies the budget")
    least = _unconstrained(weights, pairs, 0.0) if pairs else None
    if least is not None and _weight(weights, pairs, least.choice) > limit * (1 + 1e-12):
        raise Infeasible("no assignment satisfies the budget")
    return least


def _least_bound(weights: list[np.ndarray], pairs) -> float:
    """No choice weighs less: each decision's least weight and each pair's (a matrix several pairs share, once)."""
    least: dict[int, float] = {}
    for _, _, m in pairs:
        if id(m) not in least:
            least[id(m)] = float(m.min())
    return sum(float(w.min()) for w in weights) + sum(least[id(m)] for _, _, m in pairs)


def _weight(weights: list[np.ndarray], pairs, choice) -> float:
    """The budget's weight of ``choice``: its decisions' own and its pairs'."""
    return float(sum(w[k] for w, k in zip(weights, choice)) + sum(m[choice[u], choice[v]] for u, v, m in pairs))


def _mixed_in(problem: Problem, weights: list[np.ndarray], limit: float, over: Solution, best: Solution,
              bound: float) -> tuple[Solution, float]:
    """The better of ``best`` and its mix with ``over`` (:func:`_mixed`), and its gap to ``bound``."""
    mixed = _mixed(problem, weights, limit, over.choice, best.choice)
    if mixed is not None and mixed.objective < best.objective:
        best = Solution(mixed.choice, mixed.objective, False, "", {**best.stats, **mixed.stats},
                        timed_out=best.timed_out)
    return best, max(best.objective - bound, 0.0) / max(abs(best.objective), 1e-30)


def _mixed(problem: Problem, weights: list[np.ndarray], limit: float, over: list[int],
           within: list[int]) -> Solution | None:
    """Between the rounds' last plan over the budget (``over``) and its best within (``within``): the plan
    that keeps ``over`` where it can and takes ``within``'s choices in just enough of the places they differ.

    One multiplier prices every identical layer alike, so the Lagrangian plans switch all of them at once and
    the budget often lies between two of them (the duality gap): the best plan keeps some layers as ``over`` has
    them. The decisions where the two differ fall into parts no edge joins (one a layer, where the values between
    layers agree); switching a part changes the objective and the weight by its own amounts, edges to the rest
    included, whatever the other parts do. Parts switch in order of the least cost per byte saved until the plan
    fits (a greedy knapsack), then parts switched early that are no longer needed switch back."""
    differ = {v for v, (a, b) in enumerate(zip(over, within)) if a != b}
    if not differ:
        return None
    edges = [(u, v, m, False) for u, v, m in problem.edges] + [(u, v, m, True) for u, v, m in problem.budget_edges]
    neighbours: dict[int, list[int]] = {v: [] for v in differ}
    touching: dict[int, list[int]] = {v: [] for v in differ}
    for e, (u, v, _, _) in enumerate(edges):
        for a, b in ((u, v), (v, u)):
            if a in differ:
                touching[a].append(e)
                if b in differ:
                    neighbours[a].append(b)
    parts, seen = [], set()
    for v in sorted(differ):  # the parts: connected through edges among the differing decisions
        if v in seen:
            continue
        part, stack = [], [v]
        seen.add(v)
        while stack:
            a = stack.pop()
            part.append(a)
            for b in neighbours[a]:
                if b not in seen:
                    seen.add(b)
                    stack.append(b)
        parts.append(part)

    def change(part: list[int]) -> tuple[float, float]:  # (objective, weight) of switching ``part`` to within
        inside = set(part)
        df = sum(float(problem.costs[v][within[v]] - problem.costs[v][over[v]]) for v in part)
        dw = sum(float(weights[v][within[v]] - weights[v][over[v]]) for v in part)
        for e in {e for v in part for e in touching[v]}:
            u, v, m, weighs = edges[e]
            new_u, new_v = (within[u] if u in inside else over[u]), (within[v] if v in inside else over[v])
            delta = float(m[new_u, new_v] - m[over[u], over[v]])
            df, dw = (df, dw + delta) if weighs else (df + delta, dw)
        return df, dw

    changes = [change(part) for part in parts]
    excess = _weight(weights, problem.budget_edges, over) - limit
    order = sorted((i for i, (_, dw) in enumerate(changes) if dw < 0),
                   key=lambda i: changes[i][0] / -changes[i][1])
    switched, saved = [], 0.0
    for i in order:
        if saved >= excess:
            break
        switched.append(i)
        saved -= changes[i][1]
    if saved < excess:
        return None
    for i in sorted(switched, key=lambda i: changes[i][0], reverse=True):  # the costliest no longer needed back
        if saved + changes[i][1] >= excess and changes[i][0] > 0:
            switched.remove(i)
            saved += changes[i][1]
    choice = list(over)
    for i in switched:
        for v in parts[i]:
            choice[v] = within[v]
    if _weight(weights, problem.budget_edges, choice) > limit * (1 + 1e-12):
        return None
    return Solution(choice, objective(problem, choice), False, "", {"mixed_parts": len(switched)})


def solve(problem: Problem, time_limit_s: float = 60.0, optional: bool = False) -> Solution:
    """The cheapest choice (within the budget, if given). Past ``time_limit_s`` the best plan found is returned,
    with ``optimal`` False and its gap; :class:`Infeasible` only where no choice keeps the budget, or, for an
    ``optional`` solve (one whose plan would improve on one already found), where none was found within the
    budget by then (otherwise the Lagrangian rounds go on past the limit until one is). An optional solve ends
    with its Lagrangian rounds' best plan (no integer program after them)."""
    if problem.budget is not None:
        return _with_budget(problem, time_limit_s, optional)
    return _unconstrained(problem.costs, problem.edges, time_limit_s)


class Infeasible(RuntimeError):
    """No assignment satisfies the budget."""


def objective(problem: Problem, choice: list[int]) -> float:
    total = sum(float(problem.costs[v][k]) for v, k in enumerate(choice))
    return total + sum(float(m[choice[u], choice[v]]) for u, v, m in problem.edges)
