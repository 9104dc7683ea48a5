"""Calls on some of the world's ranks (a sub-mesh: sf.Layout(..., ranks=...), a pipeline stage): the arguments
that arrive from other ranks, and what the ranks outside the call get.

A DTensor argument that lives on other ranks than the call's is moved onto them first, point to point (sf.reshard,
with autograd), in its own placements where the two meshes have one shape, else replicated; the plan lists the
moves as send_recv. A rank outside the call runs nothing and communicates nothing: its outputs are placeholders
of the outputs' shapes (torch's convention for ranks outside a mesh: a DTensor holding nothing here), connected to
the inputs for autograd so a backward through them reaches what came before.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .. import _pytree_internals as pytree
from .. import runtime
from .._mesh_internals import mesh_without_groups
from ..config import ShardConfig
from ..layout import Layout, TensorLayout, common_mesh, normalize_strategy, to_placements
from .programs import Compiled, Planned
from .reshard import outside_placeholder, reshard
from ..strategy_search.plan import Collective

__all__ = ["arrival_records", "arrive", "outside_call", "placeholders"]


def arrive(config: ShardConfig, args, kwargs, move: bool, world: int | None = None):
    """DTensor arguments that live on other ranks than the call's are moved onto its ranks first, by
    point-to-point sends (sf.reshard, with autograd), in the same placements where the two meshes have one
    shape (else replicated); the call then takes them as any DTensor input. Without ``move`` (explain) a
    stand-in on a planning mesh takes their place. Returns the arguments and what moved (for the key and the
    plan's send_recv records)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    device = runtime.resolve_device(config.device)
    ranks = config.ranks or tuple(range(world or runtime.init(device=device).size()))
    arrived = []
    for i, t in enumerate(leaves):
        if not isinstance(t, DTensor) or not ranks or tuple(t.device_mesh.mesh.flatten().tolist()) == ranks:
            continue
        layout = _arrival_layout(t, ranks)
        arrived.append((i, tuple(t.device_mesh.mesh.flatten().tolist()), layout.tensor_map,
                        t.numel() * t.element_size(), t.requires_grad))
        leaves[i] = reshard(t, layout) if move else _stand_in(t, layout, device)
    if not arrived:
        return args, kwargs, ()
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return args, kwargs, (("arrived", tuple(arrived)),)


def _arrival_layout(t: DTensor, ranks: tuple[int, ...]) -> TensorLayout:
    """Where a DTensor from other ranks lands on a call's ranks: its own placements on a mesh of the same shape,
    else (another shape, pending sums, uneven pieces) replicated."""
    shape, placements = tuple(t.device_mesh.shape), tuple(t.placements)
    names = tuple(f"m{i}" for i in range(len(shape)))
    if math.prod(shape) == len(ranks) and all(p.is_replicate() or type(p) is Shard for p in placements):
        dims = [tuple(n for n, p in zip(names, placements) if p == Shard(d)) for d in range(t.ndim)]
        layout = Layout(shape, names, ranks=ranks)(*[d if d else "None" for d in dims])
        if all(t.shape[d] % math.prod(shape[names.index(n)] for n in dims[d]) == 0 for d in range(t.ndim)):
            return layout
    return Layout((len(ranks),), ("all",), ranks=ranks)(*["None"] * t.ndim)


def _stand_in(t: DTensor, layout: TensorLayout, device: str) -> DTensor:
    """For planning (explain): a DTensor as the move would leave it, on a mesh of the call's ranks, no data."""
    n = len(layout.ranks)
    spec = normalize_strategy(layout, tuple(t.shape), n, "arrival")
    mesh_spec = common_mesh([spec], n, {layout.axis(a): a for a in layout.alias_name})
    mesh = mesh_without_groups(device, torch.tensor(layout.ranks).reshape(mesh_spec.shape), mesh_spec.names,
                               rank=layout.ranks[0])
    return DTensor.from_local(torch.empty(0, dtype=t.dtype, device="meta"), mesh, to_placements(spec, mesh_spec),
                              run_check=False, shape=t.shape, stride=t.stride()).requires_grad_(t.requires_grad)


def arrival_records(arrived: tuple, name: str) -> tuple[tuple[Collective, ...], tuple[str, ...]]:
    """The point-to-point moves of inputs from other ranks, as the plan lists them (forward; backward for the
    gradients sent back), and the notes that say so: the search's request carries both into the plan."""
    collectives, notes = [], []
    for _, moves in arrived:
        for i, ranks, tensor_map, nbytes, requires_grad in moves:
            where = f"argument {i} from ranks {list(ranks)} -> {name}"
            collectives.append(Collective("send_recv", "forward", (), nbytes, where))
            if requires_grad:
                collectives.append(Collective("send_recv", "backward", (), nbytes, where))
            notes.append(f"argument {i} arrives on ranks {list(ranks)}, another mesh: moved point-to-point "
                         f"(sf.reshard) onto the call's ranks as {tensor_map} before the call")
    return tuple(collectives), tuple(notes)


def placeholders(planned: Planned, mesh) -> Callable:
    """What a call returns on a rank outside its mesh: per output, a DTensor on the call's mesh holding nothing
    here (torch's convention for ranks outside a mesh) where the output is a DTensor, else zeros of the output's
    shape (an expanded scalar: no memory). Autograd connects them to the inputs that require grad; gradients
    flowing back are placeholders too."""
    plan, captured = planned.plan, planned.captured
    vals = [n.meta["val"] for n in captured.output_nodes]

    def make(j: int) -> torch.Tensor:
        v, placements = vals[j], plan.outputs[j]
        if plan.returns_dtensor[j]:
            return outside_placeholder(v.shape, v.dtype, mesh, placements)
        shape = tuple(v.shape)
        if shape and placements is not None:  # a batch-split output (data_parallel): this rank's slice's shape
            slices = math.prod(n for n, p in zip(mesh.shape, placements) if p == Shard(0))
            shape = (shape[0] // slices,) + shape[1:]
        return torch.zeros((), dtype=v.dtype, device=runtime.mesh_device(mesh)).expand(shape)

    def run(*inputs):
        return list(_Outside.apply(make, len(vals), *inputs))

    return run


class _Outside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, make, n, *inputs):
        ctx.specs = [(t.shape, t.dtype, getattr(t, "device_mesh", None), getattr(t, "placements", None), t.device)
                     for t in inputs]
        ctx.needs = [t.requires_grad and not isinstance(t, nn.Parameter) for t in inputs]  # params: no grad here
        return tuple(make(j) for j in range(n))

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for (shape, dtype, mesh, placements, device), needs in zip(ctx.specs, ctx.needs):
            if not needs:
                out.append(None)
            elif mesh is not None:
                out.append(outside_placeholder(shape, dtype, mesh, placements))
            else:
                out.append(torch.zeros((), dtype=dtype, device=device).expand(shape))
        return (None, None, *out)


def outside_call(engine, key: tuple, args, kwargs, tensors, objects, arrived: tuple = ()):
    """On a rank outside the call's ranks: no program, no communication. The outputs are placeholders with the
    outputs' shapes (the plan is made here too, locally, for them), connected to the inputs for autograd so a
    backward through them reaches what came before (an sf.reshard that receives the gradients)."""
    compiled = engine.programs.outside.get(key)
    if compiled is None:
        device = runtime.resolve_device(engine.config.device)
        engine.group = dist.group.WORLD
        planned = engine.plan(args, kwargs, engine.world(device), device, arrived)
        mesh = runtime.device_mesh(planned.mesh_spec, device, engine.config.ranks)
        compiled = engine.programs.outside[key] = Compiled(planned, None, placeholders(planned, mesh))
    outs = compiled.program(*engine.state_tensors(compiled), *tensors)
    return compiled.captured.result(outs, tensors, objects)
