"""Sharding rules in DTensor's own form (``torch.distributed.tensor.experimental.register_sharding``) for ops DTensor
has no rule for, so that its dispatch finds them: chiefly the backward ops autograd records for a forward op
DTensor does shard (avg_pool2d runs split by batch; its avg_pool2d_backward had no rule, and the backward raised),
and what torch 2.11's DTensor lacks that later releases have (pooling by batch, flip: without them a ResNet's batch
was gathered for every pooling, and cumsum's backward, which flips, raised; squeeze of several dims, cumprod:
whole on every rank there). Not convolution: 2.11 dispatches it to
a handler of its own that takes only its eager propagation rule (shardfn's own rule runs it on the pieces there).

Registered only where DTensor has no rule of its own (never overriding one), each proven by ground truth in
tests/strategy_search/test_rule_truth.py. Each rule lists, per mesh dim, (output placements, input placements),
None for non-tensor arguments.

DTensor's registry is process-wide and shardfn's programs run through DTensor's dispatch, so the rules must be
there while shardfn plans and runs: each is registered with :data:`.registry.REGISTRY`
(``register_dtensor_rule``, aliased ``_lacking`` here), which keeps it pending until :func:`register`
(``REGISTRY.register_in_dtensor``), called by the search the first time it builds a problem (not at import:
importing shardfn leaves DTensor as it is); then they stay registered (they only add rules for ops DTensor would
refuse or run whole; other code's DTensors then take them too).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from .registry import REGISTRY

aten = torch.ops.aten
R = Replicate()

__all__ = ["REGISTERED", "register"]

REGISTERED: list = REGISTRY.registered_in_dtensor  # the ops registered so far (the registry's list)
register = REGISTRY.register_in_dtensor  # put the pending rules in DTensor's registry, once, for the ops it lacks
_lacking = REGISTRY.register_dtensor_rule  # the decorated rule, for those of its ops DTensor has no rule for


def _ndim(x) -> int:
    return len(x.shape)


def _per_batch(n_out: int, args, spatial: int):
    """Every tensor argument and the outputs split alike on the batch dim: pooling reads each (batch, channel)
    plane alone. Not the channel dim: an uneven split leaves a rank no channels, and these kernels refuse an empty
    non-batch dim (an empty batch they take)."""
    tensors = [a for a in args if hasattr(a, "shape")]
    rules = [([R] * n_out, [R if hasattr(a, "shape") else None for a in args])]
    if all(_ndim(t) == spatial + 2 for t in tensors):
        rules.append(([Shard(0)] * n_out, [Shard(0) if hasattr(a, "shape") else None for a in args]))
    return rules


@_lacking(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(*args):
    return _per_batch(1, args, 2)


@_lacking(aten.avg_pool3d_backward.default)
def _avg_pool3d_backward(*args):
    return _per_batch(1, args, 3)


@_lacking(aten.adaptive_max_pool2d_backward.default, aten.max_pool2d_with_indices_backward.default,
          aten.fractional_max_pool2d_backward.default)
def _max_pool2d_backward(*args):
    return _per_batch(1, args, 2)


@_lacking(aten.adaptive_max_pool3d_backward.default, aten.max_pool3d_with_indices_backward.default,
          aten.fractional_max_pool3d_backward.default)
def _max_pool3d_backward(*args):
    return _per_batch(1, args, 3)


def _elementwise(args):
    """Elementwise over tensor arguments of one shape: any split, the same on all of them."""
    shape = next(a.shape for a in args if hasattr(a, "shape"))
    if any(hasattr(a, "shape") and tuple(a.shape) != tuple(shape) for a in args):
        return [([R], [R if hasattr(a, "shape") else None for a in args])]
    return [([p], [p if hasattr(a, "shape") else None for a in args])
            for p in [R] + [Shard(d) for d in range(len(shape))]]


@_lacking(aten.hardtanh_backward.default, aten.hardswish_backward.default, aten.hardsigmoid_backward.default,
          aten.softshrink_backward.default, aten.hardshrink_backward.default, aten.log_sigmoid_backward.default)
def _elementwise_backward(*args):
    return _elementwise(args)


@_lacking(aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default)
def _max_pool2d(*args):
    return _per_batch(2, args, 2)  # the pooled values and their indices


@_lacking(aten.max_pool3d_with_indices.default, aten.adaptive_max_pool3d.default)
def _max_pool3d(*args):
    return _per_batch(2, args, 3)


@_lacking(aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default)
def _avg_pool2d(*args):
    return _per_batch(1, args, 2)


@_lacking(aten.avg_pool3d.default, aten._adaptive_avg_pool3d.default)
def _avg_pool3d(*args):
    return _per_batch(1, args, 3)


@_lacking(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad_output, self):
    return _per_batch(1, (grad_output, self), 2)


@_lacking(aten.flip.default)
def _flip(self, dims):
    # a flip reverses only its own dims: any other dim may be split
    flipped = {d % max(_ndim(self), 1) for d in dims}
    return [([R], [R, None])] + [([Shard(d)], [Shard(d), None]) for d in range(_ndim(self)) if d not in flipped]


@_lacking(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad_output, self):
    return _per_batch(1, (grad_output, self), 3)


@_lacking(aten.tril_.default, aten.triu_.default)
def _tri_inplace(self, diagonal=0):
    # the triangle is taken in each matrix (the last two dims) alone
    return [([R], [R, None])] + [([Shard(d)], [Shard(d), None]) for d in range(_ndim(self) - 2)]


@_lacking(aten.squeeze.dims)
def _squeeze_dims(self, dims):
    # a listed dim is never split (a rank's piece of one may have size 1 and be squeezed there); any other keeps its
    # split at its new index
    listed = {d % max(_ndim(self), 1) for d in dims}
    kept = [d for d in range(_ndim(self)) if d not in listed or self.shape[d] != 1]
    return [([R], [R, None])] + [([Shard(kept.index(d))], [Shard(d), None]) for d in kept if d not in listed]


@_lacking(aten.cumprod.default)
def _cumprod(self, dim, dtype=None):
    # a running product along its own dim: any other dim may be split
    along = dim % max(_ndim(self), 1)
    return [([R], [R, None, None])] + [([Shard(d)], [Shard(d), None, None]) for d in range(_ndim(self)) if d != along]
