"""What ``fn`` returns, split into the tensors the graph computes and a template that rebuilds the rest.

Tensors may sit in pytree containers (tuples, lists, dicts, namedtuples, registered classes) and in the
attributes of plain Python objects (transformers' ModelOutput and DynamicCache). A call rebuilds the structure
around fresh tensors: containers anew, objects as shallow copies of the traced ones with each attribute rebuilt,
constants as traced. An object that holds tensors where shardfn cannot reach them (no ``__dict__``) is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["OutputTemplate", "split_outputs"]


@dataclass(frozen=True)
class _Slot:
    index: int  # position among the graph's outputs


@dataclass(frozen=True)
class _Container:
    spec: pytree.TreeSpec
    children: tuple


@dataclass(frozen=True)
class _Object:
    number: int  # the n-th object met: a second reference to it gets the same copy
    traced: Any  # the object fn built while traced: copied, never returned
    fields: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class _Shared:
    first: int  # an object met before in the same output (a cycle or a second reference): the same copy


class OutputTemplate:
    """Rebuilds fn's output from the list of its tensors' values (:meth:`rebuild`)."""

    def __init__(self, root: Any, n_objects: int):
        self.root, self.n_objects = root, n_objects
        self.single = isinstance(root, _Slot)  # fn returns one tensor: the call returns it as is

    def rebuild(self, values: list) -> Any:
        if self.single:
            return values[0]
        return _fill(self.root, values, [None] * self.n_objects)


def _fill(part: Any, values: list, made: list) -> Any:
    if isinstance(part, _Slot):
        return values[part.index]
    if isinstance(part, _Container):
        return pytree.tree_unflatten([_fill(c, values, made) for c in part.children], part.spec)
    if isinstance(part, _Shared):
        return made[part.first]
    if isinstance(part, _Object):
        new = made[part.number] = copy.copy(part.traced)
        for name, sub in part.fields:
            new.__dict__[name] = _fill(sub, values, made)
        return new
    return part  # a constant


def split_outputs(out: Any, where: Callable[[], str] = lambda: "fn") -> tuple[list[torch.Tensor], OutputTemplate]:
    """``out``'s tensors in a fixed order, and the template that rebuilds ``out`` around new values of them."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def strip(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1)
        children, spec = pytree.tree_flatten(x)
        if not (len(children) == 1 and children[0] is x):  # a container
            keys = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(x)[0]]
            return _Container(spec, tuple(strip(c, path + k) for c, k in zip(children, keys)))
        if not _holds_tensors(x, set()):
            return x
        if id(x) in seen:
            return _Shared(seen[id(x)])
        if not hasattr(x, "__dict__"):
            raise TypeError(
                f"{where()} returns {path} = a {type(x).__name__} holding tensors that shardfn cannot reach (it has "
                "no __dict__); return the tensors themselves, or register the class as a pytree node with "
                "torch.utils._pytree.register_pytree_node")
        number = seen[id(x)] = len(seen)
        return _Object(number, x, tuple((name, strip(v, f"{path}.{name}")) for name, v in vars(x).items()))

    root = strip(out, "output")
    return tensors, OutputTemplate(root, len(seen))


def _holds_tensors(x: Any, visiting: set) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if id(x) in visiting or isinstance(x, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return False
    visiting.add(id(x))
    children, _ = pytree.tree_flatten(x)
    if not (len(children) == 1 and children[0] is x):
        return any(_holds_tensors(c, visiting) for c in children)
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return any(_holds_tensors(v, visiting) for v in vars(x).values())
    slots = [getattr(x, s, None) for s in getattr(type(x), "__slots__", ())]
    return any(_holds_tensors(v, visiting) for v in slots)
