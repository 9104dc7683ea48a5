"""The captured graph interpreted over DTensors as planned: before each op every tensor input is laid out as the
plan chose, the op runs through DTensor's dispatch or, for shardfn's own and fallback rules and where DTensor
would run it so, on the local pieces, and its result is put in its planned placement."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..capture.graph import CapturedGraph, is_getitem, is_in_place, is_view
from ..strategy_search.plan import NodePlan, Plan
from ..strategy_search.registry import REGISTRY
from ._dtensor_internals import is_masked_sum
from ._graph_internals import annotated_as, made_whole
from .expert_dispatch import dispatched
from .pieces import (VIEW_CALLS, conform, contiguous, from_local, local_piece, map_leaves, piece_shape, placed,
                     redistribute, settled, sized_to_piece, view_of_piece)
from .precision import Casts

__all__ = ["Interpreter", "node_plans"]


class Interpreter:
    """Runs ``captured``'s graph as ``plan`` lays it out on ``mesh`` (``casts``: the mixed precision policy's;
    ``regions``: each op's checkpoint region, handed to the trace; ``at_sizes``: a value as at the running call's
    sizes)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: DeviceMesh, casts: Casts,
                 regions: dict[torch.fx.Node, int], at_sizes: Callable[[Any], Any]):
        self.captured, self.plan, self.mesh, self.casts, self.regions = captured, plan, mesh, casts, regions
        self.at_sizes = at_sizes
        # each op's decisions; the ops run as they are (no decisions): getitems, and a program for every size's
        # size computations (sym_size: numbers, not tensors)
        self.node_plans, self.as_is = node_plans(captured.gm.graph, plan)
        self.written = {n.args[0] for n in captured.gm.graph.nodes if is_in_place(n.target)}
        # a mixed precision policy casts each parameter where an op reads it (after the program entered it in its
        # own dtype), so that a gradient is cast to reduce_dtype before any reduction of it: the ids of this
        # call's parameters as the program entered them
        self.cast_where_read: set[int] = set()
        self.n_params = sum(gi.kind == "param" for gi in captured.inputs)
        self.on_pieces = True  # (off while AOTAutograd traces the per-rank graphs at one size: exec.traced)
        self.sizes_traced = False  # (on while it traces them with symbolic sizes)
        self.shared: dict | None = None  # (run)
        self.layouts_now: dict | None = None
        # DTensor keeps a masked sum's mask in one buffer that every equal placement shares (and compares a new mask
        # with the one it holds: on real ranks a data-dependent read while tracing): two gathers from one split
        # table left pending at once would share it, so each is reduced as soon as its op made it
        self.masked = {n for n, np_ in self.node_plans.items()
                       if any(is_masked_sum(p) for pl in np_.outputs if pl for p in pl)}
        # how each node runs: the plan says (strategy_search.run_modes)
        self.piecewise = {n for n, np_ in self.node_plans.items() if np_.run == "pieces"}
        self.piece_views = {n for n, np_ in self.node_plans.items() if np_.run == "piece_view"}

    def _run_node(self, node: torch.fx.Node, env: dict) -> Any:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        if node in self.as_is:  # one output of a multi-output node, or a number: as it is
            return node.target(*args, **kwargs)
        # its checkpoint region, for the partitioner (recompute_checkpointed)
        with annotated_as(node, self.regions.get(node)):
            out = self._compute(node, args, kwargs)
            if node in self.masked:
                out = _masks_reduced(out)
            return self._settled_result(node, out)

    def _settled_result(self, node: torch.fx.Node, out: Any) -> Any:
        # a view hands its gradient's pending sum on to the value it views, which sums it with its other readers'
        # and resolves it once; a result a later op writes into stays as autograd made it
        if node.target in VIEW_CALLS or is_view(node.target) or node in self.written:
            return out
        return type(out)(settled(o) for o in out) if isinstance(out, (tuple, list)) else settled(out)

    def _compute(self, node: torch.fx.Node, args, kwargs) -> Any:
        """``node``'s result, its inputs laid out as planned and the result put in its planned placement."""
        np_ = self.node_plans[node]
        leaves: list[torch.Tensor] = []  # the tensor operands, in pytree's order (the plan's)

        def laid_out(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            slot = len(leaves)
            if id(leaf) in self.cast_where_read and self.casts.casts(leaf, "param"):
                leaf = self.casts.read_as_used(leaf, np_.inputs[slot])
            else:
                leaf = placed(leaf, np_.inputs[slot], self.mesh)
            leaves.append(leaf)
            return leaf

        args, kwargs = map_leaves(laid_out, (args, kwargs))
        val = self.at_sizes(node.meta.get("val"))
        if node.target in VIEW_CALLS:
            args = (contiguous(args[0]), *args[1:])

        if np_.run == "factory":
            return placed(node.target(*args, **kwargs), np_.outputs[0], self.mesh)
        if np_.run == "whole":
            return self._made_whole(node, args, kwargs, np_.outputs[0], val)
        if np_.run == "random":
            shape_of = args[0]
            whole = torch.empty(shape_of.shape, dtype=shape_of.dtype, device=self.mesh.device_type)
            return placed(node.target(whole, *args[1:], **kwargs), np_.outputs[0], self.mesh)
        if self.on_pieces and node in self.piece_views:
            out = view_of_piece(node, args, kwargs, np_, val, self.mesh)
            if out is not None:
                return out
        # on the pieces where they are even (uneven ones: DTensor's way, which keeps each rank's shapes apart)
        on_pieces = self.on_pieces and node in self.piecewise and all(
            piece_shape(t.shape, t.placements, self.mesh) is not None for t in leaves if isinstance(t, DTensor)) \
            and all(piece_shape(v.shape, p, self.mesh) is not None
                    for v, p in zip(val if isinstance(val, (tuple, list)) else [val], np_.outputs))
        if np_.run in ("local", "dispatch") or on_pieces:
            piece = local_piece(np_.outputs, self.shared)
            local_args, local_kwargs = map_leaves(lambda a: piece(a) if isinstance(a, DTensor) else a,
                                                   (args, kwargs))
            at = REGISTRY.size_argument(node.target)
            if at is not None:  # a factory sized by an argument: the piece's size, else made whole and laid out
                local_args = sized_to_piece(local_args, at, val.shape, np_.outputs[0], self.mesh)
                if local_args is None:
                    return placed(node.target(*args, **kwargs), np_.outputs[0], self.mesh)
            call = dispatched(node.target, np_.inputs, self.mesh) if np_.run == "dispatch" else node.target
            out = call(*local_args, **local_kwargs)
            if isinstance(out, torch.Tensor):
                return from_local(out, self.mesh, np_.outputs[0], val, self.layouts_now)
            if not isinstance(out, (tuple, list)):  # None, or a Python value (an op run for its checks)
                return out
            return type(out)(
                from_local(o, self.mesh, p, v, self.layouts_now) if isinstance(o, torch.Tensor) and p is not None
                else o
                for o, p, v in zip(out, np_.outputs, val)
            )
        out = node.target(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(conform(o, p) for o, p in zip(out, np_.outputs))
        return conform(out, np_.outputs[0])

    def _made_whole(self, node: torch.fx.Node, args, kwargs, layout, val) -> DTensor:
        """Every operand whole: the op on their local tensors, the result laid out as planned, its piece copied
        out so that the whole goes as the op ends; the backward reads the piece kept, not the whole made again
        (passes.keep_pieces)."""
        with made_whole():
            local_args, local_kwargs = map_leaves(lambda a: a.to_local() if isinstance(a, DTensor) else a,
                                                   (args, kwargs))
            whole = from_local(node.target(*local_args, **local_kwargs), self.mesh,
                               tuple(Replicate() for _ in layout), val, self.layouts_now)
            piece = placed(whole, layout, self.mesh)
            return from_local(piece.to_local().clone(), self.mesh, layout, val, self.layouts_now)

    def run(self, inputs: list[DTensor], constants: list[torch.Tensor]) -> list[Any]:
        # the pieces of this call's values, shared by their readers (not where the graph writes in place: a
        # value written is read afterwards through its new autograd history)
        self.shared = None if self.written or not self.on_pieces else {}
        # the layouts of this call's values (from_local); none kept in a trace of symbolic sizes (unhashable)
        self.layouts_now = {} if self.on_pieces and not self.sizes_traced else None
        try:
            return self._run(inputs, constants)
        finally:
            self.shared = self.layouts_now = None

    def _run(self, inputs: list[DTensor], constants: list[torch.Tensor]) -> list[Any]:
        env: dict[torch.fx.Node, Any] = {}
        it, consts = iter(inputs), iter(constants)
        if self.casts.policy is not None:
            self.cast_where_read = {id(x) for x in inputs[:self.n_params]}
        for node in self.captured.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "call_function":
                env[node] = self._run_node(node, env)
            elif node.op == "get_attr":
                env[node] = next(consts) if isinstance(node.meta.get("val"), torch.Tensor) else \
                    getattr(self.captured.gm, node.target)
            elif node.op == "output":
                return [conform(placed(env[o], p, self.mesh), p) for o, p in zip(node.args[0], self.plan.outputs)]
        raise AssertionError("graph has no output node")


def _masks_reduced(out: Any) -> Any:
    """``out`` with each masked pending sum reduced (whole where it was pending)."""
    def reduced(o):
        if not isinstance(o, DTensor) or not any(is_masked_sum(p) for p in o.placements):
            return o
        return redistribute(o, tuple(Replicate() if is_masked_sum(p) else p for p in o.placements))

    return type(out)(reduced(o) for o in out) if isinstance(out, (tuple, list)) else reduced(out)


def node_plans(graph: torch.fx.Graph, plan: Plan) -> tuple[dict[torch.fx.Node, NodePlan], set[torch.fx.Node]]:
    """The plan's decisions by the graph's own nodes, resolved once, and the ops that run as they are: a
    getitem (one output of a multi-output op) and an op with no tensor value (a size computed from the
    symbols of a program for every size: the search planned the graph at its sizes, without them). Every other
    op has decisions; a plan made for another graph is refused by name."""
    found, as_is, missing = {}, set(), []
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        if node.name in plan.nodes and not is_getitem(node):
            found[node] = plan.nodes[node.name]
        elif node.op == "call_function":
            val = node.meta.get("val")
            tensors = any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (tuple, list)) else [val]))
            if is_getitem(node) or not tensors:
                as_is.add(node)
            else:
                missing.append(node.name)
    if missing:
        raise ValueError(f"{plan.name}: the plan has no decisions for {len(missing)} of the graph's ops "
                         f"({', '.join(missing[:5])}): it was made for another graph")
    return found, as_is
