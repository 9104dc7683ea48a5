"""What a step keeps for its backward: the forward's values some op's backward reads, and until when.

A value is kept from when it is made until the backward of its last reader (the first in program order whose
backward reads it) has run; a value no backward reads goes after its last forward reader. The rules are the
derivative formulas' in outline (AOTAutograd's partitioner may save less, recomputing cheap ops): an op's
backward reads an input where another input needs a gradient (a weight is read for its input's gradient), or
where the op is not linear in it and it needs a gradient itself (gelu's input); ops that only move, add or
convert their inputs read none; a few ops read their own output (softmax, tanh, attention). Which ops are which
are the registry's tables (:mod:`.registry`: added_inputs, moves_gradient, linear_in_each, reads_output).
"""

from __future__ import annotations

import torch
import torch.fx

from ..capture.graph import is_getitem
from .candidates import tensor_inputs
from .cost_model import is_view_op
from .registry import REGISTRY

__all__ = ["backward_readers", "reads_input", "saved_until"]


def saved_until(nodes: list[torch.fx.Node], needs_grad: set,
                copied: frozenset = frozenset()) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each value (an op's, not a view's) some backward reads -> the node whose backward reads it last.
    ``copied``: the (reader, slot) reads a plan makes of a copy in another layout (gathered.read_copies): a
    backward that reads such a copy keeps the copy, not the value."""
    order = {n: i for i, n in enumerate(nodes)}
    until = {}
    for v in nodes:
        if v.op != "call_function" or is_view_op(v) or is_getitem(v):
            continue
        readers = backward_readers(v, needs_grad, copied)
        if REGISTRY.reads_output(v.target) and v in needs_grad:
            readers.append(v)
        if readers:
            until[v] = min(readers, key=order.__getitem__)
    return until


def backward_readers(v: torch.fx.Node, needs_grad: set, copied: frozenset = frozenset()) -> list[torch.fx.Node]:
    """The ops whose backward reads ``v``, directly or through views of it and getitems of its outputs (not
    through a ``copied`` read: see :func:`saved_until`)."""
    found = []
    for user in v.users:
        if user.op != "call_function":
            continue
        if is_view_op(user) or is_getitem(user):
            found += backward_readers(user, needs_grad, copied)
        elif user in needs_grad:  # its backward runs
            found += [user] if any(a is v and (user, k) not in copied and reads_input(user, k, needs_grad)
                                   for k, a in enumerate(tensor_inputs(user))) else []
    return found


def reads_input(node: torch.fx.Node, slot: int, needs_grad: set) -> bool:
    """Does the backward of ``node``'s op read its tensor input ``slot``?"""
    if REGISTRY.moves_gradient(node.target) or slot in REGISTRY.added_inputs(node.target):
        return False
    inputs = tensor_inputs(node)
    if any(a in needs_grad for k, a in enumerate(inputs) if k != slot):
        return True
    return (not REGISTRY.linear_in_each(node.target) and not REGISTRY.reads_output(node.target)
            and inputs[slot] in needs_grad)
