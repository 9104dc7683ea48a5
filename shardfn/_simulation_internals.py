"""A world of ranks simulated in one process (private torch, kept here alone): the fake process group, whose
collectives do nothing, and LocalTensorMode, under which every tensor holds one value per rank and collectives
compute their true result.

torch registers the "fake" backend only in its test package (torch.testing._internal.distributed.fake_pg); it is
imported here and nowhere else. The store is torch's public in-memory HashStore (the fake group exchanges nothing
through it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LocalTensorMode", "init_fake_world", "local_tensor_mode", "local_values", "not_simulated",
           "per_rank_ints"]


def init_fake_world(world_size: int) -> None:
    """The default process group: ``world_size`` ranks that exchange nothing, this process rank 0."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)


def LocalTensorMode(world_size: int):  # noqa: N802 - torch's class, constructed
    from torch.distributed._local_tensor import LocalTensorMode as mode

    return mode(world_size)


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
