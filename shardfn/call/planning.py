"""One call signature planned, locally (no communication): the call bound to the config, its mesh, fn captured on
meta tensors, the search's request built (call.request) and the search run. Also the plan of a pipeline stage
(plan_stage), and the mesh a call's layouts share (call_mesh: the one computation of it)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from .. import runtime
from .._collector import collector_paused
from ..capture import capture, split_arguments
from ..capture.dynamic import planning_graph
from ..capture.graph import CapturedGraph
from ..config import ShardConfig
from ..layout import Axis, MeshSpec, TensorSpec, common_mesh, normalize_strategy
from ..progress import Progress
from ..strategy_search import Plan, head_cut, make_plan, profile_for
from . import accumulation, parameters, submesh
from .arguments import BoundCall, bind
from .programs import Planned
from .request import build_request

__all__ = ["call_mesh", "param_specs", "plan_accumulating", "plan_call", "plan_stage"]


def plan_call(engine, args, kwargs, world: int, device: str, arrived: tuple = (),
              dynamic: dict | None = None, call: BoundCall | None = None) -> Planned:
    """Bind (unless ``call`` is the call bound already), capture and plan one call signature (local: no
    communication). ``dynamic``: {argument tensor number: dims} traced as symbols; the search plans at this
    call's sizes."""
    config, started = engine.config, time.perf_counter()  # (the search's time limit counts the capture)
    with runtime.outside_simulation(), collector_paused():
        call = call or bind(config, engine.fn, engine.name, args, kwargs, world)
        fixed = param_specs(engine, world)
        profile = profile_for(device)
        params, _ = engine.state()
        progress = Progress(sum(t.numel() for t in params.values()) + sum(math.prod(s) for s in call.shapes))
        captured = progress("capture", lambda: _capture(engine, args, kwargs, call, device, dynamic),
                            lambda c: f"{len(c.gm.graph.nodes)} graph nodes", f"{engine.name} on {world} ranks")
        engine.captures += 1
        planned = captured if not dynamic else dataclasses.replace(
            captured, gm=planning_graph(captured.gm), dynamic=None)
        layouts = [*call.held, *(f for f in call.fixed if f is not None), *fixed.values()]
        mesh_spec, cut_note = _mesh_for_heads(engine, planned, layouts, world, profile.devices_per_node)
        accumulate = accumulation.accumulating_call(engine) and torch.is_grad_enabled()
        moves, moved = submesh.arrival_records(arrived, engine.name)
        request = build_request(config, engine.name, call, planned, fixed, mesh_spec, world,
                                profile, accumulate, engine.optimizer_stage,
                                pending_grads=engine.grad_targets.keys(), arrivals=moves,
                                notes=((_dynamic_note(captured, dynamic),) if dynamic else ()) + moved + cut_note)
        plan = make_plan(planned, runtime.planning_mesh(mesh_spec, device), mesh_spec, request, progress, started)
    params, buffers = engine.state()
    return Planned(captured, plan, mesh_spec, tuple(parameters.slot(engine.module, n) for n in params),
                   tuple(parameters.slot(engine.module, n) for n in buffers), dict(dynamic or {}), request)


def plan_accumulating(engine, planned: Planned) -> Plan:
    """The plan of ``planned``'s graph accumulating without sync (every parameter's gradient left pending, as
    sf.no_sync's programs leave them), asked of the search: its request again, with ``accumulate`` and each
    parameter fixed where ``planned``'s plan laid it out (a program beside that one: the parameters are laid
    out already). Its parameters' layouts are checked to be that plan's."""
    if planned.request is None:
        raise RuntimeError(f"{engine.name}: no request kept with this plan, so no accumulating plan can be asked")
    inputs = tuple(dataclasses.replace(r, fixed=p.planned, origin="laid out")
                   if p.kind == "param" and r.fixed is None else r
                   for r, p in zip(planned.request.inputs, planned.plan.inputs))
    request = dataclasses.replace(planned.request, inputs=inputs, accumulate=True)
    graph = planned.captured if not planned.dynamic else dataclasses.replace(
        planned.captured, gm=planning_graph(planned.captured.gm), dynamic=None)
    device = runtime.resolve_device(engine.config.device)
    with runtime.outside_simulation():
        plan = make_plan(graph, runtime.planning_mesh(planned.mesh_spec, device), planned.mesh_spec, request)
    laid_out = {p.name: p.planned for p in planned.plan.inputs if p.kind == "param"}
    moved = [f"{p.name} {p.planned} (laid out {laid_out[p.name]})" for p in plan.inputs
             if p.kind == "param" and p.planned != laid_out[p.name]]
    if not plan.accumulate or moved:
        raise RuntimeError(f"{engine.name}: the search's accumulating plan "
                           + (f"moves parameters laid out already: {', '.join(moved)}" if moved else
                              "does not accumulate") + "; it must keep the program's it stands beside")
    return plan


def call_mesh(config: ShardConfig, layouts: list, world: int, devices_per_node: int,
              cuts: tuple[int, ...] = ()) -> MeshSpec:
    """The call's mesh: the one every given layout (and out_strategy's) fits on, cut where a node ends (no mesh
    dim mixes the ranks within a node with ranks across nodes, so work can be split within a node alone) and at
    ``cuts`` (:func:`shardfn.strategy_search.head_cut`)."""
    strategies = config.strategies()
    return common_mesh([*layouts, *_out_given(config, world)], world, _alias_names(strategies), _axis_links(strategies),
                       devices_per_node, cuts)


def _mesh_for_heads(engine, planned: CapturedGraph, layouts: list, world: int,
                    node: int) -> tuple[MeshSpec, tuple[str, ...]]:
    """The call's mesh, cut where attention's heads can split over a part of its inner dim (head_cut), and kept
    so for every later plan of the engine. A sharded module's parameters lie on the mesh shard() laid them out on
    (an optimizer's states, a loaded checkpoint's, made on it): a plan may move them to a cut mesh only while
    none can exist yet (its example_inputs planned in shard(), a module explain() plans unsharded); else it
    keeps that mesh and says what the cut would have given. Returns (mesh, notes)."""
    config = engine.config
    mesh = call_mesh(config, layouts, world, node, engine.mesh_cuts)
    cut = head_cut(planned.gm, mesh, [*layouts, *_out_given(config, world)])
    if cut is None:
        return mesh, ()
    params, _ = engine.state()
    laid_out = any(isinstance(p, DTensor) for p in params.values())
    if engine.module is not None and not engine.may_cut_mesh and laid_out:
        inner = max((k for k, a in enumerate(mesh.axes) if a.size > 1))
        return mesh, (f"attention's heads do not divide mesh dim {mesh.names[inner]!r} ({mesh.shape[inner]} "
                      f"ranks): it runs whole on each of them; with example_inputs given to sf.shard, the plan "
                      f"splits the heads over a part of {cut // mesh.axes[inner].stride} ranks (the parameters are "
                      f"laid out before any optimizer holds them)",)
    engine.mesh_cuts += (cut,)
    return call_mesh(config, layouts, world, node, engine.mesh_cuts), ()


def _out_given(config: ShardConfig, world: int) -> list[TensorSpec]:
    return [normalize_strategy(s, None, world, f"out_strategy[{i}]")
            for i, s in enumerate(config.out_strategy or ()) if s is not None]


def plan_stage(engine, *example_args) -> tuple[Plan, list[torch.Tensor]]:
    """The plan of the sharded module's call on ``example_args`` (made locally, running nothing) and its tensor
    outputs as meta tensors of the shapes this rank gets them (a batch-split output: this rank's slice)."""
    device = runtime.resolve_device(engine.config.device)
    planned = engine.plan(list(example_args), {}, engine.world(device), device)
    plan, outs = planned.plan, []
    for node, placements in zip(planned.captured.output_nodes[:planned.captured.n_outputs], plan.outputs):
        v = node.meta["val"]
        shape = list(v.shape)
        if shape and placements is not None and not plan.returns_dtensor[len(outs)]:
            shape[0] //= math.prod(n for n, p in zip(plan.mesh.shape, placements) if p == Shard(0))
        outs.append(torch.empty(shape, dtype=v.dtype, device="meta"))
    return plan, outs


def _capture(engine, args, kwargs, call: BoundCall, device: str, dynamic: dict | None) -> CapturedGraph:
    shapes = iter(call.shapes)
    used = _used_dtype(engine.config.precision)

    def example(a):  # the global value's description: shape, dtype (as the program uses it), requires_grad
        if not isinstance(a, torch.Tensor):
            return a
        return torch.empty(next(shapes), dtype=used(a.dtype), device="meta").requires_grad_(a.requires_grad)

    tensors, _, structure = split_arguments(args, kwargs)
    ex_args, ex_kwargs = structure.rebuild([example(t) for t in tensors])
    params, buffers = engine.state()
    meta = {n: torch.empty(tuple(t.shape), dtype=used(t.dtype) if n in params else t.dtype, device="meta")
            .requires_grad_(t.requires_grad) for n, t in {**params, **buffers}.items()}
    # planning for CUDA on a machine without it (explain) traces on the CPU: only shapes matter
    trace_device = device if device != "cuda" or torch.cuda.is_available() else "cpu"
    return capture(engine.fn, ex_args, ex_kwargs, {n: meta[n] for n in params}, {n: meta[n] for n in buffers},
                   call=engine.call_module if engine.module is not None else None, device=trace_device,
                   dynamic=dynamic)


def _used_dtype(precision) -> Callable[[torch.dtype], torch.dtype]:
    """The dtype a floating parameter or input is used in under a mixed precision policy (others: their own)."""
    if precision is None or precision.param_dtype is None:
        return lambda dtype: dtype
    return lambda dtype: precision.param_dtype if dtype.is_floating_point else dtype


def _dynamic_note(captured: CapturedGraph, dynamic: dict) -> str:
    """What explain() says of a program for every size: which dims, planned at which sizes, for which range."""
    inputs = [gi for gi in captured.inputs if gi.kind == "input"]
    dims = "; ".join(f"{inputs[j].name} dims {list(d)} (planned at {[inputs[j].shape[k] for k in d]})"
                     for j, d in sorted(dynamic.items()))
    return f"dynamic: {dims}; the program holds for {captured.dynamic.described()}"


def _alias_names(strategies) -> dict:
    """Mesh-dim names from the user's Layout aliases (used when a user axis is exactly one mesh dim)."""
    names = {}
    for layout in (given.layout for given in strategies):
        if layout is not None:
            for i, n in enumerate(layout.alias_name):
                names[Axis(layout.device_matrix[i], math.prod(layout.device_matrix[i + 1 :]))] = n
    return names


def _axis_links(strategies) -> dict:
    """The links the user's Layouts give their axes ({axis: "intra"/"inter"}); Layouts that disagree on one axis
    are an error."""
    links: dict = {}
    for layout in (given.layout for given in strategies):
        if layout is not None and layout.links is not None:
            for i, link in enumerate(layout.links):
                axis = Axis(layout.device_matrix[i], math.prod(layout.device_matrix[i + 1 :]))
                if links.setdefault(axis, link) != link:
                    raise ValueError(f"in_strategy: the Layouts given say both {links[axis]!r} and {link!r} for "
                                     f"axis {layout.alias_name[i]!r}; give every Layout of one call the same links")
    return links


def param_specs(engine, world: int) -> dict[str, TensorSpec]:
    """The parameters' fixed layouts: parameter_plan's, or those laid out already."""
    if engine.module is None:
        return {}
    return parameters.fixed_specs(engine.module, engine.config.parameter_plan, world, engine.params_laid_out,
                                  engine.ranks())
