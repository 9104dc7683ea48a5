"""Plan -> ParallelProgram: the per-rank program that runs the captured graph as planned.

The program interprets the captured graph over DTensors: before each node every tensor input is redistributed
to the placement the plan chose for it, the node runs (through DTensor's dispatch, or on local shards for
shardfn's own and fallback rules), and its result is put in the planned placement. On a real process group
that interpretation is traced once by AOTAutograd into per-rank local forward and backward aten graphs with
functional collectives (``program.graphs``), so a call runs two flat graphs, not Python per op. Inside a
simulated world (LocalTensorMode) the interpretation runs eagerly under autograd.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ..capture.graph import CapturedGraph
from ..strategy_search.plan import Plan

__all__ = ["ParallelProgram", "lower"]

aten = torch.ops.aten

def _conform(x: Any, placements: tuple[Placement, ...] | None):
    """Put an op result in its planned placement. A pending sum stays as the op left it: one the op resolved
    early stays resolved, and DTensor's own kinds (embedding's masked sum) are not re-labelled."""
    if placements is None or not isinstance(x, DTensor) or tuple(x.placements) == placements:
        return x
    target = tuple(p if q.is_partial() else q for p, q in zip(x.placements, placements))
    return x if tuple(x.placements) == target else x.redistribute(x.device_mesh, target)


def _to(x: Any, placements: tuple[Placement, ...], mesh: DeviceMesh):
    """Bring an input to the placement its consumer's strategy reads it in.

    Going to a pending sum from a whole value is left to the op's DTensor dispatch (which may split a value into
    a pending sum; the public redistribute may not): those dims are brought to Replicate here.
    """
    if isinstance(x, DTensor):
        current = tuple(x.placements)
        target = tuple(Replicate() if q.is_partial() and not p.is_partial() else q
                       for p, q in zip(current, placements))
        if current == target:
            return x
        # views later in the graph assume the layout the whole tensor had; collectives may leave shards strided
        return x.redistribute(mesh, target).contiguous()
    if isinstance(x, torch.Tensor):  # a whole value (graph constant): every rank slices its part
        return distribute_tensor(x, mesh, tuple(Replicate() if q.is_partial() else q for q in placements),
                                 src_data_rank=None)
    return x


def _from_local(t: torch.Tensor, mesh: DeviceMesh, placements, like: torch.Tensor) -> DTensor:
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


class ParallelProgram:
    """Callable on the flat list of graph inputs as DTensors in their planned placements; returns the flat
    outputs (DTensors in the plan's output placements, constants as captured)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: DeviceMesh, compiled: bool):
        self.captured, self.plan, self.mesh = captured, plan, mesh
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.tensor_outputs = [i for i, a in enumerate(captured.output_nodes) if isinstance(a, torch.fx.Node)]
        self._run: Callable = self._compile() if compiled else self.interpret

    # --- interpretation -----------------------------------------------------------------------------------

    def _run_node(self, node: torch.fx.Node, env: dict) -> Any:
        np_ = self.plan.nodes.get(node.name)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        if np_ is None:  # getitem on a multi-output node
            return node.target(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slot = 0
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                leaves[i] = _to(leaf, np_.inputs[slot], self.mesh)
                slot += 1
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        val = node.meta["val"]

        if np_.rule == "factory":
            return _to(node.target(*args, **kwargs), np_.outputs[0], self.mesh)
        if np_.rule == "random":
            shape_of = args[0]
            whole = torch.empty(shape_of.shape, dtype=shape_of.dtype, device=self.mesh.device_type)
            return _to(node.target(whole, *args[1:], **kwargs), np_.outputs[0], self.mesh)
        if np_.rule == "local":
            local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda t: t.to_local(), (args, kwargs))
            out = node.target(*local_args, **local_kwargs)
            if isinstance(out, torch.Tensor):
                return _from_local(out, self.mesh, np_.outputs[0], val)
            return type(out)(
                _from_local(o, self.mesh, p, v) if isinstance(o, torch.Tensor) and p is not None else o
                for o, p, v in zip(out, np_.outputs, val)
            )
        out = node.target(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_conform(o, p) for o, p in zip(out, np_.outputs))
        return _conform(out, np_.outputs[0])

    def interpret(self, *inputs: DTensor) -> list[Any]:
        env: dict[torch.fx.Node, Any] = {}
        it = iter(inputs)
        for node in self.captured.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "call_function":
                env[node] = self._run_node(node, env)
            elif node.op == "get_attr":
                env[node] = getattr(self.captured.gm, node.target)
            elif node.op == "output":
                outs = node.args[0]
                return [_conform(env[outs[i]], self.plan.outputs[k]) for k, i in enumerate(self.tensor_outputs)]
        raise AssertionError("graph has no output node")

    # --- compilation --------------------------------------------------------------------------------------

    def _compile(self) -> Callable:
        from functorch.compile import aot_function, make_boxed_func

        def keep(name):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                self.graphs[name] = gm
                return make_boxed_func(gm.forward)

            return compiler

        return aot_function(self.interpret, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                            inference_compiler=keep("forward"))

    def __call__(self, *inputs: DTensor) -> list[Any]:
        return self._run(*inputs)


def lower(captured: CapturedGraph, plan: Plan, mesh: DeviceMesh, compiled: bool) -> ParallelProgram:
    return ParallelProgram(captured, plan, mesh, compiled)
