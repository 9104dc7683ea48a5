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

from collections import OrderedDict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

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
        if stage == 2:
            for p, piece in zip(self.params, self.pieces):
                if piece is not p:
                    p.register_post_accumulate_grad_hook(_reduce_scatter_into(piece, syncing))
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
        for p, piece in zip(self.params, self.pieces):
            if piece is not p:  # whole again for the next forward: one all-gather per parameter
                whole = piece.redistribute(p.device_mesh, p.placements)
                p.to_local().copy_(whole.to_local())
        return loss

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


def _reduce_scatter_into(piece: nn.Parameter, syncing):
    """Stage 2: a parameter's gradient, once autograd has summed it, reduce-scattered into (added to) its piece's,
    and dropped; ``syncing(p)`` says whether to do it now (not inside no_sync)."""

    def hook(p: nn.Parameter) -> None:
        if p.grad is None or not syncing(p):
            return
        part = p.grad.redistribute(p.device_mesh, piece.placements)
        piece.grad = part if piece.grad is None else piece.grad + part
        p.grad = None

    return hook


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

