"""Modules sharded in place: attribute paths, state_dict, optimizers, training parity."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.models import GPTBlock, Net, NormedMLP, TiedLM

WORLD = 4


def _train(model, x, steps, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _assert_same_training(sharded, reference, x, steps=5, atol=2e-5):
    losses = _train(sharded, x, steps)
    ref_losses = _train(reference, x, steps)
    for r in range(WORLD):
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(on_rank(a, r), on_rank(b, r), rtol=1e-5, atol=atol)
        for (name, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters()):
            assert isinstance(p, DTensor), name
            torch.testing.assert_close(on_rank(p.full_tensor(), r), on_rank(q, r), rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{name}: {m}")


def _pair(make, plan):
    """(sharded, reference): a freshly seeded model and its sharded copy. Call inside a simulated world."""
    torch.manual_seed(0)
    reference = make()
    return sf.shard(copy.deepcopy(reference), **plan), reference


L = sf.Layout((2, 2), ("dp", "tp"))
GPT_PLANS = {
    "dp": dict(in_strategy=((4, 1, 1),)),
    "tp": dict(in_strategy=(None,), parameter_plan={
        "attn.q.weight": (4, 1), "attn.k.weight": (4, 1), "attn.v.weight": (4, 1),
        "attn.q.bias": (4,), "attn.v.bias": (4,),
        "attn.proj.weight": (1, 4), "fc.weight": (4, 1), "fc.bias": (4,), "out.weight": (1, 4)}),
    "dp_tp": dict(in_strategy=(L("dp", "None", "None"),), parameter_plan={
        "attn.q.weight": L("tp", "None"), "attn.k.weight": L("tp", "None"), "attn.v.weight": L("tp", "None"),
        "self.attn.proj.weight": L("None", "tp"), "fc.weight": L("tp", "None"), "fc.bias": L("tp"),
        "out.weight": L("None", "tp")}),
}


@pytest.mark.parametrize("name", sorted(GPT_PLANS))
def test_gpt_block_trains_like_single_process(name):
    with simulated_world(WORLD):
        model, reference = _pair(lambda: GPTBlock(dim=16, heads=4), GPT_PLANS[name])
        x = torch.randn(4, 8, 16)
        _assert_same_training(model, reference, x)
        if name != "dp":
            # tensor parallel: the column-parallel weights stay split as asked
            assert model.attn.q.weight.placements[-1] == Shard(0)
            assert model.out.weight.placements[-1] == Shard(1)


def test_a_whole_parameter_read_on_batch_pieces_gets_every_ranks_gradient():
    # an op run on each rank's batch piece (a Function, shardfn's own rules) reading a whole parameter: each rank's
    # gradient is only its piece's part (the temperature's gradient differed per rank, a quarter of eager's)
    from tests.functions import LearnedTemperature

    with simulated_world(WORLD):
        model, reference = _pair(LearnedTemperature, dict(in_strategy=((4, 1),)))
        _assert_same_training(model, reference, torch.randn(8, 4), steps=3)


def test_module_keeps_paths_keys_and_class_behaviour():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        net = Net()
        keys = list(net.state_dict())
        net.block1 = sf.shard(net.block1, in_strategy=((4, 1),), parameter_plan={"dense2.weight": (4, 1)})
        assert list(net.state_dict()) == keys
        assert isinstance(net.block1, type(Net().block1))  # still a BasicBlock
        w = net.block1.dense2.weight
        assert isinstance(w, DTensor) and w.placements == (Shard(0),)
        assert on_rank(w.to_local(), 0).shape == (8, 64)  # only this rank's shard
        assert not isinstance(net.block2.dense1.weight, DTensor)  # other blocks untouched


def test_unsharded_state_dict_loads_into_sharded_module():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        source = GPTBlock()
        model = sf.shard(GPTBlock(), in_strategy=((4, 1, 1),), parameter_plan={"fc.weight": (4, 1)})
        model.load_state_dict(source.state_dict())
        for (name, p), (_, q) in zip(model.named_parameters(), source.named_parameters()):
            torch.testing.assert_close(on_rank(p.full_tensor(), 2), on_rank(q, 2), msg=name)
        assert model.fc.weight.placements == (Shard(0),)


def test_mindspore_shard_cell_net_trains():
    with simulated_world(8):
        torch.manual_seed(0)
        reference = Net()
        net = copy.deepcopy(reference)
        net.block1 = sf.shard(net.block1, in_strategy=((8, 1),), parameter_plan={"dense2.weight": (8, 1)})
        net.block2 = sf.shard(net.block2, in_strategy=((1, 8),))
        x = torch.randn(16, 32)
        losses, ref_losses = _train(net, x, 3), _train(reference, x, 3)
        for a, b in zip(losses, ref_losses):
            torch.testing.assert_close(on_rank(a, 5), on_rank(b, 5), rtol=1e-5, atol=2e-5)


def test_parameter_grad_is_reduced_to_parameter_placements():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        net = sf.shard(Net().block1, in_strategy=((4, 1),))
        x = torch.randn(8, 32)
        net(x).sum().backward()
        for name, p in net.named_parameters():
            assert isinstance(p.grad, DTensor), name
            assert p.grad.placements == p.placements, name
            assert not any(pl.is_partial() for pl in p.grad.placements)


def test_dropout_module_in_train_and_eval():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = GPTBlock(dropout=0.2)
        model = sf.shard(copy.deepcopy(reference), in_strategy=((4, 1, 1),))
        x = torch.randn(4, 8, 16)
        torch.manual_seed(5)
        y = model(x)
        torch.manual_seed(5)
        ref = reference(x)
        torch.testing.assert_close(on_rank(y, 3), on_rank(ref, 3), rtol=1e-5, atol=1e-5)
        model.eval()
        reference.eval()
        torch.testing.assert_close(on_rank(model(x), 1), on_rank(reference(x), 1), rtol=1e-5, atol=1e-5)


def test_a_second_input_signature_keeps_the_first_plans_parameter_layouts():
    # the first call lays the free parameters out; a call with a new shape gets its own program, planned with
    # those layouts fixed, so the first program stays valid and both agree with eager
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = Net().block1
        block = sf.shard(copy.deepcopy(reference), in_strategy=((4, 1),))
        small, large = torch.randn(8, 32), torch.randn(16384, 32)  # alone, these plan different layouts
        block(small)
        layouts = {n: p.placements for n, p in block.named_parameters()}
        block(large)
        assert {n: p.placements for n, p in block.named_parameters()} == layouts
        for x in (small, large, small):
            torch.testing.assert_close(on_rank(block(x), 1), on_rank(reference(x), 1), rtol=1e-5, atol=1e-5)


NORMED_PLANS = {
    "dp": dict(in_strategy=((4, 1),)),  # batch split: statistics over the whole batch, as eager
    "tp": dict(in_strategy=(None,), parameter_plan={"fc1.weight": (4, 1), "bn.weight": (4,), "bn.bias": (4,),
                                                    "fc2.weight": (1, 4)}),
}


def assert_same_buffers(model, reference, rank=None):
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        b = b.full_tensor() if isinstance(b, DTensor) else b
        if rank is not None:
            b, c = on_rank(b, rank), on_rank(c, rank)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", sorted(NORMED_PLANS))
def test_batch_norm_updates_running_statistics_like_eager(name):
    # BatchNorm's kernel updates running_mean/var without saying so in its schema: the update must reach the
    # module's buffers, computed from the whole batch, whatever the layout
    with simulated_world(WORLD):
        model, reference = _pair(NormedMLP, NORMED_PLANS[name])
        x = torch.randn(8, 16)
        _assert_same_training(model, reference, x, steps=3)
        for r in range(WORLD):
            assert_same_buffers(model, reference, r)
        model.eval()
        reference.eval()
        for r in range(WORLD):
            torch.testing.assert_close(on_rank(model(x), r), on_rank(reference(x), r), rtol=1e-5, atol=2e-5)


TIED_PLANS = {
    "dp": dict(in_strategy=((4, 1),)),
    "vocab_parallel": dict(in_strategy=(None,), parameter_plan={"head.weight": (4, 1)}),  # named by its alias
}


@pytest.mark.parametrize("name", sorted(TIED_PLANS))
def test_tied_weights_stay_one_parameter(name):
    with simulated_world(WORLD):
        model, reference = _pair(TiedLM, TIED_PLANS[name])
        assert model.head.weight is model.emb.weight
        ids = torch.randint(0, 16, (8, 4))

        def train(m):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            for _ in range(3):
                torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
                opt.step()
                opt.zero_grad()

        train(model)
        train(reference)
        assert model.head.weight is model.emb.weight
        for r in range(WORLD):
            torch.testing.assert_close(on_rank(model.emb.weight.full_tensor(), r), on_rank(reference.emb.weight, r),
                                       rtol=1e-5, atol=2e-5)
        if name == "vocab_parallel":
            assert model.emb.weight.placements[-1] == Shard(0)
        other = TiedLM()
        model.load_state_dict(other.state_dict())  # an unsharded state_dict: both names of the tied weight
        assert model.head.weight is model.emb.weight
        torch.testing.assert_close(on_rank(model.emb.weight.full_tensor(), 0), on_rank(other.emb.weight, 0))


def test_tied_weight_given_two_strategies_is_refused():
    with simulated_world(WORLD):
        with pytest.raises(ValueError, match="one tied parameter"):
            sf.shard(TiedLM(), in_strategy=(None,), parameter_plan={"head.weight": (4, 1), "emb.weight": (1, 4)})
