"""shard_optimizer(): optimizer states kept only by the rank that owns their piece (ZeRO stages 1 and 2).

A parameter whole over some mesh dims (data parallelism: replicated over the batch's ranks) gets a *piece*: its
dim 0 split over the first of those dims (torch.chunk's pieces, as DTensor cuts them). The wrapped torch optimizer
steps the pieces, so its states (AdamW's two moments) hold one piece each, as DTensors torch.distributed.checkpoint
reshards. After each step every piece is all-gathered into its parameter, whole again for the next forward.

* stage 1: the program all-reduces gradients as ever; the step takes each rank's piece of them (no collective).
* stage 2: the program leaves each such gradient pending, and as autograd hands it over, a hook reduce-scatters it
  into its piece and drops the whole one (ZeRO-2: a rank holds a gradient whole only until it is reduced), the
  same bytes on the wire as one all-reduce: a reduce-scatter and, after the step, an all-gather. Inside
  ``sf.no_sync`` the hook waits: the pending sums accumulate, and the synced step reduce-scatters them once.

Parameters already split over every mesh dim (level 1) keep their own layout: their states are already pieces.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ._functional_collectives import all_gather_tensor, reduce_scatter_tensor

__all__ = ["ShardedOptimizer", "check_stage", "gradient_targets", "piece_placements"]

STAGES = (1, 2)


def piece_placements(p: DTensor) -> tuple | None:
    """Where parameter ``p``'s optimizer state lives: its dim 0 split over the first mesh dim it is whole on (its
    own placements elsewhere), or None where it is whole nowhere (or has no dim 0 to split)."""
    placements = tuple(p.placements)
    whole = [d for d, q in enumerate(placements) if q.is_replicate()]
    if not whole or p.dim() == 0 or any(isinstance(q, Shard) and q.dim == 0 for q in placements):
        return None
    return tuple(Shard(0) if d == whole[0] else q for d, q in enumerate(placements))


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer`` stepping pieces of its parameters (see the module's docs). Use it as the optimizer itself:
    ``step``, ``zero_grad``, ``state_dict``/``load_state_dict``, ``param_groups`` (its own, over the pieces)."""

    def __init__(self, optimizer: torch.optim.Optimizer, stage: int, syncing=lambda p: True):
        self.inner, self.stage = optimizer, stage
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.pieces: list[nn.Parameter] = []
        for p in self.params:
            target = piece_placements(p)
            if target is None:
                self.pieces.append(p)
            else:
                with torch.no_grad():
                    piece = p.detach().redistribute(p.device_mesh, target)  # a slice: no collective
                self.pieces.append(nn.Parameter(piece, requires_grad=p.requires_grad))
        self._ready: list = []  # stage 2: parameters whose summed gradients await their reduce-scatter
        if stage == 2:
            for p, piece in zip(self.params, self.pieces):
                if piece is not p:
                    p.register_post_accumulate_grad_hook(self._hook(piece, syncing))
        swap = {id(p): q for p, q in zip(self.params, self.pieces)}
        for group in optimizer.param_groups:
            group["params"] = [swap[id(p)] for p in group["params"]]
        # torch.optim.Optimizer's own bookkeeping (hooks, the step LR schedulers count), over the inner
        # optimizer's groups and state: a scheduler changing a group's lr changes the inner optimizer's
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self.param_groups, self.state, self.defaults = optimizer.param_groups, optimizer.state, optimizer.defaults
        self._patch_step_function()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p, piece in zip(self.params, self.pieces):
            if piece is p:
                continue
            g = p.grad
            if g is None:  # stage 2: the hook has put it in the piece already
                continue
            if tuple(g.placements) != tuple(piece.placements):  # stage 1: a slice of the reduced gradient
                g = g.redistribute(p.device_mesh, piece.placements)
            piece.grad = g if piece.grad is None else piece.grad + g
        self.inner.step()
        _gather_pieces([(p, q) for p, q in zip(self.params, self.pieces) if q is not p])  # whole again
        return loss

    def _hook(self, piece: nn.Parameter, syncing):
        """Stage 2: a parameter's gradient, once autograd has summed it, waits for the end of the backward pass,
        where all of them are reduce-scattered into their pieces in buckets and dropped (not inside no_sync)."""

        def hook(p: nn.Parameter) -> None:
            if p.grad is None or not syncing(p):
                return
            if not self._ready:
                torch.autograd.Variable._execution_engine.queue_callback(self._reduce_scatter_ready)
            self._ready.append((p, piece))

        return hook

    def _reduce_scatter_ready(self) -> None:
        ready, self._ready = self._ready, []
        _scatter_gradients(ready)

    def zero_grad(self, set_to_none: bool = True):
        for t in (*self.params, *self.pieces):
            if t.grad is not None:
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        raise NotImplementedError("shard_optimizer: add parameter groups to the optimizer before sharding it")

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.stage}, {self.inner!r})"


def _bucketable(p: DTensor, piece: DTensor) -> int | None:
    """The mesh dim of ``piece``'s split when ``p`` is whole everywhere else (plain data parallelism: its pieces
    can share one collective with others'), else None (moved alone, through DTensor)."""
    dims = [d for d, (a, b) in enumerate(zip(p.placements, piece.placements)) if a != b]
    return dims[0] if len(dims) == 1 and all(q.is_replicate() for q in p.placements) else None


def _by_bucket(pairs):
    """(parameter, piece) pairs grouped for one collective each: mesh, mesh dim, dtype, up to a bucket's bytes;
    the others alone."""
    from .strategy_search.buckets import bucket_bytes, in_buckets

    together, alone = [], []
    for p, piece in pairs:
        d = _bucketable(p, piece)
        (alone if d is None else together).append((p, piece, d))
    for bucket in in_buckets(together, lambda e: (id(e[0].device_mesh), e[2], e[0].dtype),
                             lambda e: e[0].numel() * e[0].element_size(), max(bucket_bytes(), 1)):
        yield bucket[0][2], [(p, piece) for p, piece, _ in bucket]
    for p, piece, _ in alone:
        yield None, [(p, piece)]


def _rows(n: int, k: int) -> int:
    """Rows of each torch.chunk piece of ``n`` rows in ``k`` (the last ones fewer or none): the padded size."""
    return -(-n // k)


def _gather_pieces(pairs) -> None:
    """Every piece all-gathered into its parameter, in buckets: each rank's pieces padded to torch.chunk's size,
    concatenated, one all-gather, cut back."""
    for d, bucket in _by_bucket(pairs):
        if d is None:
            ((p, piece),) = bucket
            p.to_local().copy_(piece.redistribute(p.device_mesh, p.placements).to_local())
            continue
        mesh = bucket[0][0].device_mesh
        k = mesh.size(d)
        flat = []
        for p, piece in bucket:
            c, local = _rows(p.shape[0], k), piece.to_local()
            padded = local.new_zeros((c,) + tuple(p.shape[1:]))
            padded[:local.shape[0]] = local
            flat.append(padded.reshape(-1))
        gathered = all_gather_tensor(torch.cat(flat), 0, (mesh, d)).reshape(k, -1)
        offset = 0
        for p, _ in bucket:
            c, row = _rows(p.shape[0], k), math.prod(p.shape[1:])
            rows = gathered[:, offset:offset + c * row].reshape(k * c, *p.shape[1:])
            p.to_local().copy_(rows[:p.shape[0]])
            offset += c * row


def _scatter_gradients(pairs) -> None:
    """Stage 2: every parameter's summed (pending) gradient reduce-scattered into its piece's, in buckets: each
    padded to torch.chunk's size, rank-major, one reduce-scatter, cut back; the whole gradients dropped."""
    for d, bucket in _by_bucket(pairs):
        if d is None:
            ((p, piece),) = bucket
            part = p.grad.redistribute(p.device_mesh, piece.placements)
        else:
            mesh = bucket[0][0].device_mesh
            k = mesh.size(d)
            blocks = []
            for p, _ in bucket:
                c, g = _rows(p.shape[0], k), p.grad.to_local()
                padded = g.new_zeros((k * c,) + tuple(p.shape[1:]))
                padded[:p.shape[0]] = g
                blocks.append(padded.reshape(k, -1))
            mine = reduce_scatter_tensor(torch.cat(blocks, dim=1).reshape(-1), "sum", 0, (mesh, d))
            offset = 0
        for p, piece in bucket:
            if d is not None:
                c, row, rows = _rows(p.shape[0], k), math.prod(p.shape[1:]), piece.to_local().shape[0]
                local = mine[offset:offset + c * row].reshape(c, *p.shape[1:])[:rows]
                offset += c * row
                part = DTensor.from_local(local, piece.device_mesh, piece.placements, run_check=False,
                                          shape=piece.shape, stride=piece.stride())
            piece.grad = part if piece.grad is None else piece.grad + part
            p.grad = None


def gradient_targets(optimizer: ShardedOptimizer) -> dict[int, tuple]:
    """Stage 2: id(parameter) -> the placements its gradient is reduce-scattered into (its piece's)."""
    if optimizer.stage != 2:
        return {}
    return {id(p): tuple(q.placements) for p, q in zip(optimizer.params, optimizer.pieces) if q is not p}


def check_stage(stage) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"shard_optimizer: stage must be 1 (states split) or 2 (states and gradients split); got "
                         f"{stage!r} (stage 3, parameters split too, is sf.shard(..., level=1))")
    return stage

