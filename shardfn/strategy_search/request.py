"""PlanRequest: everything the search is asked, per graph input and per graph output (the call site builds one:
shardfn.call.request)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Placement

from ..config import Precision
from . import cost_model as cm
from .plan import Collective
from .policy import LevelPolicy, level_policy

__all__ = ["InputRequest", "OutputRequest", "PlanRequest", "search_time_limit"]

Placements = tuple[Placement, ...]


def search_time_limit() -> float:
    """Seconds planning a call may take, from its capture's start to the plan (``SHARDFN_SEARCH_TIME_LIMIT``,
    default 20). Past it the search returns the best plan found, says so on the ``shardfn`` logger, and explain()
    shows its gap."""
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
    time_limit_s: float | None = None  # planning's seconds, the capture's included (None: search_time_limit())
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
    # recompute in backward (strategy_search.recompute): None the search decides, False never, True every layer,
    # "selective" every layer but its matmuls and attention; per module, (layer pattern, True or False) pairs:
    # those layers always or never, the rest as None
    recompute: bool | str | None | tuple[tuple[str, bool], ...] = None

    @property
    def policy(self) -> LevelPolicy:
        """What the level decides (strategy_search.policy)."""
        return level_policy(self.level)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype parameters' gradients are reduced in (None: their own)."""
        return self.precision.reduce_dtype if self.precision is not None else None

    def held(self) -> dict[int, Placements]:
        return {i: r.held for i, r in enumerate(self.inputs) if r.held is not None}

    def fixed(self) -> dict[int, Placements]:
        return {i: r.fixed for i, r in enumerate(self.inputs) if r.fixed is not None}
