"""A split moved from one tensor dim to another by one all_to_all, on CPU ranks too.

DTensor moves ``Shard(i) -> Shard(j)`` on a mesh dim with one all_to_all, except on a CPU process group, where it
gathers the whole value on every rank and cuts the new piece out of it (gloo had no all_to_all when that was
written; it has one now, uneven splits included). A data-parallel batch that is transposed, or scanned along its
split dim, would so be held whole on every rank for a moment and move n times the bytes the plan priced
(strategy_search.cost_model prices the all_to_all). Here the move is one all_to_all of the pieces, forward and
backward (where it runs the other way), wherever DTensor would gather; a simulated world keeps DTensor's own
all_to_all op.

The move is this rank's piece cut along dim j in the mesh dim's pieces (DTensor's: ``torch.chunk``'s sizes,
empty pieces last), each part sent to the rank whose piece of dim j it is, the parts received joined along dim
i in rank order. It applies where one mesh dim changes, from ``Shard(i)`` to ``Shard(j)``, and no other mesh dim
splits dim i or dim j (then the received parts are whole rows of the new piece).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from .._functional_collectives import all_to_all_single, wait_tensor
from .._simulation_internals import local_tensor_mode

__all__ = ["move_piece", "split_move"]


def split_move(x: DTensor, placements: tuple[Placement, ...]) -> tuple[int, int, int] | None:
    """(mesh dim, from dim, to dim) where bringing ``x`` to ``placements`` moves one split between two tensor
    dims no other mesh dim splits and DTensor would gather for it (a CPU mesh, real ranks); else None (DTensor's
    redistribute does it)."""
    if x.device_mesh.device_type != "cpu" or local_tensor_mode() is not None:
        return None
    current, target, ndim = tuple(x.placements), tuple(placements), x.dim()
    changed = [m for m, (p, q) in enumerate(zip(current, target)) if p != q]
    if len(changed) != 1:
        return None
    (m,) = changed
    p, q = current[m], target[m]
    if type(p) is not Shard or type(q) is not Shard:  # (a strided split is DTensor's to move)
        return None
    i, j = p.dim % ndim, q.dim % ndim
    others = [r for k, r in enumerate(current) if k != m and isinstance(r, Shard)]
    if i == j or any(r.dim % ndim in (i, j) for r in others):
        return None
    return m, i, j


def _chunks(size: int, n: int) -> list[int]:
    """The sizes of ``size`` split ``n`` ways as DTensor splits it (``torch.chunk``'s, empty pieces last)."""
    full = -(-size // n)
    return [max(0, min(size, full * (k + 1)) - full * k) for k in range(n)]


def move_piece(piece: torch.Tensor, shape, mesh, m: int, i: int, j: int) -> torch.Tensor:
    """This rank's piece split on dim ``i`` over mesh dim ``m`` -> its piece split on dim ``j`` (``shape``: the
    whole value's)."""
    n, me = mesh.size(m), mesh.get_local_rank(m)
    along_i, along_j = _chunks(shape[i], n), _chunks(shape[j], n)
    parts = torch.split(piece, along_j, dim=j)
    send = torch.cat([p.reshape(-1) for p in parts])
    rest = math.prod(s for k, s in enumerate(piece.shape) if k not in (i, j))
    sizes = [rest * along_i[r] * along_j[me] for r in range(n)]
    received = wait_tensor(all_to_all_single(send, sizes, [p.numel() for p in parts], (mesh, m)))
    block = list(piece.shape)
    block[j] = along_j[me]
    blocks = []
    for r, rows in enumerate(received.split(sizes)):
        block[i] = along_i[r]
        blocks.append(rows.view(block))
    return torch.cat(blocks, dim=i)
