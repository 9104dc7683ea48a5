"""Custom autograd.Functions in fn: captured as one call each (its target calls the Function itself), with the
ops of their forward and backward recorded; reentrant checkpointing traced through; misuses refused clearly."""

import pytest
import torch

from shardfn.capture import CaptureError, capture
from shardfn.capture.functions import FunctionCall
from tests.functions import (AddOneInPlace, BloomGelu, GradientReversal, MaskedScale, RowSoftmax,
                             StraightThroughRound, ThroughNumpy)

aten = torch.ops.aten


def _calls(fn, *args):
    gm = capture(fn, args, {}).gm
    return gm, [n for n in gm.graph.nodes if isinstance(n.target, FunctionCall)]


def _ops(records):
    return [r[0] for r in records]


def test_a_function_call_is_one_node_that_calls_the_function():
    x = torch.randn(8, 6, requires_grad=True)
    gm, (node,) = _calls(lambda a: StraightThroughRound.apply(a * 2) + 1, x)
    call = node.target
    assert call.function is StraightThroughRound and repr(call) == "StraightThroughRound.apply"
    assert _ops(call.forward_ops) == [aten.mul.Tensor, aten.round.default, aten.div.Tensor]
    assert _ops(call.backward_ops) == [aten.mul.Tensor]  # its own backward (doubles), not round's derivative
    # the node's target runs the Function: its own backward reaches the input
    y = x.detach().requires_grad_()
    (out,) = call(y)
    out.sum().backward()
    assert torch.equal(out, StraightThroughRound.apply(y)) and torch.equal(y.grad, torch.full_like(y, 2.0))


def test_old_style_functions_with_constants_and_several_outputs():
    x, mask = torch.randn(8, 6, requires_grad=True), torch.rand(8, 6) > 0.5
    _, (node,) = _calls(lambda a, m: MaskedScale.apply(a, m, 0.5)[0] * 2, x, mask)
    assert [a.meta["val"].dtype for a in node.args] == [torch.float32, torch.bool]
    assert len(node.meta["val"]) == 2  # both outputs, the sign included
    assert aten.sign.default in _ops(node.target.forward_ops)
    _, (node,) = _calls(lambda a: GradientReversal.apply(a, 0.25), x)
    assert _ops(node.target.forward_ops) == [aten.view.default]
    assert _ops(node.target.backward_ops) == [aten.mul.Tensor]  # -scale * grad


def test_identical_calls_share_a_target_and_stay_apart():
    # the same Function on the same shapes (every layer's activation) shares one target, so the search shares
    # their candidates; two calls on the same input stay two nodes (a Function may draw random numbers)
    x = torch.randn(4, 6)
    _, nodes = _calls(lambda a: BloomGelu.apply(a) + BloomGelu.apply(a) + BloomGelu.apply(a * 2), x)
    assert len(nodes) == 3 and len({id(n.target) for n in nodes}) == 1
    _, nodes = _calls(lambda a: BloomGelu.apply(a).sum() + BloomGelu.apply(a[:2]).sum(), x)
    assert len({id(n.target) for n in nodes}) == 2  # other shapes: another target


def test_a_function_that_cannot_run_backward_on_fakes_is_kept_whole():
    class NumpyBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return torch.from_numpy(g.numpy() * 2)

    _, (node,) = _calls(lambda a: NumpyBackward.apply(a), torch.randn(4, 6, requires_grad=True))
    assert node.target.backward_ops is None  # unknown: the search runs it whole


def test_reentrant_checkpoint_is_traced_through():
    gm, nodes = _calls(lambda a, w: torch.utils.checkpoint.checkpoint(lambda b: torch.tanh(b @ w), a,
                                                                       use_reentrant=True),
                       torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True))
    assert nodes == [] and any(n.target is aten.tanh.default for n in gm.graph.nodes)


def test_a_function_writing_into_its_input_is_refused():
    with pytest.raises(CaptureError, match=r"AddOneInPlace.apply writes into its input \(ctx.mark_dirty\).*new tensor"):
        capture(lambda a: AddOneInPlace.apply(a * 1), (torch.randn(4, 6, requires_grad=True),), {})


def test_a_function_that_fakes_cannot_run_names_the_fix():
    with pytest.raises(CaptureError, match=r"could not run .*ThroughNumpy.apply on fake tensors.*custom_op"):
        capture(lambda a: ThroughNumpy.apply(a), (torch.randn(4, 6),), {})


def test_function_apply_is_torch_s_own_outside_capture():
    before = torch.autograd.Function.__dict__["apply"]
    capture(lambda a: RowSoftmax.apply(a), (torch.randn(4, 6),), {})
    with pytest.raises(RuntimeError):  # a failed capture too
        capture(lambda a: RowSoftmax.apply(a.tolist()), (torch.randn(4, 6),), {})
    assert torch.autograd.Function.__dict__["apply"] is before
