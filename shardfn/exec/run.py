"""Running a ParallelProgram from eager code: what crosses the boundary, and how gradients cross back.

A call hands the program plain local tensors: each DTensor argument (a parameter, a DTensor input) through one
:class:`LocalsOf` autograd node for all of them, each plain tensor as it is. Everything else, laying inputs
out as planned, the program, putting outputs in their returned layouts, and the backward of all of it, runs
inside the program's traced local graphs. ``LocalsOf``'s backward wraps each local gradient back into a
DTensor with its argument's placements, so a parameter's ``.grad`` has the parameter's placements.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from ._dtensor_internals import layout_of, local_as, local_of

__all__ = ["LocalsOf", "global_stride"]


class LocalsOf(torch.autograd.Function):
    """DTensors -> their local tensors, in one autograd node; gradients go back as DTensors of the same layout."""

    @staticmethod
    def forward(ctx, *dtensors: DTensor):
        ctx.layouts = [layout_of(d) for d in dtensors]
        return tuple(local_of(d).detach() for d in dtensors)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(None if g is None else local_as(layout, g) for g, layout in zip(grads, ctx.layouts))


def global_stride(local: torch.Tensor, shape: Sequence[int], placements, mesh) -> tuple[int, ...]:
    """Strides of a dense tensor of global ``shape`` whose dims are ordered in memory as ``local``'s are (a
    transposed piece gives a transposed whole). Dims of equal stride keep their order. A dim of at most one
    element on every rank (``placements`` over ``mesh`` say so alike on every rank) has no place in memory: any
    stride serves it, and a kernel and its fake give it different ones. It goes right after the dim before it, so
    a contiguous piece gives a contiguous whole."""
    pieces = [1] * len(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            pieces[p.dim % len(shape)] *= mesh.size(m)
    single = [shape[d] <= pieces[d] for d in range(len(shape))]
    order = sorted((d for d in range(local.dim()) if not single[d]), key=lambda d: (-local.stride(d), d))
    for d in range(local.dim()):
        if single[d]:
            order.insert(order.index(d - 1) + 1 if d else 0, d)
    stride, acc = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)
