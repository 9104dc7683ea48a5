"""Values every rank computes whole, laid out as their readers read them as soon as they are made.

The candidates of a value computed from constants alone (an attention mask, a position table: problem.py) are
whole only, so that it ties no layers together in the solve; its readers read it in whatever layout they choose,
a local slice that costs no communication. Where every reader reads it in one layout, the plan makes it in that
layout instead: exec computes it whole and keeps a copy of its piece (``NodePlan.run`` "whole"), which the
backward reads as kept (exec.passes.keep_pieces), so no rank holds the whole beyond the op that makes it
(Llama-405B's attention mask, 64 x 4,096 x 4,096 in fp32, had stayed whole on every rank through the forward:
4.3e9 bytes; its level-1 plan at 8 layers walks 4.78e9 bytes a rank, 6.32e9 before).
"""

from __future__ import annotations

import dataclasses

import torch

from ..capture.graph import is_in_place
from . import cost_model as cm
from .candidates import Candidate
from .problem import StrategyProblem

__all__ = ["laid_out_as_read"]


def laid_out_as_read(problem: StrategyProblem, chosen: list[Candidate]) -> tuple[list[Candidate], dict]:
    """``chosen`` with each whole value that its readers all read in one other layout made in that layout, and
    the whole bytes each such value's op makes before laying it out (node -> bytes: alive while it runs). A view
    of such a value (a mask's slice) that keeps the dims its readers split as they are is laid out alike, its
    own input then read in that layout (so the value it views is laid out too)."""
    readers: dict[int, list[tuple[int, int]]] = {}
    for v, d in enumerate(problem.decisions):
        for slot, (u, _, _) in enumerate(d.sources):
            readers.setdefault(u, []).append((v, slot))
    out, whole = list(chosen), {}
    for u in reversed(range(len(out))):  # (readers first: a view laid out changes what its input is read in)
        node, c = problem.decisions[u].node, out[u]
        layouts = {tuple(out[v].inputs[slot]) for v, slot in readers.get(u, ())}
        if len(layouts) != 1 or not _made_whole(problem, node, c):
            continue
        (layout,) = layouts
        if all(p.is_replicate() for p in layout) or any(p.is_partial() for p in layout) \
                or any(r.op != "call_function" or is_in_place(r.target) for r in node.users):
            continue
        if not cm.is_view_op(node):
            # (run "whole": its rule's name, as run_modes reads rules; a factory's own rule lays out what it makes)
            out[u] = dataclasses.replace(c, outputs=(layout,), rule=c.rule if c.rule == "factory" else "whole")
            val = node.meta["val"]
            whole[node] = cm.local_numel(val.shape, c.outputs[0], problem.mesh_shape) * val.element_size()
        elif len(c.inputs) == 1 and _keeps_split_dims(node, layout) and _whole(out, problem.decisions[u].sources[0]):
            out[u] = dataclasses.replace(c, inputs=(layout,), outputs=(layout,), rule="dtensor")
    return out, whole


def _whole(chosen: list[Candidate], source) -> bool:
    """Is the value a view reads made whole (so that reading a piece of it is a local slice, as before)?"""
    u, out_idx, _ = source
    made = chosen[u].outputs[out_idx]
    return made is not None and all(p.is_replicate() for p in made)


def _keeps_split_dims(view: torch.fx.Node, layout) -> bool:
    """Does the view leave every dim ``layout`` splits, and those before it, as they are (same place, same size),
    so that its piece is the view of its input's piece (a slice of a later dim, an expand that expands none of
    them)?"""
    (base,) = [a for a in view.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)] or [None]
    if base is None:
        return False
    src, dst = tuple(base.meta["val"].shape), tuple(view.meta["val"].shape)
    last = max(p.dim for p in layout if p.is_shard())
    return len(src) > last and len(dst) > last and src[:last + 1] == dst[:last + 1]


def _made_whole(problem: StrategyProblem, node: torch.fx.Node | None, c: Candidate) -> bool:
    """An op's value made whole by every rank, needing no gradient (whose backward would have to gather it)."""
    return (node is not None and node.op == "call_function" and node not in problem.needs_grad
            and isinstance(node.meta.get("val"), torch.Tensor) and len(c.outputs) == 1
            and c.outputs[0] is not None and all(p.is_replicate() for p in c.outputs[0]))
