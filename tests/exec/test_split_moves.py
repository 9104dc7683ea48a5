"""exec.split_moves: a split moved between tensor dims by one all_to_all on real gloo ranks, where DTensor gathers.
Each move's pieces, its whole value and its gradient equal DTensor's own redistribute of the same value (and the
value the whole tensor cut as DTensor cuts it), even and uneven, on a mesh of 4 and on 2 x 2 with the other mesh
dim replicated, split on a third dim or pending."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from shardfn.exec.pieces import redistribute
from shardfn.exec.split_moves import split_move

# (mesh shape, global shape, from placements, to placements)
CASES = [
    ((4,), (8, 12), (Shard(0),), (Shard(1),)),
    ((4,), (8, 12), (Shard(1),), (Shard(0),)),
    ((4,), (6, 5), (Shard(0),), (Shard(1),)),  # uneven both ways (2, 2, 2, 0) -> (2, 2, 1, 0)
    ((4,), (3, 4, 10), (Shard(2),), (Shard(0),)),  # a dim between; one rank holds no rows after
    ((2, 2), (4, 6, 8), (Replicate(), Shard(0)), (Replicate(), Shard(2))),
    ((2, 2), (4, 6, 8), (Shard(1), Shard(0)), (Shard(1), Shard(2))),
    ((2, 2), (4, 6, 8), (Shard(0), Shard(1)), (Shard(2), Shard(1))),
    ((2, 2), (5, 7, 3), (Partial(), Shard(0)), (Partial(), Shard(1))),  # a pending sum moved as it is
]


def _moves():
    failures = []
    for k, (mesh_shape, shape, src, dst) in enumerate(CASES):
        mesh = init_device_mesh("cpu", mesh_shape)
        torch.manual_seed(k)
        whole = torch.randn(shape)
        if any(p.is_partial() for p in src):  # each rank's piece of its own addend of a pending sum
            mine = distribute_tensor(whole + dist.get_rank(), mesh, [Replicate() if p.is_partial() else p
                                                                     for p in src], src_data_rank=None)
            x = DTensor.from_local(mine.to_local(), mesh, src, run_check=False, shape=mine.shape,
                                   stride=mine.stride())
        else:
            x = distribute_tensor(whole, mesh, src)
        if split_move(x, dst) is None:
            failures.append((k, "not moved by split_moves"))
            continue
        ours = x.detach().requires_grad_()
        theirs = x.detach().requires_grad_()
        got, want = redistribute(ours, dst), theirs.redistribute(mesh, dst)
        if tuple(got.placements) != dst or not torch.equal(got.to_local(), want.to_local()) \
                or got.shape != want.shape:
            failures.append((k, "forward", got.to_local().shape, want.to_local().shape))
            continue
        weights = distribute_tensor(torch.randn(shape), mesh, [Replicate() if p.is_partial() else p for p in dst])
        (got * weights).sum().backward()
        (want * weights).sum().backward()
        if not torch.allclose(ours.grad.full_tensor(), theirs.grad.full_tensor()):
            failures.append((k, "backward"))
    return failures


def test_split_moves_equal_dtensors_redistribute(gloo4):
    assert gloo4.run(_moves) == [[]] * 4
