"""torch's functional collectives (private torch API, kept here alone): collectives as ops on tensors, which work
in eager code, in traced graphs and in a simulated world (LocalTensorMode) alike, as DTensor's own do."""

from __future__ import annotations

import torch.distributed._functional_collectives as _funcol

__all__ = ["all_gather_tensor", "all_reduce", "all_to_all_single", "reduce_scatter_tensor", "wait_tensor"]

all_gather_tensor = _funcol.all_gather_tensor
all_reduce = _funcol.all_reduce
all_to_all_single = _funcol.all_to_all_single
reduce_scatter_tensor = _funcol.reduce_scatter_tensor
wait_tensor = _funcol.wait_tensor
