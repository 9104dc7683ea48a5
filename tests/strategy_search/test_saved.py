"""What a step keeps for its backward (strategy_search.saved), checked against what autograd itself saves.

The plan's memory counts an op's input as kept for backward where the registry's tables say its backward reads it;
each op the tables say reads none is run here with inputs that need gradients, and autograd's saved tensors
(torch.autograd.graph.saved_tensors_hooks) must share no storage with its inputs."""

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.strategy_search.registry import REGISTRY
from shardfn.strategy_search.saved import saved_until

aten = torch.ops.aten


def _x(*shape):
    return torch.randn(*shape, requires_grad=True)


# a call of each op the tables say reads none of its inputs in backward: (tensor inputs, the other arguments)
_CALLS = {
    aten.cat.default: lambda: (([_x(2, 3), _x(2, 3)],), ()),
    aten.stack.default: lambda: (([_x(2, 3), _x(2, 3)],), ()),
    aten.clone.default: lambda: ((_x(2, 3),), ()),
    aten._to_copy.default: lambda: ((_x(2, 3),), ()),
    aten.neg.default: lambda: ((_x(2, 3),), ()),
    aten.sum.default: lambda: ((_x(2, 3),), ()),
    aten.sum.dim_IntList: lambda: ((_x(2, 3),), ([1],)),
    aten.mean.default: lambda: ((_x(2, 3),), ()),
    aten.mean.dim: lambda: ((_x(2, 3),), ([1],)),
    aten.expand.default: lambda: ((_x(1, 3),), ([4, 3],)),
    aten.repeat.default: lambda: ((_x(2, 3),), ([2, 1],)),
    aten.add.Tensor: lambda: ((_x(2, 3), _x(2, 3)), ()),
    aten.sub.Tensor: lambda: ((_x(2, 3), _x(2, 3)), ()),
    aten.constant_pad_nd.default: lambda: ((_x(2, 3),), ([1, 1],)),
    aten._unsafe_view.default: lambda: ((_x(2, 3),), ([6],)),
    aten.tril.default: lambda: ((_x(3, 3),), ()),
    aten.triu.default: lambda: ((_x(3, 3),), ()),
    aten.cumsum.default: lambda: ((_x(2, 3),), (1,)),
    aten.flip.default: lambda: ((_x(2, 3),), ([1],)),
    aten.roll.default: lambda: ((_x(2, 3),), ([1], [1])),
}


def _saved_storages(op, tensors, rest) -> set[int]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        op(*tensors, *rest)
    return {t.untyped_storage().data_ptr() for t in saved}


def _storages(tensors) -> set[int]:
    flat = [t for a in tensors for t in (a if isinstance(a, list) else [a])]
    return {t.untyped_storage().data_ptr() for t in flat}


def test_every_op_said_to_read_none_of_its_inputs_has_a_call_here():
    assert set(REGISTRY._tables["moves_gradient"]) == set(_CALLS)


@pytest.mark.parametrize("op", list(_CALLS), ids=str)
def test_an_op_said_to_read_none_of_its_inputs_has_autograd_save_none(op):
    assert REGISTRY.moves_gradient(op)
    tensors, rest = _CALLS[op]()
    assert not _saved_storages(op, tensors, rest) & _storages(tensors)


def test_the_check_sees_an_input_autograd_saves():
    # (silu's backward reads its input, mm's each input for the other's gradient: the check above would fail)
    x, w = _x(2, 3), _x(3, 4)
    assert _storages([x]) <= _saved_storages(aten.silu.default, [x], ())
    assert _storages([x, w]) <= _saved_storages(aten.mm.default, [x, w], ())
    assert not REGISTRY.moves_gradient(aten.silu.default) and not REGISTRY.moves_gradient(aten.mm.default)


def test_a_linear_layers_product_reshaped_by_a_reshape_that_is_no_view_is_not_kept():
    # a linear layer on a 3-D input: view, mm, then aten._unsafe_view, which autograd takes for no view and whose
    # backward reshapes the gradient alone: the product is kept for no backward of its own (each mm of a
    # transformers layer had been counted kept: Llama's logits, 2 MiB a rank of bench/plan_peak's)
    def fn(x, w):
        return torch.nn.functional.silu(torch.nn.functional.linear(x, w)).sum()

    gm = make_fx(fn)(torch.randn(2, 3, 4), torch.randn(5, 4))
    nodes = list(gm.graph.nodes)
    (product,) = [n for n in nodes if n.target is aten.mm.default]
    (reshaped,) = product.users
    assert reshaped.target is aten._unsafe_view.default
    # silu's backward reads the reshaped product (its own value): that is what stays, until silu's backward
    assert saved_until(nodes, {n for n in nodes if n.op != "output"}) == {reshaped: reshaped.next}
