"""Running a ParallelProgram from eager code: inputs in, outputs out, autograd through both.

Inputs become DTensors in the plan's placements without communication (a whole value is sliced, a
data-parallel slice is wrapped); outputs leave as plain whole tensors, this rank's batch slice, or DTensors.
Both conversions are differentiable, so gradients reach the caller's tensors; a parameter's gradient is put
in the parameter's own placements (a pending sum is reduced) by the identity redistribution at entry.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

__all__ = ["enter_input", "enter_parameter", "leave_output"]

Placements = tuple[Placement, ...]


def enter_input(x: torch.Tensor, mesh: DeviceMesh, held: Placements, planned: Placements,
                global_shape: Sequence[int]) -> DTensor:
    """This rank's value ``x`` (laid out as ``held``: whole, a batch slice, or a DTensor) in ``planned``."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            x = DTensor.from_local(x.to_local(), mesh, held, run_check=False, shape=torch.Size(global_shape),
                                   stride=_contiguous_stride(global_shape))
    else:
        x = DTensor.from_local(x, mesh, held, run_check=False, shape=torch.Size(global_shape),
                               stride=_contiguous_stride(global_shape))
    return x if tuple(x.placements) == tuple(planned) else x.redistribute(mesh, planned)


def enter_parameter(p: DTensor, mesh: DeviceMesh) -> DTensor:
    # identity forward; backward reduces the gradient to the parameter's placements (never left Partial)
    return p.redistribute(mesh, p.placements)


def leave_output(y: Any, as_dtensor: bool) -> Any:
    if not isinstance(y, DTensor) or as_dtensor:
        return y
    return y.to_local()


def whole(ndim: int) -> Placements:
    return (Replicate(),) * ndim


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(list(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
