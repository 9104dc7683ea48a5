"""Parity checks: a sharded call's outputs and gradients equal single-device eager, rank by rank."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank


def _clone(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def _loss(out) -> torch.Tensor:
    leaves = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    # a fixed, non-uniform weighting so every output element's gradient differs
    return sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in leaves)


def check_parity(fn: Callable, make_args: Callable[[], Sequence], in_strategy, world: int = 4,
                 rtol: float = 1e-5, atol: float = 1e-5, seed: int = 0, **shard_kwargs):
    """Run ``fn`` sharded on a simulated world and eagerly; compare outputs and input gradients on every rank.

    Returns the sharded callable's plan so callers can also check what was planned.
    """
    with simulated_world(world):
        torch.manual_seed(seed)
        args = list(make_args())
        ref_args = _clone(args)
        sharded = sf.shard(fn, in_strategy, **shard_kwargs)
        torch.manual_seed(seed + 1)
        out = sharded(*args)
        torch.manual_seed(seed + 1)
        ref = fn(*ref_args)
        out_leaves = torch.utils._pytree.tree_leaves(out)
        ref_leaves = torch.utils._pytree.tree_leaves(ref)
        assert len(out_leaves) == len(ref_leaves)
        for r in range(world):
            for o, e in zip(out_leaves, ref_leaves):
                torch.testing.assert_close(on_rank(o, r), on_rank(e, r), rtol=rtol, atol=atol)
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            _loss(out).backward()
            _loss(ref).backward()
            for i, (a, e) in enumerate(zip(args, ref_args)):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    assert a.grad is not None, f"input {i} got no gradient"
                    for r in range(world):
                        torch.testing.assert_close(on_rank(a.grad, r), on_rank(e.grad, r), rtol=rtol, atol=atol)
        return sf.explain(sharded, *args)
