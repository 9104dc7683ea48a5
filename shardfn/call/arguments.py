"""A call's arguments against the config: every tensor they hold, its strategy, and how it arrives.

Every tensor reachable in a call's args and kwargs (through pytree containers and the attributes of plain
objects, in :func:`shardfn.capture.structure.split`'s order) is an input of the sharded program (:func:`bind`).
``in_strategy`` gives them layouts:

* a tuple: one entry per positional argument (MindSpore's form); tensors passed by keyword are left to the
  search;
* a dict ``{argument name: entry}``: arguments by the names in fn's signature (a module's forward), positional or
  keyword alike; arguments not named are left to the search.

An entry is a strategy (a tuple of split counts or a layout) for a tensor argument, None (the search decides, for
a tensor or for everything inside a container), or a tuple/list/dict shaped like a container argument with an
entry for each of its items. The config holds them read (:meth:`shardfn.config.ShardConfig.make`: each strategy a
:class:`~shardfn.layout.Strategy`, told apart from a container there); binding only matches them to the arguments
and checks each against its tensor's shape and the world.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from .. import _pytree_internals as pytree
from ..capture import split_arguments
from ..capture.structure import kept_as_is, split
from ..config import ShardConfig
from ..layout import Axis, Strategy, TensorSpec, normalize_strategy, spec_of_dtensor

__all__ = ["BoundCall", "bind", "call_key", "sizes_of", "without_batch_rows", "without_sizes"]


def _align(value: Any, entry: Any, where: str, what: str) -> list[tuple[Any, str]]:
    """(strategy, the argument that gave it) for each tensor in ``value`` (split's order), from its in_strategy
    ``entry``."""
    if entry is None:
        return [(None, where)] * len(split(value)[0])
    if isinstance(value, torch.Tensor):
        if not isinstance(entry, Strategy):
            raise ValueError(f"{where} is {entry!r} but {what} is one tensor; give one strategy (a tuple of split "
                             "counts or a layout) or None")
        return [(entry, where)]
    if isinstance(value, (tuple, list)) and isinstance(entry, (tuple, list)):
        if len(entry) != len(value):
            raise ValueError(f"{where} has {len(entry)} entries but {what} holds {len(value)} items; give one entry "
                             "per item (None to let shardfn decide)")
        return [s for i, (v, e) in enumerate(zip(value, entry)) for s in _align(v, e, f"{where}[{i}]", f"{what}[{i}]")]
    if isinstance(value, dict) and isinstance(entry, dict):
        unknown = [k for k in entry if k not in value]
        if unknown:
            raise ValueError(f"{where} names {unknown} but {what} has only the keys {list(value)}")
        return [s for k, v in value.items() for s in _align(v, entry.get(k), f"{where}[{k!r}]", f"{what}[{k!r}]")]
    if len(pytree.tree_leaves(value)) == 1 and pytree.tree_leaves(value)[0] is value:
        if isinstance(entry, Strategy) and hasattr(value, "__dict__") and not kept_as_is(value):
            return _across_object(value, entry, where, what)
        raise ValueError(f"{where} is {entry!r} but {what} is a {type(value).__name__}, not a tensor; use None")
    raise ValueError(f"{where} is {entry!r} but {what} is a {type(value).__name__}; give None, or for a tuple, "
                     "list or dict of tensors an entry of the same shape")


def _across_object(value: Any, entry: Strategy, where: str, what: str) -> list[tuple[Any, str]]:
    """One strategy for an object (a KV cache, whose tensors have no entries of their own): each of its tensors
    with as many dims as the strategy names takes it; the others (a StaticCache's 0-dim counter) take the
    default, as if the entry were None. (A cache before its first call may hold its counters alone.)"""
    n = len(entry.spec.dims)
    tensors = split(value)[0]
    dims = sorted({t.dim() for t in tensors if t.dim() > 0})
    if dims and n not in dims:
        raise ValueError(f"{where} = {entry!r} lays out {n}-dim tensors but {what} is a {type(value).__name__} "
                         f"whose tensors have {dims} dims; give a strategy for its tensors' dims, or None")
    return [(entry, where) if t.dim() == n else (None, where) for t in tensors]


def _strategies(config: ShardConfig, fn: Callable, name: str, args: Sequence[Any], kwargs: dict) -> list:
    """(in_strategy's entry, the argument naming it) for every tensor in (args, kwargs), in split's order."""
    if isinstance(config.in_strategy, tuple):
        if len(config.in_strategy) != len(args):
            raise ValueError(
                f"in_strategy has {len(config.in_strategy)} entries but {name} was called with {len(args)} "
                f"positional inputs; give one entry per positional input (None for non-tensors or to let shardfn "
                f"decide), or a dict {{argument name: entry}}")
        found = [s for i, (a, e) in enumerate(zip(args, config.in_strategy))
                 for s in _align(a, e, f"in_strategy[{i}]", f"input {i}")]
        return found + [(None, "in_strategy")] * len(split(dict(kwargs))[0])
    by_name = _argument_names(fn, args, kwargs)
    given = config.in_strategy
    found = []
    for i, a in enumerate(args):
        key = by_name[i]
        entry = given.get(key[0]) if key[1] is None else _item(given.get(key[0]), key[1])
        found += _align(a, entry, f"in_strategy[{key[0]!r}]", f"input {i} ({key[0]})")
    for k, v in kwargs.items():
        found += _align(v, given.get(k), f"in_strategy[{k!r}]", f"argument {k!r}")
    return found


def _argument_names(fn: Callable, args: Sequence[Any], kwargs: dict) -> list[tuple[str, int | None]]:
    """For each positional argument: (its parameter's name, its index within ``*args`` or None)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise TypeError("in_strategy is a dict but fn's signature cannot be read; give a tuple, one entry per "
                        "positional input") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for i in range(len(args)):
        if i < len(positional):
            out.append((positional[i].name, None))
            continue
        star = next((p for p in params if p.kind is p.VAR_POSITIONAL), None)
        if star is None:
            raise TypeError(f"fn takes {len(positional)} positional arguments but {len(args)} were given")
        out.append((star.name, i - len(positional)))
    return out


def _item(entry: Any, index: int) -> Any:
    """The entry of the index-th extra positional argument, from the entry given for ``*args``."""
    if entry is None:
        return None
    if not isinstance(entry, (tuple, list)):
        raise ValueError(f"the entry for *args must be a tuple with one entry per extra positional argument, got "
                         f"{entry!r}")
    return entry[index] if index < len(entry) else None


@dataclass
class BoundCall:
    """One call's tensor inputs (split's order: args, then kwargs) and what the config says of them."""

    tensors: list[torch.Tensor]
    names: list[str]  # "input 0", "input 2[1]", "attention_mask", ...
    shapes: list[tuple[int, ...]]  # global shapes
    held: list[TensorSpec]  # how each arrives: whole, this rank's batch slice, a DTensor's own layout
    fixed: list[TensorSpec | None]  # the layout asked for, or None for the search to decide
    batch: tuple[Axis, ...] = ()  # data_parallel: the axes that split the batch (dim 0 of inputs and outputs)


def bind(config: ShardConfig, fn: Callable, name: str, args: Sequence[Any], kwargs: dict,
         world: int, rows: dict[int, int] | None = None) -> BoundCall:
    """Check a call's arguments against the config (local, every rank) and lay out what each tensor is.
    ``rows``: data_parallel inputs' global rows by tensor number, where the slices are uneven
    (shardfn.call.uneven_batch); else each is its slice's rows times the slices."""
    tensors, names, _ = split_arguments(args, kwargs, names=True, where=lambda: name)
    strategies = _strategies(config, fn, name, args, kwargs)
    bound = BoundCall([], [], [], [], [])
    if config.dataset_strategy == "data_parallel":
        bound.batch = _batch_axes(tensors, strategies, names, world)
        arguments = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
    for leaf, (s, arg), where in zip(tensors, strategies, names, strict=True):
        if isinstance(leaf, DTensor):
            shape = tuple(leaf.shape)
            held = spec_of_dtensor(leaf, world, where, config.ranks)
            fixed = held if s is None else normalize_strategy(s, shape, world, arg, where)
        elif config.dataset_strategy == "data_parallel":
            shape, held = _batch_slice(leaf, s, arg, where, world, bound.batch,
                                       (rows or {}).get(len(bound.tensors)), inside=id(leaf) not in arguments)
            fixed = held
        else:
            shape = tuple(leaf.shape)
            held = TensorSpec.replicated(leaf.dim())
            fixed = None if s is None else normalize_strategy(s, shape, world, arg, where)
        bound.tensors.append(leaf)
        bound.names.append(where)
        bound.shapes.append(shape)
        bound.held.append(held)
        bound.fixed.append(fixed)
    if config.dataset_strategy == "data_parallel" and not any(_plain_batch(t) for t in tensors) and bound.held:
        bound.batch = bound.held[0].dims[0] if bound.held[0].dims else ()  # DTensors alone: as the first lies
    return bound


def _batch_axes(tensors: list[torch.Tensor], strategies: list, names: list[str], world: int) -> tuple[Axis, ...]:
    """The axes that split a data_parallel call's batch: those the first batch input given a strategy names
    (input_ids' "dp" on a (dp, tp) mesh), else every rank. Batch tensors without a strategy of their own (a
    KV cache's, an attention mask generate() makes) hold this rank's rows of the same batch: split alike."""
    for leaf, (s, arg), where in zip(tensors, strategies, names):
        if s is not None and _plain_batch(leaf):
            return _batch_strategy(s, arg, where, world).dims[0]
    return normalize_strategy((world,), None, world, "data_parallel").dims[0]


def _plain_batch(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) and t.dim() > 0


def _batch_strategy(s: Any, arg: str, where: str, world: int) -> TensorSpec:
    """A data_parallel input's given strategy, checked: it splits dim 0 alone (this rank's batch slice)."""
    given = normalize_strategy(s, None, world, arg, where)
    splits = math.prod(a.size for a in given.dims[0]) if given.dims else 1
    if not given.dims or any(given.dims[1:]) or given.partial or (splits == 1 and world > 1):
        dp = (world,) + (1,) * (max(len(given.dims), 1) - 1)
        raise ValueError(
            f"{arg} = {s!r}: with dataset_strategy='data_parallel' each input arrives split on dim 0 only "
            f"(this rank's batch slice); give the device axes that split dim 0 and no other dim (ranks "
            f"along other axes pass equal slices), or None for the batch's axes (all {world} ranks unless an "
            f"input names them): use None or {dp!r}")
    return given


def _batch_slice(leaf: torch.Tensor, s: Any, arg: str, where: str, world: int, batch: tuple[Axis, ...],
                 rows: int | None, inside: bool) -> tuple[tuple[int, ...], TensorSpec]:
    """A data_parallel tensor's global shape and how it arrives: this rank's rows, split on dim 0 over the axes
    its strategy names, or the batch's. A 0-dim tensor ``inside`` an argument (a StaticCache's counter) has no
    rows: every rank holds it alike, whole (a 0-dim argument could be a number)."""
    if leaf.dim() == 0:
        if inside:
            return (), TensorSpec.replicated(0)
        raise ValueError(f"{where}: data_parallel inputs need a batch dim 0; got a 0-dim tensor (pass a "
                         "Python number instead, or use dataset_strategy='full_batch')")
    axes = batch if s is None else _batch_strategy(s, arg, where, world).dims[0]
    shape = (leaf.shape[0] * math.prod(a.size for a in axes) if rows is None else rows,) + tuple(leaf.shape[1:])
    held = TensorSpec((axes,) + ((),) * (leaf.dim() - 1))
    if s is not None:  # (the given strategy's own checks against the shape: its length)
        held = normalize_strategy(s, shape, world, f"{where} (data_parallel)")
    return shape, held


def batch_slices(config: ShardConfig, world: int) -> int:
    """How many distinct batch slices a call's ranks pass (data_parallel: the split of the first input's dim 0;
    full_batch: 1)."""
    if config.dataset_strategy != "data_parallel":
        return 1
    entries = list(config.in_strategy.values()) if isinstance(config.in_strategy, dict) else list(config.in_strategy)
    first = entries[0] if entries else None
    if not isinstance(first, Strategy):
        return world
    spec = normalize_strategy(first, None, world, "in_strategy[0]")
    return math.prod(a.size for a in spec.dims[0]) if spec.dims else world


def _tensor_key(a: torch.Tensor) -> tuple:
    """One tensor's part of a signature's structure: all but its sizes (those follow apart)."""
    if isinstance(a, DTensor):
        return ("D", a.dim(), a.dtype, a.requires_grad, tuple(a.placements), tuple(a.device_mesh.shape))
    return ("T", a.dim(), a.dtype, a.requires_grad, a.device.type)


def without_sizes(key: tuple) -> tuple:
    """A signature without its tensors' sizes: the structure calls of other sizes share (see :func:`call_key`)."""
    return (key[0], *key[2:])


def sizes_of(key: tuple) -> tuple:
    """A signature's tensors' shapes, in order (see :func:`call_key`)."""
    return key[1]


def without_batch_rows(key: tuple, tensors: list[torch.Tensor]) -> tuple:
    """A signature with the rows of each plain tensor (a data_parallel batch slice; ``tensors``: the call's) left
    out: what ranks passing slices of other lengths share."""
    sizes = tuple((None, *s[1:]) if s and not isinstance(t, DTensor) else s for s, t in zip(key[1], tensors))
    return (key[0], sizes, *key[2:])


def call_key(args: Sequence[Any], kwargs: dict) -> tuple[tuple, list[torch.Tensor], list]:
    """A call's signature, its tensors (the program's inputs, in order) and its argument objects (by number).

    The signature is (structure, sizes, ...): the structure (containers, object types and attributes, other
    values; each tensor's dtype, requires_grad, rank and layout; grad mode, autocast), then the tensors' shapes in
    order; a caller appends what else tells its calls apart. Calls that differ in sizes alone share all but the
    second (:func:`without_sizes`), found without walking the signature again (a generation asks at every token).
    """
    grad = torch.is_grad_enabled()
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call: plain tensors only
        structure = ("plain", tuple(_tensor_key(a) for a in args), grad, _autocast_state())
        return (structure, tuple(tuple(a.shape) for a in args)), list(args), []
    try:
        tensors, _, structure = split_arguments(args, kwargs)
    except TypeError:  # an argument shardfn cannot take apart: again with names, for an error that names it
        split_arguments(args, kwargs, names=True)
        raise
    free = _Hashed((structure.key(lambda i: _tensor_key(tensors[i])), grad, _autocast_state()))
    return (free, tuple(tuple(t.shape) for t in tensors)), tensors, structure.objects() if structure.n_objects else []


class _Hashed:
    """A signature's structure with its hash computed once: a call looks its signature up in several tables (its
    program, the program for every size), and the pytree specs inside hash in Python (a generation's every
    token: ~10 us a lookup for a DynamicCache's). Equal, repr'd and ordered as the structure itself."""

    __slots__ = ("value", "hash")

    def __init__(self, value: tuple):
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Hashed) and self.hash == other.hash and (
            self.value is other.value or self.value == other.value)

    def __repr__(self) -> str:
        return repr(self.value)


def _autocast_state() -> tuple:
    """torch.autocast regions change the captured ops' dtypes: a program traced inside one is not reused outside."""
    return tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cpu", "cuda"))
