"""PlanRequest: everything the search is asked, per graph input and per graph output."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

from . import cost_model as cm

__all__ = ["InputRequest", "OutputRequest", "PlanRequest", "search_time_limit"]

Placements = tuple[Placement, ...]


def search_time_limit() -> float:
    """Seconds the integer program may take (``SHARDFN_SEARCH_TIME_LIMIT``, default 20). Past it the search
    returns the best plan found, says so on the ``shardfn`` logger, and explain() shows its gap."""
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
    time_limit_s: float | None = None  # the integer program's budget (None: search_time_limit())

    def held(self) -> dict[int, Placements]:
        return {i: r.held for i, r in enumerate(self.inputs) if r.held is not None}

    def fixed(self) -> dict[int, Placements]:
        return {i: r.fixed for i, r in enumerate(self.inputs) if r.fixed is not None}
