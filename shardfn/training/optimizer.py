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

import contextlib
import math
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from .._functional_collectives import all_gather_tensor, reduce_scatter_tensor, wait_tensor
from .._simulation_internals import local_values
from ..runtime import is_simulated, simulated_map
from .local_step import as_dtensor, on_local_tensors

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
    ``step``, ``zero_grad``, ``state_dict``/``load_state_dict``, ``param_groups`` and ``state``, both over the
    model's parameters as torch's optimizers are (what torch.distributed.checkpoint's ``get_state_dict`` and LR
    schedulers read), while the inner optimizer holds the pieces and their states.

    A piece is a view of its parameter's local tensor, so weights loaded into the model at any moment (before or
    after this wrapper was built, ``model.load_state_dict``, ``sf.load``) are what the next step starts from."""

    def __init__(self, optimizer: torch.optim.Optimizer, stage: int, syncing=lambda p: True):
        self.inner, self.stage = optimizer, stage
        self.params: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.pieces: list[nn.Parameter] = []
        for p in self.params:
            target = piece_placements(p)
            self.pieces.append(p if target is None else
                               nn.Parameter(_piece_view(p, target), requires_grad=p.requires_grad))
        self._param_of = {id(q): p for p, q in zip(self.params, self.pieces)}
        self._piece_of = {id(p): q for p, q in zip(self.params, self.pieces)}
        with torch.no_grad():  # (no_grad: to_local() is the local tensor itself, whose identity is checked)
            self._viewed = [None if q is p else p.to_local() for p, q in zip(self.params, self.pieces)]
        self._provisional: dict[int, int] = {}  # id(piece) -> its states' versions, made only for state_dict()
        self._ready: list = []  # stage 2: parameters whose summed gradients await their reduce-scatter
        if stage == 2:
            for p, piece in zip(self.params, self.pieces):
                if piece is not p and p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._hook(piece, syncing))
        swap = {id(p): q for p, q in zip(self.params, self.pieces)}
        for group in optimizer.param_groups:
            group["params"] = [swap[id(p)] for p in group["params"]]
        # torch.optim.Optimizer's own bookkeeping (hooks, the step LR schedulers count)
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self.defaults = optimizer.defaults
        self._groups: tuple = ((), [])
        self._patch_step_function()

    @property
    def param_groups(self) -> list["_Group"]:
        """The inner optimizer's groups as the model's parameters' groups: read afresh, since the inner
        optimizer's ``load_state_dict`` replaces its groups (an LR scheduler must reach the new ones)."""
        inner = self.inner.param_groups
        if self._groups[0] != tuple(map(id, inner)):
            self._groups = (tuple(map(id, inner)), [_Group(g, self._param_of) for g in inner])
        return self._groups[1]

    @property
    def state(self) -> "_StateByParameter":
        """The inner optimizer's states, keyed by the model's parameters (each state's tensors: pieces)."""
        return _StateByParameter(self.inner.state, self._param_of, self._piece_of)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._drop_provisional()
        slices = {}  # stage 1: id(piece) -> this rank's slice of its parameter's reduced gradient (a local view)
        for i, (p, piece) in enumerate(zip(self.params, self.pieces)):
            if piece is p:
                continue
            local = p.to_local()
            if local is not self._viewed[i]:  # the parameter's local tensor was replaced (p.data = ...)
                self._viewed[i] = local
                fresh, own = _local_view(p, tuple(piece.placements)), piece.to_local()
                if _addresses(fresh) != _addresses(own):  # (not where it is a new view of the same memory)
                    own.copy_(fresh)
            g = p.grad
            if g is None:  # stage 2: the hook has put it in the piece already
                continue
            if tuple(g.placements) == tuple(p.placements):  # stage 1: this rank's slice of the reduced gradient
                slices[id(piece)] = _local_view(g, tuple(piece.placements))
                continue
            if tuple(g.placements) != tuple(piece.placements):
                g = g.redistribute(p.device_mesh, piece.placements)
            piece.grad = g if piece.grad is None else piece.grad + g
        with on_local_tensors(self.inner, slices) as local:
            if not local:  # (a step of DTensors: the slices as their gradients)
                for piece in self.pieces:
                    if id(piece) in slices:
                        g = as_dtensor(slices[id(piece)], piece)
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
        """The inner optimizer's state dict (states of pieces: DTensors that torch.distributed.checkpoint saves
        and reshards). Parameters with no state yet get the states their first step would make, provisional: a
        fresh optimizer's state dict has entries to load a checkpoint into (``sf.load``), and where nothing is
        loaded into them, the next step drops them and starts as torch's optimizer would."""
        self._make_provisional()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        """Loads a state dict as torch's optimizers do; its tensors may also be whole (an ordinary optimizer's,
        a full state dict) or DTensors in another layout: each is laid out as this rank's piece."""
        self.inner.load_state_dict(state_dict)
        self._provisional.clear()
        for piece in self.pieces:
            state = self.inner.state.get(piece)
            if isinstance(piece, DTensor) and state:
                for key, value in state.items():
                    state[key] = _as_piece(value, piece)

    def _make_provisional(self) -> None:
        """States for the pieces that have none, made by the inner optimizer's own step at learning rate 0 from
        zero gradients (the values a first step starts from; the pieces do not move), step counts set back to 0."""
        empty = [q for q in self.pieces if q.requires_grad and not self.inner.state.get(q)]
        if not empty:
            return
        grads = {id(q): q.grad for q in empty}
        rates = [g.get("lr") for g in self.inner.param_groups]
        try:
            for q in empty:
                q.grad = torch.zeros_like(q)
            for group in self.inner.param_groups:
                if "lr" in group:
                    group["lr"] = 0.0 * group["lr"]
            with _only(self.inner, empty), on_local_tensors(self.inner, {}):
                self.inner.step()
        finally:
            for group, lr in zip(self.inner.param_groups, rates):
                if lr is not None:
                    group["lr"] = lr
            for q in empty:
                q.grad = grads[id(q)]
        for q in empty:
            state = self.inner.state.get(q, {})
            for key, value in state.items():
                if key == "step" and isinstance(value, torch.Tensor):
                    value.zero_()
            self._provisional[id(q)] = _versions(state)

    def _drop_provisional(self) -> None:
        """Provisional states nothing was loaded into (their tensors unwritten) are dropped before a step."""
        if not self._provisional:
            return
        for q in self.pieces:
            if id(q) in self._provisional and _versions(self.inner.state.get(q, {})) == self._provisional[id(q)]:
                self.inner.state.pop(q, None)
        self._provisional.clear()

    def add_param_group(self, param_group):
        raise NotImplementedError("shard_optimizer: add parameter groups to the optimizer before sharding it")

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.stage}, {self.inner!r})"


class _Group(MutableMapping):
    """One of the inner optimizer's parameter groups as the user sees it: its "params" the model's parameters,
    every other entry the inner group's own (a learning rate set here is the one the step uses)."""

    def __init__(self, group: dict, param_of: dict[int, nn.Parameter]):
        self._group, self._params = group, [param_of[id(q)] for q in group["params"]]

    def __getitem__(self, key):
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise ValueError("shard_optimizer: a group's parameters are fixed once the optimizer is sharded")
        self._group[key] = value

    def __delitem__(self, key):
        del self._group[key]

    def __iter__(self):
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return repr({k: v for k, v in self._group.items() if k != "params"})


class _StateByParameter(Mapping):
    """The inner optimizer's states keyed by the model's parameters instead of their pieces."""

    def __init__(self, state: dict, param_of: dict[int, nn.Parameter], piece_of: dict[int, nn.Parameter]):
        self._state, self._param_of, self._piece_of = state, param_of, piece_of

    def __getitem__(self, p):
        return self._state[self._piece_of.get(id(p), p)]

    def __iter__(self):
        return (self._param_of.get(id(q), q) for q in self._state)

    def __len__(self) -> int:
        return len(self._state)


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, params: list):
    """``optimizer``'s groups holding only ``params`` for the duration (a step that touches nothing else)."""
    keep = {id(q) for q in params}
    saved = [g["params"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [q for q in group["params"] if id(q) in keep]
    try:
        yield
    finally:
        for group, ps in zip(optimizer.param_groups, saved):
            group["params"] = ps


def _versions(state: dict) -> tuple:
    return tuple(v._version if not isinstance(v, DTensor) else v.to_local()._version
                 for v in state.values() if isinstance(v, torch.Tensor))


def _as_piece(value, piece: DTensor):
    """A loaded state tensor in ``piece``'s layout: whole (of the parameter's shape) -> this rank's slice with no
    collective; a DTensor laid out otherwise -> redistributed; scalars (a step count) as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or tuple(value.shape) != tuple(piece.shape):
        return value
    if isinstance(value, DTensor):
        same = value.device_mesh == piece.device_mesh and tuple(value.placements) == tuple(piece.placements)
        return value if same else value.redistribute(piece.device_mesh, piece.placements)
    return distribute_tensor(value.to(piece.device), piece.device_mesh, piece.placements, src_data_rank=None)


def _chunk(local: torch.Tensor, t: int, k: int, c: int) -> torch.Tensor:
    """torch.chunk's piece ``c`` of ``k`` along dim ``t`` (empty past the last), as a view."""
    n, rows = _rows(local.shape[t], k), local.shape[t]
    start = min(c * n, rows)
    return local.narrow(t, start, max(0, min(n, rows - start)))


def _local_view(p: DTensor, target: tuple) -> torch.Tensor:
    """This rank's part of ``p``'s local tensor in ``target`` placements (one more mesh dim splitting it), a
    view; in a simulated world each rank's view of its own value."""
    d = next(d for d, (a, b) in enumerate(zip(p.placements, target)) if a != b)
    t, k, mesh = target[d].dim, p.device_mesh.size(d), p.device_mesh
    local = p.to_local()
    if not is_simulated():
        coordinate = mesh.get_coordinate()  # (None outside the mesh, where the local tensor is empty)
        return _chunk(local, t, k, coordinate[d] if coordinate is not None else 0)
    coordinate = {int(r): c[d] for r, c in zip(mesh.mesh.flatten(), _coordinates(mesh.mesh.shape))}
    return simulated_map(local, lambda r, values: _chunk(values[r], t, k, coordinate[r]))


def _coordinates(shape) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in torch.unravel_index(torch.tensor(n), shape)) for n in range(math.prod(shape))]


def _addresses(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements start, and its shape (each rank's, in a simulated world): a view of one memory
    (strides aside, which a size-1 dim leaves free) or not."""
    values = local_values(t) or {0: t}
    return tuple((r, v.data_ptr(), tuple(v.shape)) for r, v in sorted(values.items()))


def _piece_view(p: DTensor, target: tuple) -> DTensor:
    """``p``'s piece in ``target`` placements sharing ``p``'s memory: a step of the piece is a step of ``p``'s
    own slice, and whatever is written into ``p`` is what the piece holds."""
    return as_dtensor(_local_view(p.detach(), target), p, target)


def _split(p: DTensor, piece: DTensor) -> tuple[int, int]:
    """(mesh dim, tensor dim) of ``piece``'s split of ``p``: the one mesh dim where ``p`` is whole and the piece is
    Shard(t). t is split by no other mesh dim, so the piece is the torch.chunk piece of ``p``'s local tensor along
    t: the collectives below work on local tensors, over that mesh dim's ranks (who hold alike local shapes)."""
    (d,) = [d for d, (a, b) in enumerate(zip(p.placements, piece.placements)) if a != b]
    return d, piece.placements[d].dim


def _by_bucket(pairs, together=lambda p, d: True):
    """(parameter, piece) pairs grouped for one collective each: mesh, mesh dim, dtype, up to a bucket's bytes;
    those ``together`` refuses alone (mesh dim None). Yields (mesh dim, [(parameter, piece, tensor dim)])."""
    from ..strategy_search.buckets import bucket_bytes, in_buckets

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
        gathered = wait_tensor(all_gather_tensor(torch.cat(flat), 0, (mesh, d))).reshape(k, -1)
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
                target = tuple(q if e == d else r for e, (q, r) in enumerate(zip(p.grad.placements, p.placements)))
                g = p.grad if tuple(p.grad.placements) == target else p.grad.redistribute(p.device_mesh, target)
                blocks.append(_padded(g.to_local().movedim(t, 0), k * _rows(p.shape[t], k)).reshape(k, -1))
            mine = wait_tensor(reduce_scatter_tensor(torch.cat(blocks, dim=1).reshape(-1), "sum", 0, (mesh, d)))
            piece_grads, offset = [], 0
            for p, piece, t in bucket:
                local = piece.to_local().movedim(t, 0)
                size = _rows(p.shape[t], k) * math.prod(local.shape[1:])
                rows = mine[offset:offset + size].reshape(-1, *local.shape[1:])[:local.shape[0]]
                offset += size
                piece_grads.append(as_dtensor(rows.movedim(0, t), piece))
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

