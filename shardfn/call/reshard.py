"""sf.reshard: a DTensor in another layout, on the same ranks or on other ones.

On the same ranks it is DTensor's redistribute. Across meshes (a stage's output going to the next stage's ranks)
each target rank's piece comes from one source rank that holds all of it, by a point-to-point send; where no
source rank holds a whole target piece, the source ranks first all-gather the tensor among themselves. The
backward sends each gradient piece back to the rank that sent it (one target rank per distinct piece: replicas
hold equal gradients), and the source ranks sum what they received over the dims they replicate on.

Every rank computes the same list of transfers from the two layouts alone, so all agree on who sends what.
Every rank of the world calls it (the target's process groups are made collectively the first time); ranks in
neither mesh then do nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import runtime
from ..layout import TensorLayout, common_mesh, normalize_strategy, to_placements

__all__ = ["outside_placeholder", "reshard", "transfers"]

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, length) per tensor dim


@torch.compiler.disable  # under torch.compile around it: a graph break, run as it is
def reshard(tensor: DTensor, layout: TensorLayout) -> DTensor:
    """``tensor`` laid out as ``layout`` (whose ``ranks`` may name other ranks than the tensor's mesh), with
    autograd: gradients flow back to where the tensor came from. Call it on every rank."""
    if not isinstance(tensor, DTensor):
        raise TypeError(f"sf.reshard: tensor must be a DTensor (a shard call with an out_strategy returns one), got "
                        f"{type(tensor).__name__}")
    if not isinstance(layout, TensorLayout):
        raise TypeError(f"sf.reshard: layout must be an sf.Layout(...)(...) tensor layout, got {layout!r}")
    device = tensor.device_mesh.device_type
    runtime.init(device=device)
    runtime.check_ranks(layout.ranks, "sf.reshard")
    ranks = layout.ranks or tuple(range(dist.get_world_size()))
    runtime.prepare_ranks(ranks, device)
    spec = normalize_strategy(layout, tuple(tensor.shape), len(ranks), "sf.reshard: layout", "the tensor")
    mesh_spec = common_mesh([spec], len(ranks), {layout.axis(n): n for n in layout.alias_name})
    target = runtime.device_mesh(mesh_spec, device, None if runtime.whole_world(ranks) else ranks)
    placements = to_placements(spec, mesh_spec)
    source = tensor.device_mesh
    if any(type(p) not in (Shard, Replicate) for p in tensor.placements):
        # pending sums resolve, and other kinds of split (strided) gather, on the source ranks first
        tensor = tensor.redistribute(source, [p if type(p) in (Shard, Replicate) else Replicate()
                                              for p in tensor.placements])
    if source.mesh.tolist() == target.mesh.tolist():
        if source != target:  # the same ranks in another mesh object (other dim names): relabel, no data moves
            tensor = DTensor.from_local(tensor.to_local(), target, tensor.placements, run_check=False,
                                        shape=tensor.shape, stride=tensor.stride())
        return tensor.redistribute(target, placements)
    return _CrossMesh.apply(tensor, target, tuple(placements))


def region(shape: tuple[int, ...], mesh: torch.Tensor, rank: int, placements) -> Region:
    """The part of a tensor of global ``shape`` that ``rank`` holds on ``mesh`` (DTensor's chunking: ceil-sized
    pieces, the last ones shorter or empty; nested splits of one dim outer mesh dim first)."""
    coord = [int(c) for c in (mesh == rank).nonzero()[0]]
    offset, length = [0] * len(shape), list(shape)
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            size = -(-length[p.dim] // mesh.shape[d])
            start = min(coord[d] * size, length[p.dim])
            offset[p.dim] += start
            length[p.dim] = min(size, length[p.dim] - start)
    return tuple(offset), tuple(length)


def _contains(outer: Region, inner: Region) -> bool:
    return all(o <= i and i + n <= o + m for o, m, i, n in zip(*outer, *inner))


def transfers(shape, source: torch.Tensor, source_placements, target: torch.Tensor, target_placements):
    """Who sends what: ``gathered`` (whether the source ranks all-gather first), each source rank's held region,
    and per target rank ``(target rank, source rank, region)``. The same on every rank."""
    src_ranks, dst_ranks = source.flatten().tolist(), target.flatten().tolist()
    held = {s: region(shape, source, s, source_placements) for s in src_ranks}
    wanted = {d: region(shape, target, d, target_placements) for d in dst_ranks}
    gathered = not all(any(_contains(held[s], r) for s in src_ranks) for r in wanted.values())
    if gathered:
        held = {s: ((0,) * len(shape), tuple(shape)) for s in src_ranks}
    moves, load = [], dict.fromkeys(src_ranks, 0)
    for i, d in enumerate(dst_ranks):
        holders = [s for s in src_ranks if _contains(held[s], wanted[d])]
        # a rank in both meshes keeps its own piece; otherwise the least busy holder, the i-th one first
        s = d if d in holders else min(holders, key=lambda h: (load[h], (src_ranks.index(h) - i) % len(src_ranks)))
        load[s] += 1
        moves.append((d, s, wanted[d]))
    return gathered, held, moves


def _piece(t: torch.Tensor, at: Region, within: Region) -> torch.Tensor:
    return t[tuple(slice(o - w, o - w + n) for o, n, w in zip(*at, within[0]))]


def _exchange(sends: list, recvs: list) -> None:
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def outside_placeholder(shape, dtype, mesh, placements) -> DTensor:
    """A DTensor of global ``shape`` on ``mesh`` that holds nothing on this rank (one outside ``mesh``: torch's
    convention for such ranks)."""
    return DTensor.from_local(torch.empty(0, dtype=dtype, device=runtime.mesh_device(mesh)), mesh, placements,
                              run_check=False, shape=torch.Size(shape), stride=_contiguous(shape))


def _contiguous(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


class _CrossMesh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, target, placements):
        source, me, shape = tensor.device_mesh, dist.get_rank(), tuple(tensor.shape)
        gathered, held, moves = transfers(shape, source.mesh, tensor.placements, target.mesh, placements)
        ctx.save = (source, tuple(tensor.placements), target, placements, gathered, held, moves, tensor.dtype)
        local = None
        if me in held:
            whole = tensor.redistribute(source, [Replicate()] * source.ndim) if gathered else tensor
            local = whole.to_local()
        out, sends, recvs = None, [], []
        for d, s, r in moves:
            if math.prod(r[1]) == 0:
                if d == me:
                    out = torch.empty(r[1], dtype=tensor.dtype, device=runtime.mesh_device(target))
                continue
            if s == me and d == me:
                out = _piece(local, r, held[me]).clone()
            elif s == me:
                sends.append((_piece(local, r, held[me]).contiguous(), d))
            elif d == me:
                out = torch.empty(r[1], dtype=tensor.dtype, device=runtime.mesh_device(target))
                recvs.append((out, s))
        _exchange(sends, recvs)
        if out is None:
            return outside_placeholder(shape, tensor.dtype, target, placements)
        return DTensor.from_local(out, target, placements, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous(shape))

    @staticmethod
    def backward(ctx, grad: DTensor):
        source, source_placements, target, placements, gathered, held, moves, dtype = ctx.save
        me, shape = dist.get_rank(), tuple(grad.shape)
        g = grad.redistribute(target, placements).to_local() if me in target.mesh.flatten().tolist() else None
        buf = torch.zeros(held[me][1], dtype=dtype, device=runtime.mesh_device(source)) if me in held else None
        sends, recvs, seen = [], [], set()
        for d, s, r in moves:
            if r in seen or math.prod(r[1]) == 0:  # one target rank per distinct piece sends its gradient
                continue
            seen.add(r)
            if s == me and d == me:
                _piece(buf, r, held[me]).add_(g)
            elif d == me:
                sends.append((g.contiguous(), s))
            elif s == me:
                recvs.append((torch.empty(r[1], dtype=dtype, device=buf.device), s, r, d))
        _exchange(sends, [(t, d) for t, _, _, d in recvs])
        for t, _, r, _ in recvs:
            _piece(buf, r, held[me]).add_(t)
        pending = [Partial()] * source.ndim if gathered else \
            [Partial() if p.is_replicate() else p for p in source_placements]
        if buf is None:
            return outside_placeholder(shape, dtype, source, source_placements), None, None
        summed = DTensor.from_local(buf, source, pending, run_check=False, shape=torch.Size(shape),
                                    stride=_contiguous(shape))
        return summed.redistribute(source, source_placements), None, None

