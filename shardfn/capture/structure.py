"""Values with tensors inside, split into their tensors and a Structure that rebuilds them.

fn's arguments and its return value may hold tensors in pytree containers (tuples, lists, dicts, namedtuples,
registered classes such as transformers' ModelOutput) and in the attributes of plain Python objects (transformers'
DynamicCache and its layers). :func:`split` walks a value in a fixed order (pytree order; an object's attributes in
``__dict__`` order) and returns the tensors it meets and a :class:`Structure`: rebuilding it around other tensors
makes containers anew, plain objects as copies of the ones met with each attribute rebuilt, and keeps values as
they were where they cannot change (numbers, strings, values hashed by their contents, modules, functions,
classes). An object that holds tensors where shardfn cannot reach them (no ``__dict__``) is refused.

Arguments are split on every call (their tensors are the program's inputs, the Structure's :meth:`key` is part of
the call's signature); fn is traced on a rebuilt copy, so what it changes in an argument object (a cache it
appends to) is recorded as that object's new state (:func:`split` again, with tensors named by where they come
from) and written back into the caller's object after each call (:meth:`Structure.write_back`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from .. import _pytree_internals as pytree

__all__ = ["Structure", "kept_as_is", "split"]

_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format, torch.Size)


@dataclass(frozen=True)
class _Slot:
    index: int  # the index-th tensor of the split


@dataclass(frozen=True)
class _Input:
    index: int  # (an argument's new state) the index-th input tensor, kept as it was


@dataclass(frozen=True)
class _Container:
    spec: pytree.TreeSpec
    children: tuple


@dataclass(frozen=True)
class _Object:
    number: int  # the n-th object met: a second reference to it gets the same copy
    original: Any  # the object met (copied on rebuild, never handed out itself)
    fields: tuple[tuple[str, Any], ...]
    argument: int | None = None  # (a new state or output) the argument object it is a copy of


@dataclass(frozen=True)
class _Shared:
    number: int


@dataclass(frozen=True)
class _Argument:
    number: int  # (an output) argument object ``number`` itself, as the caller holds it


class Structure:
    """Rebuilds a split value around new tensors (:meth:`rebuild`)."""

    def __init__(self, root: Any, met: list):
        self.root, self.met, self.n_objects = root, met, len(met)
        self.single = isinstance(root, _Slot)  # one bare tensor: rebuilt as itself

    def rebuild(self, values: list, inputs: list | None = None, arguments: list | None = None) -> Any:
        """The value around ``values``; ``inputs`` fill kept input tensors, ``arguments`` are the caller's
        argument objects (for references to them)."""
        if self.single:
            return values[0]
        return _Rebuild(values, inputs, arguments, self.n_objects).part(self.root)

    def rebuild_with_objects(self, values: list) -> tuple[Any, list]:
        """The value, and the copy made of each object in it (by number)."""
        r = _Rebuild(values, None, None, self.n_objects)
        return r.part(self.root), r.made

    def objects(self) -> list:
        """The objects met, by number."""
        return list(self.met)

    def key(self, tensor_key: Callable[[int], Any]) -> Any:
        """A hashable description: containers, object types and attributes, constants, and ``tensor_key(i)`` for
        the i-th tensor. Two values with equal keys trace alike."""
        return _key(self.root, tensor_key)

    def write_back(self, into: Any, values: list, inputs: list, arguments: list) -> None:
        """Give the caller's object ``into`` the new state this Structure (an argument's) describes."""
        r = _Rebuild(values, inputs, arguments, self.n_objects)
        r.made[self.root.number] = into  # references back to the object itself
        for name, sub in self.root.fields:
            into.__dict__[name] = r.part(sub)


class _Rebuild:
    def __init__(self, values, inputs, arguments, n_objects):
        self.values, self.inputs, self.arguments = values, inputs, arguments
        self.made: list = [None] * n_objects

    def part(self, p: Any) -> Any:
        if isinstance(p, _Slot):
            return self.values[p.index]
        if isinstance(p, _Input):
            return self.inputs[p.index]
        if isinstance(p, _Container):
            return pytree.tree_unflatten([self.part(c) for c in p.children], p.spec)
        if isinstance(p, _Shared):
            return self.made[p.number]
        if isinstance(p, _Argument):
            return self.arguments[p.number]
        if isinstance(p, _Object):
            if p.argument is not None:  # an argument object: the caller's own (its new state is written back)
                self.made[p.number] = self.arguments[p.argument]
                return self.made[p.number]
            new = self.made[p.number] = copy.copy(p.original)
            for name, sub in p.fields:
                new.__dict__[name] = self.part(sub)
            return new
        return p  # a constant


def split(value: Any, where: Callable[[], str] = lambda: "fn", path: str | None = None,
          kept: dict[int, int] | None = None, copies: dict[int, int] | None = None,
          display: Callable[[str], str] = str) -> tuple[list[torch.Tensor], list[str], Structure]:
    """``value``'s tensors in a fixed order, a name for each (its path from ``path``; names are made only when
    ``path`` is given), and the Structure that rebuilds ``value`` around new tensors.

    ``kept`` maps id(tensor) -> input index: such tensors are recorded as kept inputs, not split off;
    ``copies`` maps id(object) -> argument number: such objects, below the top, are references to the caller's
    argument objects. ``display(path)`` is how an error names a path.
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    seen: dict[int, int] = {}
    met: list = []  # the objects, by number
    kept, copies = kept or {}, copies or {}
    root_id = id(value)

    def strip(x: Any, at: str | None) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) in kept:
                return _Input(kept[id(x)])
            tensors.append(x)
            names.append(at)
            return _Slot(len(tensors) - 1)
        if isinstance(x, _SCALARS):
            return x
        if not _is_object(x):  # a container
            children, spec = pytree.tree_flatten(x)
            keys = [None] * len(children) if at is None else \
                [at + pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(x)[0]]
            return _Container(spec, tuple(strip(c, k) for c, k in zip(children, keys)))
        if id(x) in copies and id(x) != root_id:
            return _Argument(copies[id(x)])
        if id(x) in seen:
            return _Shared(seen[id(x)])
        if kept_as_is(x):
            return x
        if not hasattr(x, "__dict__"):
            if not _holds_tensors(x, set()):
                return x
            raise TypeError(
                f"{where()}: {display(at) if at is not None else 'a value'} is a {type(x).__name__} holding "
                "tensors that shardfn cannot reach "
                "(it has no __dict__); pass or return the tensors themselves, or register the class as a pytree "
                "node with torch.utils._pytree.register_pytree_node")
        number = seen[id(x)] = len(seen)
        met.append(x)
        fields = tuple((name, strip(v, None if at is None else f"{at}.{name}")) for name, v in vars(x).items())
        return _Object(number, x, fields, copies.get(id(x)))

    root = strip(value, path)
    return tensors, names, Structure(root, met)


_OBJECT_TYPES: dict[type, bool] = {}  # per type: a pytree leaf? (pytree's registry is by type)
_REGISTERED = [-1]  # pytree's registered node types when the memo was made (a registration since: made anew)


def _is_object(x: Any) -> bool:
    """Whether pytree takes ``x`` for a leaf (an object, not a container). Asked of every object in every call's
    arguments (a DynamicCache and each of its layers, at every token): remembered by type."""
    registered = pytree.registered_types()
    if registered != _REGISTERED[0]:
        _OBJECT_TYPES.clear()
        _REGISTERED[0] = registered
    leaf = _OBJECT_TYPES.get(type(x))
    if leaf is None:
        children, _ = pytree.tree_flatten(x)
        leaf = _OBJECT_TYPES[type(x)] = len(children) == 1 and children[0] is x
    return leaf


def kept_as_is(x: Any) -> bool:
    """Values a call cannot change and a trace reads as constants: hashed by their contents (enums, frozen
    dataclasses, tuples of those), modules (their tensors are parameters and buffers), functions, classes."""
    if isinstance(x, (torch.nn.Module, type)) or callable(x):
        return True
    try:
        return type(x).__hash__ is not object.__hash__ and type(x).__hash__ is not None and hash(x) is not None
    except TypeError:
        return False


def _holds_tensors(x: Any, visiting: set) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if id(x) in visiting or isinstance(x, _SCALARS) or isinstance(x, type) or callable(x):
        return False
    visiting.add(id(x))
    children, _ = pytree.tree_flatten(x)
    if not (len(children) == 1 and children[0] is x):
        return any(_holds_tensors(c, visiting) for c in children)
    if hasattr(x, "__dict__"):
        return any(_holds_tensors(v, visiting) for v in vars(x).values())
    slots = [getattr(x, s, None) for s in getattr(type(x), "__slots__", ())]
    return any(_holds_tensors(v, visiting) for v in slots)


def _key(p: Any, tensor_key: Callable[[int], Any]) -> Any:
    if isinstance(p, _Slot):
        return ("T", tensor_key(p.index))
    if isinstance(p, _Input):
        return ("I", p.index)
    if isinstance(p, _Container):
        return ("C", p.spec, tuple(_key(c, tensor_key) for c in p.children))
    if isinstance(p, _Object):
        return ("O", type(p.original), tuple((n, _key(s, tensor_key)) for n, s in p.fields), p.argument)
    if isinstance(p, (_Shared, _Argument)):
        return p
    return _constant_key(p, set())


def _constant_key(x: Any, visiting: set) -> Any:
    """Equal for constants a trace cannot tell apart: equal values, or objects of one type with equal attributes."""
    if isinstance(x, _SCALARS):
        return (type(x), x)
    try:
        if type(x).__hash__ is not object.__hash__:
            hash(x)
            return ("V", type(x), x)
    except TypeError:
        pass
    if id(x) in visiting:
        return ("cycle",)
    visiting.add(id(x))
    children, spec = pytree.tree_flatten(x)
    if not (len(children) == 1 and children[0] is x):
        return ("C", spec, tuple(_constant_key(c, visiting) for c in children))
    if hasattr(x, "__dict__") and not isinstance(x, type) and not callable(x):
        return ("O", type(x), tuple((k, _constant_key(v, visiting)) for k, v in vars(x).items()))
    return ("id", type(x), _Identity(x))  # nothing better to compare: this very object


class _Identity:
    """Equal only for the same object (a program traced with one function is not reused for another of the same
    name), shown by name: ranks compare digests of signatures, and an address differs from process to process."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return getattr(self.obj, "__qualname__", type(self.obj).__qualname__)
