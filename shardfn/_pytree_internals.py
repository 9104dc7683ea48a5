"""torch's pytree utilities (private to torch: ``torch.utils._pytree``), behind this one shim: the functions and
the spec type shardfn flattens arguments, outputs and op schemas with; and :func:`graph_leaves`, the leaves of a
graph node's arguments or value without pytree's registry."""

from torch.utils._pytree import (
    SUPPORTED_NODES,
    TreeSpec,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_map_only,
    tree_unflatten,
)

__all__ = ["TreeSpec", "graph_leaves", "keystr", "register_pytree_node", "registered_types", "tree_flatten",
           "tree_flatten_with_path", "tree_leaves", "tree_map", "tree_map_only", "tree_unflatten"]


def registered_types() -> int:
    """How many types pytree's registry holds: what a memo of pytree's answers per type is valid for."""
    return len(SUPPORTED_NODES)


def graph_leaves(x) -> list:
    """``tree_leaves(x)`` for what an fx node holds (its args and kwargs, its ``meta["val"]``): tuples, lists and
    dicts nested (a ``torch.Size`` too), flattened in the same order. The search asks it of every node several
    times over (each recompute try again), where pytree's registry lookup per container cost 5-10x the walk."""
    out: list = []
    _gather(x, out)
    return out


def _gather(x, out: list) -> None:
    if isinstance(x, (tuple, list)):
        for y in x:
            _gather(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _gather(y, out)
    else:
        out.append(x)
