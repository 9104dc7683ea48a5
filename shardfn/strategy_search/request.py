"""PlanRequest: everything the search is asked, per graph input and per graph output, and how a call's config,
arguments and captured graph make one (:func:`build_request`: the search's policy, data parallelism's included)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from ..arguments import BoundCall
from ..capture.graph import CapturedGraph
from ..config import Precision, ShardConfig
from ..layout import MeshSpec, TensorSpec, normalize_strategy, to_placements
from . import cost_model as cm
from .plan import Collective

__all__ = ["InputRequest", "OutputRequest", "PlanRequest", "build_request", "search_time_limit"]

Placements = tuple[Placement, ...]


def search_time_limit() -> float:
    """Seconds the whole search may take, from its first step to the plan (``SHARDFN_SEARCH_TIME_LIMIT``, default
    20; the capture before it is not counted). Past it the search returns the best plan found, says so on the
    ``shardfn`` logger, and explain() shows its gap."""
    value = os.environ.get("SHARDFN_SEARCH_TIME_LIMIT", "20")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not limit > 0:
        raise ValueError(f"SHARDFN_SEARCH_TIME_LIMIT={value!r}: give a positive number of seconds")
    return limit


@dataclass(frozen=True)
class InputRequest:
    """What the caller says of one graph input: the layout it arrives in (None: laid out as planned before the
    call, as parameters are) and the layout asked for (None: the search decides)."""

    held: Placements | None = None
    fixed: Placements | None = None
    # who gave ``fixed`` (the plan shows it): "in_strategy", "dtensor" (the argument's own layout), "data_parallel",
    # "parameter_plan", "laid out" (by an earlier call), "buffer"; "search" where nobody did
    origin: str = "search"


@dataclass(frozen=True)
class OutputRequest:
    """What the caller wants of one graph output: its placements, and whether it is returned as a DTensor (else
    as this rank's local tensor: a whole value, or its batch slice)."""

    placements: Placements
    as_dtensor: bool = False


@dataclass(frozen=True)
class PlanRequest:
    """Everything the search is asked, per graph input (placeholder order) and per graph output."""

    inputs: tuple[InputRequest, ...]
    outputs: tuple[OutputRequest, ...]
    grad: bool = True  # a backward pass runs
    level: int = 0
    profile: cm.DeviceProfile = cm.CPU
    # mesh dims over which the batch stays split (data parallelism): values computed from the inputs split there
    # are not gathered over them in forward, wherever a plan can avoid it
    keep_split: tuple[int, ...] = ()
    time_limit_s: float | None = None  # the whole search's budget in seconds (None: search_time_limit())
    # accumulation without sync (sf.no_sync): parameters' gradients are not all-reduced in this program
    accumulate: bool = False
    # a sharded optimizer's stage (sf.shard_optimizer): 1 splits the optimizer states of whole parameters over
    # their first whole mesh dim, 2 their gradients too (reduce-scattered, not all-reduced)
    optimizer_stage: int = 0
    # parameters (by name) whose gradients a stage-2 sharded optimizer reduce-scatters itself: left pending
    pending_grads: frozenset[str] = frozenset()
    # a mixed precision policy: its reduce_dtype prices parameters' gradient reductions; the plan carries it
    precision: Precision | None = None
    name: str = "fn"  # the sharded callable's
    # what the caller adds to the plan: notes (a program for every size says its symbols), and the point-to-point
    # moves of arguments that arrive from other ranks (submesh.arrival_records)
    notes: tuple[str, ...] = ()
    arrivals: tuple[Collective, ...] = ()

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype parameters' gradients are reduced in (None: their own)."""
        return self.precision.reduce_dtype if self.precision is not None else None

    def held(self) -> dict[int, Placements]:
        return {i: r.held for i, r in enumerate(self.inputs) if r.held is not None}

    def fixed(self) -> dict[int, Placements]:
        return {i: r.fixed for i, r in enumerate(self.inputs) if r.fixed is not None}


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
                       precision=config.precision, name=name, notes=tuple(notes), arrivals=tuple(arrivals))


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
            if spec is None and config.dataset_strategy == "data_parallel" and config.level != 1:
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
