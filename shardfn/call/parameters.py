"""A sharded module's parameters as DTensors: laid out in place, on meta without allocating, loaded into.

A parameter keeps its Parameter object where it already is a DTensor (its value is swapped in: optimizers built
on it keep working); a plain one is replaced in every slot that holds it, as FSDP2's ``fully_shard`` does, so
tied weights stay tied. A parameter on the meta device is laid out as meta pieces of this rank's shape: nothing
is allocated until :func:`shardfn.materialize` (or ``module.to_empty``) gives each rank its own pieces.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layout import TensorSpec, normalize_strategy, spec_of_dtensor

__all__ = ["check_materialized", "fixed_specs", "lay_out", "lay_out_loaded_tensors", "lay_out_planned", "on_meta",
           "replace_parameter", "slot"]


def slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(owning module, attribute) of the parameter or buffer ``name``."""
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


def on_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def lay_out(module: nn.Module, name: str, mesh, placements, device: str) -> None:
    """Lay parameter ``name`` of ``module`` out in ``placements`` on ``mesh``, in place: each rank keeps its
    piece of the whole value, or, for a parameter still on meta, a meta piece of its shape."""
    owner, leaf = slot(module, name)
    p = owner._parameters[leaf]
    if isinstance(p, DTensor) and p.device_mesh == mesh and tuple(p.placements) == tuple(placements):
        return
    if on_meta(p):
        whole = torch.empty(p.shape, dtype=p.dtype, device="meta")
    else:
        whole = (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(device)
    new = nn.Parameter(distribute_tensor(whole, mesh, list(placements), src_data_rank=None),
                       requires_grad=p.requires_grad)
    replace_parameter(module, name, new)


def lay_out_planned(module: nn.Module, plan, mesh, device: str) -> None:
    """Lay ``module``'s parameters out as ``plan`` placed them, in place (same Parameter objects: optimizers
    keep working)."""
    for entry in plan.inputs:
        if entry.kind == "param":
            lay_out(module, entry.name, mesh, entry.planned, device)


def replace_parameter(module: nn.Module, name: str, new: nn.Parameter) -> None:
    """Put ``new`` where parameter ``name`` is: swapped into a DTensor parameter (the same object), else in every
    slot that holds the old one."""
    owner, leaf = slot(module, name)
    old = owner._parameters[leaf]
    if isinstance(old, DTensor) and isinstance(old, nn.Parameter):
        torch.utils.swap_tensors(old, new)
        return
    for slot_name, p in list(module.named_parameters(remove_duplicate=False)):
        if p is old:
            slot_owner, slot_leaf = slot(module, slot_name)
            slot_owner._parameters[slot_leaf] = new


def lay_out_loaded_tensors(module, state_dict, prefix, *_):
    """A state_dict of whole tensors (from the unsharded module) loads: each is laid out like its parameter."""
    for name, p in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                                          src_data_rank=None)


def unmaterialized(module: nn.Module) -> list[str]:
    """The parameters and buffers of ``module`` still on the meta device."""
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if on_meta(t)]


def check_materialized(module: nn.Module, name: str) -> None:
    """A module built on meta runs once its pieces exist: a clear error naming what is still meta."""
    missing = unmaterialized(module)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"{name} was called while {shown} {'is' if len(missing) == 1 else 'are'} still on the meta "
            "device (no values yet). Give each rank its pieces first: sf.materialize(module) (to_empty and "
            "the model's own initialisation, per rank), or sf.materialize(module, init=None) then "
            "sf.load(module, checkpoint)")


def fixed_specs(module: nn.Module, parameter_plan: dict, world: int, laid_out: bool,
                ranks: tuple[int, ...] | None) -> dict[str, TensorSpec]:
    """The parameters' fixed layouts: parameter_plan's, and once a call has laid the parameters out, all of
    them as they are (programs of other signatures hold their layouts: a later plan may not move them)."""
    params = dict(module.named_parameters())
    if laid_out:
        return {name: spec_of_dtensor(p, world, name, ranks) for name, p in params.items() if isinstance(p, DTensor)}
    return {name: normalize_strategy(s, tuple(params[name].shape), world, f"parameter_plan[{name!r}]", name)
            for name, s in parameter_plan.items() if s is not None}
