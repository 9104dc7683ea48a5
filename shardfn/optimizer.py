"""shard_optimizer(): optimizer states kept only by the rank that owns their piece (ZeRO stages 1 and 2).

A parameter whole over some mesh dims (data parallelism: replicated over the batch's ranks) gets a *piece*: a
dim no mesh dim splits yet (dim 0 under plain data parallelism, dim 1 of a Megatron column-parallel weight) split
over the first of those mesh dims (torch.chunk's pieces, as DTensor cuts them), so the piece is a slice of what the
rank holds. The wrapped torch optimizer steps the pieces, so its states (AdamW's two moments) hold one piece each,
as DTensors torch.distributed.checkpoint reshards. After each step every piece is all-gathered into its parameter,
whole again for the next forward.

* stage 1: the program all-reduces gradients as ever; the step takes each rank's piece of them (no collective).
* stage 2: the program leaves each such gradient pending, and as autograd hands it over, a hook reduce-scatters it
  into its piece and drops the whole one (ZeRO-2: a rank holds a gradient whole only until it is reduced), the
  same bytes on the wire as one all-reduce: a reduce-scatter and, after the step, an all-gather. Inside
  ``sf.no_sync`` the hook waits: the pending sums accumulate, and the synced step reduce-scatters them once.

Parameters already split over every mesh dim (level 1) keep their own layout: their states are already pieces;
so do those split on every tensor dim already (a tensor-parallel bias).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

from ._functional_collectives import all_gather_tensor, reduce_scatter_tensor

__all__ = ["ShardedOptimizer", "check_stage", "gradient_targets", "piece_placements"]

STAGES = (1, 2)


def piece_placements(p: DTensor) -> tuple | None:
    """Where parameter ``p``'s optimizer state lives: split over the first mesh dim ``p`` is whole on, along a
    tensor dim no mesh dim splits yet (the first with as many entries as that mesh dim has ranks, else the first),
    its own placements elsewhere. So the piece is a slice of what this rank holds, taken with no collective: plain
    data parallelism splits dim 0; a Megatron column-parallel weight, dim 0 split over tp, dim 1 over dp. None
    where ``p`` is whole nowhere, or where every dim is split already (a tensor-parallel bias: a second split of
    its dim 0 over dp would be another rank's rows, not a slice of this rank's)."""
    placements = tuple(p.placements)
    whole = [d for d, q in enumerate(placements) if q.is_replicate()]
    split = {q.dim for q in placements if isinstance(q, Shard)}
    free = [t for t in range(p.dim()) if t not in split]
    if not whole or not free or p.numel() == 0:
        return None
    n = p.device_mesh.size(whole[0])
    t = min(free, key=lambda t: (p.shape[t] < n, t))
    return tuple(Shard(t) if d == whole[0] else q for d, q in enumerate(placements))


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
        # whole again; a rank outside a parameter's mesh (another pipeline stage's) holds nothing of it
        _gather_pieces([(p, q) for p, q in zip(self.params, self.pieces)
                        if q is not p and p.device_mesh.get_coordinate() is not None])
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


def _split(p: DTensor, piece: DTensor) -> tuple[int, int]:
    """(mesh dim, tensor dim) of ``piece``'s split of ``p``: the one mesh dim where ``p`` is whole and the piece is
    Shard(t). t is split by no other mesh dim, so the piece is the torch.chunk piece of ``p``'s local tensor along
    t: the collectives below work on local tensors, over that mesh dim's ranks (who hold alike local shapes)."""
    (d,) = [d for d, (a, b) in enumerate(zip(p.placements, piece.placements)) if a != b]
    return d, piece.placements[d].dim


def _by_bucket(pairs, together=lambda p, d: True):
    """(parameter, piece) pairs grouped for one collective each: mesh, mesh dim, dtype, up to a bucket's bytes;
    those ``together`` refuses alone (mesh dim None). Yields (mesh dim, [(parameter, piece, tensor dim)])."""
    from .strategy_search.buckets import bucket_bytes, in_buckets

    fused, alone = [], []
    for p, piece in pairs:
        d, t = _split(p, piece)
        (fused if together(p, d) else alone).append((p, piece, d, t))
    for bucket in in_buckets(fused, lambda e: (id(e[0].device_mesh), e[2], e[0].dtype),
                             lambda e: e[0].numel() * e[0].element_size(), max(bucket_bytes(), 1)):
        yield bucket[0][2], [(p, piece, t) for p, piece, _, t in bucket]
    for p, piece, _, t in alone:
        yield None, [(p, piece, t)]


def _rows(n: int, k: int) -> int:
    """Rows of each torch.chunk piece of ``n`` rows in ``k`` (the last ones fewer or none): the padded size."""
    return -(-n // k)


def _padded(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``rows`` (split dim first) padded with zeros to ``n`` rows. F.pad, not a slice assignment: in a simulated
    world a piece's row count differs per rank (1, 0, 0, 0 for a 1-element bias on 4 ranks), which an op takes
    but indexing into a slice cannot (LocalTensorMode compares that count with a plain int and fails)."""
    return F.pad(rows, [0, 0] * (rows.dim() - 1) + [0, n - rows.shape[0]])


def _gather_pieces(pairs) -> None:
    """Every piece all-gathered into its parameter, in buckets: each rank's pieces (split dim first) padded to
    torch.chunk's size, concatenated, one all-gather over the split's mesh dim, cut back."""
    for d, bucket in _by_bucket(pairs):
        mesh = bucket[0][0].device_mesh
        k = mesh.size(d)
        flat = [_padded(piece.to_local().movedim(t, 0), _rows(p.shape[t], k)).reshape(-1) for p, piece, t in bucket]
        gathered = all_gather_tensor(torch.cat(flat), 0, (mesh, d)).reshape(k, -1)
        offset = 0
        for p, _, t in bucket:
            local = p.to_local()
            rest = local.movedim(t, 0).shape[1:]
            size = _rows(p.shape[t], k) * math.prod(rest)
            rows = gathered[:, offset:offset + size].reshape(-1, *rest)[:p.shape[t]]
            local.copy_(rows.movedim(0, t))
            offset += size


def _scatter_gradients(pairs) -> None:
    """Stage 2: every parameter's summed (pending) gradient reduce-scattered into its piece's, in buckets: each
    (split dim first) padded to torch.chunk's size, rank-major, one reduce-scatter over the split's mesh dim, cut
    back; the whole gradients dropped. A gradient not pending over that mesh dim goes through DTensor alone."""
    for d, bucket in _by_bucket(pairs, lambda p, d: p.grad.placements[d] == Partial()):
        if d is None:
            ((p, piece, _),) = bucket
            piece_grads = [p.grad.redistribute(p.device_mesh, piece.placements)]
        else:
            mesh = bucket[0][0].device_mesh
            k = mesh.size(d)
            blocks = []
            for p, _, t in bucket:
                # pending over other mesh dims too (a parameter whole on both dp and tp): summed there first
                g = p.grad.redistribute(p.device_mesh, [q if e == d else r for e, (q, r) in
                                                        enumerate(zip(p.grad.placements, p.placements))])
                blocks.append(_padded(g.to_local().movedim(t, 0), k * _rows(p.shape[t], k)).reshape(k, -1))
            mine = reduce_scatter_tensor(torch.cat(blocks, dim=1).reshape(-1), "sum", 0, (mesh, d))
            piece_grads, offset = [], 0
            for p, piece, t in bucket:
                local = piece.to_local().movedim(t, 0)
                size = _rows(p.shape[t], k) * math.prod(local.shape[1:])
                rows = mine[offset:offset + size].reshape(-1, *local.shape[1:])[:local.shape[0]]
                offset += size
                piece_grads.append(DTensor.from_local(rows.movedim(0, t), mesh, piece.placements, run_check=False,
                                                      shape=piece.shape, stride=piece.stride()))
        for (p, piece, _), part in zip(bucket, piece_grads):
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

