"""Batch slices of different lengths (dataset_strategy="data_parallel", an epoch's last batch).

Ranks may pass slices of any lengths, an empty one too. The global batch is their concatenation in the order of
the pieces the input's strategy gives the ranks (rank order for the default split over every rank); ranks that
hold the same piece (replicas along the other mesh axes) pass equal slices. A call whose ranks agree on all but
their slices' lengths (shardfn.call.agreement tells them all, with every rank's row counts) is run on that global
batch as any call of its shape: the rows first move between ranks, point to point, into the pieces DTensor lays
a tensor of that many rows out in (``torch.chunk``'s, the last ones shorter or empty), the program planned for
that batch runs, and each output split like an input of the same rows moves back into that input's slices, so
every rank gets the rows of its own slice. Autograd runs the moves backward: gradients equal eager's on the whole
batch. An uneven call costs its moves (and its first time a plan for that global batch); an even one nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from .. import runtime
from ..capture import split_arguments
from ..layout import MeshSpec, TensorSpec, to_placements
from .reshard import region
from ..strategy_search import profile_for
from .arguments import bind
from .planning import call_mesh, param_specs

__all__ = ["Rows", "UnevenInputs", "move_rows", "rows_of", "simulated_rows", "uneven_call", "uneven_inputs"]

Span = tuple[int, int]  # (first row, number of rows) of the global batch


@dataclass(frozen=True)
class Rows:
    """Where one batch input's rows are, per position in the call's ranks: ``have`` as the ranks passed them,
    ``want`` as the program's layout of ``total`` rows holds them; ``peers`` the positions that share the rows
    (the same other-axes coordinates), per position."""

    total: int
    have: tuple[Span, ...]
    want: tuple[Span, ...]
    peers: tuple[tuple[int, ...], ...]

    def back(self) -> "Rows":
        return Rows(self.total, self.want, self.have, self.peers)


def rows_of(counts: list[int], spec: TensorSpec, mesh_spec: MeshSpec, name: str) -> Rows:
    """The rows of one batch input whose ranks hold ``counts`` rows (per position in the call's ranks), split
    by ``spec`` on the call's mesh."""
    world = mesh_spec.world_size
    placements = to_placements(spec, mesh_spec)
    mesh = torch.arange(world).reshape(mesh_spec.shape)
    pieces = math.prod(a.size for a in spec.dims[0])
    split_dims = [d for d, p in enumerate(placements) if p == Shard(0)]
    index = [region((pieces,), mesh, p, placements)[0][0] for p in range(world)]  # which piece each rank holds

    def other_axes(p: int) -> tuple[int, ...]:
        coord = [int(c) for c in (mesh == p).nonzero()[0]]
        return tuple(c for d, c in enumerate(coord) if d not in split_dims)

    groups: dict[tuple, list[int]] = {}
    for p in range(world):
        groups.setdefault(other_axes(p), []).append(p)
    slices = [tuple(counts[p] for p in sorted(g, key=index.__getitem__)) for g in groups.values()]
    if len(set(slices)) > 1:
        raise ValueError(
            f"{name}: with dataset_strategy='data_parallel' ranks that hold the same piece of the batch (along the "
            f"mesh axes that do not split it) pass equal slices; the ranks passed {counts} rows (rank order). Give "
            "those ranks the same rows, or split the batch over every rank (in_strategy None)")
    total = sum(slices[0])
    have: list[Span] = [(0, 0)] * world
    for g in groups.values():
        start = 0
        for p in sorted(g, key=index.__getitem__):
            have[p] = (start, counts[p])
            start += counts[p]
    want = [region((total,), mesh, p, placements) for p in range(world)]
    peers = [tuple(groups[other_axes(p)]) for p in range(world)]
    return Rows(total, tuple(have), tuple((o[0], n[0]) for o, n in want), tuple(peers))


def _overlap(a: Span, b: Span) -> Span:
    start, end = max(a[0], b[0]), min(a[0] + a[1], b[0] + b[1])
    return (start, max(0, end - start))


def _move(t: torch.Tensor, rows: Rows, me: int, ranks: tuple[int, ...]) -> torch.Tensor:
    """This rank's rows in ``rows.want`` from its rows in ``rows.have``: point-to-point within its peers."""
    mine, wanted = rows.have[me], rows.want[me]
    out = t.new_empty((wanted[1], *t.shape[1:]))
    ops = []
    for q in rows.peers[me]:
        sent, got = _overlap(mine, rows.want[q]), _overlap(wanted, rows.have[q])
        if q == me:
            if got[1]:
                out[got[0] - wanted[0]:got[0] - wanted[0] + got[1]] = t[got[0] - mine[0]:got[0] - mine[0] + got[1]]
            continue
        if sent[1]:
            ops.append(dist.P2POp(dist.isend, t[sent[0] - mine[0]:sent[0] - mine[0] + sent[1]].contiguous(),
                                  ranks[q]))
        if got[1]:
            ops.append(dist.P2POp(dist.irecv, out[got[0] - wanted[0]:got[0] - wanted[0] + got[1]], ranks[q]))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _move_simulated(t: torch.Tensor, rows: Rows, ranks: tuple[int, ...]) -> torch.Tensor:
    """:func:`_move` in a simulated world: each rank's new rows cut from its peers' values."""

    def piece(r: int, values: dict[int, torch.Tensor]) -> torch.Tensor:
        p = ranks.index(r)
        wanted, parts = rows.want[p], []
        for q in sorted(rows.peers[p], key=lambda q: rows.have[q][0]):
            got = _overlap(wanted, rows.have[q])
            if got[1]:
                start = got[0] - rows.have[q][0]
                parts.append(values[ranks[q]][start:start + got[1]])
        return torch.cat(parts) if parts else values[r].new_empty((0, *values[r].shape[1:]))

    return runtime.simulated_map(t, piece)


class _MoveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, rows: Rows, me: int, ranks: tuple[int, ...]):
        ctx.save = (rows, me, ranks)
        return _move_simulated(t, rows, ranks) if runtime.is_simulated() else _move(t, rows, me, ranks)

    @staticmethod
    def backward(ctx, grad):
        rows, me, ranks = ctx.save
        if runtime.is_simulated():
            return _move_simulated(grad, rows.back(), ranks), None, None, None
        return _move(grad.contiguous(), rows.back(), me, ranks), None, None, None


def move_rows(t: torch.Tensor, rows: Rows, me: int, ranks: tuple[int, ...]) -> torch.Tensor:
    """``t`` (this rank's rows as ``rows.have`` says) in ``rows.want``'s pieces, with autograd. Every rank of
    the call calls it alike."""
    return _MoveRows.apply(t, rows, me, ranks)


def simulated_rows(engine, tensors: list) -> dict[int, tuple[int, ...]] | None:
    """In a simulated world, each rank's batch inputs' row counts where some differ between ranks (real ranks
    learn theirs in the agreement)."""
    if not runtime.is_simulated() or engine.config.dataset_strategy != "data_parallel":
        return None
    batch = [t for t in tensors if engine.in_batch(t)]
    counts = [runtime.simulated_counts(t.shape[0]) for t in batch]
    if all(c is None for c in counts):
        return None
    world = len(next(c for c in counts if c is not None))
    return {r: tuple(int(t.shape[0]) if c is None else c[r] for t, c in zip(batch, counts)) for r in range(world)}


@dataclass(frozen=True)
class UnevenInputs:
    """An uneven call's batch inputs moved to the rows the program for their global batch holds on each rank."""

    args: tuple
    kwargs: dict
    tensors: list  # the call's tensors, the batch inputs moved
    moves: dict[int, Rows]  # each batch input's rows, by tensor number
    held: tuple  # each tensor's held split
    me: int  # this rank's position in the call's ranks (simulated: 0, every rank's at once)
    ranks: tuple[int, ...]

    @property
    def batch(self) -> dict[int, int]:
        """Each batch input's global rows: the key and the bound call of the program for them."""
        return {j: where.total for j, where in self.moves.items()}


def uneven_inputs(engine, rows: dict[int, tuple[int, ...]], args, kwargs, tensors: list) -> UnevenInputs:
    """The call's batch inputs moved into the pieces of their global batch (``rows``: per global rank of the
    call, its batch inputs' row counts): as a call runs them, and as explain() plans them."""
    device = runtime.resolve_device(engine.config.device)
    world = engine.world(device)
    ranks = engine.ranks() or tuple(range(world))
    me = 0 if runtime.is_simulated() else ranks.index(dist.get_rank())  # (simulated: every rank's, at once)
    batch = [j for j, t in enumerate(tensors) if engine.in_batch(t)]
    with runtime.outside_simulation():  # (the held splits; the rows are the slices')
        call = bind(engine.config, engine.fn, engine.name, args, kwargs, world, rows=dict.fromkeys(batch, 0))
        mesh_spec = call_mesh(engine.config, [*call.held, *(f for f in call.fixed if f is not None),
                                              *param_specs(engine, world).values()], world,
                              profile_for(device).devices_per_node, engine.mesh_cuts)
    moves = {j: rows_of([rows[r][i] for r in ranks], call.held[j], mesh_spec, call.names[j])
             for i, j in enumerate(batch)}
    moved = list(tensors)
    for j, where in moves.items():
        moved[j] = move_rows(tensors[j], where, me, ranks)
    args, kwargs = split_arguments(args, kwargs)[2].rebuild(moved)
    return UnevenInputs(args, kwargs, moved, moves, call.held, me, ranks)


def uneven_call(engine, rows: dict[int, tuple[int, ...]], args, kwargs, tensors: list, arrived: tuple, start):
    """A call whose ranks passed batch slices of other lengths (``rows``: per global rank of the call, its batch
    inputs' row counts): run on their concatenation. The program is the one for that global batch, kept by the
    signature with the batch's rows. Returns the program and the outputs (those split as a batch input is, back
    in that input's slices)."""
    uneven = uneven_inputs(engine, rows, args, kwargs, tensors)
    args, kwargs, batch = uneven.args, uneven.kwargs, uneven.batch
    compiled, outs = engine.run(engine.key(args, kwargs, arrived, batch=batch), args, kwargs, uneven.tensors,
                                arrived, start, batch)
    plan, vals = compiled.plan, [n.meta["val"] for n in compiled.captured.output_nodes]
    outs = list(outs)
    for k, out in enumerate(outs):  # outputs split as a batch input is go back into that input's slices
        if plan.returns_dtensor[k] or plan.outputs[k] is None or not vals[k].dim():
            continue
        same = [where for j, where in uneven.moves.items() if where.total == vals[k].shape[0] and
                to_placements(uneven.held[j], compiled.planned.mesh_spec) == tuple(plan.outputs[k])]
        if same:
            outs[k] = move_rows(out, same[0].back(), uneven.me, uneven.ranks)
    return compiled, outs
