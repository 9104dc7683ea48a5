"""Values of the interpreted program as DTensors and ops run on their operands' pieces.

An interpreted call (a simulated world; a program for every size at a size met first) runs each op of the
captured graph over DTensors. DTensor's dispatch propagates each op's sharding with fake tensors, afresh at every
new size. Where the plan says an op runs on its operands' pieces as they are (``NodePlan.run``, decided by
strategy_search.run_modes), the interpreter runs it on the pieces itself (where they are even); views likewise,
their size arguments rewritten to the pieces' (:func:`view_of_piece`),
handing a gradient's pending sum on as DTensor's view rules do. Here too: laying a value out as an op reads it
(:func:`placed`), and the autograd functions that keep a gradient a DTensor and settle its pending sums.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Shard
from torch._prims_common import make_contiguous_strides_for

from ._dtensor_internals import layout_for, layout_of, local_as, local_of
from .run import global_stride
from .split_moves import move_piece, split_move

__all__ = ["GradAsDTensor", "GradSettled", "VIEW_CALLS", "as_dtensor", "conform", "contiguous", "from_local",
           "gradient_placements", "local_piece", "map_leaves", "piece_shape", "placed", "redistribute",
           "redistributed", "settled", "view_of_piece"]

aten = torch.ops.aten


def conform(x: Any, placements: tuple[Placement, ...] | None):
    """Put an op result in its planned placement. A pending sum stays as the op left it: one the op resolved
    early stays resolved, and DTensor's own kinds (embedding's masked sum) are not re-labelled."""
    if placements is None or not isinstance(x, DTensor) or tuple(x.placements) == placements:
        return x
    target = tuple(p if q.is_partial() else q for p, q in zip(x.placements, placements))
    return x if tuple(x.placements) == target else redistribute(x, target)


def placed(x: Any, placements: tuple[Placement, ...], mesh: DeviceMesh):
    """Bring an input to the placement its consumer's strategy reads it in.

    Going to a pending sum from a whole value is left to the op's DTensor dispatch (which may split a value into
    a pending sum; the public redistribute may not): those dims are brought to Replicate here, as are pending
    values of another kind (a pending sum read as a pending maximum: reduced, then the op's own).
    """
    if isinstance(x, DTensor):
        current = tuple(x.placements)
        target = tuple(Replicate() if q.is_partial() and p != q else q
                       for p, q in zip(current, placements))
        if current == target:
            return x
        return redistribute(x, target)
    if isinstance(x, torch.Tensor):  # a whole value (graph constant): every rank slices its part
        return distribute_tensor(x, mesh, tuple(Replicate() if q.is_partial() else q for q in placements),
                                 src_data_rank=None)
    return x


def redistribute(x: DTensor, placements) -> DTensor:
    """``x`` in ``placements``. A collective's result is contiguous but keeps its input's global strides: from a
    contiguous input (and, going back, a contiguous gradient) the DTensor's strides and its local tensor's agree.
    A split moved between dims is one all_to_all also where DTensor would gather (exec.split_moves)."""
    placements = tuple(placements)
    move = split_move(x, placements)
    if move is not None:
        return _SplitMoved.apply(x, placements, *move)
    return GradAsDTensor.apply(contiguous(x).redistribute(x.device_mesh, placements))


def redistributed(x: DTensor, placements) -> DTensor:
    """``x`` in ``placements`` with no autograd node of its own (a gradient in backward), contiguous; a split
    moved between dims by one all_to_all as in :func:`redistribute`."""
    placements = tuple(placements)
    move = split_move(x, placements)
    if move is None:
        return contiguous(contiguous(x).redistribute(x.device_mesh, placements))
    return _moved(x, placements, *move)


def _moved(x: DTensor, placements: tuple, m: int, i: int, j: int) -> DTensor:
    return DTensor.from_local(move_piece(local_of(x), x.shape, x.device_mesh, m, i, j), x.device_mesh, placements,
                              run_check=False, shape=x.shape, stride=make_contiguous_strides_for(x.shape))


class _SplitMoved(torch.autograd.Function):
    """A split moved from dim ``i`` to dim ``j`` over mesh dim ``m`` by one all_to_all (exec.split_moves); its
    gradient moves back by one."""

    @staticmethod
    def forward(ctx, x, placements, m, i, j):
        ctx.mesh, ctx.held, ctx.move = x.device_mesh, gradient_placements(x.placements), (m, i, j)
        return _moved(x, placements, m, i, j)

    @staticmethod
    def backward(ctx, grad):
        m, i, j = ctx.move
        target = tuple(Shard(j) if k == m else p for k, p in enumerate(ctx.held))
        grad = as_dtensor(grad, ctx.mesh, target)
        if tuple(grad.placements) != target:
            grad = redistributed(grad, target)
        return _moved(grad, ctx.held, m, j, i), None, None, None, None


class GradAsDTensor(torch.autograd.Function):
    """Identity whose backward hands a redistribution's backward what it needs: a contiguous DTensor gradient,
    also where a backward formula made a plain tensor of the global shape (sgn's zeros), a whole value."""

    @staticmethod
    def forward(ctx, x):
        ctx.mesh, ctx.placements = x.device_mesh, gradient_placements(x.placements)
        # a new DTensor on an alias of the piece: DTensor's own view_as would propagate its sharding, afresh at
        # every new size
        return local_as(layout_of(x), local_of(x).detach())

    @staticmethod
    def backward(ctx, grad):
        return contiguous(as_dtensor(grad, ctx.mesh, ctx.placements))


class GradSettled(GradAsDTensor):
    """An op's result whose gradient (its readers' contributions summed) is brought to the result's own layout,
    pending sums resolved, before it reaches the op: the plan prices each value's gradient so (one reduction
    where readers left pending sums). Left to DTensor, a pending sum would travel on into the backward of the
    ops that made the value, which would then gather their other operands to run whole on every rank (a
    Megatron layer's weights, in transformers' Llama)."""

    @staticmethod
    def backward(ctx, grad):
        grad = GradAsDTensor.backward(ctx, grad)
        return grad if tuple(grad.placements) == ctx.placements else redistributed(grad, ctx.placements)


def settled(x: Any) -> Any:
    return GradSettled.apply(x) if isinstance(x, DTensor) and x.requires_grad else x


def gradient_placements(placements) -> tuple:
    """Where a gradient goes: the value's own placements with pending sums replicated (as DTensor's)."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def as_dtensor(grad: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    if isinstance(grad, DTensor):
        return grad
    if grad._is_zerotensor():  # a lazy zero (no storage): made real before it is sliced
        grad = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
    return distribute_tensor(grad, mesh, placements, src_data_rank=None)


def local_piece(outputs, shared: dict | None = None) -> Callable[[DTensor], torch.Tensor]:
    """An input's piece for an op run on the pieces. Along a mesh dim where the op's results are split, each rank
    computes its own part of them from a whole (replicated) input, so that input's gradient on each rank is its
    part of the sum: it goes back as a pending sum there (a convolution's weight under a batch split), never as
    if every rank had the whole gradient. So too where a result is a pending sum (each rank's experts' rows)."""
    split = {i for pl in outputs if pl for i, p in enumerate(pl) if not p.is_replicate()}

    def piece(t: DTensor) -> torch.Tensor:
        grad = tuple(Partial() if i in split and p.is_replicate() else p for i, p in enumerate(t.placements))
        if shared is None:
            return t.to_local(grad_placements=grad)
        # one piece for every reader of a value (of one gradient layout): autograd sums their gradients on the
        # pieces, where apart it would sum DTensors (a sharding propagation at every new size)
        key = (id(t), grad)
        if key not in shared:
            shared[key] = (t, t.to_local(grad_placements=grad))  # (t held: its id stays its own)
        return shared[key][1]

    return piece


def from_local(t: torch.Tensor, mesh: DeviceMesh, placements, like: torch.Tensor,
                layouts: dict | None = None) -> DTensor:
    """``t`` (this rank's piece) as a DTensor of ``like``'s global shape, with strides in ``t``'s own order: a
    kernel may lay its result out otherwise than the captured one did, and DTensor reads the strides it is told.
    With ``layouts`` (an interpreted call's), each layout is made once and shared (_FromPiece)."""
    stride = global_stride(t, like.shape, placements, mesh)
    if layouts is None:
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=like.shape, stride=stride)
    key = (tuple(placements), tuple(like.shape), stride, t.dtype)
    spec = layouts.get(key)
    if spec is None:
        spec = layouts[key] = layout_for(mesh, placements, like.shape, stride, t.dtype)
    return _FromPiece.apply(t, spec)


class _FromPiece(torch.autograd.Function):
    """``DTensor.from_local(t, ...)`` in a layout made once for the values of a call that share it (each from_local
    builds and checks a new one). Its backward is from_local's: the gradient brought to the layout's placements,
    pending sums resolved (Replicate where the value itself is pending)."""

    @staticmethod
    def forward(ctx, t, spec):
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return local_as(spec, t.detach())

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        spec = ctx.spec
        target = gradient_placements(spec.placements)
        grad = as_dtensor(grad, spec.mesh, target)
        if tuple(grad.placements) != target:
            grad = redistributed(grad, target)
        return local_of(grad), None


# make_fx records `view` where eager's tensor allowed it; a piece laid out otherwise (a redistributed operand, an
# elementwise result following it) may not. Every view is valid on a contiguous tensor.
VIEW_CALLS = (aten.view.default, aten._unsafe_view.default)


def contiguous(x: Any) -> Any:
    # DTensor checks a view against its global strides, the kernel against the local ones: both must allow it
    if isinstance(x, DTensor) and not (x.is_contiguous() and local_of(x).is_contiguous()):
        return _Contiguous.apply(x)
    return x


class _Contiguous(torch.autograd.Function):
    """``x`` contiguous, its piece and its global strides both, made on the piece: DTensor's contiguous() returns a
    DTensor whose global strides are contiguous as it is (its piece may not be), and its clone would propagate
    its sharding afresh at every new size. The gradient passes as it is (a clone's), pending sums too. The whole's
    strides are the contiguous ones of its shape, never read off the piece: an empty piece (6 rows over 4 ranks)
    has strides of no order, and every rank must say the same strides."""

    @staticmethod
    def forward(ctx, x):
        piece = local_of(x).detach().contiguous()
        return DTensor.from_local(piece, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=make_contiguous_strides_for(x.shape))

    @staticmethod
    def backward(ctx, grad):
        return grad


def map_leaves(fn: Callable, obj: Any) -> Any:
    """An op's arguments (lists, tuples, dicts of values) with ``fn`` applied to each value, in pytree's order:
    pytree's general walk, per node of every interpreted call, cost more than the op on a small piece."""
    if isinstance(obj, (list, tuple)):
        mapped = [map_leaves(fn, x) for x in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    if isinstance(obj, dict):
        return {k: map_leaves(fn, v) for k, v in obj.items()}
    return fn(obj)


def piece_shape(shape: torch.Size, placements, mesh: DeviceMesh) -> list[int] | None:
    """Every rank's piece of a tensor of ``shape`` in ``placements``, where the splits are even (else None)."""
    local = list(shape)
    for d, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh.size(d)
            if local[p.dim] % n:
                return None
            local[p.dim] //= n
    return local


def sized_to_piece(args: tuple, at: int, shape, placements, mesh: DeviceMesh) -> tuple | None:
    """A sized factory's arguments (its size at position ``at``) for this rank's piece of a result of ``shape``
    laid out as ``placements``; None where that split is uneven (pieces of several sizes)."""
    size = piece_shape(shape, placements, mesh)
    return None if size is None else (*args[:at], size, *args[at + 1:])


# views run on the operand's piece (strategy_search.run_modes says which), their size argument (index 1, where
# taken) rewritten to the result's piece
_SIZED_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.expand.default}
# views along one dim (its argument's position, name, default): on pieces only where that dim is whole
_DIM_OF_VIEW = {aten.squeeze.dim: (1, "dim", None), aten.slice.Tensor: (1, "dim", 0),
                aten.select.int: (1, "dim", None), aten.split.Tensor: (2, "dim", 0),
                aten.split_with_sizes.default: (2, "dim", 0)}


def _view_dim_whole(node: torch.fx.Node, args, kwargs, placements) -> bool:
    """For a view along one dim: whether that dim is whole on every rank (a slice of a split dim is not the
    slice of each piece)."""
    where = _DIM_OF_VIEW.get(node.target)
    if where is None:
        return True
    i, name, default = where
    dim = args[i] if len(args) > i else kwargs.get(name, default)
    ndim = args[0].dim()
    dim = dim % ndim if ndim else 0
    return not any(isinstance(p, Shard) and p.dim % ndim == dim for p in placements)


class _Held:
    """What a view run on a piece hands its autograd node: the piece as viewed (detached, under autograd), its
    results, and the layouts of the results and of the input's gradient."""

    __slots__ = ("piece", "outs", "specs", "mesh", "x_grad", "x_shape")


class _ViewOfPiece(torch.autograd.Function):
    """Results of a view run on this rank's piece (``held.outs``, computed from ``held.piece`` under autograd), as
    DTensors. Backward runs the piece's view backward on the gradients' pieces; a pending sum (Partial) of the
    gradient passes on to the input's where every result's gradient has it, as DTensor's view rules hand it on:
    the value viewed sums it with its other readers' gradients and resolves it once (GradSettled)."""

    @staticmethod
    def forward(ctx, x, held: _Held):
        ctx.held = held
        return tuple(DTensor.from_local(o.detach(), held.mesh, pl, run_check=False, shape=shape, stride=stride)
                     for o, (pl, shape, stride) in zip(held.outs, held.specs))

    @staticmethod
    def backward(ctx, *grads):
        held = ctx.held
        ctx.held = None
        mesh, n = held.mesh, held.mesh.ndim
        got = [(o, as_dtensor(g, mesh, gradient_placements(pl)), gradient_placements(pl))
               for o, g, (pl, _, _) in zip(held.outs, grads, held.specs) if g is not None and o.requires_grad]
        if not got:
            return None, None
        # mesh dims where every gradient is pending, of one kind, and the result whole: left pending
        first = got[0][1].placements
        pending = {m for m in range(n) if first[m].is_partial() and all(
            g.placements[m] == first[m] and want[m].is_replicate() for _, g, want in got)}
        pieces = []
        for _, g, want in got:
            target = tuple(first[m] if m in pending else want[m] for m in range(n))
            if tuple(g.placements) != target:
                g = redistributed(g, target)
            pieces.append(local_of(g))
        (grad,) = torch.autograd.grad([o for o, _, _ in got], [held.piece], pieces)
        placements = tuple(first[m] if m in pending else p for m, p in enumerate(held.x_grad))
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=held.x_shape,
                                  stride=global_stride(grad, held.x_shape, placements, mesh)), None


def view_of_piece(node: torch.fx.Node, args, kwargs, np_, val, mesh: DeviceMesh) -> Any:
    """``node`` (a view) run on its operand's piece as DTensor's rule would, without its sharding propagation;
    None where it cannot be (an uneven split, a split dim viewed along, an operand not as planned)."""
    x = args[0]
    if not isinstance(x, DTensor) or tuple(x.placements) != np_.inputs[0] or \
            piece_shape(x.shape, x.placements, mesh) is None or \
            not _view_dim_whole(node, args, kwargs, x.placements):
        return None
    many = isinstance(val, (tuple, list))
    vals = val if many else (val,)
    shapes = [piece_shape(v.shape, p, mesh) for v, p in zip(vals, np_.outputs)]
    if any(s is None for s in shapes):
        return None
    rest = list(args[1:])
    if node.target in _SIZED_VIEWS:
        rest[0] = shapes[0]
    piece = local_of(x)
    if node.target in VIEW_CALLS and not piece.is_contiguous():  # (a DTensor's contiguous() reads its
        piece = piece.contiguous()                               # global strides alone)
    grad = torch.is_grad_enabled() and x.requires_grad
    if grad:
        piece = piece.detach().requires_grad_()
    out = node.target(piece, *rest, **kwargs)
    outs = list(out) if many else [out]
    if [list(o.shape) for o in outs] != shapes:  # not DTensor's rule's pieces: left to DTensor
        return None
    # the global strides DTensor's rule gives (a slice's, an expand's): the view of an empty tensor of the
    # operand's global layout
    try:
        meta = node.target(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), *args[1:],
                           **kwargs)
    except RuntimeError:  # (DTensor's dispatch says why)
        return None
    metas = list(meta) if many else [meta]
    specs = [(p, m.shape, m.stride()) for p, m in zip(np_.outputs, metas)]
    if grad and any(o.requires_grad for o in outs):
        held = _Held()
        held.piece, held.outs, held.specs, held.mesh = piece, outs, specs, mesh
        held.x_grad, held.x_shape = gradient_placements(x.placements), x.shape
        wrapped = _ViewOfPiece.apply(x, held)
    else:
        wrapped = tuple(DTensor.from_local(o.detach() if grad else o, mesh, pl, run_check=False,
                                           shape=shape, stride=stride)
                        for o, (pl, shape, stride) in zip(outs, specs))
    return type(out)(wrapped) if many else wrapped[0]
