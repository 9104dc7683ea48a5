"""A graph that runs eagerly, its aten ops called through torch's own Python bindings.

A captured or traced graph calls each op as ``torch.ops.aten.<op>.<overload>(...)``: an OpOverload, whose call
converts every argument to the op's schema types in a generic (boxed) way. The same op called as ``torch.mm``
or ``x.view(...)`` goes through the bindings torch generates for each op, which parse arguments several times
faster: a small op's call costs ~1 us there against 2-5 us (``aten.view.default`` with a size list: 4.7 us, the
method 1.1 us, on a 2-core CPU). A graph of a few hundred small ops, a decoding step of a language model in a
world of one, spends a third of its time in that conversion: on a GPU, such a step is bound by how fast ops are
launched.

:func:`direct_calls` gives a copy of a graph whose ops of a table are called through their bindings: the table is
the rule registry's (:mod:`shardfn.strategy_search.registry`, ``REGISTRY.binding``). It holds only ops whose
binding takes the schema's arguments as the graph passes them (positional ones in order, keyword-only ones by name)
and reaches the very overload the graph names for them: the function variant (``torch.<op>``, or
``torch._C._nn.<op>``) or the method (``x.<op>``); the result, its autograd and its dtype are the op's own. Ops
outside the table (random ones, in-place ones, those without a binding such as ``_unsafe_view`` or
``slice.Tensor``, those whose binding takes other arguments) keep their OpOverload call. The copy runs only: plans,
explain and traces read the graph itself.
"""

from __future__ import annotations

import torch
import torch.fx

from ..strategy_search.registry import REGISTRY

__all__ = ["direct_calls"]

def _binding(op: torch._ops.OpOverload):
    """How to call ``op`` directly: ("call_function", the binding) or ("call_method", its name); None to keep it."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    where = REGISTRY.binding(name)  # "function" (torch's variable functions), "nn" (torch._C._nn), "method"
    if where is None:
        return None
    if where == "method":
        return ("call_method", name) if hasattr(torch.Tensor, name) else None
    found = getattr(torch._C._VariableFunctions if where == "function" else torch._C._nn, name, None)
    return None if found is None else ("call_function", found)


def direct_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` (sharing its attributes) whose ops of the table are called through their bindings."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    changed = False
    for node in graph.nodes:
        direct = _binding(node.target) if node.op == "call_function" else None
        if direct is not None:
            node.op, node.target = direct
            changed = True
    return torch.fx.GraphModule(gm, graph) if changed else gm
