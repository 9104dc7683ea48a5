"""sf.shard_optimizer: optimizer states (stage 1) and gradients (stage 2) split over the ranks the parameters are
whole on; training equals torch's optimizer on the unsharded model. Real ranks, checkpoints of the split states
loaded into another world size: tests/exec/test_gloo.py."""

import contextlib
import copy

import pytest
import torch
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from shardfn.runtime import simulated_world
from shardfn.strategy_search.pricing import parameter_copies
from tests.test_modules import GPT_PLANS, L
from tests.harness import on_rank
from tests.models import GPTBlock

WORLD = 4


def _slice(t):
    per = t.shape[0] // WORLD
    return local_tensor_mode().rank_map(lambda r: on_rank(t, r)[per * r: per * (r + 1)].clone())


def train_both(stage, world, slice_of, steps=3, micro=1, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
               **shard_kwargs):
    """A data-parallel GPT block with a sharded optimizer (AdamW, or ``optimizer(params)``) against the unsharded
    one; the sharded model and optimizer. ``world``: the number of batch slices; ``micro`` > 1: that many
    micro-batches a step, all but the last inside sf.no_sync; ``shard_kwargs`` go to sf.shard (in_strategy too)."""
    torch.manual_seed(0)
    reference = GPTBlock(16, 4)
    model = sf.shard(copy.deepcopy(reference), **{"in_strategy": (None,), "dataset_strategy": "data_parallel",
                                                  **shard_kwargs})
    opt = sf.shard_optimizer(optimizer(model.parameters()), model, stage=stage)
    ref_opt = optimizer(reference.parameters())
    for step in range(steps):
        for m in range(micro):
            torch.manual_seed(10 * step + m)
            x = torch.randn(8, 4, 16)
            reference(x).square().mean().backward()
            with sf.no_sync(model) if m < micro - 1 else contextlib.nullcontext():
                (model(slice_of(x)).square().mean() / world).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return model, opt, reference, ref_opt


def _step_both(model, opt, reference, ref_opt, x):
    """One step of the data-parallel model on this rank's rows of ``x`` and of the unsharded one on all of it."""
    (model(_slice(x)).square().mean() / WORLD).backward()
    reference(x).square().mean().backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def _assert_trained_alike(model, reference, ranks):
    for name, q in reference.named_parameters():
        whole = model.get_parameter(name).full_tensor()
        for r in range(ranks):
            # AdamW divides a gradient by its magnitude: a near-zero one summed in another order moves up to lr
            torch.testing.assert_close(on_rank(whole, r), q.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage, micro", [(1, 1), (2, 1), (2, 3)], ids=["stage1", "stage2", "stage2-no_sync"])
def test_sharded_adamw_trains_like_torch_and_keeps_pieces(stage, micro):
    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(stage, WORLD, _slice, micro=micro)
        _assert_trained_alike(model, reference, WORLD)
        # each rank holds its piece of every state (dim 0 split over the 4 ranks), the unsharded optimizer's own
        # (AdamW would hide gradients scaled alike in the parameters; not in its moments)
        for piece, q in zip(opt.pieces, reference.parameters()):
            for name in ("exp_avg", "exp_avg_sq"):
                state = opt.state[piece][name]
                assert tuple(state.placements) == (Shard(0),)
                torch.testing.assert_close(on_rank(state.full_tensor(), 1), ref_opt.state[q][name], rtol=1e-4,
                                           atol=1e-6)
        if stage == 2:  # gradients went to the pieces; no rank keeps a parameter's whole gradient
            assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
], ids=["sgd-momentum-foreach", "adam-for-loop", "adamw-fused"])
def test_torch_optimizers_foreach_and_fused_step_the_pieces(optimizer):
    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(2, WORLD, _slice, optimizer=optimizer)
        _assert_trained_alike(model, reference, WORLD)
        piece, q = opt.pieces[0], next(reference.parameters())
        states = {n: v for n, v in opt.state[piece].items() if isinstance(v, DTensor) and v.dim()}
        assert states, opt.state[piece]  # momentum or moments: pieces, holding the unsharded optimizer's values
        for name, state in states.items():
            assert tuple(state.placements) == (Shard(0),), name
            torch.testing.assert_close(on_rank(state.full_tensor(), 0), ref_opt.state[q][name], rtol=1e-4, atol=1e-6)


class _OwnAdamW(torch.optim.AdamW):
    """A user's optimizer: torch's AdamW's step, but a type shard_optimizer cannot know is elementwise."""


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer, local", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2), True),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), True),
    (lambda ps: _OwnAdamW(ps, lr=1e-2), False),
], ids=["adamw", "sgd-nesterov", "subclass"])
def test_elementwise_optimizers_step_local_tensors_others_dtensors(optimizer, local, stage):
    # an elementwise step runs on each rank's local tensors (no DTensor dispatch per op) and its states are pieces
    # again after it; any other optimizer (here a subclass, whose step may read more than an element) steps the
    # DTensors
    made, kinds = [], []

    def spied(ps):
        made.append(optimizer(ps))
        if len(made) == 1:  # (the sharded optimizer's inner one; the next is the unsharded reference's)
            made[0].register_step_pre_hook(
                lambda o, *_: kinds.append({isinstance(p, DTensor) for g in o.param_groups for p in g["params"]}))
        return made[-1]

    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(stage, WORLD, _slice, optimizer=spied)
        _assert_trained_alike(model, reference, WORLD)
        for piece in opt.pieces:
            states = [v for v in opt.state[piece].values() if isinstance(v, torch.Tensor) and v.dim() == piece.dim()]
            assert states and all(isinstance(v, DTensor) and v.placements == piece.placements for v in states)
    assert kinds == [{not local}] * 3, kinds


def test_the_plan_knows_the_split_states_and_reduce_scatters():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        plans = {}
        for stage in (0, 1, 2):
            model = sf.shard(GPTBlock(16, 4), in_strategy=(None,), dataset_strategy="data_parallel")
            if stage:
                sf.shard_optimizer(torch.optim.AdamW(model.parameters()), model, stage=stage)
            plans[stage] = sf.explain(model, _slice(torch.randn(8, 4, 16)))
    peaks = [plans[s].cost.peak_bytes for s in (0, 1, 2)]
    assert peaks[0] > peaks[1] > peaks[2], peaks  # states split, then gradients too
    assert plans[2].count("reduce_scatter", "backward") == plans[0].count("all_reduce", "backward") > 0
    assert plans[2].count("all_reduce", "backward") == 0


def test_misuse_is_a_clear_error():
    with simulated_world(2):
        model = sf.shard(GPTBlock(16, 4), in_strategy=(None,), dataset_strategy="data_parallel")
        opt = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match="stage must be 1 .* or 2 .*stage 3, parameters split too, is "
                                             r"sf.shard\(..., level=1\)"):
            sf.shard_optimizer(opt, model, stage=3)
        with pytest.raises(TypeError, match="GPTBlock is not a sharded module"):
            sf.shard_optimizer(opt, GPTBlock(16, 4))
        stranger = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match=r"1 of the optimizer's parameters \(shapes \[\(3,\)\]\) are not "
                                             "parameters of the sharded modules given"):
            sf.shard_optimizer(torch.optim.SGD([stranger, *model.parameters()]), model)
        sharded = sf.shard_optimizer(opt, model)
        with pytest.raises(TypeError, match="not already sharded"):
            sf.shard_optimizer(sharded, model)


# data x tensor parallelism (Megatron) on a 2 x 2 (dp, tp) mesh: rank r holds batch row r // 2
MEGATRON = dict(in_strategy=(L("dp", "None", "None"),), parameter_plan=GPT_PLANS["dp_tp"]["parameter_plan"])
# each parameter's states on a rank: column-parallel weights (dim 0 split over tp) split on dim 1 over dp, the
# row-parallel ones (dim 1 over tp) on dim 0; a tensor-parallel bias, split on its only dim already, whole over dp
MEGATRON_STATES = {"attn.q.weight": (8, 8), "attn.k.weight": (8, 8), "attn.v.weight": (8, 8),
                   "fc.weight": (32, 8), "fc.bias": (32,), "out.weight": (8, 32), "attn.proj.weight": (8, 8),
                   "attn.q.bias": (8,), "ln1.weight": (8,), "out.bias": (8,)}


def _dp_row(t):
    return local_tensor_mode().rank_map(lambda r: on_rank(t, r)[4 * (r // 2): 4 * (r // 2) + 4].clone())


@pytest.mark.parametrize("stage", [1, 2])
def test_megatron_column_parallel_states_are_split_over_data_parallel_ranks(stage):
    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(stage, 2, _dp_row, steps=2, **MEGATRON)
        _assert_trained_alike(model, reference, WORLD)
        names = {id(p): n for n, p in model.named_parameters()}
        for p, piece, q in zip(opt.params, opt.pieces, reference.parameters()):
            name = names[id(p)]
            assert (piece is p) == (name == "fc.bias"), name
            for key in ("exp_avg", "exp_avg_sq"):
                state = opt.state[piece][key]
                assert tuple(state.placements) == tuple(piece.placements), name
                if name in MEGATRON_STATES:
                    assert all(tuple(on_rank(state, r).shape) == MEGATRON_STATES[name] for r in range(WORLD)), name
                torch.testing.assert_close(on_rank(state.full_tensor(), 3), ref_opt.state[q][key], rtol=1e-4,
                                           atol=1e-6, msg=lambda m: f"{name} {key}: {m}")
        assert tuple(opt.pieces[list(names.values()).index("attn.q.weight")].placements) == (Shard(1), Shard(0))
        # the plan's memory model splits the states of the parameters the optimizer splits, and only those
        for p, piece in zip(opt.params, opt.pieces):
            assert (parameter_copies(p.placements, (2, 2), stage, p.dim()) == 4.0) == (piece is p), names[id(p)]



@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_smaller_than_the_world_in_a_simulated_world(stage):
    # nn.Linear(8, 1)'s bias has pieces of 1, 0, 0, 0 elements on 4 ranks: in a simulated world a piece's size
    # differs per rank, which the step's gather once wrote through a slice assignment that LocalTensorMode refuses
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
        opt = sf.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, stage=stage)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for _ in range(3):
            _step_both(model, opt, reference, ref_opt, torch.randn(8, 16))
        _assert_trained_alike(model, reference, WORLD)
        bias = opt.pieces[-1]
        assert [on_rank(opt.state[bias]["exp_avg"], r).numel() for r in range(WORLD)] == [1, 0, 0, 0]
        torch.testing.assert_close(on_rank(opt.state[bias]["exp_avg"].full_tensor(), 2),
                                   ref_opt.state[reference[2].bias]["exp_avg"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", [1])  # (stage 2 differs in where gradients go, not in the pieces)
def test_weights_loaded_after_wrapping_are_what_the_step_starts_from(stage):
    # the pieces are views of the parameters: a load after sf.shard_optimizer (or after a step) is not undone by
    # the next step, which steps the loaded weights as torch's AdamW steps them
    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(stage, WORLD, _slice, steps=1)
        torch.manual_seed(7)
        loaded = GPTBlock(16, 4)
        model.load_state_dict(loaded.state_dict())
        reference.load_state_dict(loaded.state_dict())
        torch.manual_seed(8)
        _step_both(model, opt, reference, ref_opt, torch.randn(8, 4, 16))
        _assert_trained_alike(model, reference, WORLD)


@pytest.mark.parametrize("stage", [2])
def test_an_lr_set_after_load_state_dict_reaches_the_step(stage):
    with simulated_world(WORLD):
        model, opt, _, _ = train_both(stage, WORLD, _slice, steps=1)
        opt.load_state_dict(opt.state_dict())  # (torch's load_state_dict replaces the inner groups)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr 0 from now on
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        assert [g["lr"] for g in opt.param_groups] == [0.0]
        (model(_slice(torch.randn(8, 4, 16))).square().mean()).backward()
        opt.step()
        scheduler.step()
        for n, p in model.named_parameters():
            assert torch.equal(on_rank(p.full_tensor(), 0), on_rank(before[n], 0)), n
        # param_groups and state are over the model's parameters, as torch's optimizers' are
        params = list(model.parameters())
        assert opt.param_groups[0]["params"] == params and set(opt.state) == set(params)


def test_torch_checkpoint_apis_read_and_write_a_sharded_optimizer():
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    with simulated_world(WORLD):
        model, opt, reference, ref_opt = train_both(2, WORLD, _slice, steps=2)
        names = {p: n for n, p in reference.named_parameters()}
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        assert set(full["state"]) == set(names.values())
        for q, name in names.items():  # whole, keyed by parameter names: the unsharded AdamW's
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(on_rank(full["state"][name][key], 3), ref_opt.state[q][key], rtol=1e-4,
                                           atol=1e-6)
        sharded = get_optimizer_state_dict(model, opt)
        assert all(isinstance(s["exp_avg"], DTensor) for s in sharded["state"].values())
        # a fresh model and sharded optimizer take the whole states: each rank keeps its slice
        fresh, fresh_opt, _, _ = train_both(2, WORLD, _slice, steps=0)
        set_optimizer_state_dict(fresh, fresh_opt, full, options=StateDictOptions(full_state_dict=True))
        for (name, p), piece in zip(fresh.named_parameters(), fresh_opt.pieces):
            got = fresh_opt.state[p]["exp_avg"]
            assert got.placements == piece.placements, name
            torch.testing.assert_close(on_rank(got.full_tensor(), 1), on_rank(full["state"][name]["exp_avg"], 1))
