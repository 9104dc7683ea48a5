import torch
import torch.nn.functional as F

from shardfn import _pytree_internals as pytree


def _program(x, w, b):
    h = torch.cat([x, x * 2], dim=1)  # (a list argument)
    first, second = torch.split(h, 4, dim=1)  # (a tuple value)
    n = F.layer_norm(first, (4,), w, b)  # (a shape argument)
    s = (n + second).sum(dim=[0, 1], keepdim=True)  # (a list of dims)
    return s.expand(x.shape[0], 4).reshape(-1, 2), torch.nn.functional.scaled_dot_product_attention(
        x.view(1, 1, 8, 4), x.view(1, 1, 8, 4), x.view(1, 1, 8, 4), is_causal=True)  # (a kwarg)


def test_graph_leaves_are_pytrees_leaves_for_every_node_of_a_captured_program():
    from shardfn.capture import capture

    graph = capture(_program, [torch.randn(8, 4), torch.randn(4), torch.randn(4)], {})
    nodes = list(graph.gm.graph.nodes)
    assert any(isinstance(n.meta.get("val"), (tuple, list)) for n in nodes)  # (a node of several values)
    for node in nodes:
        for held in ((node.args, node.kwargs), node.meta.get("val")):
            assert pytree.graph_leaves(held) == pytree.tree_leaves(held), node
    size = torch.Size([2, 3])
    assert pytree.graph_leaves((size, [1, {"a": 2}])) == pytree.tree_leaves((size, [1, {"a": 2}]))
