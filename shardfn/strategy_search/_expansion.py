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
    rows, numbered = _Numbered.of(rules, shapes, mesh_shape, firsts)
    found = []
    for combo in itertools.product(rows, repeat=len(mesh_shape)):
        specs = [None if column[0] == -1 else column for column in zip(*combo)]
        if any(numbered.mixed(s) for s in specs if s is not None):
            continue
        ins = tuple(s for s in specs[n_out:] if s is not None)
        if len(ins) != len(shapes) or (n_out == 1 and specs[0] is None):
            return None  # (DTensor's expansion raises on these rules)
        if not all(numbered.fits(i, s) or (uneven and s == numbered.laid_out[i]) for i, s in enumerate(ins)):
            continue
        outs = [None if s is None else numbered.placements(s) for s in specs[:n_out]]
        out = None if n_out == 0 else outs[0] if n_out == 1 else tuple(outs)
        found.append((out, tuple(numbered.placements(s) for s in ins)))
    return found


class _Numbered:
    """The expansion's placements by number: torch's placements hash and answer isinstance in Python (~0.2-0.3 us
    each), and the combinations over Llama-405B's 4-D mesh hashed them 2 million times. Each operand's tuple of
    numbers is tested once (they recur across combinations) and becomes one tuple of placements."""

    def __init__(self, table: list[Placement], shapes, mesh_shape, laid_out):
        self.table, self.shapes, self.mesh_shape, self.laid_out = table, shapes, mesh_shape, laid_out
        self.pending = [(type(q), q.reduce_op) if isinstance(q, Partial) else None for q in table]
        self.split = [q.dim if type(q) is Shard else None for q in table]
        self._mixed, self._fits, self._placements = {}, {}, {}

    @classmethod
    def of(cls, rules, shapes, mesh_shape, firsts) -> tuple[list[tuple[int, ...]], _Numbered]:
        """(``rules``' rows by number, -1 where an operand is absent; the numbering)."""
        numbers: dict[Placement, int] = {}
        rows = [tuple(-1 if q is None else numbers.setdefault(q, len(numbers)) for q in row) for row in rules]
        laid_out = [tuple(numbers.get(q, -2) for q in first) for first in firsts]
        return rows, cls(list(numbers), shapes, mesh_shape, laid_out)

    def mixed(self, numbers: tuple[int, ...]) -> bool:
        hit = self._mixed.get(numbers)
        if hit is None:
            hit = self._mixed[numbers] = _mixed({self.pending[k] for k in numbers if self.pending[k] is not None})
        return hit

    def fits(self, i: int, numbers: tuple[int, ...]) -> bool:
        """Is input ``i`` shardable so (:func:`shardable`)?"""
        key = (i, numbers)
        hit = self._fits.get(key)
        if hit is None:
            hit = self._fits[key] = _split_fits(self.shapes[i], [self.split[k] for k in numbers], self.mesh_shape)
        return hit

    def placements(self, numbers: tuple[int, ...]) -> Placements:
        hit = self._placements.get(numbers)
        if hit is None:
            hit = self._placements[numbers] = tuple(self.table[k] for k in numbers)
        return hit


def _mixed_pending(placements: Placements) -> bool:
    """Pending reductions of more than one kind on one operand (a sum and an average commute: allowed)."""
    return _mixed({(type(p), p.reduce_op) for p in placements if isinstance(p, Partial)})


def _mixed(kinds: set) -> bool:
    return len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})


def shardable(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """DTensor's is_tensor_shardable for Replicate, Shard and pending placements on sizes known as numbers: no dim
    split into more pieces than it has elements, none past the last."""
    return _split_fits(shape, [p.dim if type(p) is Shard else None for p in placements], mesh_shape)


def _split_fits(shape: tuple[int, ...], dims: Sequence[int | None], mesh_shape: tuple[int, ...]) -> bool:
    """:func:`shardable` by each mesh dim's split tensor dim (None: not split over it)."""
    pieces = [1] * len(shape)
    for size, dim in zip(mesh_shape, dims):
        if dim is not None:
            if dim >= len(shape):
                return False
            pieces[dim] *= size
            if shape[dim] < pieces[dim]:
                return False
    return True
