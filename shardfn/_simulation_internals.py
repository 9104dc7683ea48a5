"""A world of ranks simulated in one process (private torch, kept here alone): the fake process group, whose
collectives do nothing, and LocalTensorMode, under which every tensor holds one value per rank and collectives
compute their true result.

torch registers the "fake" backend only in its test package (torch.testing._internal.distributed.fake_pg); it is
imported here and nowhere else. The store is torch's public in-memory HashStore (the fake group exchanges nothing
through it)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

__all__ = ["LocalTensorMode", "PerRankBoolError", "PerRankWriteError", "group_rank_lists", "init_fake_world",
           "local_tensor_mode", "local_values", "not_simulated", "per_rank_bools_refused", "per_rank_ints",
           "plain_writes_once", "world_op", "world_ops_run_whole", "zero_tensors_materialized"]


def init_fake_world(world_size: int) -> None:
    """The default process group: ``world_size`` ranks that exchange nothing, this process rank 0."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)


def LocalTensorMode(world_size: int):  # noqa: N802 - torch's class, constructed
    from torch.distributed._local_tensor import LocalTensorMode as mode

    return mode(world_size)


class PerRankBoolError(RuntimeError):
    """Ranks' answers to a yes/no question differ where a program reads one answer (a check, a branch)."""


@contextlib.contextmanager
def per_rank_bools_refused():
    """LocalTensorMode combines ranks' differing answers of ``torch.equal`` (each rank's pieces compared) as it
    combines differing ints: into one per-rank SymInt, which Python reads as one truthy value. A check then passes
    in the simulated world that real ranks fail (there each rank answers for itself, and while a program is traced
    torch refuses the data-dependent read): DTensor's mask buffer compares two gathers' masks so. Inside this
    context such an answer raises instead, as on real ranks. (Other per-rank bools, a kernel's ``.item()`` of its
    own mask, stay as torch combines them: real ranks read each its own there.)"""
    import torch.distributed._local_tensor as lt

    run = lt._for_each_rank_run_func

    def refusing(func, *args, **kwargs):
        out = run(func, *args, **kwargs)
        if func is torch.ops.aten.equal.default and not isinstance(out, bool):
            raise PerRankBoolError(
                f"torch.equal answers differently on the ranks ({out}) where the program reads one answer: on real "
                "ranks each rank would take its own branch (traced, a data-dependent read fails); the simulated "
                "world refuses it as well")
        return out

    lt._for_each_rank_run_func = refusing
    try:
        yield
    finally:
        lt._for_each_rank_run_func = run


class PerRankWriteError(RuntimeError):
    """An op writes ranks' differing values into an ordinary tensor, which holds one value for every rank."""


@functools.cache
def _written(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument an op writes into (self of an in-place op, out=, a running statistic)."""
    schema = getattr(func, "_schema", None)
    return () if schema is None else tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _plain_written(func, args, kwargs) -> list[torch.Tensor]:
    from torch.distributed._local_tensor import LocalTensor

    found = [args[i] if i < len(args) else kwargs.get(name) for i, name in _written(func)]
    return [t for t in found if isinstance(t, torch.Tensor) and not isinstance(t, LocalTensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (torch.equal(a, b) or (
        a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))


@contextlib.contextmanager
def plain_writes_once():
    """LocalTensorMode runs an op once per rank; where the op writes into an ordinary tensor (made outside the
    world, or from one by an op on ordinary tensors) and reads a per-rank one, every rank wrote into that one
    tensor in turn: ``plain.mul_(per_rank)`` multiplied it world-size times (a custom op's backward, in eager, so
    gave each rank a wrong gradient). Inside this context each rank writes into its own copy, as real ranks do,
    and the copy lands in the tensor when the ranks agree; where they differ, one tensor cannot hold the ranks'
    values and it raises."""
    import torch.distributed._local_tensor as lt
    import torch.utils._pytree as pytree

    run = lt._for_each_rank_run_func

    def apart(func, ranks, args, kwargs, **kw):
        plain = _plain_written(func, args, kwargs)
        if not plain or not any(isinstance(a, lt.LocalTensor) for a in pytree.tree_leaves((args, kwargs))):
            return run(func, ranks, args, kwargs, **kw)
        copies = {id(t): lt.LocalTensor({r: t.detach().clone() for r in ranks}) for t in plain}
        swap = lambda a: copies.get(id(a), a) if isinstance(a, torch.Tensor) else a  # noqa: E731
        out = run(func, ranks, pytree.tree_map(swap, args), pytree.tree_map(swap, kwargs), **kw)
        for t in plain:
            values = list(copies[id(t)]._local_tensors.values())
            if not all(_same(values[0], v) for v in values[1:]):
                raise PerRankWriteError(
                    f"{func} writes the ranks' differing values into an ordinary tensor of shape {tuple(t.shape)}, "
                    "which holds one value for every rank in a simulated world (real ranks each hold their own): "
                    "make it per rank first (a factory inside the world, or simulated_map)")
            t.copy_(values[0])
        back = {id(copies[id(t)]): t for t in plain}  # an in-place op or out= returns what it wrote into
        return pytree.tree_map(lambda o: back.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)

    lt._for_each_rank_run_func = apart
    try:
        yield
    finally:
        lt._for_each_rank_run_func = run


@contextlib.contextmanager
def zero_tensors_materialized():
    """A backward formula may make an efficient zero tensor (no storage: sgn's gradient of a real input). Under
    LocalTensorMode each rank's is one, inside a per-rank tensor that does not carry its kind, and accumulating a
    gradient into it crashed the process (a segmentation fault). Each rank gets real zeros instead: the same
    numbers, as real ranks compute them."""
    import torch.distributed._local_tensor as lt

    run = lt._for_each_rank_run_func

    def materialized(func, ranks, args, kwargs, **kw):
        if func is torch.ops.aten._efficientzerotensor.default:  # (zeros' own signature)
            func = torch.ops.aten.zeros.default
        return run(func, ranks, args, kwargs, **kw)

    lt._for_each_rank_run_func = materialized
    try:
        yield
    finally:
        lt._for_each_rank_run_func = run


# ops that communicate inside (an exchange whose sizes the data decides): LocalTensorMode would run each rank's
# call alone, its collectives on the fake group exchanging nothing; these run once for every rank together
_WORLD_OPS: dict = {}


def world_op(op, fn) -> None:
    """Run ``op`` in a simulated world as ``fn(per_rank)``: ``per_rank`` each rank's (args, kwargs) of ordinary
    tensors, the result each rank's output (a dict by rank), which ``fn`` computes with every rank's values at
    hand, as the ranks' exchanges would."""
    _WORLD_OPS[op] = fn


def group_rank_lists(group_name: str) -> list[list[int]]:
    """Every group of ranks a collective on ``group_name`` (one mesh dim's group, seen from this process) runs
    over in the simulated world: that group and its copies along the other mesh dims, as LocalTensorMode finds
    them for its own collectives."""
    from torch.distributed._local_tensor._c10d import _prepare_collective_groups
    from torch.distributed.distributed_c10d import _resolve_process_group

    ranks, offsets, _ = _prepare_collective_groups(_resolve_process_group(group_name))
    return [[offset + r for r in ranks] for offset in offsets]


@contextlib.contextmanager
def world_ops_run_whole():
    """Inside, an op given to :func:`world_op` runs once for all ranks (its function), not once per rank."""
    import torch.distributed._local_tensor as lt
    import torch.utils._pytree as pytree

    run = lt._for_each_rank_run_func

    def whole(func, ranks, args, kwargs, **kw):
        fn = _WORLD_OPS.get(func)
        if fn is None:
            return run(func, ranks, args, kwargs, **kw)
        per_rank = {r: pytree.tree_map(lambda a: lt._map_to_rank_local_val(a, r), (args, kwargs)) for r in ranks}
        return lt._combine_rank_results(fn(per_rank), None)

    lt._for_each_rank_run_func = whole
    try:
        yield
    finally:
        lt._for_each_rank_run_func = run


def local_tensor_mode():
    """The active LocalTensorMode, or None."""
    from torch.distributed._local_tensor import local_tensor_mode as active

    return active()


def not_simulated():
    """A context where tensors are ordinary again."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def local_values(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Each rank's value of a tensor made under LocalTensorMode (None for an ordinary tensor)."""
    values = getattr(t, "_local_tensors", None)
    return None if values is None else dict(values)


def per_rank_ints(size) -> dict[int, int] | None:
    """Each rank's value of a size that differs between ranks (a per-rank shape), or None for a plain number."""
    local = getattr(getattr(size, "node", None), "_local_ints", None)
    return None if local is None else dict(local)
