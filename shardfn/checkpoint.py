"""Checkpoints that survive a crash: torch.distributed.checkpoint, switched in only once every rank has written.

``save(state_dict, path)`` writes with torch.distributed.checkpoint (DCP) into a fresh folder beside ``path``
(``.<name>.<n>``), and only after every rank has finished its files and DCP has written the metadata does rank 0
point ``path``, a symbolic link, at the new folder: one ``rename`` of a link, atomic on POSIX filesystems. So at
every moment of a save, ``path`` names a complete checkpoint: the previous one until the switch, the new one
after it. A save that failed or was killed leaves its folder behind; the next save removes it, and the folder of
the checkpoint it replaces once it is switched in.

``load(state_dict, path)`` reads the checkpoint ``path`` names into ``state_dict`` in place, resharding to the
layouts ``state_dict`` holds (another world size, one process), as DCP does.

Both are collectives over the world, as DCP's save and load are: every rank calls them with the same ``path``,
which all ranks must see (a shared filesystem). Outside a process group they run in this process alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .runtime import control_group

__all__ = ["load", "save"]


def _versions(path: str) -> dict[int, str]:
    """The version folders of checkpoint ``path``: number -> folder."""
    parent, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(r"\." + re.escape(name) + r"\.(\d+)")
    found = {}
    for entry in os.listdir(parent):  # the parent exists: save() checked it first
        match = pattern.fullmatch(entry)
        if match:
            found[int(match.group(1))] = os.path.join(parent, entry)
    return found


def _current(path: str) -> str | None:
    """The folder ``path`` points at, or None before the first save."""
    return os.path.realpath(path) if os.path.islink(path) else None


def _problem(path: str) -> str | None:
    """Why ``path`` cannot take a save on this rank, or None."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.lexists(path) and not os.path.islink(path):
        return (f"shardfn.save: path {path!r} exists and is not a checkpoint written by shardfn.save (a link to "
                "its current version); save to a new path, or move the existing one away")
    if not os.path.isdir(parent):
        return f"shardfn.save: the folder {parent!r} of path {path!r} does not exist; create it first"
    if not os.access(parent, os.W_OK):
        return f"shardfn.save: the folder {parent!r} of path {path!r} is not writable"
    return None


def _world() -> tuple[Any, int, int]:
    """(group, rank, world size) of the collective save: shardfn's control group, or the default group where the
    process group was made without shardfn.init; no group in a world of one, a simulated world (one process)
    and outside a process group."""
    if not dist.is_initialized():
        return None, 0, 1
    world = dist.get_world_size()
    if world == 1 or dist.get_backend() == "fake":
        return None, dist.get_rank(), world
    return control_group() or dist.group.WORLD, dist.get_rank(), world


@contextlib.contextmanager
def _quiet():
    """DCP warns that it assumes one process whenever no process group exists; here that is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _from_rank_0(value: Any, group) -> Any:
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _switch(path: str, folder: str) -> None:
    """Point the link ``path`` at ``folder`` in one rename (relative, so the checkpoint's parent can move)."""
    parent = os.path.dirname(os.path.abspath(path))
    staged = os.path.join(parent, f".{os.path.basename(path)}.link")
    if os.path.lexists(staged):
        os.unlink(staged)
    os.symlink(os.path.basename(folder), staged)
    os.replace(staged, path)
    descriptor = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself reaches the disk before the old version is removed
    finally:
        os.close(descriptor)


def save(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Save ``state_dict`` (DTensors, tensors, optimizer state: what torch.distributed.checkpoint takes) as the
    checkpoint ``path``, atomically: a crash at any moment leaves ``path`` loadable, old or new. Call it on
    every rank with the same ``path``."""
    path = os.fspath(path)
    group, rank, world = _world()
    # every rank checks its own view of the filesystem and all learn every problem: the same error everywhere
    problems = [_problem(path)] * world
    if group is not None:
        dist.all_gather_object(problems, problems[0], group=group)
    failing = [(r, p) for r, p in enumerate(problems) if p]
    if failing:
        first, problem = failing[0]
        raise ValueError(problem + ("" if len(failing) == world else f" (seen on rank {first})"))
    folder = current = None
    if rank == 0:
        current = _current(path)
        versions = _versions(path)
        for stale in (f for f in versions.values() if f != current):  # left by saves that did not finish
            shutil.rmtree(stale, ignore_errors=True)
        parent, name = os.path.split(os.path.abspath(path))
        folder = os.path.join(parent, f".{name}.{max(versions, default=0) + 1}")
    folder = _from_rank_0(folder, group)
    with _quiet():
        dcp.save(state_dict, checkpoint_id=folder, process_group=group, no_dist=group is None)
    # DCP returns on every rank once rank 0 has written the metadata, after all ranks' files were written
    if group is not None:
        dist.barrier(group=group)
    if rank == 0:
        _switch(path, folder)
        if current:  # the version just replaced
            shutil.rmtree(current, ignore_errors=True)
    if group is not None:
        dist.barrier(group=group)  # no rank goes on (and loads, or saves again) before the switch


def load(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Load the checkpoint ``path`` (from :func:`save`, or any DCP checkpoint folder) into ``state_dict`` in
    place, in the layouts ``state_dict`` holds."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"shardfn.load: no checkpoint at {path!r}")
    group, _, _ = _world()
    with _quiet():
        dcp.load(state_dict, checkpoint_id=os.path.realpath(path), process_group=group, no_dist=group is None)
