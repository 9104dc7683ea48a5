"""Checkpoints that survive a crash: torch.distributed.checkpoint, switched in only once every rank has written.

``save(state_dict, path)`` writes with torch.distributed.checkpoint (DCP) into a fresh folder beside ``path``
(``.<name>.<n>``), and only after every rank has finished its files and DCP has written the metadata does rank 0
point ``path``, a symbolic link, at the new folder: one ``rename`` of a link, atomic on POSIX filesystems. So at
every moment of a save, ``path`` names a complete checkpoint: the previous one until the switch, the new one
after it. A save that failed or was killed leaves its folder behind; the next save removes it, and the folder of
the checkpoint it replaces once it is switched in.

``load(target, path)`` reads the checkpoint ``path`` names into ``target`` (a state_dict, or a module: its
state_dict) in place, each rank reading only the pieces it holds, in the layouts ``target`` holds (another world
size, one process): a DCP checkpoint (``save``'s, or any DCP folder, written sharded or whole), or the format
transformers' ``save_pretrained`` writes and ``from_pretrained`` reads (one ``.safetensors`` file, or a folder
with ``model.safetensors`` or a ``model.safetensors.index.json`` naming several), read slice by slice.

Both are collectives over the world, as DCP's save and load are: every rank calls them with the same ``path``,
which all ranks must see (a shared filesystem). Outside a process group they run in this process alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..runtime import control_group

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
    try:
        os.makedirs(parent, exist_ok=True)  # as dcp.save does
    except OSError as e:
        return f"shardfn.save: the folder {parent!r} of path {path!r} could not be created: {e}"
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


def load(target: dict[str, Any] | nn.Module, path: str | os.PathLike) -> None:
    """Load the checkpoint ``path`` into ``target`` (a state_dict, or a module) in place, in the layouts it holds,
    each rank reading its own pieces: a DCP checkpoint (:func:`save`'s, or any DCP folder), or safetensors files
    as ``save_pretrained`` writes them. Every name and shape is checked before anything is written."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"shardfn.load: no checkpoint at {path!r}")
    module = target if isinstance(target, nn.Module) else None
    state_dict = module.state_dict() if module is not None else target
    files = safetensors_files(path)
    if files is not None:
        _load_safetensors(state_dict, files, path, _tied_names(module) if module is not None else {})
    else:
        folder = os.path.realpath(path)
        _check_names(state_dict, dcp.FileSystemReader(folder).read_metadata(), path, module is not None)
        group, _, _ = _world()
        with _quiet():
            dcp.load(state_dict, checkpoint_id=folder, process_group=group, no_dist=group is None)
    if module is not None:
        check_loaded_buffers(module)


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every tensor in a nested state dict, named as torch.distributed.checkpoint
    flattens it (keys joined by dots)."""
    if isinstance(value, torch.Tensor):
        yield prefix, tuple(value.shape)
    elif isinstance(value, Mapping):
        for key, v in value.items():
            yield from _tensors(v, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in value):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))


def _check_names(state_dict: dict[str, Any], metadata, path: str, is_module: bool) -> None:
    """The target's tensors against the checkpoint's, before anything is read (every rank reads the same
    metadata, so every rank raises alike): a name missing on either side or a shape that differs is an error
    naming it. Checkpoint tensors under a name nothing in the target starts with (an optimizer's states
    beside a model loaded alone) are not asked for. The targets of all ranks count as one (a pipeline stage's
    optimizer states are on its own ranks only), so every rank decides alike."""
    stored = {n: tuple(m.size) for n, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    wanted = dict(_tensors(state_dict))
    group, _, world = _world()
    if group is not None:
        every = [None] * world
        dist.all_gather_object(every, wanted, group=group)
        wanted = {n: shape for w in every for n, shape in w.items()}
    missing = [n for n in wanted if n not in stored]
    shapes = [f"{n} has shape {wanted[n]} in the target but {stored[n]} in the checkpoint"
              for n in wanted if n in stored and stored[n] != wanted[n]]
    roots = {str(k).split(".")[0] for k in state_dict}  # (an optimizer's state dict with no states yet too)
    extra = [n for n in stored if n not in wanted and n.split(".")[0] in roots]
    if not (missing or shapes or extra):
        return
    problems = shapes
    if missing:
        problems.append(f"{len(missing)} of the target's tensors are not in the checkpoint ({_few(missing)})"
                        + _prefix_hint(missing, stored, is_module))
    if extra:
        problems.append(f"{len(extra)} of the checkpoint's tensors are not in the target ({_few(extra)})"
                        + _states_hint(extra))
    raise ValueError(f"shardfn.load: {path!r} does not fit the target, nothing was loaded: " + "; ".join(problems))


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _prefix_hint(missing: list[str], stored: dict, is_module: bool) -> str:
    """Where the checkpoint holds the missing names under one prefix, or holds them without the target's."""
    prefixes = {s[:-len(n)] for n in missing for s in stored if s.endswith("." + n)}
    if len(prefixes) == 1 and all(any(s.endswith("." + n) for s in stored) for n in missing):
        (prefix,) = prefixes
        target = "model.state_dict()" if is_module else "the state dict"
        nested = "".join(f"{{{k!r}: " for k in prefix.rstrip(".").split("."))
        return (f": the checkpoint holds them under the prefix {prefix!r}; load with "
                f"sf.load({nested}{target}{'}' * prefix.count('.')}, path)")
    bare = {n.split(".", 1)[0] for n in missing if "." in n and n.split(".", 1)[1] in stored}
    if len(bare) == 1 and all("." in n and n.split(".", 1)[1] in stored for n in missing):
        return (f": the checkpoint holds them without the prefix {next(iter(bare)) + '.'!r}; load that part of "
                "the target on its own (sf.load(model, path) for a module's state)")
    return ""


def _states_hint(extra: list[str]) -> str:
    if any(".state." in n for n in extra):
        return (": the target has no optimizer states to load them into (a torch optimizer makes them at its "
                "first step): take the target from torch.distributed.checkpoint.state_dict.get_state_dict(model, "
                "optimizer), which makes them, or from an sf.shard_optimizer optimizer's state_dict()")
    return ""


def safetensors_files(path: str) -> dict[str, str] | None:
    """{tensor name: file} of a safetensors checkpoint (a file, or a folder with ``model.safetensors`` or an
    index), or None where ``path`` is none (a DCP folder)."""
    if os.path.isfile(path):
        return _names_in([path]) if path.endswith(".safetensors") else None
    indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
    if indexes:
        index = os.path.join(path, indexes[0])
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"shardfn.load: {index!r} is not a safetensors index (a JSON object with a "
                             f"'weight_map' of tensor name -> file): {e}") from e
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            raise FileNotFoundError(f"shardfn.load: the index {index!r} names files that are not in {path!r}: "
                                    f"{', '.join(missing)}; copy the whole checkpoint folder")
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    return _names_in([single]) if os.path.isfile(single) else None


def _names_in(files: list[str]) -> dict[str, str]:
    from safetensors import safe_open

    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _tied_names(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's other names (tied weights): a checkpoint holds a tied weight once."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: [n for n in names if n != name] for names in by_id.values() for name in names}


def _load_safetensors(state_dict: dict[str, Any], files: dict[str, str], path: str,
                      tied: dict[str, list[str]]) -> None:
    from safetensors import safe_open

    # what each entry reads (its own name, or a tied twin's), checked whole before anything is written
    source, problems = {}, []
    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(files.values()))}
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                continue
            stored = next((n for n in [name, *tied.get(name, [])] if n in files), None)
            if stored is None:
                problems.append(f"{name} is not in the checkpoint")
                continue
            shape = tuple(opened[files[stored]].get_slice(stored).get_shape())
            if shape != tuple(value.shape):
                problems.append(f"{name} has shape {tuple(value.shape)} in the model but {shape} in the checkpoint")
                continue
            source[name] = stored
        if problems:
            raise ValueError(f"shardfn.load: {path!r} does not fit the model, nothing was loaded: "
                             + "; ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8
                                                            else ""))
        with torch.no_grad():
            for name, stored in source.items():
                value = state_dict[name]
                entry = opened[files[stored]].get_slice(stored)
                if isinstance(value, DTensor):
                    local = value.to_local()
                    (chunk,) = value.__create_chunk_list__()  # this rank's piece: offsets and sizes
                    if all(type(x) is int for x in (*chunk.offsets, *chunk.sizes)):
                        piece = entry[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
                    else:  # a simulated world (each rank's piece in one process): read whole, cut as DTensor does
                        piece = distribute_tensor(opened[files[stored]].get_tensor(stored), value.device_mesh,
                                                  value.placements, src_data_rank=None).to_local()
                    local.copy_(piece.reshape(local.shape))
                else:
                    value.copy_(opened[files[stored]].get_tensor(stored))


def check_loaded_buffers(module: nn.Module) -> None:
    """Buffers a checkpoint does not hold (non-persistent ones) that :func:`shardfn.materialize` left unwritten
    (``init=None``) hold no values: a clear error instead of a model that computes with garbage."""
    unwritten = module.__dict__.get(UNWRITTEN_BUFFERS, {})
    still = [name for name, b in module.named_buffers() if name in unwritten and unwritten[name][0] is b
             and b._version == unwritten[name][1]]
    if still:
        raise ValueError(f"shardfn.load: buffer(s) {', '.join(still[:5])} are not in the checkpoint (non-persistent) "
                         "and hold no values: sf.materialize(module, init=None) left them as allocated. Call "
                         "sf.materialize(module) (the model's own initialisation computes them) before sf.load.")
    module.__dict__.pop(UNWRITTEN_BUFFERS, None)


# the module attribute where materialize(init=None) notes the buffers it allocated and did not compute
UNWRITTEN_BUFFERS = "_shardfn_unwritten_buffers"
