"""A mixed precision policy as a program applies it (config.Precision, from torch's MixedPrecisionPolicy):
floating parameters and inputs used in param_dtype, parameters' gradients reduced in reduce_dtype, outputs left in
output_dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from .pieces import as_dtensor, contiguous, gradient_placements

__all__ = ["Casts"]


class Casts:
    """The casts of ``policy`` (None: none)."""

    def __init__(self, policy):
        self.policy = policy

    def used(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """A floating parameter or input as the program uses it (mixed precision: in param_dtype; a parameter's
        gradient then goes back through reduce_dtype, in which it is reduced)."""
        p = self.policy
        if not self.casts(x, kind):
            return x
        if kind == "param":
            return _UsedAs.apply(x, p.param_dtype, p.reduce_dtype or p.param_dtype)
        return x.to(p.param_dtype)

    def casts(self, x: torch.Tensor, kind: str) -> bool:
        """Whether a mixed precision policy casts this parameter or input."""
        p = self.policy
        return not (p is None or p.param_dtype is None or kind == "buffer" or not x.dtype.is_floating_point
                    or x.dtype == p.param_dtype)

    def read_as_used(self, x: DTensor, placements) -> DTensor:
        """A parameter as an op reads it under a mixed precision policy: cast to param_dtype, then laid out as the
        op reads it (a level-1 parameter gathered in param_dtype); its gradient goes back cast to reduce_dtype
        first, then reduced (the gather's reduce-scatter in reduce_dtype, as FSDP2's)."""
        p = self.policy
        target = tuple(Replicate() if q.is_partial() and not c.is_partial() else q
                       for c, q in zip(x.placements, placements))
        if target == tuple(x.placements):
            return _UsedAs.apply(x, p.param_dtype, p.reduce_dtype or p.param_dtype)
        return _LaidOutAs.apply(x, target, p.param_dtype, p.reduce_dtype or p.param_dtype)

    def returned(self, out: Any) -> Any:
        p = self.policy
        if p is None or p.output_dtype is None or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point():
            return out
        return out.to(p.output_dtype)


class _UsedAs(torch.autograd.Function):
    """A parameter cast to the dtype the program uses it in (mixed precision); its gradient goes back in
    ``reduce_dtype``, pending sums included, so the reduction where the parameter entered runs in that dtype."""

    @staticmethod
    def forward(ctx, x, dtype, reduce_dtype):
        ctx.reduce_dtype = reduce_dtype
        return x.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.reduce_dtype), None, None


class _LaidOutAs(torch.autograd.Function):
    """A parameter cast to ``dtype`` and redistributed to ``placements`` (a level-1 parameter gathered in
    param_dtype); its gradient goes back the other way: cast to ``reduce_dtype``, then redistributed (the gather's
    reduce-scatter in reduce_dtype). One node for both: between two, autograd would cast the gradient back to the
    dtype of the value between them."""

    @staticmethod
    def forward(ctx, x, placements, dtype, reduce_dtype):
        ctx.mesh, ctx.reduce_dtype = x.device_mesh, reduce_dtype
        ctx.held, ctx.placements = gradient_placements(x.placements), gradient_placements(placements)
        return contiguous(x.to(dtype)).redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        grad = contiguous(as_dtensor(grad, ctx.mesh, ctx.placements).to(ctx.reduce_dtype))
        return contiguous(grad.redistribute(ctx.mesh, ctx.held)), None, None, None
