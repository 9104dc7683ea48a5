"""The captured graph in a canonical order: its ops ordered and named by what they compute, not by the order
fn's Python ran them in.

Every rank captures fn itself, and ranks must hold one program (its collectives in one order). Python code may
run independent work in an order that differs between processes: transformers' Gemma 3 and ModernBERT compute
each attention type's rotary tables ``for layer_type in set(config.layer_types)``, and a set of strings
iterates in an order set by the process's hash seed, which differs between the processes a launcher starts.
Their graphs then compute the same values in another order under other node names, and ranks would refuse to
run together. Here each op gets a digest of what it computes (its op, its constant arguments and its inputs'
digests, placeholders by position), and the graph is rebuilt in topological order taking, among the ops that
are ready, the smallest digest first, with fresh names in that order. Ops whose order is part of what they do
keep their traced order among themselves: random ops (the order of draws), writes into inputs, and calls of
custom autograd.Functions (which may draw or count).
"""

from __future__ import annotations

import hashlib
import heapq

import torch
import torch.fx

from .functions import FunctionCall
from .graph import is_in_place, is_seeded, is_view
from .. import _pytree_internals as pytree

__all__ = ["canonical_order"]


def _keeps_order(node: torch.fx.Node) -> bool:
    target = node.target
    if isinstance(target, FunctionCall) or is_in_place(target):
        return True
    return is_seeded(target)


def _digests(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, str]:
    digest: dict[torch.fx.Node, str] = {}
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            what = f"{node.op} {node.target}"
        else:
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: digest[a])
            # each rank traces on its own device (cuda:0, cuda:1, ...): the kind is what the op computes
            args = pytree.tree_map_only(torch.device, lambda d: d.type, args)
            what = f"{node.op} {node.target!r} {args!r}"
        digest[node] = hashlib.blake2b(what.encode(), digest_size=16).hexdigest()
    return digest


def _readers(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes reading ``node``'s storage: its users, and the users of views of it."""
    found, views = set(), [node]
    while views:
        source = views.pop()
        for user in source.users:
            found.add(user)
            if is_view(user.target) and user.args and user.args[0] is source:
                views.append(user)
    return found


def canonical_order(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` rebuilt in canonical order (placeholders first as they are, the output last), names fresh."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    digest = _digests([n for n in nodes if n is not output])
    # dependencies: inputs; for ops that keep their order, the previous such op; a write into a value comes
    # after the reads of it (or of a view of it) traced before it, and before those traced after it
    waits = {n: {a for a in n.all_input_nodes if a.op != "placeholder"} for n in body}
    ordered = [n for n in body if _keeps_order(n)]
    for before, after in zip(ordered, ordered[1:]):
        waits[after].add(before)
    position = {n: i for i, n in enumerate(nodes)}
    for write in body:
        if is_in_place(write.target) and write.args and isinstance(write.args[0], torch.fx.Node):
            for reader in _readers(write.args[0]):
                if reader is write or reader not in waits:
                    continue
                if position[reader] < position[write]:
                    waits[write].add(reader)
                else:
                    waits[reader].add(write)
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in body}
    for n, deps in waits.items():
        for d in deps:
            readers[d].append(n)
    # (the traced position only breaks ties between ops computing the same thing)
    ready = [(digest[n], position[n], n) for n in body if not waits[n]]
    heapq.heapify(ready)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in placeholders:
        env[p] = graph.node_copy(p, env.__getitem__)
    while ready:
        _, _, node = heapq.heappop(ready)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        # a fresh name, numbered in canonical order, after the op as make_fx names it (mm, mm_1, ...)
        name = node.target.overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) else None
        env[node] = graph.create_node(node.op, node.target, args, kwargs, name=name)
        env[node].meta = dict(node.meta)
        for reader in readers[node]:
            waits[reader].discard(node)
            if not waits[reader]:
                heapq.heappush(ready, (digest[reader], position[reader], reader))
    assert len(env) == len(nodes) - 1, "the captured graph has a cycle"
    graph.node_copy(output, env.__getitem__)
    return torch.fx.GraphModule(gm, graph)
