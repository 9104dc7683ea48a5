"""A gate before a forward graph's first communication, where a call's own check may still be under way.

A cached call's ranks agree on the call (shardfn.call.agreement) with one small all-reduce on the control group.
Waited for at once, it is a full round trip of every rank before the program's first op; started instead, it
may be waited for as late as the graph's first collective (or its first write into an input, or its end), so
the local ops before it run while the agreement is in flight, and a call whose ranks disagree still raises on
every rank before any of its collectives starts. :func:`gate` puts that wait into a traced forward graph;
:func:`hold` gives it what to wait for (a callable, run once: it raises where the ranks disagree)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from ..capture.graph import is_in_place

__all__ = ["gate", "hold", "open_gate"]

_held: list[Callable[[], None]] = []  # the running call's pending check (at most one: calls do not nest)


def hold(settle: Callable[[], None]) -> None:
    """The running call's check: settled by the forward graph's gate, else by :func:`open_gate` after it."""
    _held[:] = [settle]


@torch.fx.node.has_side_effect
def open_gate() -> None:
    """Settle the held check, if any (raising on every rank where the ranks disagree)."""
    if _held:
        _held.pop()()


def _writes_input(node: torch.fx.Node) -> bool:
    """Does ``node`` write into a graph input (a buffer updated in place, through views of it)?"""
    if node.op != "call_function":
        return False
    into = node.kwargs.get("out") if isinstance(node.kwargs.get("out"), torch.fx.Node) else \
        node.args[0] if is_in_place(node.target) and node.args else None
    while isinstance(into, torch.fx.Node) and into.op == "call_function" and into.args and (
            is_in_place(into.target) or getattr(into.target, "is_view", False)):  # its storage is its input's
        into = into.args[0]
    return isinstance(into, torch.fx.Node) and into.op == "placeholder"


def gate(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with a call of :func:`open_gate` before its first collective or write into an input, or else
    before its output."""
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op == "output" or _writes_input(n) or (
        n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"))
    with graph.inserting_before(first):
        graph.call_function(open_gate)
    gm.recompile()
    return gm
