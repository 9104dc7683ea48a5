"""Layouts in memory: a piece redistributed or computed locally may be strided otherwise than the captured value
was, and views recorded at capture must still work on it."""

import torch
import torch.nn.functional as F

import shardfn as sf
from tests.models import GPTBlock
from tests.parity import check_parity

B, T, H, D = 4, 8, 4, 8


def heads_scaled(x, c):
    q = x.view(B, T, H, D).transpose(1, 2)  # a transposed view
    y = q * c  # follows q's strides in eager
    return y.transpose(1, 2).contiguous().view(B, T, H * D)  # contiguous() was a no-op at capture: not recorded


def test_a_view_recorded_on_a_contiguous_value_works_after_redistribution():
    # x split along T and c along heads: one of them is redistributed for the multiply
    plan = check_parity(heads_scaled, lambda: (torch.randn(B, T, H * D, requires_grad=True),
                                               torch.randn(B, H, T, D, requires_grad=True)),
                        ((1, 4, 1), (1, 4, 1, 1)), world=4)
    assert plan.count("all_to_all") + plan.count("all_gather") > 0  # the case needs a redistribution


def attention_out(q, k, v):
    # the CPU flash kernel returns (B, H, T, D) laid out as (B, T, H, D)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, H * D)


def test_a_kernel_laying_out_its_result_otherwise_keeps_later_views_valid():
    args = lambda: [torch.randn(B, H, T, D, requires_grad=True) for _ in range(3)]  # noqa: E731
    for strategy in [(1, 4, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1)]:
        check_parity(attention_out, args, (strategy, None, None), world=4)


def test_a_world_of_one_plans_no_split_and_no_collective():
    block = GPTBlock(dim=16, heads=4)
    plan = sf.explain(block, torch.randn(2, 8, 16), in_strategy=(None,), world_size=1)
    placements = {p for n in plan.nodes.values() for pl in (*n.inputs, *n.outputs) if pl for p in pl}
    assert all(p.is_replicate() for p in placements), placements
    assert plan.collectives == ()
