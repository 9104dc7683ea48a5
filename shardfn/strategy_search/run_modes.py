"""How exec runs each node of a plan (``NodePlan.run``), decided here once, as the plan is read out: exec reads it
and derives nothing again.

  factory    : made whole, then laid out as planned (a factory op's own rule);
  random     : drawn whole from the seed, then laid out, so a seed gives eager's numbers;
  local      : the op (a Function's call, a shardfn rule's op) called on each rank's pieces;
  dispatch   : a mixture-of-experts call on each rank's tokens and experts, each (token, slot) pair sent to the
               rank holding its expert and back (exec.expert_dispatch; the mesh dim: expert_rules.dispatch_dims);
  pieces     : an op DTensor's rule runs on its operands' pieces as they are: called on them directly, without
               DTensor's propagation on every call (where the pieces are even; else as dtensor);
  piece_view : a view run on its operand's piece, its size argument the piece's (where that dim is whole; else
               as dtensor);
  dtensor    : dispatched on DTensors, DTensor's rule laying the result out;
  whole      : made whole by every rank from whole operands, then laid out as planned (a value computed from
               constants that its readers all read split: strategy_search.as_read).

(A graph input or output keeps its rule's name: ``input``, ``output``.)
"""

from __future__ import annotations

import torch
import torch.fx

from torch.distributed.tensor.placement_types import Partial

from ..capture.graph import is_view
from .registry import REGISTRY

__all__ = ["RUN_MODES", "run_mode", "runs_on_pieces", "view_on_pieces"]

RUN_MODES = ("factory", "random", "local", "dispatch", "pieces", "piece_view", "dtensor", "whole", "input",
             "output")


def run_mode(node: torch.fx.Node, rule: str, inputs, outputs, graph_writes: bool) -> str:
    """How exec runs ``node`` chosen with ``rule`` at these placements. ``graph_writes``: the graph writes into a
    value in place (a write through a view must reach its base through autograd's view tracking, which a piece's
    view run apart from its DTensor does not keep: no view runs on a piece then)."""
    if rule != "dtensor":  # (an input or output, a factory, a random op, a local rule, "whole": as its rule says)
        return rule
    if runs_on_pieces(node, inputs, outputs):
        return "pieces"
    if not graph_writes and view_on_pieces(node, inputs, outputs):
        return "piece_view"
    return "dtensor"


_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None))


def runs_on_pieces(node: torch.fx.Node, inputs, outputs) -> bool:
    """Whether ``node`` (run by DTensor's rule at these planned placements) computes each rank's piece of its
    results from its operands' pieces alone, so the interpreter may run it on them directly: a pointwise op, or
    one the registry's table runs on pieces (REGISTRY.runs_on_pieces), on tensors and plain values, no pending
    sum in or out (whose gradient the pieces would not give; a sum of REGISTRY.sums_on_pieces may leave one)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
        return False
    listed = REGISTRY.runs_on_pieces(op)
    if not (listed or torch.Tag.pointwise in op.tags) or is_view(op):
        return False
    if not outputs or any(pl is None for pl in outputs) or any(p.is_partial() for pl in inputs for p in pl):
        return False
    # a sum left pending: each rank sums its piece, and the gradient (whole: GradSettled) expands onto the piece.
    # Not an average's: a piece's mean divides its gradient by the piece's count, not the whole's
    if any(p.is_partial() for pl in outputs for p in pl) and not (REGISTRY.sums_on_pieces(op) and all(
            p == Partial("sum") for pl in outputs for p in pl if p.is_partial())):
        return False

    def plain(a) -> bool:
        if isinstance(a, (list, tuple)):
            return listed and all(plain(x) for x in a)
        return isinstance(a, (torch.fx.Node, *_PLAIN))

    return all(plain(a) for a in (*node.args, *node.kwargs.values()))


def view_on_pieces(node: torch.fx.Node, inputs, outputs) -> bool:
    """Whether ``node`` is a view the interpreter may run on its operand's piece: one of the registry's
    (REGISTRY.view_on_pieces) on one tensor, its other arguments plain, no pending sum in or out (a pending sum of
    the gradient passes: _ViewOfPiece)."""
    if not REGISTRY.view_on_pieces(node.target) or not outputs or any(pl is None for pl in outputs):
        return False
    if len(inputs) != 1:
        return False
    if any(p.is_partial() for pl in (*inputs, *outputs) for p in pl):
        return False
    rest = (*node.args[1:], *node.kwargs.values())
    plain = all(isinstance(a, (torch.fx.Node, *_PLAIN)) or
                (isinstance(a, (list, tuple)) and all(isinstance(b, (torch.fx.Node, int)) for b in a)) for a in rest)
    return isinstance(node.args[0], torch.fx.Node) and plain and not any(
        isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) for a in rest)
