"""A DeviceMesh without process groups (private DeviceMesh arguments, kept here alone): a layout's frame for ranks
that hold no groups of it. shardfn needs one to plan (no communication, rank 0's view), for a sub-mesh seen from a
rank outside it (DTensor treats it as "not a member"), and for a stand-in of an argument arriving from other
ranks (its layout described, nothing held)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_without_groups"]


def mesh_without_groups(device: str, ranks: torch.Tensor | Sequence[int], names: tuple[str, ...] | None = None,
                        rank: int | None = None) -> DeviceMesh:
    """A DeviceMesh over ``ranks`` that makes no process group; ``rank``: the rank it is seen from (default: this
    process's, which must then be initialised)."""
    if rank is None:
        return DeviceMesh(device, ranks, mesh_dim_names=names, _init_backend=False)
    return DeviceMesh(device, ranks, mesh_dim_names=names, _init_backend=False, _rank=rank)
