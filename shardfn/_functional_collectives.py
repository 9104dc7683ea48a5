"""torch's functional collectives (private torch API, kept here alone): collectives as ops on tensors, which work
in eager code, in traced graphs and in a simulated world (LocalTensorMode) alike, as DTensor's own do. Releases
from 2.13 renamed the gather and the scatter (``*_single``) and warn on every call of the old names."""

from __future__ import annotations

import torch.distributed._functional_collectives as _funcol

__all__ = ["all_gather_tensor", "all_reduce", "all_to_all_single", "reduce_scatter_tensor", "wait_tensor"]

all_gather_tensor = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
reduce_scatter_tensor = getattr(_funcol, "reduce_scatter_single", None) or _funcol.reduce_scatter_tensor
all_reduce = _funcol.all_reduce
all_to_all_single = _funcol.all_to_all_single
wait_tensor = _funcol.wait_tensor
