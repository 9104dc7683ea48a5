"""A fill made whole only to be cut to a piece is made as the piece.

The backward runs through DTensor's rules, and some of them make a value whole that the plan holds split: a
gather's backward makes zeros of its input's whole size (``new_zeros``, which DTensor's rule makes replicated)
and then lays them out as the scatter-add after it reads them, a piece cut out of the whole and copied. At a
loss over logits split 4 ways that is four times the piece for a moment, at the step's peak (bench/plan_peak's
Llama: 2 MiB of zeros where the piece is 0.5). Every element of a fill is the same, so the piece is the fill at
the piece's size: :func:`fill_pieces` makes it so in a traced graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..strategy_search.registry import REGISTRY

__all__ = ["fill_pieces"]

aten = torch.ops.aten
# ops that return a part of their input (or a copy of it): of a fill, a fill of the same value
_CUTS = (aten.split.Tensor, aten.split_with_sizes.default, operator.getitem, aten.clone.default,
         aten.slice.Tensor, aten.narrow.default)


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What reads ``node``, but items of its result nothing reads (a split's other pieces)."""
    return [u for u in node.users if u.users or u.target is not operator.getitem]


def _piece_of(fill: torch.fx.Node) -> torch.fx.Node | None:
    """The last node of the chain of cuts that alone reads ``fill`` (each read by the next alone), or None."""
    node = fill
    while len(_readers(node)) == 1 and _readers(node)[0].target in _CUTS:
        node = _readers(node)[0]
    return None if node is fill else node


def fill_pieces(graph: torch.fx.Graph) -> None:
    """Each fill (``new_zeros`` and the like: the registry's factories sized by an argument, whose piece any rank
    makes alike) read only through a chain of cuts made at the size the chain ends with; the chain then has no
    readers and goes."""
    fills = REGISTRY.sized_factories()
    for fill in [n for n in graph.nodes if n.op == "call_function" and n.target in fills]:
        piece = _piece_of(fill)
        val = piece.meta.get("val") if piece is not None else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape) \
                or not val.is_contiguous():
            continue  # (symbolic sizes, a strided result, a tuple: as it is)
        at = REGISTRY.size_argument(fill.target)
        with graph.inserting_before(piece):
            made = graph.call_function(fill.target, (*fill.args[:at], list(val.shape), *fill.args[at + 1:]),
                                       dict(fill.kwargs))
        made.meta = {**fill.meta, "val": val}
        piece.replace_all_uses_with(made)
        node = piece
        while True:  # (the chain, from its end, with the items of it nothing reads)
            above = node.args[0] if node is not fill else None
            for item in list(node.users):
                graph.erase_node(item)
            graph.erase_node(node)
            if above is None:
                break
            node = above
