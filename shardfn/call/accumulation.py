"""Gradient accumulation without sync: micro-steps whose parameter gradients are summed locally, reduced once.

Inside ``sf.no_sync(model)`` a sharded callable runs a program whose backward leaves each parameter's gradient
pending (a Partial DTensor) over the mesh dims where the parameter is whole, instead of all-reducing it; autograd
sums those partial gradients into ``.grad`` with no communication. The first call after the context runs the same
program and, once its backward has finished, reduces every pending ``.grad`` once, in buckets (as DDP's
``no_sync`` and FSDP2's ``set_requires_gradient_sync(False)`` do). A parameter split over a mesh dim still has its
gradient reduce-scattered there at every micro-step: its whole-size gradient is never kept.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..strategy_search.buckets import bucket_bytes, in_buckets

__all__ = ["accumulated", "accumulating", "accumulating_call", "reduce_pending"]


@contextlib.contextmanager
def accumulating(engines: list):
    """Run ``engines``' calls without gradient sync; the next call of each after it reduces what was summed."""
    before = [e.sync for e in engines]
    for e in engines:
        e.sync = False
    try:
        yield
    finally:
        for e, was in zip(engines, before):
            e.sync = was


def reduce_pending(params: Iterable[torch.nn.Parameter]) -> int:
    """All-reduce every parameter's pending (Partial) ``.grad`` into the parameter's placements, in buckets of
    ``SHARDFN_BUCKET_MB`` per dtype and set of mesh dims. Returns the number of collectives."""
    pending = []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            pending.append((p, tuple(d for d, (a, b) in enumerate(zip(g.placements, p.placements))
                                     if a.is_partial() and not b.is_partial())))
    buckets = in_buckets(pending, lambda e: (id(e[0].grad.device_mesh), e[1], e[0].grad.dtype),
                         lambda e: e[0].grad.to_local().numel() * e[0].grad.element_size(), max(bucket_bytes(), 1))
    for bucket in buckets:
        _reduce_bucket([p for p, _ in bucket], bucket[0][1])
    return len(buckets)


def _reduce_bucket(params: list, dims: tuple[int, ...]) -> None:
    """One all-reduce (per pending mesh dim) of the concatenated local gradients of ``params``. The flat buffer
    is a DTensor pending over ``dims`` and whole elsewhere: the peers along ``dims`` hold the same pieces of
    every gradient, so only they sum."""
    mesh = params[0].grad.device_mesh
    locals_ = [p.grad.to_local() for p in params]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    pending = tuple(Partial() if d in dims else Replicate() for d in range(mesh.ndim))
    whole = DTensor.from_local(flat, mesh, pending, run_check=False).redistribute(
        mesh, (Replicate(),) * mesh.ndim).to_local()
    offset = 0
    for p, t in zip(params, locals_):
        piece = whole[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
        p.grad = DTensor.from_local(piece, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def accumulating_call(engine) -> bool:
    """Does this call of ``engine`` leave parameters' gradients pending (inside no_sync, or the synced call
    after it)?"""
    return engine.module is not None and (not engine.sync or engine.pending)


def accumulated(engine, outs: list) -> list:
    """Outputs of a call that left parameters' gradients pending: inside no_sync, noted; the synced call after
    it reduces every pending gradient once its backward has finished."""
    if not engine.sync:
        engine.pending = True
        return outs
    engine.pending = False
    # a stage-2 sharded optimizer reduce-scatters its parameters' gradients itself
    params = [p for n, p in engine.module.named_parameters() if n not in engine.grad_targets]

    def reduce():
        reduce_pending(params)

    return list(_AtBackwardEnd.apply(reduce, *outs))


class _AtBackwardEnd(torch.autograd.Function):
    """Identity on a call's outputs whose backward has ``fn`` run once the whole backward pass has finished (when
    autograd has summed every gradient into ``.grad``)."""

    @staticmethod
    def forward(ctx, fn, *outs):
        ctx.fn = fn
        return tuple(o.view_as(o) if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.fn)
        return (None, *grads)
