"""torch's pytree utilities (private to torch: ``torch.utils._pytree``), behind this one shim: the functions and
the spec type shardfn flattens arguments, outputs and op schemas with."""

from torch.utils._pytree import (
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

__all__ = ["TreeSpec", "keystr", "register_pytree_node", "tree_flatten", "tree_flatten_with_path", "tree_leaves",
           "tree_map", "tree_map_only", "tree_unflatten"]
