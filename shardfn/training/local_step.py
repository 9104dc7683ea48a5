"""An optimizer's step on each rank's local tensors instead of DTensors, where that is the same step.

torch's optimizers step DTensor parameters op by op through DTensor's dispatch: a GPT stack of 180 parameters
pays ~10 DTensor ops per parameter per step (AdamW's for-loop step on the CPU), more than the step of the whole
model on plain tensors. Where the optimizer's step is elementwise within each parameter (no norm, no factored
statistic, no matrix product: torch's SGD, Adam, AdamW and their kin) and every parameter and gradient is laid
out alike with no pending sum, the step of the DTensors is the step of each rank's local tensors: it runs on
those, in the same memory, and the states it makes are wrapped back as DTensors laid out as their parameter
(what torch.distributed.checkpoint saves). Any other optimizer (a subclass with its own step, LBFGS, Muon)
steps the DTensors as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

__all__ = ["as_dtensor", "on_local_tensors"]

# torch.optim's optimizers whose update of an element reads only that element's parameter, gradient and states
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
                "Rprop")


def _steps_locally(optimizer: torch.optim.Optimizer) -> bool:
    if not any(type(optimizer) is getattr(torch.optim, name, None) for name in _ELEMENTWISE):
        return False  # (exact types: a subclass may step otherwise)
    for group in optimizer.param_groups:
        for q in group["params"]:
            if not isinstance(q, DTensor):
                return False  # (plain and DTensor parameters in one list: the foreach path takes one kind)
            alike = [q.grad, *optimizer.state.get(q, {}).values()]
            if any(p.is_partial() for p in q.placements) or not all(_laid_out_alike(t, q) for t in alike):
                return False
    return True


def _laid_out_alike(t, q: DTensor) -> bool:
    """``t`` (a gradient or a state) is nothing, a scalar, or a DTensor laid out as ``q`` on its mesh."""
    if not isinstance(t, torch.Tensor) or (t.dim() == 0 and not isinstance(t, DTensor)):
        return True
    return isinstance(t, DTensor) and t.device_mesh == q.device_mesh and t.placements == q.placements


@contextlib.contextmanager
def on_local_tensors(optimizer: torch.optim.Optimizer, more_grads: Mapping[int, torch.Tensor]):
    """For the duration, ``optimizer``'s parameters, their gradients and states are each rank's local tensors (the
    same memory) where that steps alike (see the module's docs); else nothing changes. ``more_grads``: id(DTensor
    parameter) -> a local gradient to add to its own (a slice of a reduced gradient, with no DTensor made for
    it). Yields whether the step runs locally (where not, the caller makes ``more_grads`` DTensor gradients)."""
    if not _steps_locally(optimizer):
        yield False
        return
    saved = [group["params"] for group in optimizer.param_groups]
    swapped = []  # (DTensor parameter, its local tensor, its states before)
    with torch.no_grad():  # (to_local() is then the local tensor itself, not a view of it)
        for group in optimizer.param_groups:
            params = []
            for q in group["params"]:
                local = q.to_local()
                grads = [g for g in (None if q.grad is None else q.grad.to_local(), more_grads.get(id(q)))
                         if g is not None]
                local.grad = grads[0] if len(grads) == 1 else (grads[0] + grads[1]) if grads else None
                before = optimizer.state.pop(q, None)
                if before is not None:
                    optimizer.state[local] = {k: v.to_local() if isinstance(v, DTensor) else v
                                              for k, v in before.items()}
                swapped.append((q, local, before or {}))
                params.append(local)
            group["params"] = params
    try:
        yield True
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        for q, local, before in swapped:
            local.grad = None
            state = optimizer.state.pop(local, None)
            if state is not None:
                optimizer.state[q] = {k: _laid_out_as(v, q, before.get(k)) for k, v in state.items()}


def _laid_out_as(value, q: DTensor, before):
    """A state the local step left: as the DTensor it was (the same local tensor, updated in place), a new one of
    the parameter's dims as a DTensor laid out as ``q``, a scalar (a step count) as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.dim() != q.dim():
        return value
    if isinstance(before, DTensor):
        with torch.no_grad():
            if before.to_local() is value:
                return before
    return as_dtensor(value, q)


def as_dtensor(local: torch.Tensor, like: DTensor, placements: tuple | None = None) -> DTensor:
    """``local`` as this rank's piece of a DTensor of ``like``'s shape and mesh, in ``placements`` (``like``'s)."""
    with torch.no_grad():
        return DTensor.from_local(local, like.device_mesh, placements or like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
