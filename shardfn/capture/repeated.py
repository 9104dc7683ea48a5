"""Identical layers traced once: a model's repeated layers captured at the cost of two.

A model's layers (the modules of an ``nn.ModuleList`` or ``nn.Sequential``) that are alike (one class, parameters
and buffers of the same shapes and dtypes, the same attributes but ``layer_idx``) and are called on arguments alike
(the same shapes, strides and dtypes, the same Python values) run the same ops on their own parameters. Tracing
each costs seconds at real sizes (80 layers of a 70B model: most of a 13 s capture), so while fn is captured:

- the first two calls of a layer run as they are, their inputs (arguments, parameters and buffers) and outputs
  passed through marker ops (``shardfn::layer_inputs``, ``shardfn::layer_outputs``) that show where they start
  and end in the graph;
- each later call becomes one ``shardfn::layer_copy`` node on its inputs, with outputs of the first call's shapes.

After the trace (:meth:`LayersTracedOnce.inlined`) each copy node is replaced by a copy of the first call's nodes on
its own inputs, annotated with its own module path, and the markers are removed: the graph is the one a full trace
makes. That holds only where the ops do not depend on which layer runs them, so the second traced call is the
witness: where its ops differ from the first's (a layer that reads its index, ``x / (layer_idx + 1)``), or a
traced call wrote into its inputs or read a value from outside them, the capture traces fn again with those
layers run as they are (:class:`NotCopied`). A layer's own checkpoint regions (transformers' gradient
checkpointing wraps each layer's forward) are numbered in each copy as a trace numbers them, and constants it
makes are compared by value and named as a trace names them.

A layer with hooks on its submodules, arguments that are not tensors or plain values (a KV cache object), or a
dynamic capture (symbolic sizes) is always traced as it runs.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import operator
import re
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx

from .. import _pytree_internals as pytree
from . import functions as _functions  # noqa: F401 - defines shardfn::autograd_function
from ._fake_internals import disable_current_modes
from ._tracing import checkpoint_regions_so_far, own_global_hooks, skip_checkpoint_regions
from .graph import CHECKPOINT_REGION, MODULE_PATH

__all__ = ["LayersTracedOnce", "NotCopied"]

_STATE = threading.local()  # .active: the LayersTracedOnce of the capture running on this thread
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"forward"}
_INDEX_NAMES = frozenset({"layer_idx"})  # an index transformers' layers keep for their KV cache
_SIMPLE = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, enum.Enum)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class NotCopied(Exception):
    """Layers whose copies would differ from a trace: the capture traces them as they run."""

    def __init__(self, signatures: set):
        super().__init__(f"{len(signatures)} kind(s) of layer traced as they run")
        self.signatures = signatures


@dataclass
class _Calls:
    """The calls of layers alike on arguments alike."""
    signature: Any  # the layers' signature (what NotCopied names)
    traced: list[int] = field(default_factory=list)  # the numbers of its marked calls (first, witness)
    copyable: bool = True
    outputs: list[tuple] | None = None  # (shape, stride, dtype, device) of each output tensor
    structure: Any = None  # the output's (spec, non-tensor leaves)
    regions: int | None = None  # how many checkpoint regions one call runs inside


@dataclass
class _Marked:
    calls: _Calls
    path: str
    regions: int = 0  # the checkpoint regions met before it (its own are numbered from here)


class LayersTracedOnce:
    """One capture's repeated layers (see the module docstring); :meth:`patched` while fn is traced, then
    :meth:`inlined` on its graph."""

    def __init__(self, root: torch.nn.Module | None, applies: Callable[[], bool], excluded: set = frozenset()):
        self.applies = applies
        self.marked: list[_Marked] = []  # each marked call, by number
        # each copy node's (calls, module path, checkpoint regions met before it), by number
        self.copies: list[tuple[_Calls, str, int]] = []
        self.calls: dict[Any, _Calls] = {}
        self.inside = 0  # > 0 while a marked call runs: layers inside it run as they are
        # id(layer) -> (layer, signature, its attributes alone, path)
        self.layers = _repeated_layers(root, excluded) if root is not None else {}

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """While active, the repeated layers' forwards are routed here (each layer's own ``forward`` attribute)."""
        saved = _STATE.__dict__.get("active")
        _STATE.active = self
        routed = []
        try:
            for layer, *_ in self.layers.values():
                if "forward" not in vars(layer):  # (one the user set on the instance is left alone)
                    layer.forward = types.MethodType(_routed_forward(self, type(layer).forward), layer)
                    routed.append(layer)
            yield
        finally:
            for layer in routed:
                del layer.forward
            _STATE.active = saved

    # -- while fn is traced -----------------------------------------------------------------------------------

    def call(self, layer: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        _, signature, attributes, path = self.layers[id(layer)]
        key = None if self.inside or not self.applies() else _call_key(layer, signature, attributes, args, kwargs)
        if key is None:
            return forward(layer, *args, **kwargs)
        calls = self.calls.setdefault(key, _Calls(signature))
        if not calls.copyable:
            return forward(layer, *args, **kwargs)
        if len(calls.traced) < 2:
            return self._marked_call(layer, forward, args, kwargs, calls, path)
        return self._copied_call(layer, args, kwargs, calls, path)

    def _marked_call(self, layer, forward, args, kwargs, calls: _Calls, path: str) -> Any:
        number = len(self.marked)
        regions = checkpoint_regions_so_far()
        self.marked.append(_Marked(calls, path, regions))
        calls.traced.append(number)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        state = _state_of(layer)
        inputs = layer_inputs([leaves[i] for i in at] + [t for *_, t in state], number)
        for i, t in zip(at, inputs):
            leaves[i] = t
        a, k = pytree.tree_unflatten(leaves, spec)
        self.inside += 1
        try:
            with _state_swapped(state, inputs[len(at):]):
                out = forward(layer, *a, **k)
        finally:
            self.inside -= 1
        out_leaves, out_spec = pytree.tree_flatten(out)
        tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        structure = (out_spec, [None if isinstance(x, torch.Tensor) else x for x in out_leaves])
        outputs = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors]
        inner = checkpoint_regions_so_far() - regions
        if (not tensors or _written(inputs) or _aliases(tensors, inputs) or not all(_simple(x) for x in structure[1])
                or (calls.outputs is not None and (calls.outputs, repr(calls.structure), calls.regions)
                    != (outputs, repr(structure), inner))):
            calls.copyable = False
        calls.outputs, calls.structure, calls.regions = outputs, structure, inner
        marked = iter(layer_outputs(tensors, number)) if tensors else iter(())
        return pytree.tree_unflatten([next(marked) if isinstance(x, torch.Tensor) else x for x in out_leaves],
                                     out_spec)

    def _copied_call(self, layer, args, kwargs, calls: _Calls, path: str) -> Any:
        number = len(self.copies)
        self.copies.append((calls, path, checkpoint_regions_so_far()))
        skip_checkpoint_regions(calls.regions)  # its regions numbered as a trace would number them
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outs = iter(layer_copy(tensors + [t for *_, t in _state_of(layer)], number))
        spec, leaves = calls.structure
        return pytree.tree_unflatten([next(outs) if x is None else x for x in leaves], spec)

    # -- after the trace --------------------------------------------------------------------------------------

    def inlined(self, gm: torch.fx.GraphModule, function_calls: list) -> torch.fx.GraphModule:
        """``gm`` with every copy node replaced by its layer's ops and the markers removed; raises
        :class:`NotCopied` naming the layers whose copies would not be what a trace makes."""
        if not self.marked:
            return gm
        segments = _segments(gm, len(self.marked))
        copied = {id(calls): calls for calls, *_ in self.copies}  # the kinds of call copied, each once
        # a traced call found unfit to copy (it wrote into its inputs, say) ran on its marked inputs, not on the
        # values themselves: traced again as it runs
        failed = {m.calls.signature for n, m in enumerate(self.marked)
                  if not m.calls.copyable or (id(m.calls) in copied and not _closed(segments[n]))}
        for calls in copied.values():
            first, witness = (segments[n] for n in calls.traced[:2])
            if calls.signature not in failed and not _alike(gm, first, witness, function_calls):
                failed.add(calls.signature)
        if failed:
            raise NotCopied(failed)
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is _COPY:
                calls, path, regions = self.copies[node.args[1]]
                first = self.marked[calls.traced[0]]
                _copy_into(graph, node, segments[calls.traced[0]], (first.path, path), regions - first.regions,
                           function_calls)
        for segment in segments:
            _unmarked(graph, segment.start)
            _unmarked(graph, segment.end)
        _constants_numbered(gm)
        graph.lint()
        gm.recompile()
        return gm


# -- the marker and copy ops ----------------------------------------------------------------------------------

def _like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors]


@torch.library.custom_op("shardfn::layer_inputs", mutates_args=())
def layer_inputs(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    raise RuntimeError("shardfn::layer_inputs marks a layer's inputs only while fn is captured")


@torch.library.custom_op("shardfn::layer_outputs", mutates_args=())
def layer_outputs(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    raise RuntimeError("shardfn::layer_outputs marks a layer's outputs only while fn is captured")


@torch.library.custom_op("shardfn::layer_copy", mutates_args=())
def layer_copy(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    raise RuntimeError("shardfn::layer_copy stands for a layer's ops only while fn is captured")


layer_inputs.register_fake(lambda tensors, call: _like(tensors))
layer_outputs.register_fake(lambda tensors, call: _like(tensors))


@layer_copy.register_fake
def _(tensors, call):
    calls, *_ = _STATE.active.copies[call]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in calls.outputs]


_INPUTS, _OUTPUTS, _COPY = (torch.ops.shardfn.layer_inputs.default, torch.ops.shardfn.layer_outputs.default,
                            torch.ops.shardfn.layer_copy.default)
_FUNCTION = torch.ops.shardfn.autograd_function.default  # (capture.functions: a Function call's node)


# -- the graph: segments, their check, their copies -----------------------------------------------------------

@dataclass
class _Segment:
    start: torch.fx.Node  # the layer_inputs marker
    inputs: dict[int, torch.fx.Node]  # its getitem node of each input
    nodes: list[torch.fx.Node]  # the layer's own ops, in order
    end: torch.fx.Node | None = None  # the layer_outputs marker


def _segments(gm: torch.fx.GraphModule, n: int) -> list[_Segment]:
    """Each marked call's segment of the graph, by number (trace order is graph order)."""
    segments: list[_Segment | None] = [None] * n
    current = None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _INPUTS:
            current = segments[node.args[1]] = _Segment(node, {}, [])
        elif node.op == "call_function" and node.target is _OUTPUTS:
            segments[node.args[1]].end = node
            current = None
        elif current is not None:
            if _is_item_of(node, current.start):
                current.inputs[node.args[1]] = node
            else:
                current.nodes.append(node)
    return segments


def _is_item_of(node: torch.fx.Node, of: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and node.args[0] is of


def _outside(node: torch.fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def _closed(segment: _Segment) -> bool:
    """Whether the segment reads only its inputs (or the graph's inputs and constants), and only its outputs are
    read after it."""
    inside = set(segment.nodes) | set(segment.inputs.values())
    if segment.end is None:
        return False
    for node in segment.nodes:
        if any(x not in inside and not _outside(x) for x in node.all_input_nodes):
            return False
    return all(u in inside or u is segment.end for node in inside for u in node.users)


def _alike(gm: torch.fx.GraphModule, first: _Segment, witness: _Segment, function_calls: list) -> bool:
    """Whether the two traced calls made the same ops on corresponding values."""
    if len(first.nodes) != len(witness.nodes) or first.inputs.keys() != witness.inputs.keys():
        return False
    twin = {first.inputs[i]: witness.inputs[i] for i in first.inputs}

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, (torch.fx.Node, torch.Tensor)) or isinstance(b, (torch.fx.Node, torch.Tensor)):
            return twin.get(a, a) is b
        return type(a) is type(b) and (a == b or (a != a and b != b))  # (NaN equals NaN here)

    for a, b in zip(first.nodes, witness.nodes):
        if a.op == b.op == "get_attr":  # a constant each call made (its own attribute): alike if equal
            if not _equal_constants(getattr(gm, a.target), getattr(gm, b.target)):
                return False
        elif a.op != b.op or a.target != b.target:
            return False
        (la, sa), (lb, sb) = pytree.tree_flatten((a.args, a.kwargs)), pytree.tree_flatten((b.args, b.kwargs))
        if a.target is _FUNCTION:  # (tensors, call number): the calls must be of one Function call alike
            la, lb = la[:-1], lb[:-1]
            if function_calls[a.args[1]] is not function_calls[b.args[1]]:
                return False
        if sa != sb or len(la) != len(lb) or not all(same(x, y) for x, y in zip(la, lb)):
            return False
        twin[a] = b
    return all(same(x, y) for x, y in zip(first.end.args[0], witness.end.args[0]))


def _equal_constants(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.shape, a.dtype, a.stride(), a.device) != (b.shape, b.dtype, b.stride(), b.device):
            return False
        with disable_current_modes():  # (the capture's fake mode is still on: these are real values)
            return bool(torch.equal(a, b))
    return a is b


def _copy_into(graph: torch.fx.Graph, copy: torch.fx.Node, segment: _Segment, paths: tuple[str, str],
               shift: int, function_calls: list) -> None:
    """The segment's ops on the copy node's inputs, in its place: its module paths moved from ``paths[0]`` to
    ``paths[1]``, its own checkpoint regions' numbers by ``shift``."""
    tensors = copy.args[0]
    value = {node: tensors[i] for i, node in segment.inputs.items()}
    outer = segment.start.meta.get("custom") or {}
    own = copy.meta.get("custom") or {}
    with graph.inserting_before(copy):
        for node in segment.nodes:
            new = graph.node_copy(node, lambda x: value.get(x, x))
            if node.target is _FUNCTION:  # each call its own number (FunctionCall is per call)
                new.args = (new.args[0], len(function_calls))
                function_calls.append(function_calls[node.args[1]])
            new.meta["custom"] = _annotations(node, outer, own, paths, shift)
            value[node] = new
    outs = [value.get(x, x) for x in segment.end.args[0]]
    for item in list(copy.users):
        item.replace_all_uses_with(outs[item.args[1]])
        graph.erase_node(item)
    graph.erase_node(copy)


def _annotations(node: torch.fx.Node, outer: dict, own: dict, paths: tuple[str, str], shift: int) -> dict:
    """A copied node's annotations: the copy's own (the checkpoint region around it, its module path), the ones
    the layer set inside itself (its own checkpoint regions renumbered), its submodule's path moved to the copy's
    layer."""
    custom = dict(own)
    (from_path, to_path) = paths
    for k, v in (node.meta.get("custom") or {}).items():
        if k == MODULE_PATH:
            if v == from_path or v.startswith(from_path + "."):
                custom[k] = to_path + v[len(from_path):]
        elif outer.get(k) != v:
            custom[k] = v + shift if k == CHECKPOINT_REGION else v
    return custom


def _constants_numbered(gm: torch.fx.GraphModule) -> None:
    """The graph's constants named as a trace names them (``_tensor_constant0``, ``1``, ... in the order it first
    reads each): a copy reads its first call's, under a name of its own."""
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and re.fullmatch(r"_tensor_constant\d+", n.target)]
    values = [getattr(gm, n.target) for n in nodes]
    for name in {n.target for n in nodes}:
        delattr(gm, name)
    for i, (node, value) in enumerate(zip(nodes, values)):
        node.target = f"_tensor_constant{i}"
        setattr(gm, node.target, value)


def _unmarked(graph: torch.fx.Graph, marker: torch.fx.Node | None) -> None:
    """The marker gone: its items read what it marked."""
    if marker is None:
        return
    for item in list(marker.users):
        item.replace_all_uses_with(marker.args[0][item.args[1]])
        graph.erase_node(item)
    graph.erase_node(marker)


# -- which layers, which calls ----------------------------------------------------------------------------------

def _repeated_layers(root: torch.nn.Module, excluded: set) -> dict[int, tuple[torch.nn.Module, Any, Any, str]]:
    """id(layer) -> (layer, signature, its attributes alone, path) for the modules of root's ModuleLists and
    Sequentials that have a twin."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    by_signature: dict[Any, list[torch.nn.Module]] = {}
    for m in root.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            for layer in m.children():
                signature = _signature(layer)
                if signature is not None and signature not in excluded:
                    by_signature.setdefault(signature, []).append(layer)
    return {id(layer): (layer, signature, _signature(layer, state=False), paths[id(layer)])
            for signature, layers in by_signature.items() if len({id(x) for x in layers}) >= 2 for layer in layers}


def _signature(layer: torch.nn.Module, state: bool = True) -> Any:
    """What makes two layers run the same ops: their modules' classes, attributes (but the index) and, with
    ``state``, their parameters' and buffers' shapes, dtypes and requires_grad."""
    parts = []
    for path, sub in layer.named_modules(remove_duplicate=False):
        tensors = tuple((name, tuple(t.shape), t.dtype, bool(t.requires_grad))
                        for name, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None) \
            if state else ()
        attributes = tuple(sorted((k, _value(v)) for k, v in vars(sub).items()
                                  if k not in _MODULE_INTERNALS and k not in _INDEX_NAMES))
        parts.append((path, type(sub), tensors, attributes))
    return tuple(parts)


def _value(v: Any) -> Any:
    """An attribute as the signature compares it: plain values by value, anything else by identity."""
    if _simple(v):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value(x) for x in v))
    if isinstance(v, functools.partial):  # (made per layer: GELU's tanh approximation)
        return ("partial", _value(v.func), _value(v.args), tuple(sorted((k, _value(x)) for k, x in v.keywords.items())))
    return ("id", id(v))


def _simple(v: Any) -> bool:
    return isinstance(v, _SIMPLE) or (isinstance(v, (tuple, list)) and all(_simple(x) for x in v))


def _call_key(layer: torch.nn.Module, signature: Any, attributes: Any, args: tuple, kwargs: dict) -> Any:
    """What makes two calls of layers alike trace the same ops; None where a call cannot be copied."""
    if any(getattr(sub, h, None) for sub in list(layer.modules())[1:] for h in _HOOKS) or not own_global_hooks():
        return None  # a hook inside the layer runs per call
    leaves, spec = pytree.tree_flatten((args, kwargs))
    first: dict[int, int] = {}
    described = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if isinstance(x.shape, torch.Size) and any(not isinstance(s, int) for s in x.shape):
                return None  # symbolic sizes
            described.append(("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, first.setdefault(id(x), i)))
        elif _simple(x):
            described.append(_value(x))
        else:
            return None
    state = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for *_, t in _state_of(layer))
    modes = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
             tuple(m.training for m in layer.modules()))
    if _signature(layer, state=False) != attributes:  # an attribute set since (by the model's forward, say)
        return None
    return signature, str(spec), tuple(described), state, modes


def _state_of(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of each parameter and buffer slot in the layer (a tied one at each place)."""
    return [(sub, name, t) for sub in layer.modules()
            for name, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]


@contextlib.contextmanager
def _state_swapped(state: list, tensors: list[torch.Tensor]) -> Iterator[None]:
    """The layer's parameters and buffers read as ``tensors`` (the marked ones) while active."""
    for (sub, name, _), t in zip(state, tensors):
        (sub._parameters if name in sub._parameters else sub._buffers)[name] = t
    try:
        yield
    finally:
        for sub, name, t in state:
            (sub._parameters if name in sub._parameters else sub._buffers)[name] = t


def _written(tensors: list[torch.Tensor]) -> bool:
    """Whether the traced call wrote into (or changed the view of) any of its marked inputs."""
    try:
        return any(torch._functionalize_has_data_mutation(t) or torch._functionalize_has_metadata_mutation(t)
                   for t in tensors)
    except RuntimeError:  # not functional tensors: nothing tells, so no copy
        return True


def _aliases(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    ids = {id(t) for t in inputs}
    for t in outputs:
        while t is not None:
            if id(t) in ids:
                return True
            t = t._base
    return False


def _routed_forward(owner: LayersTracedOnce, forward: Callable) -> Callable:
    def routed(layer, *args, **kwargs):
        active = getattr(_STATE, "active", None)
        if active is not owner:  # another thread, or after the capture
            return forward(layer, *args, **kwargs)
        return owner.call(layer, forward, args, kwargs)

    return routed
