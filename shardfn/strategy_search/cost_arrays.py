"""The cost model's redistributions for many pairs of layouts at once (numpy): what pricing's edge matrices need.

:func:`cost_model.redistribute_collectives` walks one pair of layouts; an edge of a 3-D mesh pairs hundreds of
producer layouts with hundreds of consumer ones (1.9 million pairs for two Llama-3-70B layers on 8 x 8 x 8), too
many to walk one at a time in Python. Here the same walk runs on arrays of pairs, one mesh dim at a time, with the
same arithmetic in the same order, so every figure is bit for bit the scalar one (tests/strategy_search/
test_cost_arrays.py checks both on every pair of layouts). A layout is coded one int per mesh dim:
``Shard(d)`` d, ``Replicate`` -1, a pending sum -2 (other kinds of pending sums below).
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import numpy as np
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from . import cost_model as cm

__all__ = ["R", "P", "PairMemo", "codes", "edge_seconds", "pair_seconds", "redistribute_seconds"]

R, P = -1, -2


def codes(placements: Sequence[Placement], partials: dict) -> tuple[int, ...] | None:
    """The layout's code; None for what only the scalar walk knows (strided shards). Pending sums are -2 for a
    plain sum, and one code below that per other kind (embedding's masked sum) in ``partials``, which the codes
    compared with each other share."""
    out = []
    for p in placements:
        if type(p) is Shard and p.dim >= 0:
            out.append(p.dim)
        elif type(p) is Replicate:
            out.append(R)
        elif type(p) is Partial and p.reduce_op == "sum":
            out.append(P)
        elif p.is_partial():
            out.append(partials.setdefault(p, P - 1 - len(partials)))
        else:
            return None
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _bytes_table(shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int,
                 low: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of every layout whose codes lie from ``low`` to the last tensor dim, and the weight of each mesh
    dim's code in its index: a row's bytes are ``table[(row - low) @ weights]``."""
    base = max(len(shape), 1) - low
    weights = base ** np.arange(len(mesh_shape), dtype=np.int64)
    every = np.array(list(itertools.product(range(low, low + base), repeat=len(mesh_shape))), dtype=np.int64)
    return _computed_bytes(shape, every[:, ::-1], mesh_shape, itemsize), weights  # (row i: the codes of index i)


def _computed_bytes(shape, cur: np.ndarray, mesh_shape, itemsize: int) -> np.ndarray:
    """As cost_model.local_numel, times ``itemsize`` (nested ceil divisions are one ceil division by the
    product)."""
    total = np.ones(len(cur), dtype=np.int64)
    for t, size in enumerate(shape):
        ways = np.ones(len(cur), dtype=np.int64)
        for d, n in enumerate(mesh_shape):
            ways = np.where(cur[:, d] == t, ways * n, ways)
        total *= -(-int(size) // ways)
    return total * itemsize


def redistribute_seconds(shape, itemsize: int, src: np.ndarray, dst: np.ndarray, mesh_shape, profile,
                         links: Sequence[str], share: Callable | None = None,
                         gathers_on: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of redistributing each row of ``src`` to the same row of ``dst`` (coded layouts, one row a pair),
    as the sum of :func:`cost_model.collective_seconds` over :func:`cost_model.redistribute_collectives`; and
    whether each runs an all_gather on a mesh dim of ``gathers_on`` (an all_to_all keeps a value split, its dim
    moved: each rank holds as much as before).
    ``share(kind, nbytes)``: the latency share of each collective (None: 1).
    Each step works on the rows it moves alone, and each row's bytes are a lookup by an index kept as it moves
    (a 4-D mesh's edge pairs a million layouts, most of which move on few of its dims)."""
    n = len(mesh_shape)
    # (one contiguous small-int column per mesh dim: the steps read and write one dim at a time)
    cur = [np.ascontiguousarray(src[:, d], dtype=np.int8) for d in range(n)]
    goal = [np.ascontiguousarray(dst[:, d], dtype=np.int8) for d in range(n)]
    total = np.zeros(len(src))
    gathers = np.zeros(len(src), dtype=bool)
    low = min(int(src.min(initial=R)), int(dst.min(initial=R)), R)
    table, weights = _bytes_table(tuple(int(n) for n in shape), tuple(mesh_shape), itemsize, low)
    index = np.zeros(len(src), dtype=np.int64)
    for d in range(n):
        index += (cur[d].astype(np.int64) - low) * weights[d]

    def collective(rows, kind: str, d: int, nbytes, copied):
        if mesh_shape[d] <= 1 or not len(rows):
            return
        alpha, beta, launch = profile.link(links[d]).constants(kind)
        if share is not None:
            ls = share(kind, nbytes)
            alpha, launch = alpha * ls, launch * ls
        hops, part = cm.ring_terms(kind, mesh_shape[d])
        total[rows] = total[rows] + (launch + 2 * copied / profile.mem_bytes_per_s + hops * alpha
                                     + part * nbytes * beta)
        if d in gathers_on and kind == "all_gather":
            gathers[rows] = True

    def move(mask, d: int, t: np.ndarray) -> None:  # (cost_model.redistribute_collectives' move)
        rows = np.flatnonzero(mask)
        if not len(rows):
            return
        s, t, at = cur[d][rows], t[rows], index[rows]
        size = table[at]
        for kind, pick in (("reduce_scatter", (s <= P) & (t >= 0)), ("all_reduce", (s <= P) & (t < 0)),
                           ("all_to_all", (s >= 0) & (t >= 0))):
            collective(rows[pick], kind, d, size[pick], np.where(t[pick] != 0, size[pick], 0)
                       if kind == "reduce_scatter" else 0)
        pick = (s >= 0) & (t < 0)
        size = table[at[pick] + (R - s[pick].astype(np.int64)) * weights[d]]  # (the value gathered on ``d``)
        collective(rows[pick], "all_gather", d, size, np.where(s[pick] != 0, size, 0))
        cur[d][rows] = t
        index[rows] = at + (t.astype(np.int64) - s) * weights[d]

    split = np.zeros(len(src), dtype=bool)  # DTensor's order: where a mesh dim splits, innermost out first
    for d in range(n):
        split |= (cur[d] >= 0) & (mesh_shape[d] > 1)
    for d in reversed(range(n)):
        t = goal[d]
        nested = np.zeros(len(src), dtype=bool)  # a split of that tensor dim on an outer mesh dim differs
        for i in range(d):
            nested |= (cur[i] == t) != (goal[i] == t)
        t = np.where((t >= 0) & nested, np.int8(R), t)
        move(split & (cur[d] != t), d, t)
    for d in range(n):  # then, from the outermost in, whatever is still off
        move(cur[d] != goal[d], d, goal[d])
    return total, gathers


def _distinct(keys: list) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys (rows) in first-seen order, and each key's row."""
    pos: dict = {}
    idx = np.array([pos.setdefault(k, len(pos)) for k in keys], dtype=np.int64)
    return np.array(list(pos), dtype=np.int64).reshape(len(pos), -1), idx


class _PairTable:
    """The figures of one (tensor, collectives' pricing) for every pair of the layouts met so far: a square
    matrix over the codes in the order met, NaN where a pair was not asked for yet."""

    def __init__(self):
        self.index: dict[tuple[int, ...], int] = {}
        self.seconds = np.full((0, 0), np.nan)
        self.gathers = np.zeros((0, 0), dtype=bool)

    def rows(self, coded: np.ndarray) -> np.ndarray:
        """Each code's row and column (new codes added; the matrices grow by a quarter more than they need: a 4-D
        mesh's 5-D values have up to 2,401 codes, whose matrices doubled to 4,096 would hold 150 MB)."""
        out = np.array([self.index.setdefault(c, len(self.index)) for c in map(tuple, coded.tolist())],
                       dtype=np.int64)
        if len(self.index) > len(self.seconds):
            n, old = max(len(self.index) * 5 // 4, 64), len(self.seconds)
            seconds, gathers = np.full((n, n), np.nan), np.zeros((n, n), dtype=bool)
            seconds[:old, :old], gathers[:old, :old] = self.seconds, self.gathers
            self.seconds, self.gathers = seconds, gathers
        return out


class PairMemo:
    """:func:`pair_seconds`' figures kept per tensor shape and pricing, and per pair of layouts: a model's edges
    pair the same layouts of the same shapes again and again (Llama-3.1-405B's 297 candidate-list pairs ask for
    35 million pairs of layouts, 7.8 million of them distinct), so each is computed once. Figures are per row
    (:func:`redistribute_seconds` computes each pair alone), so a memoized one is bit for bit a fresh one."""

    def __init__(self):
        self._tables: dict[tuple, _PairTable] = {}

    def table(self, key: tuple) -> _PairTable:
        return self._tables.setdefault(key, _PairTable())


def pair_seconds(shape, itemsize: int, srcs: list, dsts: list, mesh_shape, profile, links,
                 share: Callable | None = None, gathers_on: Sequence[int] = (),
                 memo: PairMemo | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`redistribute_seconds` of every coded layout of ``srcs`` to every one of ``dsts``, as matrices
    (each distinct pair computed once; with ``memo``, once for every call given it)."""
    a, i = _distinct(srcs)
    b, j = _distinct(dsts)
    if memo is None:
        seconds, gathers = redistribute_seconds(shape, itemsize, np.repeat(a, len(b), 0),
                                                np.tile(b, (len(a), 1)), mesh_shape, profile, links, share,
                                                gathers_on)
        seconds, gathers = seconds.reshape(len(a), len(b)), gathers.reshape(len(a), len(b))
    else:
        table = memo.table((tuple(int(n) for n in shape), itemsize, tuple(mesh_shape), id(profile), tuple(links),
                            share, tuple(gathers_on)))
        ra, rb = table.rows(a), table.rows(b)
        block = np.ix_(ra, rb)
        seconds = table.seconds[block]
        missing_a, missing_b = np.nonzero(np.isnan(seconds))
        if len(missing_a):
            new, gathered = redistribute_seconds(shape, itemsize, a[missing_a], b[missing_b], mesh_shape, profile,
                                                 links, share, gathers_on)
            table.seconds[ra[missing_a], rb[missing_b]] = new
            if gathers_on:
                table.gathers[ra[missing_a], rb[missing_b]] = gathered
            seconds[missing_a, missing_b] = new
        gathers = table.gathers[block] if gathers_on else np.zeros(seconds.shape, dtype=bool)
    if len(a) == len(srcs) and len(b) == len(dsts):  # (each distinct already, in order: no repeats to spread)
        return seconds, gathers
    pick = np.ix_(i, j)
    return seconds[pick], gathers[pick]


def _gradient_target(code: tuple[int, ...], accumulate: bool) -> tuple[int, ...]:
    # cost_model.gradient_placement (pending sums whole), or accumulator_placement (whole dims pending)
    if accumulate:
        return tuple(P if c < 0 else c for c in code)
    return tuple(R if c <= P else c for c in code)


def _gradient_arriving(code: tuple[int, ...], pend: Sequence[bool]) -> tuple[int, ...]:
    # cost_model.backward_collectives' gradient at the consumer: pending where it left a sum, else resolved
    return tuple(P if p else (R if c <= P else c) for c, p in zip(code, pend))


def edge_seconds(shape, itemsize: int, grad_itemsize: int, src_keys: list, dst_keys: list, mesh_shape, profile,
                 links, grad: bool, share: Callable | None = None,
                 memo: PairMemo | None = None) -> np.ndarray | None:
    """Pricing's edge matrix: for producer keys (output layout, accumulates) and consumer keys (input layout,
    pending sums), the seconds of the forward redistribution plus, with ``grad``, its backward dual (the
    gradient's collectives bearing ``share`` of their latency). None where a layout has no code. ``memo``: as
    :func:`pair_seconds`'."""
    partials: dict = {}
    src = [codes(p, partials) for p, _ in src_keys]
    dst = [codes(p, partials) for p, _ in dst_keys]
    if None in src or None in dst:
        return None
    fwd, _ = pair_seconds(shape, itemsize, src, dst, mesh_shape, profile, links, memo=memo)
    if not grad:
        return fwd
    arriving = [_gradient_arriving(c, pd) for c, (_, pd) in zip(dst, dst_keys)]
    back, _ = pair_seconds(shape, grad_itemsize, arriving, [_gradient_target(c, acc) for c, (_, acc) in
                                                            zip(src, src_keys)], mesh_shape, profile, links, share,
                           memo=memo)
    if any(acc for _, acc in src_keys):  # an edge that moves the value resolves its gradient's pending sums
        resolved, _ = pair_seconds(shape, grad_itemsize, arriving, [_gradient_target(c, False) for c in src],
                                   mesh_shape, profile, links, share, memo=memo)
        ids: dict = {}
        src_ids, dst_ids = (np.array([ids.setdefault(c, len(ids)) for c in cs]) for cs in (src, dst))
        stays = (dst_ids[:, None] == src_ids[None, :]) & np.array([acc for _, acc in src_keys], dtype=bool)
        back = np.where(stays, back, resolved)
    return fwd + back.T
