"""CapturedGraph: what capture hands to strategy_search."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .structure import Structure

__all__ = ["CHECKPOINT_REGION", "MODULE_PATH", "CaptureError", "CapturedGraph", "GraphInput", "checkpoint_region",
           "draws_random", "is_getitem", "is_in_place", "is_seeded", "is_view", "made_from_alone", "module_path",
           "replayable"]

# the key in node.meta["custom"] naming the activation-checkpoint region a node was computed in
CHECKPOINT_REGION = "shardfn_checkpoint"


class CaptureError(RuntimeError):
    """``fn`` could not be traced into a graph (data-dependent control flow, an unsupported construct)."""


def checkpoint_region(node: torch.fx.Node) -> int | None:
    """The activation-checkpoint region (``torch.utils.checkpoint``) ``node`` was computed in, or None. Backward
    computes such values again from the region's inputs instead of keeping them from forward. Capture marks the
    captured graph's nodes; exec's tracing carries the mark on to the nodes of each rank's graphs."""
    return (node.meta.get("custom") or {}).get(CHECKPOINT_REGION)


# the key in node.meta["custom"] naming the submodule (its path in the captured module) a node was computed in
MODULE_PATH = "shardfn_module"


def module_path(node: torch.fx.Node) -> str:
    """The path, in the captured module, of the innermost submodule whose forward computed ``node``: "" for the
    module's own code, a function's, or a torch release without node annotations."""
    return (node.meta.get("custom") or {}).get(MODULE_PATH, "")


def is_in_place(target: Any) -> bool:
    """An aten-style op that writes into its first input and returns it (``copy_``, ``add_``): the ``_`` suffix.
    In a captured (functionalized) graph these are the updates of inputs: a buffer's running statistics."""
    return isinstance(target, torch._ops.OpOverload) and target.name().split("::")[-1].split(".")[0].endswith("_")


def is_seeded(target: Any) -> bool:
    """An aten op torch tags as drawing from a random generator (``bernoulli``, dropout, attention with dropout):
    whatever its arguments (:func:`draws_random` reads them)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def draws_random(node: torch.fx.Node) -> bool:
    """Does ``node`` draw from a random generator, so that computed again it would differ? An op torch tags as
    seeded does, but an attention kernel whose ``dropout_p`` is 0 draws nothing (transformers' models call SDPA
    so whenever attention dropout is off: in evaluation, and in training with their default of 0)."""
    target = node.target
    if not is_seeded(target):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return not (isinstance(given, (int, float)) and given == 0)
    return True


def replayable(node: torch.fx.Node) -> bool:
    """Can ``node`` run again with the same result? Not a random draw (drawn again, it would differ), nor a
    write."""
    return not is_in_place(node.target) and not draws_random(node)


def made_from_alone(graph: torch.fx.Graph, roots, where=None) -> set[torch.fx.Node]:
    """``roots`` and the values ``graph`` computes from them alone (each input of the op among them, and the op
    passing ``where`` if given): what a parameter's gather, cast or transpose makes, which backward can make again
    from the parameter's piece."""
    found = set(roots)
    for node in graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in found for a in node.all_input_nodes) \
                and (where is None or where(node)):
            found.add(node)
    return found


def is_getitem(node: torch.fx.Node) -> bool:
    """getitem on a multi-output node: one of its producer's outputs, taken as it is (no decision of its own)."""
    return node.op == "call_function" and node.target is operator.getitem


def is_view(target: Any) -> bool:
    """An aten op whose result is a view of its input (``view``, ``t``, ``slice``, ``expand``): it holds no memory
    of its own, and its gradient goes to its input's."""
    return isinstance(target, torch._ops.OpOverload) and target.is_view


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of the captured graph: a module parameter, a module buffer, or a tensor input."""

    kind: str  # "param" | "buffer" | "input"
    name: str  # parameter/buffer path, or the input's name: "input 0", "input 2[1]", "attention_mask"
    index: int  # position among the module's params/buffers, or among the tensor leaves of (args, kwargs)
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # a 0-dim input on the CPU of a program on another device, needing no gradient, traced there: eager mixes CPU
    # scalars with device tensors (a StaticCache's counter, whose ``.to(device)`` is then a copy)
    on_cpu: bool = False


@dataclass
class CapturedGraph:
    """An aten-level fx graph of ``fn`` on fake tensors of the global shapes.

    Placeholders are ``inputs`` in order (parameters, buffers, then the tensors reachable in the call's args and
    kwargs, in :func:`~shardfn.capture.structure.split` order); every node carries ``meta["val"]``, the fake value
    of its global result. The graph returns fn's tensors (``n_outputs`` of them; ``outputs`` rebuilds fn's return
    value around them), then the new tensors of the argument objects fn changed (``states``: argument object
    number, first output index, its new state). The graph is forward only: backward is derived at lowering.
    """

    gm: torch.fx.GraphModule
    inputs: list[GraphInput]
    arguments: Structure
    outputs: Structure
    n_outputs: int
    states: list[tuple[int, int, Structure]]
    # dims traced as symbols (capture.dynamic.DynamicDims), or None: every size is a number of the graph
    dynamic: Any = None

    def result(self, values: list, inputs: list, arguments: list) -> Any:
        """fn's return value from the graph's outputs; first each changed argument object gets its new state.
        ``inputs`` are the call's argument tensors, ``arguments`` its argument objects (the caller's)."""
        for number, first, state in self.states:
            state.write_back(arguments[number], values[first:], inputs, arguments)
        return self.outputs.rebuild(values, inputs, arguments)

    def code_across_ranks(self) -> str:
        """The graph's code as every rank must hold it: each rank traces on its own device (cuda:0 on rank 0,
        cuda:1 on rank 1), whose index is left out."""
        return re.sub(r"device\(type='(\w+)', index=\d+\)", r"device(type='\1')", self.gm.code)

    def __post_init__(self):
        # the graph is final once captured: its placeholders and outputs are read on every call
        self.placeholders: list[torch.fx.Node] = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        (out,) = [n for n in self.gm.graph.nodes if n.op == "output"]
        self.output_nodes: list[torch.fx.Node] = list(out.args[0])
        # placeholder index -> the nodes writing into that input in place (its update, e.g. running_mean)
        position = {n: i for i, n in enumerate(self.placeholders)}
        self.writes: dict[int, list[torch.fx.Node]] = {}
        for n in self.gm.graph.nodes:
            if n.op == "call_function" and is_in_place(n.target) and n.args and n.args[0] in position:
                self.writes.setdefault(position[n.args[0]], []).append(n)
