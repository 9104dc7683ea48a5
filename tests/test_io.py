"""Inputs and outputs: data-parallel slices, DTensor inputs, DTensor outputs in out_strategy's layout."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardfn as sf
from shardfn.layout import Axis, MeshSpec
from shardfn.runtime import device_mesh, simulated_world
from tests.harness import on_rank
from tests.models import BasicBlock


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def test_data_parallel_inputs_and_outputs_are_rank_slices():
    # every positional tensor is this rank's slice of the batch; parameters live in the module
    world = 4
    with simulated_world(world):
        torch.manual_seed(0)
        reference = BasicBlock(dim=6, hidden=8)
        block = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
        whole = torch.randn(4 * world, 6)
        # rank r holds rows [4r, 4r + 4) of the global batch
        x = local_tensor_mode().rank_map(lambda r: on_rank(whole, r)[4 * r : 4 * r + 4].clone())
        y = block(x)
        ref = reference(whole)
        for r in range(world):
            torch.testing.assert_close(on_rank(y, r), on_rank(ref, r)[4 * r : 4 * r + 4])
        # each rank's loss is over its slice; gradients are reduced over the whole batch
        y.sum().backward()
        ref.sum().backward()
        for (name, p), (_, q) in zip(block.named_parameters(), reference.named_parameters()):
            for r in range(world):
                torch.testing.assert_close(on_rank(p.grad.full_tensor(), r), on_rank(q.grad, r), rtol=1e-5,
                                           atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_out_strategy_returns_dtensors_in_that_layout():
    with simulated_world(4):
        torch.manual_seed(0)
        x, w1, w2 = torch.randn(8, 6), torch.randn(6, 8), torch.randn(8, 4)
        f = sf.shard(mlp, in_strategy=((4, 1), None, None), out_strategy=((1, 4),))
        y = f(x, w1, w2)
        assert isinstance(y, DTensor)
        assert tuple(y.placements) == (Shard(1),)
        ref = mlp(x, w1, w2)
        torch.testing.assert_close(on_rank(y.full_tensor(), 2), on_rank(ref, 2))
        assert on_rank(y.to_local(), 2).shape == (8, 1)


def test_dtensor_inputs_keep_their_layout():
    with simulated_world(4):
        torch.manual_seed(0)
        mesh = device_mesh(MeshSpec((Axis(4, 1),), ("d0",)), "cpu")
        x = torch.randn(8, 6)
        w1 = torch.randn(6, 8, requires_grad=True)
        w2 = torch.randn(8, 4)
        xd = distribute_tensor(x, mesh, [Shard(0)])
        w1d = distribute_tensor(w1.detach(), mesh, [Shard(1)]).requires_grad_()
        f = sf.shard(mlp, in_strategy=(None, None, None))
        y = f(xd, w1d, w2)
        plan = sf.explain(f, xd, w1d, w2)
        assert plan.nodes["arg0_1"].outputs[0] == (Shard(0),)
        assert plan.nodes["arg1_1"].outputs[0] == (Shard(1),)
        rw1 = w1.detach().clone().requires_grad_()
        ref = mlp(x, rw1, w2)
        torch.testing.assert_close(on_rank(y, 1), on_rank(ref, 1))
        y.sum().backward()
        ref.sum().backward()
        assert isinstance(w1d.grad, DTensor)
        torch.testing.assert_close(on_rank(w1d.grad.full_tensor(), 3), on_rank(rw1.grad, 3), rtol=1e-5, atol=1e-5)


def test_non_tensor_arguments_and_outputs_pass_through():
    def scaled(x, k, *, bias=0.0):
        return x * k + bias, k

    with simulated_world(4):
        f = sf.shard(scaled, in_strategy=((4, 1), None))
        x = torch.randn(8, 2)
        y, k = f(x, 3, bias=1.0)
        assert k == 3
        torch.testing.assert_close(on_rank(y, 0), on_rank(x * 3 + 1.0, 0))


def _scale_in_place(x, w):
    x.mul_(2)  # an update of the caller's tensor, as a module's forward updates its buffers
    return x @ w


def test_in_place_update_of_an_input_reaches_the_callers_tensor():
    with simulated_world(4):
        torch.manual_seed(0)
        x, w = torch.randn(8, 4), torch.randn(4, 8)
        ref_x = x.clone()
        ref = _scale_in_place(ref_x, w)
        y = sf.shard(_scale_in_place, in_strategy=(None, (1, 4)))(x, w)
        for r in range(4):
            torch.testing.assert_close(on_rank(y, r), on_rank(ref, r))
            torch.testing.assert_close(on_rank(x, r), on_rank(ref_x, r))


@pytest.mark.parametrize("strategy", [(4, 1), (2, 2), (1, 4)])
def test_in_place_update_of_an_input_laid_out_otherwise_is_written_back(strategy):
    # x arrives whole, is split as asked, updated in its pieces and written back whole into the caller's tensor
    with simulated_world(4):
        torch.manual_seed(0)
        x, w = torch.randn(8, 4), torch.randn(4, 8)
        ref_x = x.clone()
        ref = _scale_in_place(ref_x, w)
        y = sf.shard(_scale_in_place, in_strategy=(strategy, None))(x, w)
        for r in range(4):
            torch.testing.assert_close(on_rank(y, r), on_rank(ref, r))
            torch.testing.assert_close(on_rank(x, r), on_rank(ref_x, r))
