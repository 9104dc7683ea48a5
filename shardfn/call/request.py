"""build_request(): the search's request for one call, from the call's config, its bound arguments and its captured
graph: each graph input's arriving and fixed layouts, each output's, and the objective (data parallelism's policy
included)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from ..capture.graph import CapturedGraph
from ..config import ShardConfig
from ..layout import MeshSpec, TensorSpec, normalize_strategy, to_placements
from ..strategy_search import cost_model as cm
from ..strategy_search.plan import Collective
from ..strategy_search.policy import level_policy
from ..strategy_search.request import InputRequest, OutputRequest, PlanRequest
from .arguments import BoundCall

__all__ = ["build_request"]


def build_request(config: ShardConfig, name: str, call: BoundCall, captured: CapturedGraph,
                  param_specs: dict[str, TensorSpec], mesh_spec: MeshSpec, world: int,
                  profile: cm.DeviceProfile, accumulate: bool = False, optimizer_stage: int = 0,
                  pending_grads=frozenset(), notes: tuple[str, ...] = (),
                  arrivals: tuple[Collective, ...] = ()) -> PlanRequest:
    """What the search is asked for one call: each graph input's arriving and fixed layouts, each output's, and
    the objective. ``param_specs``: the parameters' fixed layouts (parameter_plan's, or those laid out already).
    ``accumulate``, ``optimizer_stage``, ``pending_grads``, ``notes``, ``arrivals``: as PlanRequest's."""
    return PlanRequest(tuple(_input_requests(config, captured, call, param_specs, mesh_spec)),
                       tuple(_output_requests(config, name, captured, world, mesh_spec, call.batch)),
                       grad=torch.is_grad_enabled(), level=config.level, profile=profile,
                       keep_split=_data_parallel_dims(config, call, mesh_spec), accumulate=accumulate,
                       optimizer_stage=optimizer_stage, pending_grads=frozenset(pending_grads),
                       precision=config.precision, name=name, notes=tuple(notes), arrivals=tuple(arrivals),
                       recompute=config.recompute)


def _input_requests(config: ShardConfig, captured: CapturedGraph, call: BoundCall, param_specs,
                    mesh_spec: MeshSpec) -> list[InputRequest]:
    requests = []
    whole = (Replicate(),) * len(mesh_spec.axes)
    tensor_inputs = iter(range(len(call.tensors)))
    for gi in captured.inputs:
        if gi.kind == "param":
            spec = param_specs.get(gi.name)
            origin = "search" if spec is None else \
                "parameter_plan" if config.parameter_plan.get(gi.name) is not None else "laid out"
            if spec is None and config.dataset_strategy == "data_parallel" \
                    and not level_policy(config.level).searches_data_parallel_parameters:
                spec, origin = TensorSpec.replicated(len(gi.shape)), "data_parallel"  # every rank holds it whole
            requests.append(InputRequest(None, None if spec is None else to_placements(spec, mesh_spec), origin))
        elif gi.kind == "buffer":
            requests.append(InputRequest(whole, whole, "buffer"))  # buffers stay whole
        else:
            j = next(tensor_inputs)
            fixed = call.fixed[j]
            requests.append(InputRequest(to_placements(call.held[j], mesh_spec),
                                         None if fixed is None else to_placements(fixed, mesh_spec),
                                         _argument_origin(config, call, j)))
    return requests


def _argument_origin(config: ShardConfig, call: BoundCall, j: int) -> str:
    """Who gave argument tensor ``j``'s layout (InputRequest.origin)."""
    if call.fixed[j] is None:
        return "search"
    if isinstance(call.tensors[j], DTensor) and call.fixed[j] == call.held[j]:
        return "dtensor"
    return "data_parallel" if config.dataset_strategy == "data_parallel" else "in_strategy"


def _data_parallel_dims(config: ShardConfig, call: BoundCall, mesh_spec: MeshSpec) -> tuple[int, ...]:
    """Under data parallelism, the mesh dims the batch is split over: it stays split over them."""
    if config.dataset_strategy != "data_parallel" or not call.batch:
        return ()
    placements = to_placements(TensorSpec((call.batch,)), mesh_spec)
    return tuple(d for d, p in enumerate(placements) if not p.is_replicate())


def _batch_split(v: torch.Tensor, batch_axes: tuple, world: int, j: int) -> TensorSpec:
    """A data-parallel output: split on dim 0 as the inputs' batch is (by default over every rank); rows that do
    not divide among the slices are cut as torch.chunk cuts them (DTensor's uneven pieces)."""
    if not batch_axes:
        return normalize_strategy((world,) + (1,) * (v.dim() - 1), tuple(v.shape), world,
                                  f"output {j} (data_parallel)")
    return TensorSpec((batch_axes,) + ((),) * (v.dim() - 1))


def _output_requests(config: ShardConfig, name: str, captured: CapturedGraph, world: int, mesh_spec: MeshSpec,
                     batch_axes: tuple = ()) -> list[OutputRequest]:
    vals = [n.meta["val"] for n in captured.output_nodes]  # fn's outputs, then argument objects' new tensors
    out_strategy = config.out_strategy
    if out_strategy is not None and len(out_strategy) != captured.n_outputs:
        raise ValueError(f"out_strategy has {len(out_strategy)} entries but {name} returns "
                         f"{captured.n_outputs} tensors; give one entry per output tensor")
    requests = []
    for j, v in enumerate(vals):
        s = out_strategy[j] if out_strategy is not None and j < captured.n_outputs else None
        if s is not None:
            spec = normalize_strategy(s, tuple(v.shape), world, f"out_strategy[{j}]", f"output {j}")
        elif config.dataset_strategy == "data_parallel" and v.dim() > 0:
            spec = _batch_split(v, batch_axes, world, j)
        else:
            spec = TensorSpec.replicated(v.dim())
        requests.append(OutputRequest(to_placements(spec, mesh_spec), as_dtensor=s is not None))
    return requests
