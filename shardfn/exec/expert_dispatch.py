"""Experts split over a mesh dim whose ranks split the tokens too: each (token, slot) pair goes to the rank of
that dim holding its expert, is computed there and comes back (all_to_all, with this step's counts): the
all-to-all token dispatcher of torchtitan and Megatron-Core, exact and dropless.

A plan says so per MoEExperts call (run mode ``dispatch``, strategy_search.expert_rules): over mesh dim m the
tokens, their top-k experts and weights and the result are split on the token dim, the experts on the expert dim.
Each rank holds its tokens and its experts. A pair whose expert no rank of m's group holds (the experts are split
along another mesh dim too, whose ranks hold the same tokens) adds nothing here: the result is that dim's pending
sum, as in the experts' gather layout.

Forward, on each rank: the group's experts (all_gather of each rank's first id and count), each pair's owner, the
pairs' counts per owner (all_to_all), the pairs' token rows with their expert and weight (one all_to_all: their
bytes side by side), transformers' experts on the pairs received (capture.experts), the weighted rows back
(all_to_all), summed by token. Backward dispatches again with the result's gradient beside each token row, runs
the experts' backward where they are held and sends back each pair's token and weight gradients; the expert
weights' gradients stay with them. Nothing is kept between the two (the forward runs once more in backward, as
MoEExperts' does).

The steps are written once, as a generator that yields each exchange (:func:`_forward_steps`,
:func:`_backward_steps`); real ranks answer them with collectives on the group, and a simulated world
(LocalTensorMode: every rank's values in one process) answers them for all ranks of each group at once
(_simulation_internals.world_op).
"""

from __future__ import annotations

from typing import Generator

import torch
from torch.utils.flop_counter import register_flop_formula

from .. import _simulation_internals as _simulation
from .._functional_collectives import all_gather_tensor, all_to_all_single, wait_tensor
from ..capture._function_internals import autograd_inside_an_op
from ..capture.experts import _moe_flops, _run_experts
from ..strategy_search.expert_rules import dispatch_dims

__all__ = ["MoEDispatch", "dispatched"]

# one exchange a step asks for: ("experts", (first, count)) -> every group rank's, in group order; ("swap", rows,
# counts, expected) -> (rows received, counts received): ``rows`` tensors whose first dim lists the pairs by
# destination, ``counts`` (group size,) how many go to each rank, ``expected`` how many come from each where
# known (the way back: what this rank sent there), else None (exchanged first)
Steps = Generator[tuple, object, object]


class _Route:
    """Where this rank's (token, slot) pairs go: the pairs held by the group, sorted by owner."""

    def __init__(self, index: torch.Tensor, firsts_counts: list[torch.Tensor]):
        k = index.size(1)
        table = _owner_table(firsts_counts, index.device)
        ids = index.reshape(-1)
        owner = table[ids.clamp(0, table.numel() - 1)].masked_fill(ids >= table.numel(), -1)
        held = (owner >= 0).nonzero().squeeze(1)
        self.order = held[torch.argsort(owner[held], stable=True)]  # flat (token * k + slot) pair numbers
        self.token = torch.div(self.order, k, rounding_mode="floor")
        self.ids = ids[self.order]
        self.counts = torch.bincount(owner[self.order], minlength=len(firsts_counts))


def _owner_table(firsts_counts: list[torch.Tensor], device) -> torch.Tensor:
    """Each expert id's owner (its rank in the group), -1 where none of the group holds it."""
    ranges = [(int(fc[0]), int(fc[1])) for fc in firsts_counts]
    table = torch.full((max([f + c for f, c in ranges] + [1]),), -1, dtype=torch.int64, device=device)
    for rank, (first, count) in enumerate(ranges):
        table[first:first + count] = rank
    return table


def _first_and_count(experts: torch.Tensor) -> torch.Tensor:
    """This rank's experts as (first global id, count): a rank holds a contiguous run of them."""
    first = experts[:1].to(torch.int64) if experts.numel() else experts.new_zeros(1, dtype=torch.int64)
    return torch.cat([first, first.new_tensor([experts.numel()])])


def _forward_steps(hidden, index, weights, experts, gate_up, down, act: str, impl: str) -> Steps:
    route = _Route(index, (yield ("experts", _first_and_count(experts))))
    sent = [hidden[route.token], route.ids.unsqueeze(1), weights.reshape(-1, 1)[route.order]]
    (rows, ids, pair_weights), counts = yield ("swap", sent, route.counts, None)
    out = _run_experts(rows, ids, pair_weights, experts, gate_up, down, act, impl)
    (back,), _ = yield ("swap", [out], counts, route.counts)
    return hidden.new_zeros(hidden.shape).index_add(0, route.token, back)


def _backward_steps(grad, hidden, index, weights, experts, gate_up, down, act: str, impl: str) -> Steps:
    route = _Route(index, (yield ("experts", _first_and_count(experts))))
    sent = [hidden[route.token], grad[route.token], route.ids.unsqueeze(1), weights.reshape(-1, 1)[route.order]]
    (rows, grad_rows, ids, pair_weights), counts = yield ("swap", sent, route.counts, None)
    ins = [rows.requires_grad_(), pair_weights.requires_grad_(), gate_up.detach().requires_grad_(),
           down.detach().requires_grad_()]
    grads = [torch.zeros_like(t) for t in ins]
    if experts.numel() and rows.size(0):
        with autograd_inside_an_op(), torch.enable_grad():
            out = _run_experts(ins[0], ids, ins[1], experts, ins[2], ins[3], act, impl)
            found = torch.autograd.grad(out, ins, grad_rows.to(out.dtype), allow_unused=True)
        grads = [z if g is None else g for g, z in zip(found, grads)]
    (grad_hidden_rows, grad_weights_rows), _ = yield ("swap", grads[:2], counts, route.counts)
    grad_hidden = hidden.new_zeros(hidden.shape).index_add(0, route.token, grad_hidden_rows.to(hidden.dtype))
    grad_weights = weights.new_zeros(weights.numel()).index_put((route.order,),
                                                               grad_weights_rows.squeeze(1).to(weights.dtype))
    return grad_hidden, grad_weights.view(weights.shape), grads[2], grads[3]


# --- real ranks: the group's collectives --------------------------------------------------------------------

def _on_group(steps: Steps, group: str):
    """Run ``steps`` on this rank, answering each exchange with collectives over ``group``."""
    try:
        ask = next(steps)
        while True:
            ask = steps.send(_group_experts(ask[1], group) if ask[0] == "experts" else _swapped(*ask[1:], group))
    except StopIteration as done:
        return done.value


def _group_experts(first_and_count: torch.Tensor, group: str) -> list[torch.Tensor]:
    # (small, every call: a group name may be made again for other ranks in a later world of this process)
    return list(wait_tensor(all_gather_tensor(first_and_count, 0, group)).view(-1, 2))


def _swapped(rows: list[torch.Tensor], counts: torch.Tensor, expected: torch.Tensor | None, group: str):
    """``rows`` sent by ``counts`` (their bytes side by side: one all_to_all whatever their dtypes), after the
    counts each rank receives are exchanged where not ``expected``."""
    received = expected if expected is not None else wait_tensor(all_to_all_single(counts, None, None, group))
    send, recv = counts.tolist(), received.tolist()  # this step's counts: one host read a swap
    packed = torch.cat([r.contiguous().view(torch.uint8) for r in rows], dim=1)
    got = wait_tensor(all_to_all_single(packed, recv, send, group))
    widths = [r.size(1) * r.element_size() for r in rows]
    return [piece.contiguous().view(r.dtype) for piece, r in zip(got.split(widths, dim=1), rows)], received


# --- a simulated world: every rank of each group at once -----------------------------------------------------

def _in_world(make_steps, per_rank: dict) -> dict:
    """Each rank's result of the steps ``make_steps(*args)`` makes, every group's ranks run in lockstep and their
    exchanges answered from each other's values, as the collectives would."""
    any_args = next(iter(per_rank.values()))[0]
    results = {}
    for ranks in _simulation.group_rank_lists(any_args[-1]):
        ranks = [r for r in ranks if r in per_rank]
        steps = {r: make_steps(*per_rank[r][0][:-1]) for r in ranks}
        asks = {r: next(s) for r, s in steps.items()}
        while asks:
            answers = _world_answers(ranks, asks)
            asks = {}
            for r in ranks:
                try:
                    asks[r] = steps[r].send(answers[r])
                except StopIteration as done:
                    results[r] = done.value
    return results


def _world_answers(ranks: list[int], asks: dict) -> dict:
    if asks[ranks[0]][0] == "experts":
        gathered = [asks[r][1] for r in ranks]
        return {r: list(gathered) for r in ranks}
    pieces = {r: [list(t.split(asks[r][2].tolist())) for t in asks[r][1]] for r in ranks}  # [tensor][dest]
    answers = {}
    for j, r in enumerate(ranks):
        received = [torch.cat([pieces[src][i][j] for src in ranks]) for i in range(len(asks[r][1]))]
        answers[r] = (received, torch.stack([asks[src][2][j] for src in ranks]))
    return answers


# --- the ops ------------------------------------------------------------------------------------------------

@torch.library.custom_op("shardfn::moe_dispatch", mutates_args=())
def moe_dispatch(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, act: str, impl: str, group: str) -> torch.Tensor:
    with torch.no_grad():
        return _on_group(_forward_steps(hidden, index, weights, experts, gate_up, down, act, impl), group)


@moe_dispatch.register_fake
def _(hidden, index, weights, experts, gate_up, down, act, impl, group):
    return torch.empty_like(hidden)


@torch.library.custom_op("shardfn::moe_dispatch_backward", mutates_args=())
def moe_dispatch_backward(grad: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                          experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, impl: str,
                          group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _on_group(_backward_steps(grad, hidden, index, weights, experts, gate_up, down, act, impl), group)


@moe_dispatch_backward.register_fake
def _(grad, hidden, index, weights, experts, gate_up, down, act, impl, group):
    return tuple(torch.empty_like(t) for t in (hidden, weights, gate_up, down))


def _forward_in_world(per_rank: dict) -> dict:
    with torch.no_grad():
        return _in_world(_forward_steps, per_rank)


_simulation.world_op(torch.ops.shardfn.moe_dispatch.default, _forward_in_world)
_simulation.world_op(torch.ops.shardfn.moe_dispatch_backward.default,
                     lambda per_rank: _in_world(_backward_steps, per_rank))


def _dispatch_flops(hidden, index, weights, experts, gate_up, down, act=None, impl=None, group=None, **kw) -> int:
    return _moe_flops(hidden, index, weights, experts, gate_up, down)  # the rank's own pairs, on average


register_flop_formula(torch.ops.shardfn.moe_dispatch)(_dispatch_flops)


class MoEDispatch(torch.autograd.Function):
    """``moe_dispatch`` with its gradient (tokens, routing weights, both expert weights) over process group
    ``group`` (by name): MoEExperts' arguments, run on each rank's tokens and experts."""

    @staticmethod
    def forward(ctx, hidden, index, weights, experts, gate_up, down, act: str, impl: str, group: str):
        ctx.save_for_backward(hidden, index, weights, experts, gate_up, down)
        ctx.names = (act, impl, group)
        return torch.ops.shardfn.moe_dispatch(hidden, index, weights, experts, gate_up, down, act, impl, group)

    @staticmethod
    def backward(ctx, grad):
        hidden, index, weights, experts, gate_up, down = ctx.saved_tensors
        gh, gw, ggu, gd = torch.ops.shardfn.moe_dispatch_backward(grad.contiguous(), hidden, index, weights,
                                                                  experts, gate_up, down, *ctx.names)
        return gh, None, gw, None, ggu, gd, None, None, None


def dispatched(call, inputs, mesh):
    """What runs ``call`` (a MoEExperts node's target: capture.functions.FunctionCall) planned with these inputs'
    placements (run mode ``dispatch``) on each rank's pieces: MoEDispatch over its dispatch mesh dim's group."""
    (dim,) = dispatch_dims(inputs)
    group = mesh.get_group(dim).group_name

    def run(*tensors):
        args, kwargs = call.arguments(tensors)
        return [MoEDispatch.apply(*args, *kwargs.values(), group)]

    return run
