"""Dims whose size changes between calls: traced as symbols, so one captured graph serves every size.

A capture with dynamic dims traces fn on fake inputs whose sizes in those dims are symbols of a ShapeEnv (as
torch.compile's dynamic shapes do): the graph computes sizes from its inputs (``sym_size`` nodes) instead of
holding them as numbers, and the ShapeEnv records what fn's Python assumed of them (its guards: a branch on a
size, a split that needs a size above 1). :class:`DynamicDims` answers, for a call of other sizes, whether the
graph holds for them (the guards), the symbols' values, and each value's shape at those sizes. The search plans
on :func:`planning_graph`: the same graph at the sizes it was traced for (the hint), sizes as numbers again.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .. import _pytree_internals as pytree
from ._fake_internals import FakeTensorMode, constant_source, functional_tensors

__all__ = ["DynamicDims", "SymbolicBindings", "planning_graph", "symbolic_input"]


class SymbolicBindings(dict):
    """The symbols' values as the sizes of a trace (SymInts of exec's trace for every size): every size computed
    from them stays symbolic in that trace, none read as a number."""


@dataclass
class DynamicDims:
    """The symbols of one capture: ``dims`` maps a graph input (its placeholder position) to {dim: symbol}."""

    shape_env: ShapeEnv
    dims: dict[int, dict[int, sympy.Symbol]] = dataclasses.field(default_factory=dict)
    _checks: list = dataclasses.field(default_factory=list, repr=False)  # each guard as a Python function
    _sizes: dict = dataclasses.field(default_factory=dict, repr=False)  # each size expression compiled (size)

    def symbolic(self, position: int, shape: tuple[int, ...], dynamic: tuple[int, ...]) -> tuple:
        """``shape`` with the ``dynamic`` dims as new symbols (hinted by their sizes now), for input ``position``."""
        out = list(shape)
        for d in dynamic:
            symbol = self.shape_env.create_symbol(shape[d], constant_source(f"shardfn_input{position}_dim{d}"),
                                                  dynamic_dim=DimDynamic.DYNAMIC)
            self.dims.setdefault(position, {})[d] = symbol
            out[d] = self.shape_env.create_symintnode(symbol, hint=shape[d])
        return tuple(out)

    def bindings(self, shapes: dict[int, tuple[int, ...]], symbolic: bool = False) -> dict[sympy.Symbol, int]:
        """The symbols' values for a call whose graph inputs have the global ``shapes`` (by position); ``symbolic``:
        shapes of a trace's (SymInts), as :class:`SymbolicBindings`."""
        if symbolic:
            return SymbolicBindings({symbol: shapes[position][d] for position, dims in self.dims.items()
                                     for d, symbol in dims.items()})
        return {symbol: int(shapes[position][d]) for position, dims in self.dims.items() for d, symbol in dims.items()}

    def rejects(self, bindings: dict[sympy.Symbol, int]) -> str | None:
        """Why the graph does not hold for these sizes (a guard fn's Python relied on, a symbol's range), or None."""
        for symbol, value in bindings.items():
            bounds = self.shape_env.var_to_range.get(symbol)
            if bounds is not None and not (bounds.lower <= value <= bounds.upper):
                return f"a dynamic dim of size {value} is outside the range the capture allows ({bounds})"
        guards = self.shape_env.guards
        if len(self._checks) != len(guards):  # (compiled once: a generation asks at every token)
            self._checks = [_check_of(g.expr) for g in guards]
        for guard, holds in zip(guards, self._checks):
            if not holds(bindings):
                return f"the capture assumed {guard.expr}, which does not hold for {bindings}"
        return None

    def described(self) -> str:
        """The sizes the graph holds for: each symbol's range, and what fn's Python assumed of them."""
        ranges = []
        for dims in self.dims.values():
            for symbol in dims.values():
                bounds = self.shape_env.var_to_range.get(symbol)
                upper = "" if bounds is None or not bounds.upper.is_Integer else str(int(bounds.upper))
                ranges.append(f"{symbol} >= {int(bounds.lower) if bounds is not None else 0}"
                              + (f", <= {upper}" if upper else ""))
        assumed = [str(g.expr) for g in self.shape_env.guards]
        return "sizes " + "; ".join(ranges) + (f" (assumed: {', '.join(assumed)})" if assumed else "")

    def size(self, s: Any, bindings: dict[sympy.Symbol, int]) -> Any:
        """A size (int or SymInt) at these bindings."""
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            if isinstance(bindings, SymbolicBindings):
                return _symbolic_size(expr)(bindings)
            compute = self._sizes.get(expr)
            if compute is None:  # (compiled once: an interpreted call asks for every value's shape)
                compute = self._sizes[expr] = _size_of(expr)
            return compute(bindings)
        return s

    def concrete(self, val: Any, bindings: dict[sympy.Symbol, int]) -> Any:
        """A node's value (or tuple of them) at these bindings: a tensor's shape and strides as numbers (a meta
        tensor), a size a number."""
        return _numbered(val, lambda s: self.size(s, bindings))


# the integer functions torch's size expressions use, as Python computes them (sizes are never negative)
_PYTHON = {"FloorDiv": operator.floordiv, "CleanDiv": operator.floordiv, "PythonMod": operator.mod,
           "Mod": operator.mod, "Max": max, "Min": min}


# the same, on a trace's SymInts: a maximum or minimum stays symbolic (Python's max would guard on a comparison)
_SYMBOLIC = {**_PYTHON, "Max": torch.sym_max, "Min": torch.sym_min}


@functools.lru_cache(maxsize=4096)
def _symbolic_size(expr: sympy.Basic) -> Callable[[SymbolicBindings], Any]:
    """A size expression computed from symbolic values (a trace's SymInts), as the trace records it."""
    if expr.is_Integer:
        value = int(expr)
        return lambda bindings: value
    if expr.is_Symbol:
        return lambda bindings: bindings[expr]
    symbols = sorted(expr.free_symbols, key=str)
    compiled = sympy.lambdify(symbols, expr, modules=[_SYMBOLIC, "math"])
    return lambda bindings: compiled(*(bindings[s] for s in symbols))


def _check_of(expr: sympy.Basic) -> Callable[[dict], bool]:
    """Whether ``expr`` (a guard) holds at some symbols' values (_compiled)."""
    return _compiled(expr, bool)


def _compiled(expr: sympy.Basic, cast: Callable) -> Callable[[dict], Any]:
    """``expr``'s value at some symbols' values, as ``cast`` reads it: a Python function compiled from it (a tenth
    of sympy's substitution, per expression and call), checked against the substitution the first time it runs,
    which is used instead where compiling fails or the two differ."""
    symbols = sorted(expr.free_symbols, key=str)
    try:
        compiled = sympy.lambdify(symbols, expr, modules=[_PYTHON, "math"])
    except Exception:  # noqa: BLE001 - a function lambdify does not know: substitution
        compiled = None
    trusted: list[bool] = []

    def substituted(bindings: dict) -> Any:
        return cast(expr.xreplace(bindings))

    def value(bindings: dict) -> Any:
        if compiled is None or trusted == [False]:
            return substituted(bindings)
        try:
            fast = cast(compiled(*(bindings[s] for s in symbols)))
        except Exception:  # noqa: BLE001 - a symbol without a value, an unknown function: substitution
            return substituted(bindings)
        if not trusted:
            trusted.append(fast == substituted(bindings))
            if not trusted[0]:
                return substituted(bindings)
        return fast

    return value


def _size_of(expr: sympy.Basic) -> Callable[[dict], int]:
    """A size expression's value at some symbols' values: a symbol or a number read as it is, anything else
    compiled (_compiled)."""
    if expr.is_Integer:
        value = int(expr)
        return lambda bindings: value
    if expr.is_Symbol:
        return lambda bindings: int(bindings[expr])
    return _compiled(expr, int)


def symbolic_input(fake_mode: FakeTensorMode, dims: DynamicDims, position: int, shape: tuple[int, ...],
                   dynamic: tuple[int, ...], **kwargs) -> torch.Tensor:
    """A fake input of ``shape`` whose ``dynamic`` dims are symbols."""
    with fake_mode:
        return torch.empty(dims.symbolic(position, shape, dynamic), **kwargs)


def _numbered(val: Any, size: Callable[[torch.SymInt], int], mode: FakeTensorMode | None = None) -> Any:
    """``val`` (a value, or a tuple of them) with its SymInts as the numbers ``size`` gives: a SymInt a number, a
    tensor of symbolic shape or strides an empty one of those numbers (on meta; or, in fake ``mode``, on its own
    device, requiring grad as it did)."""
    def number(s):
        return size(s) if isinstance(s, torch.SymInt) else s

    def one(x):
        if isinstance(x, torch.SymInt):
            return size(x)
        if not isinstance(x, torch.Tensor) or not any(isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride())):
            return x
        shape, stride = [number(s) for s in x.shape], [number(s) for s in x.stride()]
        if mode is None:
            return torch.empty_strided(shape, stride, dtype=x.dtype, device="meta")
        with mode:
            return torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)
    return pytree.tree_map(one, val)


def planning_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a symbolic graph at the sizes it was traced for: each size computed from the inputs becomes its
    number again and every value its shape at those sizes. The copy keeps the nodes' names, so a plan made on it
    names the nodes of the symbolic graph."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    sizes: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            sizes[node] = val.node.hint
        elif val is not None:
            node.meta = {**node.meta, "val": _numbered(val, lambda s: s.node.hint, mode)}
    for node in graph.nodes:
        node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: sizes.get(n, n))
    for node in reversed(list(sizes)):
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


def functionalized(func):
    """``func`` with its in-place ops as out-of-place ones and each input it wrote into written by one copy_ at
    the end (as torch.func.functionalize(func, remove="mutations")), by torch's Python functionalization: the C++
    one runs composite ops (dropout) whose kernels read a symbolic size as a number."""
    FunctionalTensor, FunctionalTensorMode = functional_tensors()

    def from_functional(t):
        torch._sync(t)
        return torch._from_functional_tensor(t.elem)

    def inner(*args):
        mode = FunctionalTensorMode()
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            with mode:
                wrapped = [FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a for a in args]
                outs = pytree.tree_map_only(FunctionalTensor, from_functional, func(*wrapped))
            for a, w in zip(args, wrapped):
                if isinstance(w, FunctionalTensor):
                    torch._sync(w)
                    if torch._functionalize_has_data_mutation(w.elem):
                        a.copy_(torch._from_functional_tensor(w.elem))
        return outs

    return inner
