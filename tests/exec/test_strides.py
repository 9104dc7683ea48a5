"""Layouts in memory: a piece redistributed or computed locally may be strided otherwise than the captured value
was, and views recorded at capture must still work on it."""

import torch
import torch.nn.functional as F

from torch.distributed.tensor import Shard

import shardfn as sf
from tests.harness import on_rank
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


def test_a_piece_of_one_element_along_a_dim_is_laid_out_whole_as_its_other_dims_say():
    # a dim of one element on every rank has any stride (a fake kernel gives it another than the real one): it
    # does not order the whole's dims, so a contiguous piece has contiguous global strides
    from shardfn.exec.run import global_stride
    from shardfn.runtime import simulated_world

    with simulated_world(4, local_tensors=False):
        mesh, heads = sf.init(), (Shard(2),)
        piece = torch.randn(B, 1, T, D).transpose(1, 2)  # (B, T, 1, D), contiguous, its third dim's stride T * D
        assert piece.is_contiguous()
        assert global_stride(piece, (B, T, H, D), heads, mesh) == (T * H * D, H * D, D, 1)
        # two heads a rank: their order in memory is the piece's
        two = torch.randn(B, 2, T, D).transpose(1, 2)
        assert global_stride(two, (B, T, 2 * H, D), heads, mesh) == (T * 2 * H * D, D, T * D, 1)
        # split unevenly, one element or none on each rank: the same on every rank; the other dims transposed
        piece = torch.randn(D, T, 1).permute(2, 1, 0)
        assert global_stride(piece, (3, T, D), (Shard(0),), mesh) == (T * D, 1, T)


def test_a_view_of_a_piece_whose_dim_of_one_element_is_strided_out_of_order():
    # exec's own steps before a view recorded at capture: the piece as a DTensor in a layout of the call's
    # (from_local; DTensor.from_local would lay the piece out afresh), made contiguous for the view
    # (interpret), then DTensor's view, which checks the global strides
    from shardfn.exec.pieces import contiguous, from_local
    from shardfn.runtime import simulated_world

    with simulated_world(4):
        mesh = sf.init()
        piece = torch.randn(B, 1, T, D).transpose(1, 2)  # one head of (B, H, T, D), transposed
        d = contiguous(from_local(piece, mesh, (Shard(2),), torch.empty(B, T, H, D, device="meta"), {}))
        out = d.view(B, T, H * D)
        assert out.placements == (Shard(2),)
        for r in range(4):
            torch.testing.assert_close(on_rank(out, r), on_rank(piece.reshape(B, T, D), r))


def packed_heads(x):
    # q, k, v from one (B, T, 3, H, D) tensor, as a fused qkv projection gives them: attention's result is laid
    # out as (B, T, H, D), so the reshape back is recorded as a view; on H ranks each holds one head
    q, k, v = x.permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(B, T, H * D)


PACKED = dict(in_strategy=((1, 4, 1, 1, 1),), out_strategy=((1, 1, 4),))  # the output split as the heads


def _packed_heads_parity(ranks: int = 1) -> None:
    """On each of ``ranks`` ranks (this one, or a simulated world's): the plan keeps one head per rank up to the
    view, and the output and the input's gradient equal eager's."""
    torch.manual_seed(0)
    x = torch.randn(B, T, 3, H, D, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    sharded = sf.shard(packed_heads, **PACKED)
    plan = sf.explain(sharded, x)
    views = [n for n in plan.nodes.values() if n.op == "aten.view.default" and n.shapes == ((B, T, H * D),)]
    assert [n.inputs[0] for n in views] == [(Shard(2),)], plan  # the view reads a piece of one head
    weights = torch.linspace(-1, 1, B * T * H * D).reshape(B, T, H * D)
    for _ in range(2):  # the first call traces (real ranks); the second runs the traced graphs
        x.grad = None
        out = sharded(x)
        (out.full_tensor() * weights).sum().backward()
    ref = packed_heads(ref_x)
    (ref * weights).sum().backward()
    for r in range(ranks):
        torch.testing.assert_close(on_rank(out.full_tensor(), r), on_rank(ref, r), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(on_rank(x.grad, r), on_rank(ref_x.grad, r), rtol=1e-5, atol=1e-5)


def test_a_view_of_one_head_per_rank_after_attention_simulated():
    # (passes without the fix: the simulated world interprets the program over the CPU kernel, whose one-head
    # result keeps its dims in order; the traced program of real ranks gets the fake kernel's: the test below)
    from shardfn.runtime import simulated_world

    with simulated_world(4):
        _packed_heads_parity(4)


def test_a_view_of_one_head_per_rank_after_attention_on_real_ranks(gloo4):
    # real ranks trace the program with attention's fake kernel, whose result strides its one-head dim otherwise
    # than the CPU kernel does (the simulated world's): samples/meta_init.py's plan on 4 torchrun ranks
    gloo4.run(_packed_heads_parity)
