"""A fill made whole only to be cut to a piece is made as the piece (exec.filled_pieces), with the same values."""

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

import shardfn as sf
from shardfn.exec.filled_pieces import fill_pieces

aten = torch.ops.aten


def _fills(gm) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target is aten.new_zeros.default]


def test_zeros_cut_to_a_piece_are_made_as_the_piece_with_the_same_result():
    # what DTensor's backward of a gather runs where the plan splits its input 4 ways (on 2 x 2): zeros of the
    # whole, a piece cut on each mesh dim and copied, then the scatter-add into it
    def backward_like(grad, index):
        zeros = grad.new_zeros([8, 16])
        piece = zeros.split(4)[1].clone().split(2)[0].clone()
        return piece.scatter_add(1, index, grad)

    grad, index = torch.randn(2, 1), torch.randint(0, 16, (2, 1))
    gm = make_fx(backward_like)(grad, index)
    expected = gm(grad, index)
    assert _fills(gm) == [(8, 16)]
    fill_pieces(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert _fills(gm) == [(2, 16)]
    assert not [n for n in gm.graph.nodes if n.target in (aten.split.Tensor, aten.clone.default)]
    assert torch.equal(gm(grad, index), expected)


def test_a_fill_read_whole_or_cut_to_a_strided_piece_stays():
    def read_whole(x):
        zeros = x.new_zeros([8, 4])
        return zeros.split(4)[0].clone() + 1, zeros.sum()

    def strided(x):
        return x.new_ones([8, 4])[:, ::2] + x

    for fn, x in ((read_whole, torch.randn(4, 4)), (strided, torch.randn(8, 2))):
        gm = make_fx(fn)(x)
        before = [n.target for n in gm.graph.nodes]
        fill_pieces(gm.graph)
        assert [n.target for n in gm.graph.nodes] == before


def _loss(x, w, index):  # (each row's: returned split as the rows are, the plan keeps them split)
    return -torch.gather(torch.log_softmax(x @ w, -1), 1, index)


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randn(16, 32, requires_grad=True), torch.randint(0, 32, (8, 1))


def _split_loss_body():
    x, w, index = _inputs()
    sharded = sf.shard(_loss, in_strategy=((4, 1), None, (4, 1)), out_strategy=((4, 1),), level=2)
    plan = sf.explain(sharded, x, w, index)
    sharded(x, w, index).sum().backward()
    (compiled,) = sf.engine_of(sharded).programs.values()
    return plan.nodes["gather"].inputs[0], _fills(compiled.program.graphs["backward"]), w.grad


def test_a_loss_gathered_from_split_logits_makes_its_zeros_as_pieces_in_the_backward_ranks_run(gloo4):
    # a loss's gather from log-probabilities split by rows over 4 real ranks: the backward graph they run makes
    # the gather's zeros at the piece's size (2 rows), not the whole (8), and the gradient is eager's
    x, w, index = _inputs()
    _loss(x, w, index).sum().backward()
    for placements, fills, grad in gloo4.run(_split_loss_body):
        assert placements[0].is_shard(0)  # (the rows split where it runs)
        assert fills == [(2, 32)]
        torch.testing.assert_close(grad, w.grad)
