"""Gradient accumulation without sync (sf.no_sync): micro-steps sum their gradients locally, the next synced call
reduces them once; the gradients equal eager's accumulated over every micro-batch. Real ranks, where the traced
backward graphs are counted: tests/exec/test_gloo.py."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import Partial, Replicate

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.models import GPTBlock

WORLD = 4


def _slice(t):
    per = t.shape[0] // WORLD
    return local_tensor_mode().rank_map(lambda r: on_rank(t, r)[per * r: per * (r + 1)].clone())


def accumulate(model, reference, batches, world, slice_of, inside):
    """``inside`` micro-steps in no_sync, the rest after it, against eager on the whole batches; the placements
    of the gradients after the micro-steps inside."""
    for x in batches:
        reference(x).square().mean().backward()
    with sf.no_sync(model):
        for x in batches[:inside]:
            (model(slice_of(x)).square().mean() / world).backward()
    pending = {n: tuple(p.grad.placements) for n, p in model.named_parameters()}
    for x in batches[inside:]:
        (model(slice_of(x)).square().mean() / world).backward()
    return pending


def test_micro_steps_sum_locally_and_the_next_call_reduces_once():
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = GPTBlock(16, 4)
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
        batches = [torch.randn(8, 4, 16) for _ in range(3)]
        pending = accumulate(model, reference, batches, WORLD, _slice, inside=2)
        assert set(pending.values()) == {(Partial(),)}  # summed locally, not reduced
        for name, q in reference.named_parameters():
            p = model.get_parameter(name)
            assert tuple(p.grad.placements) == (Replicate(),)
            g = p.grad.full_tensor()
            for r in range(WORLD):
                torch.testing.assert_close(on_rank(g, r), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_split_parameter_is_still_reduce_scattered_at_every_micro_step():
    # level 1 splits the weights: their gradients go to their pieces at once (never kept whole), the rest waits
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = GPTBlock(16, 4)
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel", level=1)
        batches = [torch.randn(8, 4, 16) for _ in range(2)]
        pending = accumulate(model, reference, batches, WORLD, _slice, inside=1)
        for name, placements in pending.items():
            own = tuple(model.get_parameter(name).placements)
            assert placements == tuple(Partial() if p.is_replicate() else p for p in own), name
        for name, q in reference.named_parameters():
            g = model.get_parameter(name).grad.full_tensor()
            torch.testing.assert_close(on_rank(g, 0), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_no_sync_takes_sharded_modules_only():
    with simulated_world(2):
        f = sf.shard(lambda x: x * 2, in_strategy=((2, 1),))
        with pytest.raises(TypeError, match="no_sync takes sharded modules"):
            sf.no_sync(f)
