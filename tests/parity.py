"""Parity checks: a sharded call's outputs and gradients equal single-device eager, rank by rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

import shardfn as sf
from shardfn.capture.structure import split
from shardfn.runtime import simulated_world
from tests.harness import on_rank


@dataclass
class Call:
    """Positional and keyword arguments of one call (tensors anywhere inside them)."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _clone(tree):
    return pytree.tree_map_only(torch.Tensor, lambda a: a.detach().clone().requires_grad_(a.requires_grad), tree)


def tensors_of(out) -> list[torch.Tensor]:
    """The tensors in an output, in containers and plain objects alike (the order shardfn rebuilds them in)."""
    return split(out)[0]


def _loss(out) -> torch.Tensor:
    leaves = [o for o in tensors_of(out) if o.is_floating_point()]
    # a fixed, non-uniform weighting so every output element's gradient differs
    return sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in leaves)


def _as_call(made: Any) -> Call:
    return made if isinstance(made, Call) else Call(tuple(made))


def check_parity(fn: Callable, make_args: Callable[[], Any], in_strategy, world: int = 4,
                 rtol: float = 1e-5, atol: float = 1e-5, seed: int = 0, **shard_kwargs):
    """Run ``fn`` sharded on a simulated world and eagerly; compare outputs and input gradients on every rank.

    ``make_args()`` returns the positional arguments, or a :class:`Call` with keyword arguments too. Returns the
    sharded callable's plan so callers can also check what was planned.
    """
    with simulated_world(world):
        torch.manual_seed(seed)
        call = _as_call(make_args())
        ref_call = _clone(call)
        sharded = sf.shard(fn, in_strategy, **shard_kwargs)
        torch.manual_seed(seed + 1)
        out = sharded(*call.args, **call.kwargs)
        torch.manual_seed(seed + 1)
        ref = fn(*ref_call.args, **ref_call.kwargs)
        compare(out, ref, call, ref_call, world, rtol, atol)
        return sf.explain(sharded, *call.args, kwargs=call.kwargs)


def compare(out, ref, call: Call, ref_call: Call, ranks: int, rtol: float, atol: float,
            backward: bool = False) -> None:
    """Outputs equal on each of ``ranks`` ranks; then, after a backward of both (where an input requires grad, or
    ``backward``), every input's gradient."""
    out_leaves, ref_leaves = tensors_of(out), tensors_of(ref)
    assert len(out_leaves) == len(ref_leaves)
    for r in range(ranks):
        for o, e in zip(out_leaves, ref_leaves):
            torch.testing.assert_close(on_rank(o, r), on_rank(e, r), rtol=rtol, atol=atol)
    inputs = [a for a in pytree.tree_leaves((call.args, call.kwargs)) if isinstance(a, torch.Tensor)]
    ref_inputs = [a for a in pytree.tree_leaves((ref_call.args, ref_call.kwargs)) if isinstance(a, torch.Tensor)]
    if not (backward or any(a.requires_grad for a in inputs)):
        return
    _loss(out).backward()
    _loss(ref).backward()
    for i, (a, e) in enumerate(zip(inputs, ref_inputs)):
        if a.requires_grad:
            assert a.grad is not None, f"tensor input {i} got no gradient"
            for r in range(ranks):
                torch.testing.assert_close(on_rank(a.grad, r), on_rank(e.grad, r), rtol=rtol, atol=atol)


def check_module_parity(make_module: Callable[[], torch.nn.Module], make_args: Callable[[], Any], in_strategy,
                        world: int = 4, rtol: float = 1e-5, atol: float = 1e-5, seed: int = 0, **shard_kwargs):
    """``make_module()`` sharded on a simulated world against an unsharded copy: outputs, input gradients and
    parameter gradients equal on every rank. Returns the plan."""
    import copy

    with simulated_world(world):
        torch.manual_seed(seed)
        reference = make_module()
        sharded = sf.shard(copy.deepcopy(reference), in_strategy, **shard_kwargs)
        call = _as_call(make_args())
        ref_call = _clone(call)
        out = sharded(*call.args, **call.kwargs)
        ref = reference(*ref_call.args, **ref_call.kwargs)
        compare(out, ref, call, ref_call, world, rtol, atol, backward=True)
        for (name, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            for r in range(world):
                torch.testing.assert_close(on_rank(p.grad.full_tensor(), r), on_rank(q.grad, r), rtol=rtol,
                                           atol=atol, msg=lambda m: f"{name}: {m}")
        return sf.explain(sharded, *call.args, kwargs=call.kwargs)


def check_parity_here(fn: Callable, make_args: Callable[[], Any], in_strategy, rtol: float = 1e-5,
                      atol: float = 1e-5, seed: int = 0, **shard_kwargs):
    """:func:`check_parity` on the ranks this process is one of (real ranks run the traced, post-pass graphs):
    outputs and input gradients of the sharded call equal eager on this rank. Returns the sharded callable."""
    torch.manual_seed(seed)
    call = _as_call(make_args())
    ref_call = _clone(call)
    sharded = sf.shard(fn, in_strategy, **shard_kwargs)
    for _ in range(2):  # the first call traces; the second runs the cached graphs
        torch.manual_seed(seed + 1)
        out = sharded(*call.args, **call.kwargs)
    torch.manual_seed(seed + 1)
    ref = fn(*ref_call.args, **ref_call.kwargs)
    compare(out, ref, call, ref_call, 1, rtol, atol)
    return sharded
