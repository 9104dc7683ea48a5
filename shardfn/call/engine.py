"""Engine: one sharded callable's state, and the steps of a call of it.

A call, in order: (1) check that it is not nested or transformed; (2) look its signature up in the program cache
(shardfn.call.programs). A first call of a signature then (3) binds the arguments to the config, captures fn and
plans it, all local, on every rank (shardfn.call.planning); (4) agrees with every other rank that they make the
same call (or all raise: shardfn.call.agreement); (5) lays the module's parameters out as planned and lowers the
plan to this rank's program. Every call then (6) runs the program and rebuilds fn's output. A repeat call agrees
on its signature and runs (its traced forward graph waits for that agreement before its first collective:
exec.gate). Calls whose sizes change (call.sizes), whose ranks pass batch slices of other lengths
(call.uneven_batch), made outside a sub-mesh call's ranks (call.submesh) or accumulating without sync
(call.accumulation) take their own modules' paths.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import runtime
from ..capture import capturing, check_not_transformed
from ..config import ShardConfig
from ..exec.gate import hold, open_gate
from ..exec.lower import lower
from . import accumulation, parameters, planning, sizes, step_times, submesh, uneven_batch
from .agreement import Agreement, UnevenBatch, call_agreement, check_mode, digests_of_alike, inputs_alike
from .arguments import BoundCall, bind, call_key, without_batch_rows
from .programs import Compiled, Planned, Programs

__all__ = ["Engine"]


class Engine:
    """Plans and runs one sharded callable: the shared core of ShardedFunction and ShardedModule."""

    def __init__(self, fn: Callable, config: ShardConfig, module: nn.Module | None = None):
        self.fn, self.config, self.module = fn, config, module
        target = module if module is not None else fn
        self.name = getattr(target, "__qualname__", type(target).__name__)  # before a module's class is swapped
        self.programs = Programs(self.name)  # every program and per-signature memo this callable keeps
        self.group = None  # the process group the cached programs were made for
        self.params_laid_out, self.capturing_self = False, False  # (set by the first call's plan: layouts kept)
        self.mesh_cuts, self.may_cut_mesh = (), False  # attention's cuts of the mesh (planning._mesh_for_heads)
        # accumulation without sync (sf.no_sync): calls leave parameters' gradients pending while ``sync`` is
        # off; ``pending`` says some are, which the next synced call reduces once its backward is done
        self.sync, self.pending = True, False
        # a stage-2 sharded optimizer's pieces: parameter name -> the placements its gradient is reduce-scattered
        # into (sf.shard_optimizer), and its stage (the plan's memory model splits the states)
        self.grad_targets: dict[str, tuple] = {}
        self.optimizer_stage = 0
        self.captures = 0  # captures (and plans) made: what a call of a new signature costs, counted
        self.planning_error: Exception | None = None  # the last first call's own failure to capture or plan
        # calls are timed (shardfn.call.step_times) with CUDA events where the programs run on CUDA (device="cuda"
        # on a machine without it is the call's own error, raised after this mark)
        self.cuda_clock = torch.cuda.is_available() and config.device in ("cuda", None)

    # Under torch.compile of a model around this call, the call is a graph break: Dynamo runs it as it is (its own
    # capture, plan and traced graphs) instead of tracing shardfn's Python
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        start = step_times.mark(self.cuda_clock)  # the step as its caller times it: from here
        args, kwargs, arrived, key, tensors, objects = self.signature(args, kwargs, move=True)
        self._check_not_nested_or_transformed(tensors)
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not self.group:  # a new process group: programs made for the old one are void
            self.programs.clear()
        if self.config.ranks is not None and not self._runs_here():
            return submesh.outside_call(self, key, args, kwargs, tensors, objects, arrived)
        if (rows := uneven_batch.simulated_rows(self, tensors)) is not None:  # (real ranks: in the agreement)
            compiled, outs = uneven_batch.uneven_call(self, rows, args, kwargs, tensors, arrived, start)
            return compiled.captured.result(outs, tensors, objects)
        try:
            compiled, outs = self.run(key, args, kwargs, tensors, arrived, start)
            self.programs.last_uneven.pop(key, None)
        except UnevenBatch as uneven:  # raised on every rank alike
            compiled, outs = uneven_batch.uneven_call(self, uneven.rows, args, kwargs, tensors, arrived, start)
            self.programs.last_uneven[key] = compiled
        return compiled.captured.result(outs, tensors, objects)

    def run(self, key: tuple, args, kwargs, tensors: list, arrived: tuple, start,
            batch: dict[int, int] | None = None) -> tuple[Compiled, list]:
        """The program for this call's signature (made now if new), run: it and its outputs. ``start``: the
        call's start mark (shardfn.call.step_times). ``batch``: an uneven call's batch inputs' global rows, by
        tensor number (its global batch: a program of its own, see uneven_batch.uneven_call)."""
        compiled, made = self.programs.get(key), False
        if compiled is None:
            if not batch:
                compiled, made = sizes.for_every_size(self, key, args, kwargs, tensors, arrived)
            if compiled is None:
                compiled, made = self.first_call(key, args, kwargs, arrived, batch=batch), True
        if not made and (mode := check_mode()) != "first":  # (a program made now agreed as it was made)
            _agree_again(compiled, (lambda: inputs_alike(self.config, args, kwargs)) if mode == "values" else None)
        try:
            outs = compiled.program(*self.state_tensors(compiled), *tensors)
        finally:
            open_gate()  # (a check no graph settled: this call's graphs were not the gated ones)
        compiled.times.ran(start, outs)  # the call's time, a hook for its backward's (shardfn.call.step_times)
        if compiled.plan.accumulate and torch.is_grad_enabled():
            outs = accumulation.accumulated(self, outs)
        return compiled, outs

    def first_call(self, key: tuple, args, kwargs, arrived: tuple = (), dynamic: dict | None = None,
                   batch: dict[int, int] | None = None) -> Compiled:
        """A call of a new signature, in steps: its own checks, then the ranks agree on the call; capture and
        plan (local), then the ranks agree on the program; lay the parameters out as planned; lower the plan to
        this rank's program. A rank that fails a local step still takes part in the agreement after it, which
        raises on every rank alike (nothing hangs). ``dynamic``: dims traced as symbols; ``batch``: an uneven
        call's global batch rows."""
        device = runtime.resolve_device(self.config.device)
        world = self.world(device)
        self.group = dist.group.WORLD
        agreement = call_agreement(self, key, args, kwargs, batch)
        call = self._checked_call(agreement, args, kwargs, world, batch)
        planned = self._agreed_plan(agreement, args, kwargs, world, device, arrived, dynamic, call)
        mesh = runtime.device_mesh(planned.mesh_spec, device, self.ranks())
        if self.module is not None:
            parameters.lay_out_planned(self.module, planned.plan, mesh, device)
            self.params_laid_out = True
        compiled = Compiled(planned, agreement, lower(planned.captured, planned.plan, mesh))
        if not dynamic:  # (a program for every size is kept by the signature without sizes: call.sizes)
            self.programs[key] = compiled
        return compiled

    def _checked_call(self, agreement: Agreement, args, kwargs, world: int, batch) -> BoundCall:
        """The call bound to the config (its own checks), once every rank has agreed on it. The ranks agree
        before planning (an uneven batch is known here, before a plan for one rank's slice). A model's replicas
        are compared once, before its first step: later, kernels that sum in no fixed order (atomics on a GPU)
        may leave replicated parameters apart in their last bits, harmlessly."""
        first_step = not self.params_laid_out
        error = call = None
        try:  # local: a rank whose checks fail tells the others in the agreement
            if self.module is not None:
                parameters.check_materialized(self.module, self.name)
            with runtime.outside_simulation():
                call = bind(self.config, self.fn, self.name, args, kwargs, world, rows=batch)
        except Exception as e:  # noqa: BLE001 - re-raised on this rank by check(), reported on the others
            error = self.planning_error = e

        def alike() -> dict[str, int]:
            params, buffers = self.state() if first_step else ({}, {})
            return {**inputs_alike(self.config, args, kwargs), **digests_of_alike({**params, **buffers})}

        agreement.check(first=True, error=error, values=alike)
        return call

    def _agreed_plan(self, agreement: Agreement, args, kwargs, world: int, device: str, arrived: tuple,
                     dynamic: dict | None, call: BoundCall) -> Planned:
        """The call captured and planned (local), once every rank has agreed on the program (its code and plan)."""
        planned = error = None
        try:  # local: a rank that fails here still takes part in the agreement
            planned = self.plan(args, kwargs, world, device, arrived, dynamic, call)
        except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_program, reported on the others
            error = self.planning_error = e
        agreement.check_program(planned and planned.captured.code_across_ranks(),
                                planned and planned.plan.table(), error)
        return planned

    def plan(self, args, kwargs, world: int, device: str, arrived: tuple = (), dynamic: dict | None = None,
             call: BoundCall | None = None) -> Planned:
        """This call signature captured and planned (local: no communication): shardfn.call.planning."""
        return planning.plan_call(self, args, kwargs, world, device, arrived, dynamic, call)

    # -- the call's signature ------------------------------------------------------------------------------

    def signature(self, args, kwargs, move: bool, world: int | None = None):
        """The call's arguments (those from other ranks moved, or stood in for), what moved, its cache key, its
        tensors and its argument objects."""
        key, tensors, objects = self.key(args, kwargs, (), with_tensors=True)
        arrived = ()
        if any(isinstance(t, DTensor) for t in tensors):  # (a DTensor may live on other ranks: moved first)
            args, kwargs, arrived = submesh.arrive(self.config, args, kwargs, move=move, world=world)
            if arrived:
                key, tensors, objects = self.key(args, kwargs, arrived, with_tensors=True)
        return args, kwargs, arrived, key, tensors, objects

    def key(self, args, kwargs, arrived: tuple, with_tensors: bool = False, batch: dict[int, int] | None = None):
        key, tensors, objects = call_key(args, kwargs)
        key += arrived
        if self.module is not None:
            key += (self.module.training,)
        if accumulation.accumulating_call(self) and torch.is_grad_enabled():
            key += ("no sync",)
        if self.optimizer_stage:
            key += (("optimizer stage", self.optimizer_stage, tuple(sorted(self.grad_targets.items()))),)
        if batch:  # (an uneven call's pieces: their rows follow from the batch's)
            key = without_batch_rows(key, tensors) + (("batch rows", tuple(sorted(batch.items()))),)
        return (key, tensors, objects) if with_tensors else key

    def in_batch(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this rank's slice of a data_parallel batch."""
        return self.config.dataset_strategy == "data_parallel" and not isinstance(t, DTensor) and t.dim() > 0

    def _check_not_nested_or_transformed(self, tensors: list[torch.Tensor]) -> None:
        if capturing():
            raise ValueError(
                f"{self.name} is a sharded callable called while another shard call traces its fn: nested "
                "shard calls are not supported. Shard the outer function only, or call the inner one outside it."
            )
        check_not_transformed(tensors, lambda: self.name)

    # -- ranks and state -----------------------------------------------------------------------------------

    def _runs_here(self) -> bool:
        """Whether this rank is one of the call's ranks (checking they exist, on every rank, first)."""
        runtime.init(device=runtime.resolve_device(self.config.device))
        runtime.check_ranks(self.config.ranks, self.name)
        return runtime.is_member(self.config.ranks)

    def ranks(self) -> tuple[int, ...] | None:
        """The call's ranks, None for the whole world."""
        return None if runtime.whole_world(self.config.ranks) else self.config.ranks

    def world(self, device: str) -> int:
        ranks = self.ranks()
        return runtime.init(device=device).size() if ranks is None else len(ranks)

    def state_tensors(self, compiled: Compiled) -> list[torch.Tensor]:
        planned = compiled.planned
        return [owner._parameters[leaf] for owner, leaf in planned.param_slots] + \
            [owner._buffers[leaf] for owner, leaf in planned.buffer_slots]

    def state(self) -> tuple[dict, dict]:
        if self.module is None:
            return {}, {}
        return dict(self.module.named_parameters()), dict(self.module.named_buffers())

    def call_module(self, state, *args, **kwargs):
        self.capturing_self = True
        try:
            return torch.func.functional_call(self.module, state, args, kwargs)
        finally:
            self.capturing_self = False


def _agree_again(compiled: Compiled, values) -> None:
    """A repeat call's agreement: a gated program's forward graph settles it before its first collective
    (exec.gate), so it overlaps the forward's local work; any other waits for it here."""
    if compiled.program.gated:
        hold(compiled.agreement.started(first=False, values=values))
    else:
        compiled.agreement.check(first=False, values=values)
