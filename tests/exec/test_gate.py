"""exec.gate: a forward graph settles a call's pending agreement before its first collective, its first write
into an input, or else its end."""

import torch
import torch.fx

from shardfn.exec import gate as gates

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _graph(*targets):
    """x -> each target in turn (unary ops, or a write into x itself: copy_(x, prev)) -> output."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    h = x
    for t in targets:
        h = g.call_function(t, (x, h) if t is aten.copy_.default else
                            (h, "sum", "0") if t is c10d.all_reduce.default else (h,))
    g.output(h)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _before_gate(gm) -> list:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    at = next(i for i, n in enumerate(nodes) if n.target is gates.open_gate)
    return [n.target for n in nodes[:at]]


def test_the_gate_stands_before_the_first_collective_or_write():
    assert _before_gate(gates.gate(_graph(aten.neg.default, aten.relu.default, c10d.all_reduce.default,
                                          aten.neg.default))) == [aten.neg.default, aten.relu.default]
    assert _before_gate(gates.gate(_graph(aten.neg.default, aten.copy_.default, c10d.all_reduce.default))) == \
        [aten.neg.default]
    assert _before_gate(gates.gate(_graph(aten.neg.default, aten.relu.default))) == \
        [aten.neg.default, aten.relu.default]


def test_the_gate_settles_what_is_held_once():
    gm = gates.gate(_graph(aten.neg.default))
    settled = []
    gates.hold(lambda: settled.append(1))
    torch.testing.assert_close(gm(torch.ones(2)), -torch.ones(2))
    gm(torch.ones(2))  # nothing held now
    gates.open_gate()
    assert settled == [1]
