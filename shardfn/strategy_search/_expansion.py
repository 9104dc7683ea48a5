"""DTensor's full-mesh expansion of single-mesh-dim rules, done on placements alone.

DTensor's ``expand_to_full_mesh_op_strategy`` takes an op's rules for one mesh dim (rows of output and input
placements) and makes every combination of them over the mesh dims, one DTensorSpec per operand of each and the
costs of redistributing to it; then drops the combinations that mix kinds of pending reduction on one operand
and those that shard an input dim into more pieces than it has elements. The search reads only the placements:
on Llama-405B's 4-D mesh (8 x 8 x 2 x 8) the specs and costs took 7.3 s of the 12.5 s its candidates took. The
same combinations, dropped by the same tests, as tuples: checked against DTensor's own on every supported torch
release (tests/strategy_search/test_expansion.py). Rules this does not cover (strided shards, placements of
other kinds, sizes not known as numbers) return None: the caller asks DTensor.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["expand_placements", "shardable"]

Placements = tuple[Placement, ...]


def expand_placements(rules: Sequence[Sequence[Placement | None]], mesh_shape: tuple[int, ...], n_out: int,
                      shapes: Sequence[tuple[int, ...]], firsts: Sequence[Placements],
                      uneven: bool) -> list[tuple[Any, tuple[Placements, ...]]] | None:
    """Every (output placements, input placements) combination of ``rules`` (rows of ``n_out`` outputs then the
    inputs, one placement each for one mesh dim; None where an operand is absent) over ``mesh_shape``, as DTensor
    expands them: a single output's placements as one tuple, several as a tuple of tuples (None where absent).
    ``shapes``: each tensor input's global shape; an input may be split unevenly into more pieces than elements
    where ``uneven`` and it is so laid out already (``firsts``: each input's one current layout)."""
    if not all(p is None or type(p) in (Replicate, Shard) or isinstance(p, Partial) for row in rules for p in row):
        return None
    if not all(isinstance(d, int) for shape in shapes for d in shape):
        return None
    shardable: dict = {}
    mixed: dict = {}  # (an operand's placements recur across combinations: each tested once)
    found = []
    for combo in itertools.product(rules, repeat=len(mesh_shape)):
        specs = [None if column[0] is None else column for column in zip(*combo)]
        if any(mixed[s] if s in mixed else mixed.setdefault(s, _mixed_pending(s)) for s in specs if s is not None):
            continue
        ins = tuple(s for s in specs[n_out:] if s is not None)
        if len(ins) != len(shapes) or (n_out == 1 and specs[0] is None):
            return None  # (DTensor's expansion raises on these rules)
        if not all(_fits(shapes[i], s, mesh_shape, shardable, i) or (uneven and s == tuple(firsts[i]))
                   for i, s in enumerate(ins)):
            continue
        out = None if n_out == 0 else specs[0] if n_out == 1 else tuple(specs[:n_out])
        found.append((out, ins))
    return found


def _mixed_pending(placements: Placements) -> bool:
    """Pending reductions of more than one kind on one operand (a sum and an average commute: allowed)."""
    kinds = {(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)}
    return len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})


def shardable(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """DTensor's is_tensor_shardable for Replicate, Shard and pending placements on sizes known as numbers: no dim
    split into more pieces than it has elements, none past the last."""
    pieces = [1] * len(shape)
    for size, p in zip(mesh_shape, placements):
        if type(p) is Shard:
            if p.dim >= len(shape):
                return False
            pieces[p.dim] *= size
            if shape[p.dim] < pieces[p.dim]:
                return False
    return True


def _fits(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...], memo: dict, i: int) -> bool:
    key = (i, placements)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = shardable(shape, placements, mesh_shape)
    return hit
