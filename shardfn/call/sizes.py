"""Calls whose sizes change: one program for every size of the dims that changed (capture.dynamic), made once a
structure (the signature without sizes) is called with a second size, and run at the sizes of each call."""

from __future__ import annotations

import dataclasses
import logging

import torch

from .. import runtime
from ..capture import split_arguments
from ..exec.lower import lower, use_inductor
from . import planning
from .agreement import alone, call_agreement
from .programs import Compiled

__all__ = ["for_every_size"]

_log = logging.getLogger("shardfn")


def for_every_size(engine, key: tuple, args, kwargs, tensors: list,
                   arrived: tuple) -> tuple[Compiled | None, bool]:
    """A new signature whose structure was seen before with other sizes: the program that serves every size of
    the dims that changed (made now, once, traced with those dims as symbols), if its capture holds for these
    sizes, and whether it was made now. None: a program for this signature alone (the first sizes of a
    structure; dynamic dims off; a size the dynamic capture's guards reject, said on the ``shardfn`` logger)."""
    if engine.config.dynamic is False or arrived:
        return None, False
    programs = engine.programs
    serving = programs.serving(key, tensors)
    if isinstance(serving, str):
        _log.info("shardfn: %s: a program for these sizes alone: %s", engine.name, serving)
        return None, False
    if serving is not None:
        return _at_these_sizes(engine, serving, key, args, kwargs), False
    given = _given_dims(engine, args, kwargs, tensors)
    dims = programs.dims_changed(key, given)
    if not dims:
        return None, False
    _log.info("shardfn: %s: dims %s are traced as symbols (one program for every size)%s", engine.name, dims,
              "" if given else ": their sizes changed since the first call")
    engine.planning_error = None
    try:
        compiled = engine.first_call(key, args, kwargs, arrived, dynamic=dims)
    except Exception as e:  # noqa: BLE001 - this rank's own capture or plan failed, and every rank's alike
        # (the agreement raises a rank's own error only then): all fall back; anything else stops the call
        if e is not engine.planning_error or isinstance(engine.config.dynamic, dict):
            raise
        _log.warning("shardfn: %s: its sizes changed, but tracing dims %s as symbols failed (%s: %s); one "
                     "program per size", engine.name, dims, type(e).__name__, str(e).splitlines()[0])
        programs.no_symbols(key)
        return None, False
    programs.keep_for_every_size(key, compiled)
    return _at_these_sizes(engine, compiled, key, args, kwargs), True


def _at_these_sizes(engine, compiled: Compiled, key: tuple, args, kwargs) -> Compiled:
    """The program for every size, for a call of this signature. It runs interpreted over DTensors (no capture,
    no plan, no trace: the symbolic graph's plan at the sizes its values take now); on real ranks a signature
    called SHARDFN_TRACE_AFTER times is traced into per-rank graphs at its sizes (Programs.trace_now), except in
    a world of one without Inductor, where the captured graph runs as it is either way. The ranks compare this
    call's signature, its sizes included, as for any program."""
    # (alone, an agreement compares nothing: the program's own serves, and a generation's token makes none)
    here = compiled if alone(engine.ranks()) else \
        dataclasses.replace(compiled, agreement=call_agreement(engine, key, args, kwargs))
    mesh = compiled.program.mesh
    inductor = use_inductor(mesh.device_type)
    if runtime.is_simulated() or (mesh.size() == 1 and not inductor):
        return _synced_once(engine, compiled, here)
    if not inductor:  # one trace with the dims as symbols, unless it failed
        if compiled.traced is None:
            compiled.traced = compiled.program.traced(for_every_size=True)
        if compiled.traced.for_every_size.failed is None:
            return dataclasses.replace(here, program=compiled.traced)
    if not engine.programs.trace_now(compiled, key):
        return _synced_once(engine, compiled, here)
    here = dataclasses.replace(here, program=compiled.program.traced(for_every_size=False))
    engine.programs[key] = here
    return here


def _synced_once(engine, compiled: Compiled, here: Compiled) -> Compiled:
    """An interpreted call of the program for every size, with gradients: its parameters' gradients are left
    pending and reduced once its backward has ended, in buckets (as the call after sf.no_sync reduces them:
    call.accumulation), not each by its own all-reduce as autograd hands it over (each a wait for every rank;
    the traced graphs fuse them: exec.passes). Not under no_sync (already so), a mixed precision policy or a
    sharded optimizer (their gradients' reductions are their own), or in a world of one."""
    if engine.module is None or not torch.is_grad_enabled() or compiled.plan.accumulate or \
            engine.config.precision is not None or engine.optimizer_stage or compiled.program.mesh.size() == 1:
        return here
    if compiled.synced_once is None:  # (planned and lowered once, beside the program that reduces as it goes)
        compiled.synced_once = lower(compiled.captured, _accumulating_plan(engine, compiled, here.agreement),
                                     compiled.program.mesh)
    program = compiled.synced_once
    return dataclasses.replace(here, planned=dataclasses.replace(here.planned, plan=program.plan),
                               program=program)


def _accumulating_plan(engine, compiled: Compiled, agreement):
    """The search's plan of the program for every size accumulating without sync (planning.plan_accumulating),
    which the ranks agree on as on a first call's plan (each plans it alone: a solve cut short by its time
    limit may end elsewhere on another rank), a rank's failure raised on every rank."""
    plan = error = None
    try:
        plan = planning.plan_accumulating(engine, compiled.planned)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_program, reported on the others
        error = e
    if agreement is not None:
        agreement.check_program(None, plan and plan.table(), error)
    elif error is not None:
        raise error
    return plan


def _given_dims(engine, args, kwargs, tensors: list) -> dict[int, tuple[int, ...]]:
    """shard(dynamic={argument: dims})'s dims, by argument tensor number: every tensor of that argument (a
    container's, an object's attributes') takes them."""
    if not isinstance(engine.config.dynamic, dict):
        return {}
    names = split_arguments(args, kwargs, names=True)[1]
    dims: dict[int, tuple[int, ...]] = {}
    for argument, wanted in engine.config.dynamic.items():
        prefix = f"input {argument}" if isinstance(argument, int) else argument
        for j, name in enumerate(names):
            if name != prefix and not name.startswith((prefix + ".", prefix + "[")):
                continue
            if wanted[-1] >= tensors[j].dim():
                raise ValueError(f"dynamic[{argument!r}] = {wanted}: {name} has {tensors[j].dim()} dims (shape "
                                 f"{tuple(tensors[j].shape)}); name dims below {tensors[j].dim()}")
            dims[j] = wanted
    return dims
