"""Batch slices of different lengths under dataset_strategy="data_parallel" (shardfn.call.uneven_batch): the call
runs on the whole batch, with eager's results and gradients, on real gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from shardfn.layout import Axis, MeshSpec, TensorSpec
from shardfn.runtime import simulated_world
from shardfn.call.uneven_batch import rows_of
from tests.harness import on_rank


class _Net(nn.Module):
    """A batch statistic (batch norm) and a mean loss over the batch: both see the whole batch, or differ."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x, target):
        y = self.down(torch.relu(self.norm(self.up(x))))
        return y, F.mse_loss(y, target)


def _piece_rows(counts: list[int], pieces: list[int]) -> list[int]:
    """Rows per piece of the batch, from each rank's count and the piece it holds."""
    return [counts[pieces.index(i)] for i in range(max(pieces) + 1)]


def _slices(whole: torch.Tensor, counts: list[int], pieces: list[int]) -> torch.Tensor:
    """This rank's slice of the batch (the batch's pieces in order; ``pieces``: the piece each rank holds)."""
    me = pieces[dist.get_rank()]
    start = sum(_piece_rows(counts, pieces)[:me])
    return whole[start:start + counts[dist.get_rank()]].clone()


def _uneven_steps(counts_per_step, tensor_parallel=False):
    """Steps whose ranks pass slices of these lengths; per step whether this rank's outputs, the loss and every
    gradient equal eager's on the whole batch, and the captures made."""
    torch.manual_seed(0)
    reference = _Net()
    in_strategy, parameter_plan = (None, None), None
    if tensor_parallel:  # the batch split over "dp" (ranks 0,1 and 2,3 hold the same piece), the hidden over "tp"
        mesh = sf.Layout((2, 2), ("dp", "tp"))
        in_strategy = (mesh("dp", "None"), mesh("dp", "None"))
        parameter_plan = {"up.weight": mesh("tp", "None"), "up.bias": mesh("tp"), "down.weight": mesh("None", "tp")}
    model = sf.shard(copy.deepcopy(reference), in_strategy=in_strategy, parameter_plan=parameter_plan,
                     dataset_strategy="data_parallel")
    results = []
    pieces = [0, 0, 1, 1] if tensor_parallel else [0, 1, 2, 3]
    for counts in counts_per_step:
        rows = sum(_piece_rows(counts, pieces))
        x, target = torch.randn(rows, 6), torch.randn(rows, 3)
        mine = _slices(x, counts, pieces).requires_grad_()
        y, loss = model(mine, _slices(target, counts, pieces))
        loss.backward()
        ref_x = x.clone().requires_grad_()
        ref_y, ref_loss = reference(ref_x, target)
        ref_loss.backward()
        same = y.shape[0] == counts[dist.get_rank()] and \
            torch.allclose(y, _slices(ref_y.detach(), counts, pieces), atol=1e-5)
        same &= torch.allclose(loss.detach(), ref_loss.detach(), atol=1e-6)
        same &= torch.allclose(mine.grad, _slices(ref_x.grad, counts, pieces), atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            same &= torch.allclose(g, q.grad, atol=1e-5)
        same &= torch.allclose(model.norm.running_mean.full_tensor() if hasattr(model.norm.running_mean,
                                                                                 "full_tensor")
                               else model.norm.running_mean, reference.norm.running_mean, atol=1e-6)
        model.zero_grad()
        reference.zero_grad()
        results.append(bool(same))
    return results, sf.engine_of(model).captures


def test_an_epochs_last_batch_and_an_empty_slice_match_eager(gloo4):
    # even, then the last batch of an epoch (2, 2, 1, 1: moved into 2, 2, 2, 0), one rank with nothing, even again
    steps = [[4, 4, 4, 4], [2, 2, 1, 1], [3, 0, 3, 3], [4, 4, 4, 4], [2, 2, 1, 1]]
    for results, captures in gloo4.run(_uneven_steps, steps):
        assert results == [True] * len(steps)
        assert captures == 3  # the even batch, and one program per global batch of the uneven ones


def test_uneven_slices_with_a_tensor_parallel_axis(gloo4):
    # a 2 x 2 mesh: the batch split over the first axis (rank pairs 0,1 and 2,3 hold the same piece), the
    # hidden layer over the second
    steps = [[3, 3, 1, 1], [2, 2, 2, 2]]
    for results, _ in gloo4.run(_uneven_steps, steps, True):
        assert results == [True, True]


class _Attention(nn.Module):
    """Grouped-query attention of 6 heads over 2 (whose heads do not divide 4 ranks: the mesh is cut 2 x 2)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(6, 24), nn.Linear(6, 16), nn.Linear(24, 3)

    def forward(self, x, target):
        q = self.q(x).view(-1, 4, 6, 4).transpose(1, 2)  # rows of 4 tokens each: (rows, heads, tokens, head dim)
        k, v = self.kv(x).view(-1, 4, 2, 8).transpose(1, 2).chunk(2, dim=-1)
        y = self.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2)).mean(1)
        return y, F.mse_loss(y, target)


@pytest.mark.parametrize("net", [_Net, _Attention])
def test_simulated_ranks_run_an_uneven_batch_as_real_ones_do(net):
    # _Attention: the batch over "dp" (ranks 0-3 hold one piece, 4-7 the other), attention's heads over a part of
    # "tp" (the mesh cut 2 x 2 x 2): the program's mesh is finer than the one the rows are moved on
    from torch.distributed._local_tensor import local_tensor_mode

    world, counts, starts = ((4, [2, 2, 1, 1], [0, 2, 4, 5]) if net is _Net else
                             (8, [3] * 4 + [1] * 4, [0] * 4 + [3] * 4))
    with simulated_world(world):
        torch.manual_seed(0)
        reference = net()
        layout = sf.Layout((2, 4), ("dp", "tp"))
        in_strategy = (None, None) if net is _Net else (layout("dp", "None", "None"), layout("dp", "None"))
        # (_Attention: planned in shard(), so that its parameters may lie on the cut mesh)
        example = None if net is _Net else (torch.empty(3, 4, 6, device="meta"), torch.empty(3, 3, device="meta"))
        model = sf.shard(copy.deepcopy(reference), in_strategy=in_strategy, dataset_strategy="data_parallel",
                         example_inputs=example)
        rows = max(s + c for s, c in zip(starts, counts))
        x, target = torch.randn(rows, 6) if net is _Net else torch.randn(rows, 4, 6), torch.randn(rows, 3)
        mine = local_tensor_mode().rank_map(lambda r: on_rank(x, r)[starts[r]:starts[r] + counts[r]].clone())
        theirs = local_tensor_mode().rank_map(lambda r: on_rank(target, r)[starts[r]:starts[r] + counts[r]].clone())
        mine.requires_grad_()
        y, loss = model(mine, theirs)
        loss.backward()
        ref_x = x.clone().requires_grad_()
        ref_y, ref_loss = reference(ref_x, target)
        ref_loss.backward()
        for r in range(world):
            rows = slice(starts[r], starts[r] + counts[r])
            torch.testing.assert_close(on_rank(y, r), on_rank(ref_y, r)[rows])
            torch.testing.assert_close(on_rank(loss, r), on_rank(ref_loss, r))
            torch.testing.assert_close(on_rank(mine.grad, r), on_rank(ref_x.grad, r)[rows])
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                torch.testing.assert_close(on_rank(g, r), on_rank(q.grad, r), msg=lambda m: f"{name}: {m}")
        if net is _Attention:
            assert sf.explain(model, mine, theirs).mesh.shape == (2, 2, 2)


def _replicas_disagree():
    # ranks 0 and 1 hold the same piece of the batch (the other axis is tensor parallel) but pass other lengths
    try:
        _uneven_steps([[3, 2, 1, 1]], tensor_parallel=True)
    except ValueError as e:
        return str(e)
    return "ran"


def test_replicas_of_a_piece_that_pass_other_lengths_are_an_error_on_every_rank(gloo4):
    for message in gloo4.run(_replicas_disagree):
        assert "ranks that hold the same piece of the batch" in message and "[3, 2, 1, 1]" in message, message


def test_where_rows_go():
    mesh = MeshSpec((Axis(4, 1),), ("d0",))
    rows = rows_of([2, 2, 1, 1], TensorSpec(((Axis(4, 1),), ())), mesh, "input 0")
    assert rows.total == 6
    assert rows.have == ((0, 2), (2, 2), (4, 1), (5, 1))
    assert rows.want == ((0, 2), (2, 2), (4, 2), (6, 0))  # torch.chunk(6 rows, 4): 2, 2, 2, 0
    assert rows.back().want == rows.have
