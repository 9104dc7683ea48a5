"""shard(), ShardedFunction, ShardedModule, explain(): the public face, and the steps of a call.

A call of a sharded callable, in order: (1) check that it is not nested or transformed; (2) look its signature up
in the cache. A first call of a signature then (3) binds the arguments to the config, captures fn and plans it,
all local, on every rank; (4) agrees with every other rank that they make the same call (or all raise);
(5) lays the module's parameters out as planned and lowers the plan to this rank's program. Every call then
(6) runs the program and rebuilds fn's output. A repeat call agrees on its signature and runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from . import accumulation, parameters, runtime, step_times, submesh, uneven_batch
from .optimizer import ShardedOptimizer
from .optimizer import check_stage as optimizer_check_stage
from .optimizer import gradient_targets as optimizer_gradient_targets
from .agreement import (Agreement, UnevenBatch, alone, call_mode, check_mode, describe_call, digest,
                        digests_of_alike, identity, inputs_alike)
from .arguments import BoundCall, bind, call_key, without_batch_rows
from .capture import capture, capturing, check_not_transformed, split_arguments
from .capture.dynamic import planning_graph
from .capture.graph import CapturedGraph
from .config import ShardConfig
from .exec.lower import lower, use_inductor
from .layout import Axis, MeshSpec, TensorLayout, TensorSpec, common_mesh, normalize_strategy, to_placements
from .programs import Compiled, Planned, Programs
from .progress import Progress
from .strategy_search import Plan, build_request, make_plan, profile_for

__all__ = ["ShardedFunction", "ShardedModule", "engine_of", "explain", "no_sync", "shard", "shard_optimizer"]

_log = logging.getLogger("shardfn")


class _Engine:
    """Plans and runs one sharded callable: the shared core of ShardedFunction and ShardedModule."""

    def __init__(self, fn: Callable, config: ShardConfig, module: nn.Module | None = None):
        self.fn, self.config, self.module = fn, config, module
        target = module if module is not None else fn
        self.name = getattr(target, "__qualname__", type(target).__name__)  # before a module's class is swapped
        self.programs = Programs(self.name)
        self.outside: dict[tuple, Compiled] = {}  # plans of calls this rank is outside of (placeholders only)
        self.group = None  # the process group the cached programs were made for
        self.params_laid_out = False  # set by the first call's plan; later plans keep the layouts
        self.capturing_self = False
        # accumulation without sync (sf.no_sync): calls leave parameters' gradients pending while ``sync`` is
        # off; ``pending`` says some are, which the next synced call reduces once its backward is done
        self.sync, self.pending = True, False
        # a stage-2 sharded optimizer's pieces: parameter name -> the placements its gradient is reduce-scattered
        # into (sf.shard_optimizer), and its stage (the plan's memory model splits the states)
        self.grad_targets: dict[str, tuple] = {}
        self.optimizer_stage = 0
        self.captures = 0  # captures (and plans) made: what a call of a new signature costs, counted
        self.planning_error: Exception | None = None  # the last first call's own failure to capture or plan
        # calls are timed (shardfn.step_times) with CUDA events where the programs run on CUDA (device="cuda" on a
        # machine without it is the call's own error, raised after this mark)
        self.cuda_clock = torch.cuda.is_available() and config.device in ("cuda", None)

    # Under torch.compile of a model around this call, the call is a graph break: Dynamo runs it as it is (its own
    # capture, plan and traced graphs) instead of tracing shardfn's Python
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        start = step_times.mark(self.cuda_clock)  # the step as its caller times it: from here
        args, kwargs, arrived, key, tensors, objects = self._signature(args, kwargs, move=True)
        self._check_not_nested_or_transformed(tensors)
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not self.group:  # a new process group: programs made for the old one are void
            self.programs.clear()
            self.outside.clear()
        if self.config.ranks is not None and not self._runs_here():
            return self._outside_call(key, args, kwargs, tensors, objects, arrived)
        if (rows := self._simulated_rows(tensors)) is not None:  # (real ranks learn it in the agreement)
            compiled, outs = self._uneven_call(rows, args, kwargs, tensors, arrived, start)
            return compiled.captured.result(outs, tensors, objects)
        try:
            compiled, outs = self._run(key, args, kwargs, tensors, arrived, start)
        except UnevenBatch as uneven:  # raised on every rank alike
            compiled, outs = self._uneven_call(uneven.rows, args, kwargs, tensors, arrived, start)
        return compiled.captured.result(outs, tensors, objects)

    def _run(self, key: tuple, args, kwargs, tensors: list, arrived: tuple, start,
             batch: dict[int, int] | None = None) -> tuple[Compiled, list]:
        """The program for this call's signature (made now if new), run: it and its outputs. ``start``: the
        call's start mark (shardfn.step_times). ``batch``: an uneven call's batch inputs' global rows, by tensor
        number (its global batch: a program of its own, see _uneven_call)."""
        compiled, made = self.programs.get(key), False
        if compiled is None:
            if not batch:
                compiled, made = self._for_every_size(key, args, kwargs, tensors, arrived)
            if compiled is None:
                compiled, made = self._first_call(key, args, kwargs, arrived, batch=batch), True
        if not made and (mode := check_mode()) != "first":  # (a program made now agreed as it was made)
            compiled.agreement.check(first=False, values=(lambda: inputs_alike(self.config, args, kwargs))
                                     if mode == "values" else None)
        outs = compiled.program(*self._state_tensors(compiled), *tensors)
        compiled.times.ran(start, outs)  # the call's time, a hook for its backward's (shardfn.step_times)
        if compiled.plan.accumulate and torch.is_grad_enabled():
            outs = self._accumulated(outs)
        return compiled, outs

    def _simulated_rows(self, tensors: list) -> dict[int, tuple[int, ...]] | None:
        """In a simulated world, each rank's batch inputs' row counts where some differ between ranks."""
        if not runtime.is_simulated() or self.config.dataset_strategy != "data_parallel":
            return None
        batch = [t for t in tensors if self._in_batch(t)]
        counts = [runtime.simulated_counts(t.shape[0]) for t in batch]
        if all(c is None for c in counts):
            return None
        world = len(next(c for c in counts if c is not None))
        return {r: tuple(int(t.shape[0]) if c is None else c[r] for t, c in zip(batch, counts)) for r in range(world)}

    def _uneven_call(self, rows: dict[int, tuple[int, ...]], args, kwargs, tensors: list,
                     arrived: tuple, start) -> tuple[Compiled, list]:
        """A call whose ranks passed batch slices of other lengths (``rows``: per global rank of the call, its
        batch inputs' row counts): run on their concatenation (see shardfn.uneven_batch). The program is the one
        for that global batch, kept by the signature with the batch's rows."""
        device = runtime.resolve_device(self.config.device)
        world = self._world(device)
        ranks = self._ranks() or tuple(range(world))
        me = 0 if runtime.is_simulated() else ranks.index(dist.get_rank())  # (simulated: every rank's, at once)
        batch = [j for j, t in enumerate(tensors) if self._in_batch(t)]
        with runtime.outside_simulation():  # (the held splits; the rows are the slices')
            call = bind(self.config, self.fn, self.name, args, kwargs, world, rows=dict.fromkeys(batch, 0))
            mesh_spec = self._mesh_spec(call, self._param_specs(world), world, device)
        moves = {j: uneven_batch.rows_of([rows[r][i] for r in ranks], call.held[j], mesh_spec, call.names[j])
                 for i, j in enumerate(batch)}
        moved = list(tensors)
        for j, where in moves.items():
            moved[j] = uneven_batch.move_rows(tensors[j], where, me, ranks)
        structure = split_arguments(args, kwargs)[2]
        args, kwargs = structure.rebuild(moved)
        batch = {j: where.total for j, where in moves.items()}
        compiled, outs = self._run(self._key(args, kwargs, arrived, batch=batch), args, kwargs, moved, arrived, start,
                                   batch)
        plan, vals = compiled.plan, [n.meta["val"] for n in compiled.captured.output_nodes]
        outs = list(outs)
        for k, out in enumerate(outs):  # outputs split as a batch input is go back into that input's slices
            if plan.returns_dtensor[k] or plan.outputs[k] is None or not vals[k].dim():
                continue
            same = [where for j, where in moves.items() if where.total == vals[k].shape[0] and
                    to_placements(call.held[j], mesh_spec) == tuple(plan.outputs[k])]
            if same:
                outs[k] = uneven_batch.move_rows(out, same[0].back(), me, ranks)
        return compiled, outs

    def _accumulating(self) -> bool:
        """Does this call leave parameters' gradients pending (inside no_sync, or the synced call after it)?"""
        return self.module is not None and (not self.sync or self.pending)

    def _accumulated(self, outs: list) -> list:
        """Outputs of a call that left parameters' gradients pending: inside no_sync, noted; the synced call after
        it reduces every pending gradient once its backward has finished."""
        if not self.sync:
            self.pending = True
            return outs
        self.pending = False
        # a stage-2 sharded optimizer reduce-scatters its parameters' gradients itself
        params = [p for n, p in self.module.named_parameters() if n not in self.grad_targets]

        def reduce():
            accumulation.reduce_pending(params)

        return list(_AtBackwardEnd.apply(reduce, *outs))

    # -- the steps ---------------------------------------------------------------------------------------------

    def _signature(self, args, kwargs, move: bool, world: int | None = None):
        """The call's arguments (those from other ranks moved, or stood in for), what moved, its cache key, its
        tensors and its argument objects."""
        key, tensors, objects = self._key(args, kwargs, (), with_tensors=True)
        arrived = ()
        if any(isinstance(t, DTensor) for t in tensors):  # (a DTensor may live on other ranks: moved first)
            args, kwargs, arrived = submesh.arrive(self.config, args, kwargs, move=move, world=world)
            if arrived:
                key, tensors, objects = self._key(args, kwargs, arrived, with_tensors=True)
        return args, kwargs, arrived, key, tensors, objects

    def _key(self, args, kwargs, arrived: tuple, with_tensors: bool = False, batch: dict[int, int] | None = None):
        key, tensors, objects = call_key(args, kwargs)
        key += arrived
        if self.module is not None:
            key += (self.module.training,)
        if self._accumulating() and torch.is_grad_enabled():
            key += ("no sync",)
        if self.optimizer_stage:
            key += (("optimizer stage", self.optimizer_stage, tuple(sorted(self.grad_targets.items()))),)
        if batch:  # (an uneven call's pieces: their rows follow from the batch's)
            key = without_batch_rows(key, tensors) + (("batch rows", tuple(sorted(batch.items()))),)
        return (key, tensors, objects) if with_tensors else key

    def _in_batch(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this rank's slice of a data_parallel batch."""
        return self.config.dataset_strategy == "data_parallel" and not isinstance(t, DTensor) and t.dim() > 0

    def _check_not_nested_or_transformed(self, tensors: list[torch.Tensor]) -> None:
        if capturing():
            raise ValueError(
                f"{self.name} is a sharded callable called while another shard call traces its fn: nested "
                "shard calls are not supported. Shard the outer function only, or call the inner one outside it."
            )
        check_not_transformed(tensors, lambda: self.name)

    def _runs_here(self) -> bool:
        """Whether this rank is one of the call's ranks (checking they exist, on every rank, first)."""
        runtime.init(device=runtime.resolve_device(self.config.device))
        runtime.check_ranks(self.config.ranks, self.name)
        return runtime.is_member(self.config.ranks)

    def _ranks(self) -> tuple[int, ...] | None:
        """The call's ranks, None for the whole world."""
        return None if runtime.whole_world(self.config.ranks) else self.config.ranks

    def _world(self, device: str) -> int:
        ranks = self._ranks()
        return runtime.init(device=device).size() if ranks is None else len(ranks)

    def _first_call(self, key: tuple, args, kwargs, arrived: tuple = (), dynamic: dict | None = None,
                    batch: dict[int, int] | None = None) -> Compiled:
        """A call of a new signature, in steps: its own checks, then the ranks agree on the call; capture and
        plan (local), then the ranks agree on the program; lay the parameters out as planned; lower the plan to
        this rank's program. A rank that fails a local step still takes part in the agreement after it, which
        raises on every rank alike (nothing hangs). ``dynamic``: dims traced as symbols; ``batch``: an uneven
        call's global batch rows."""
        device = runtime.resolve_device(self.config.device)
        world = self._world(device)
        self.group = dist.group.WORLD
        agreement = self._agreement(key, args, kwargs, batch)
        call = self._checked_call(agreement, args, kwargs, world, batch)
        planned = self._agreed_plan(agreement, args, kwargs, world, device, arrived, dynamic, call)
        mesh = runtime.device_mesh(planned.mesh_spec, device, self._ranks())
        if self.module is not None:
            parameters.lay_out_planned(self.module, planned.plan, mesh, device)
            self.params_laid_out = True
        # (a program for every size is interpreted: traced graphs hold one size; real ranks trace it at each size
        # they meet again: _at_these_sizes)
        compiled = Compiled(planned, agreement, lower(planned.captured, planned.plan, mesh))
        if not dynamic:  # (a program for every size is kept by the signature without sizes: _for_every_size)
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
            params, buffers = self._state() if first_step else ({}, {})
            return {**inputs_alike(self.config, args, kwargs), **digests_of_alike({**params, **buffers})}

        agreement.check(first=True, error=error, values=alike)
        return call

    def _agreed_plan(self, agreement: Agreement, args, kwargs, world: int, device: str, arrived: tuple,
                     dynamic: dict | None, call: BoundCall) -> Planned:
        """The call captured and planned (local), once every rank has agreed on the program (its code and plan)."""
        planned = error = None
        try:  # local: a rank that fails here still takes part in the agreement
            planned = self.plan(args, kwargs, world, lambda spec: runtime.planning_mesh(spec, device), device,
                                arrived, dynamic, call)
        except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_program, reported on the others
            error = self.planning_error = e
        agreement.check_program(planned and planned.captured.code_across_ranks(),
                                planned and planned.plan.table(), error)
        return planned

    def _agreement(self, key: tuple, args, kwargs, batch: dict[int, int] | None = None) -> Agreement:
        """What the ranks compare for a call of this signature (its sizes included; data_parallel slices' row
        counts apart: ranks may pass slices of other lengths, shardfn.uneven_batch)."""
        rows: tuple[int, ...] = ()
        if self.config.dataset_strategy == "data_parallel":
            tensors = split_arguments(args, kwargs)[0]
            key = without_batch_rows(key, tensors)
            rows = tuple(sorted(batch.items())) if batch else \
                tuple(t.shape[0] for t in tensors if self._in_batch(t))
        ranks = self._ranks()
        if alone(ranks):  # nothing to compare (a generation's every token asks: no description to build)
            return Agreement(self.name, 0, ranks=ranks, rows=rows)
        who = identity(self.name, self.module if self.module is not None else self.fn, self.config)
        mode = call_mode(self.module, self._accumulating())
        return Agreement(self.name, digest(f"{who}|{key!r}"), describe_call(who, self.config, args, kwargs, mode),
                         ranks=ranks, rows=rows)

    def _at_these_sizes(self, compiled: Compiled, key: tuple, args, kwargs) -> Compiled:
        """The program for every size, for a call of this signature. It runs interpreted over DTensors (no
        capture, no plan, no trace: the symbolic graph's plan at the sizes its values take now); on real ranks a
        signature called SHARDFN_TRACE_AFTER times is traced into per-rank graphs at its sizes
        (Programs.trace_now), except in a world of one without Inductor, where the captured graph runs as it is
        either way. The ranks compare this call's
        signature, its sizes included, as for any program."""
        # (alone, an agreement compares nothing: the program's own serves, and a generation's token makes none)
        here = compiled if alone(self._ranks()) else \
            dataclasses.replace(compiled, agreement=self._agreement(key, args, kwargs))
        mesh = compiled.program.mesh
        if runtime.is_simulated() or (mesh.size() == 1 and not use_inductor(mesh.device_type)) \
                or not self.programs.trace_now(compiled, key):
            return self._synced_once(compiled, here)
        here = dataclasses.replace(here, program=compiled.program.traced_at_these_sizes())
        self.programs[key] = here
        return here

    def _synced_once(self, compiled: Compiled, here: Compiled) -> Compiled:
        """An interpreted call of the program for every size, with gradients: its parameters' gradients are left
        pending and reduced once its backward has ended, in buckets (as the call after sf.no_sync reduces them:
        _accumulated), not each by its own all-reduce as autograd hands it over (each a wait for every rank; the
        traced graphs fuse them: exec.passes). Not under no_sync (already so), a mixed precision policy or a
        sharded optimizer (their gradients' reductions are their own), or in a world of one."""
        if self.module is None or not torch.is_grad_enabled() or compiled.plan.accumulate or \
                self.config.precision is not None or self.optimizer_stage or compiled.program.mesh.size() == 1:
            return here
        if compiled.synced_once is None:  # (lowered once, beside the program that reduces as it goes)
            compiled.synced_once = lower(compiled.captured, dataclasses.replace(compiled.plan, accumulate=True),
                                         compiled.program.mesh)
        program = compiled.synced_once
        return dataclasses.replace(here, planned=dataclasses.replace(here.planned, plan=program.plan),
                                   program=program)

    def _for_every_size(self, key: tuple, args, kwargs, tensors: list,
                        arrived: tuple) -> tuple[Compiled | None, bool]:
        """A new signature whose structure was seen before with other sizes: the program that serves every size
        of the dims that changed (made now, once, traced with those dims as symbols), if its capture holds for
        these sizes, and whether it was made now. None: a program for this signature alone (the first sizes of a
        structure; dynamic dims off; a size the dynamic capture's guards reject, said on the ``shardfn``
        logger)."""
        if self.config.dynamic is False or arrived:
            return None, False
        serving = self.programs.serving(key, tensors)
        if isinstance(serving, str):
            _log.info("shardfn: %s: a program for these sizes alone: %s", self.name, serving)
            return None, False
        if serving is not None:
            return self._at_these_sizes(serving, key, args, kwargs), False
        given = self._given_dims(args, kwargs, tensors)
        dims = self.programs.dims_changed(key, given)
        if not dims:
            return None, False
        _log.info("shardfn: %s: dims %s are traced as symbols (one program for every size)%s", self.name, dims,
                  "" if given else ": their sizes changed since the first call")
        self.planning_error = None
        try:
            compiled = self._first_call(key, args, kwargs, arrived, dynamic=dims)
        except Exception as e:  # noqa: BLE001 - this rank's own capture or plan failed, and every rank's alike
            # (the agreement raises a rank's own error only then): all fall back; anything else stops the call
            if e is not self.planning_error or isinstance(self.config.dynamic, dict):
                raise
            _log.warning("shardfn: %s: its sizes changed, but tracing dims %s as symbols failed (%s: %s); one "
                         "program per size", self.name, dims, type(e).__name__, str(e).splitlines()[0])
            self.programs.no_symbols(key)
            return None, False
        self.programs.keep_for_every_size(key, compiled)
        return self._at_these_sizes(compiled, key, args, kwargs), True

    def _given_dims(self, args, kwargs, tensors: list) -> dict[int, tuple[int, ...]]:
        """shard(dynamic={argument: dims})'s dims, by argument tensor number: every tensor of that argument (a
        container's, an object's attributes') takes them."""
        if not isinstance(self.config.dynamic, dict):
            return {}
        names = split_arguments(args, kwargs, names=True)[1]
        dims: dict[int, tuple[int, ...]] = {}
        for argument, wanted in self.config.dynamic.items():
            prefix = f"input {argument}" if isinstance(argument, int) else argument
            for j, name in enumerate(names):
                if name != prefix and not name.startswith((prefix + ".", prefix + "[")):
                    continue
                if wanted[-1] >= tensors[j].dim():
                    raise ValueError(f"dynamic[{argument!r}] = {wanted}: {name} has {tensors[j].dim()} dims (shape "
                                     f"{tuple(tensors[j].shape)}); name dims below {tensors[j].dim()}")
                dims[j] = wanted
        return dims

    def _outside_call(self, key: tuple, args, kwargs, tensors, objects, arrived: tuple = ()):
        """On a rank outside the call's ranks: no program, no communication. The outputs are placeholders with
        the outputs' shapes (the plan is made here too, locally, for them), connected to the inputs for autograd
        so a backward through them reaches what came before (an sf.reshard that receives the gradients)."""
        compiled = self.outside.get(key)
        if compiled is None:
            device = runtime.resolve_device(self.config.device)
            self.group = dist.group.WORLD
            planned = self.plan(args, kwargs, self._world(device), lambda spec: runtime.planning_mesh(spec, device),
                                device, arrived)
            mesh = runtime.device_mesh(planned.mesh_spec, device, self.config.ranks)
            compiled = self.outside[key] = Compiled(planned, None, submesh.placeholders(planned, mesh))
        outs = compiled.program(*self._state_tensors(compiled), *tensors)
        return compiled.captured.result(outs, tensors, objects)

    def plan(self, args, kwargs, world: int, mesh_of: Callable[[MeshSpec], Any], device: str,
             arrived: tuple = (), dynamic: dict | None = None, call: BoundCall | None = None) -> Planned:
        """Bind (unless ``call`` is the call bound already), capture and plan one call signature (local: no
        communication). ``dynamic``: {argument tensor number: dims} traced as symbols; the search plans at this
        call's sizes."""
        with runtime.outside_simulation():
            call = call or bind(self.config, self.fn, self.name, args, kwargs, world)
            param_specs = self._param_specs(world)
            profile = profile_for(device)
            mesh_spec = self._mesh_spec(call, param_specs, world, device, profile)
            params, _ = self._state()
            progress = Progress(sum(t.numel() for t in params.values()) + sum(math.prod(s) for s in call.shapes))
            captured = progress("capture", lambda: self._capture(args, kwargs, call, device, dynamic),
                                lambda c: f"{len(c.gm.graph.nodes)} graph nodes", f"{self.name} on {world} ranks")
            self.captures += 1
            planned = captured if not dynamic else dataclasses.replace(
                captured, gm=planning_graph(captured.gm), dynamic=None)
            accumulate = self._accumulating() and torch.is_grad_enabled()
            moves, moved = submesh.arrival_records(arrived, self.name)
            request = build_request(self.config, self.name, call, planned, param_specs, mesh_spec, world,
                                    profile, accumulate, self.optimizer_stage,
                                    pending_grads=self.grad_targets.keys(), arrivals=moves,
                                    notes=((_dynamic_note(captured, dynamic),) if dynamic else ()) + moved)
            plan = make_plan(planned, mesh_of(mesh_spec), mesh_spec, request, progress)
        params, buffers = self._state()
        return Planned(captured, plan, mesh_spec, tuple(parameters.slot(self.module, n) for n in params),
                       tuple(parameters.slot(self.module, n) for n in buffers), dict(dynamic or {}))

    def _mesh_spec(self, call: BoundCall, param_specs: dict[str, TensorSpec], world: int, device: str,
                   profile=None) -> MeshSpec:
        """The call's mesh: the one every given layout fits on, cut where a node ends (no mesh dim mixes the
        ranks within a node with ranks across nodes, so work can be split within a node alone)."""
        out_given = [normalize_strategy(s, None, world, f"out_strategy[{i}]")
                     for i, s in enumerate(self.config.out_strategy or ()) if s is not None]
        profile = profile or profile_for(device)
        return common_mesh([*call.held, *(f for f in call.fixed if f is not None), *param_specs.values(),
                            *out_given], world, _alias_names(self.config.strategies()),
                           _axis_links(self.config.strategies()), profile.devices_per_node)

    def _capture(self, args, kwargs, call: BoundCall, device: str, dynamic: dict | None = None) -> CapturedGraph:
        shapes = iter(call.shapes)

        used = _used_dtype(self.config.precision)

        def example(a):  # the global value's description: shape, dtype (as the program uses it), requires_grad
            if not isinstance(a, torch.Tensor):
                return a
            return torch.empty(next(shapes), dtype=used(a.dtype), device="meta").requires_grad_(a.requires_grad)

        tensors, _, structure = split_arguments(args, kwargs)
        ex_args, ex_kwargs = structure.rebuild([example(t) for t in tensors])
        params, buffers = self._state()
        meta = {n: torch.empty(tuple(t.shape), dtype=used(t.dtype) if n in params else t.dtype, device="meta")
                .requires_grad_(t.requires_grad) for n, t in {**params, **buffers}.items()}
        # planning for CUDA on a machine without it (explain) traces on the CPU: only shapes matter
        trace_device = device if device != "cuda" or torch.cuda.is_available() else "cpu"
        return capture(self.fn, ex_args, ex_kwargs, {n: meta[n] for n in params}, {n: meta[n] for n in buffers},
                       call=self._call_module if self.module is not None else None, device=trace_device,
                       dynamic=dynamic)

    def _param_specs(self, world: int) -> dict[str, TensorSpec]:
        if self.module is None:
            return {}
        return parameters.fixed_specs(self.module, self.config.parameter_plan, world, self.params_laid_out,
                                      self._ranks())

    def _state_tensors(self, compiled: Compiled) -> list[torch.Tensor]:
        planned = compiled.planned
        return [owner._parameters[leaf] for owner, leaf in planned.param_slots] + \
            [owner._buffers[leaf] for owner, leaf in planned.buffer_slots]

    # -- module state ------------------------------------------------------------------------------------------

    def _state(self) -> tuple[dict, dict]:
        if self.module is None:
            return {}, {}
        return dict(self.module.named_parameters()), dict(self.module.named_buffers())

    def _call_module(self, state, *args, **kwargs):
        self.capturing_self = True
        try:
            return torch.func.functional_call(self.module, state, args, kwargs)
        finally:
            self.capturing_self = False


def _dynamic_note(captured: CapturedGraph, dynamic: dict) -> str:
    """What explain() says of a program for every size: which dims, planned at which sizes, for which range."""
    inputs = [gi for gi in captured.inputs if gi.kind == "input"]
    dims = "; ".join(f"{inputs[j].name} dims {list(d)} (planned at {[inputs[j].shape[k] for k in d]})"
                     for j, d in sorted(dynamic.items()))
    return f"dynamic: {dims}; the program holds for {captured.dynamic.described()}"


class _AtBackwardEnd(torch.autograd.Function):
    """Identity on a call's outputs whose backward has ``fn`` run once the whole backward pass has finished (when
    autograd has summed every gradient into ``.grad``)."""

    @staticmethod
    def forward(ctx, fn, *outs):
        ctx.fn = fn
        return tuple(o.view_as(o) if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.fn)
        return (None, *grads)


def shard_optimizer(optimizer: torch.optim.Optimizer, *modules: nn.Module, stage: int = 2):
    """``optimizer`` (over the parameters of the sharded ``modules``) with its states split over the ranks the
    parameters are whole on: stage 1 the states, stage 2 the gradients too (reduce-scattered in backward). Every
    rank calls it alike; the modules' next calls are planned again for it. See shardfn.optimizer."""
    stage = optimizer_check_stage(stage)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"shard_optimizer takes a torch.optim optimizer (not already sharded); got "
                        f"{type(optimizer).__name__}")
    from .pipeline import Pipeline  # (which imports this module)

    owners = {}
    for m in [s for m in modules for s in (m.stages if isinstance(m, Pipeline) else (m,))]:  # a pipeline: its stages
        if not isinstance(m, ShardedModule):
            raise TypeError(f"shard_optimizer: {type(m).__name__} is not a sharded module; pass the modules "
                            "sf.shard returned (or an sf.pipeline of them), whose parameters the optimizer steps")
        engine = engine_of(m)
        owners.update({id(p): (engine, n) for n, p in m.named_parameters()})
    strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owners]
    if strangers:
        raise ValueError(f"shard_optimizer: {len(strangers)} of the optimizer's parameters (shapes "
                         f"{[tuple(p.shape) for p in strangers[:3]]}) are not parameters of the sharded modules "
                         "given; build the optimizer on model.parameters() after sf.shard, and pass that model")
    sharded = ShardedOptimizer(optimizer, stage, syncing=lambda p: owners[id(p)][0].sync)
    targets = optimizer_gradient_targets(sharded)
    for engine, _ in {id(e): (e, n) for e, n in owners.values()}.values():
        engine.optimizer_stage = stage
        engine.grad_targets = {n: targets[pid] for pid, (e, n) in owners.items() if e is engine and pid in targets}
    return sharded


def no_sync(*sharded):
    """A context in which the sharded modules' calls accumulate parameters' gradients without reducing them (each
    rank sums its own part into ``.grad``); the first call of each after it reduces the sum once, as its backward
    ends. Every rank enters it alike (a rank that does not is told so with the others). See shardfn.accumulation."""
    engines = []
    for s in sharded:
        if not isinstance(s, ShardedModule):
            raise TypeError(f"no_sync takes sharded modules (sf.shard(module, ...)); got {type(s).__name__}: a "
                            "sharded function has no parameters whose gradients it reduces")
        engines.append(engine_of(s))
    return accumulation.accumulating(engines)


def _alias_names(strategies) -> dict:
    """Mesh-dim names from the user's Layout aliases (used when a user axis is exactly one mesh dim)."""
    names = {}
    for s in strategies:
        if isinstance(s, TensorLayout):
            for i, n in enumerate(s.alias_name):
                names[Axis(s.device_matrix[i], math.prod(s.device_matrix[i + 1 :]))] = n
    return names


def _axis_links(strategies) -> dict:
    """The links the user's Layouts give their axes ({axis: "intra"/"inter"}); Layouts that disagree on one axis
    are an error."""
    links: dict = {}
    for s in strategies:
        if isinstance(s, TensorLayout) and s.links is not None:
            for i, link in enumerate(s.links):
                axis = Axis(s.device_matrix[i], math.prod(s.device_matrix[i + 1 :]))
                if links.setdefault(axis, link) != link:
                    raise ValueError(f"in_strategy: the Layouts given say both {links[axis]!r} and {link!r} for "
                                     f"axis {s.alias_name[i]!r}; give every Layout of one call the same links")
    return links


# --- public objects -----------------------------------------------------------------------------------------


class ShardedFunction:
    """A function sharded over the world; call it like the function. See :func:`shard`."""

    def __init__(self, engine: _Engine):
        self._engine = engine
        self.__wrapped__ = engine.fn
        self.__doc__ = getattr(engine.fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<shardfn.ShardedFunction {self._engine.name}>"


class ShardedModule:
    """Mixin put in front of a sharded module's class: forward runs the sharded program."""

    _shardfn_engine: _Engine

    def forward(self, *args, **kwargs):
        engine = self.__dict__["_shardfn_engine"]
        if engine.capturing_self:
            return super().forward(*args, **kwargs)
        return engine(*args, **kwargs)


def engine_of(sharded: ShardedFunction | ShardedModule) -> _Engine:
    """The engine behind a sharded function or module, for tools and tests to read: its ``config``, its
    ``programs`` (by signature, and for every size: shardfn.programs), its ``captures`` (captures and plans made so
    far). Read it; changing it is not supported."""
    if isinstance(sharded, ShardedFunction):
        return sharded._engine
    if isinstance(sharded, ShardedModule):
        return sharded.__dict__["_shardfn_engine"]
    raise TypeError(f"engine_of takes what sf.shard returned, got {type(sharded).__name__}")


_SHARDED_CLASSES: dict[type, type] = {}


def _shard_module(module: nn.Module, engine: _Engine, example_inputs=None) -> nn.Module:
    cls = type(module)
    if cls not in _SHARDED_CLASSES:
        # in the module of the original class: libraries that ask where a model class comes from (transformers
        # treats classes from outside it as custom code, initialised otherwise) see the model as it is
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
    device = runtime.resolve_device(engine.config.device)
    world = engine._world(device)
    # Lay parameters out now: parameter_plan's layouts, the rest whole until a plan places them: the first
    # call's, or, given example inputs, the plan for them, made now (parameters on meta stay meta pieces)
    specs = engine._param_specs(world)
    given = [normalize_strategy(s, None, world, "in_strategy") for s in engine.config.strategies()]
    mesh_spec = common_mesh([*specs.values(), *given], world, _alias_names(engine.config.strategies()),
                            _axis_links(engine.config.strategies()), profile_for(device).devices_per_node)
    mesh = runtime.device_mesh(mesh_spec, device, engine._ranks())
    for name, p in list(module.named_parameters()):
        spec = specs.get(name, TensorSpec.replicated(p.dim()))
        parameters.lay_out(module, name, mesh, to_placements(spec, mesh_spec), device)
    module.__class__ = _SHARDED_CLASSES[cls]
    module.__dict__["_shardfn_engine"] = engine
    module._register_load_state_dict_pre_hook(parameters.lay_out_loaded_tensors, with_module=True)
    if example_inputs is not None:
        args, kwargs = _example_call(example_inputs)
        planned = engine.plan(args, kwargs, world, lambda spec: runtime.planning_mesh(spec, device), device)
        parameters.lay_out_planned(module, planned.plan,
                                   runtime.device_mesh(planned.mesh_spec, device, engine._ranks()), device)
        engine.params_laid_out = True
    return module


def _example_call(example_inputs) -> tuple[list, dict]:
    """``example_inputs`` as (args, kwargs): a tuple of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, dict):
        return [], dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return list(example_inputs), {}
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs], {}
    raise TypeError(f"example_inputs must be a tuple of fn's positional arguments or a dict of its keyword "
                    f"arguments (tensors may be meta tensors), got {type(example_inputs).__name__}")


def _used_dtype(precision) -> Callable[[torch.dtype], torch.dtype]:
    """The dtype a floating parameter or input is used in under a mixed precision policy (others: their own)."""
    if precision is None or precision.param_dtype is None:
        return lambda dtype: dtype
    return lambda dtype: precision.param_dtype if dtype.is_floating_point else dtype


def _engine_for(fn, in_strategy, out_strategy, parameter_plan, level, device, dataset_strategy,
                mp_policy=None, dynamic=None) -> _Engine:
    if isinstance(fn, (ShardedFunction, ShardedModule)):
        raise ValueError(f"{fn!r} is already sharded; shard the original function or module once")
    if not callable(fn):
        raise TypeError(f"shard: fn must be a function or an nn.Module, got {type(fn).__name__}")
    module = fn if isinstance(fn, nn.Module) else None
    target = fn.forward if module is not None else fn
    config = ShardConfig.make(target, in_strategy, out_strategy, parameter_plan, level, device, dataset_strategy,
                              module=module, mp_policy=mp_policy, dynamic=dynamic)
    return _Engine(target, config, module=module)


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, level=0, device=None,
          dataset_strategy="full_batch", example_inputs=None, mp_policy=None, dynamic=None):
    """Shard ``fn`` (a function of tensors, or an nn.Module, sharded in place) over all ranks.

    See the README for the full semantics: ``in_strategy`` has one entry per positional input (a tuple of split
    counts, an ``sf.Layout(...)(...)``, or None to let shardfn decide), or is a dict by argument name (keyword
    arguments included); ``out_strategy`` None returns whole tensors (or this rank's batch slice with
    ``dataset_strategy="data_parallel"``), a tuple returns DTensors in those layouts; ``parameter_plan`` fixes
    module parameters' layouts; ``level`` picks the search objective. ``example_inputs`` (modules only: a tuple
    of positional arguments or a dict of keyword arguments, tensors may be meta) plans the call now and lays the
    parameters out as planned, before any call: a module built on meta then stays meta pieces until
    :func:`shardfn.materialize` gives each rank its own. ``mp_policy`` (modules only): torch's
    ``MixedPrecisionPolicy`` (or its fields): parameters, kept in their dtype, are used and gathered in
    ``param_dtype``, their gradients reduced in ``reduce_dtype``, outputs returned in ``output_dtype``.
    ``dynamic``: None (default) makes one program for every size of the dims whose size changed, once a second
    size is seen (those dims traced as symbols); False keeps one program per size; a dict {argument position or
    keyword name: dims} makes them dynamic from the first call (every tensor of that argument).
    """
    engine = _engine_for(fn, in_strategy, out_strategy, parameter_plan, level, device, dataset_strategy, mp_policy,
                         dynamic)
    if engine.config.ranks is not None:  # a call on a sub-mesh: its process groups are made now, by every rank
        device = runtime.resolve_device(engine.config.device)
        runtime.init(device=device)
        runtime.check_ranks(engine.config.ranks, engine.name)
        runtime.prepare_ranks(engine.config.ranks, device)
    if engine.module is not None:
        return _shard_module(engine.module, engine, example_inputs)
    if example_inputs is not None:
        raise TypeError("shard: example_inputs lays a module's parameters out before its first call; a function "
                        "has none: leave example_inputs out (its first call plans it)")
    return ShardedFunction(engine)


def plan_stage(sharded: ShardedModule, *example_args) -> tuple[Plan, list[torch.Tensor]]:
    """The plan of ``sharded(*example_args)`` (made locally, running nothing) and its tensor outputs as meta
    tensors of the shapes this rank gets them (a batch-split output: this rank's slice)."""
    engine = engine_of(sharded)
    device = runtime.resolve_device(engine.config.device)
    planned = engine.plan(list(example_args), {}, engine._world(device),
                          lambda spec: runtime.planning_mesh(spec, device), device)
    plan, outs = planned.plan, []
    for node, placements in zip(planned.captured.output_nodes[:planned.captured.n_outputs], plan.outputs):
        v = node.meta["val"]
        shape = list(v.shape)
        if shape and placements is not None and not plan.returns_dtensor[len(outs)]:
            shape[0] //= math.prod(n for n, p in zip(plan.mesh.shape, placements) if p == Shard(0))
        outs.append(torch.empty(shape, dtype=v.dtype, device="meta"))
    return plan, outs


def explain(fn_or_sharded, *example_args, world_size: int | None = None, kwargs: dict | None = None,
            **shard_kwargs) -> Plan:
    """The plan ``shard(fn, **shard_kwargs)(*example_args, **kwargs)`` runs, made without running anything.

    ``world_size`` plans for that many ranks with no processes; example arguments (and module parameters) may
    be meta tensors; ``kwargs`` are fn's keyword arguments; ``device="cuda"`` plans with the GPU cost profile even
    where CUDA is absent.
    """
    engine = engine_of(fn_or_sharded) if isinstance(fn_or_sharded, (ShardedFunction, ShardedModule)) else \
        _explained_engine(fn_or_sharded, len(example_args), shard_kwargs)
    device = runtime.resolve_device(engine.config.device) if engine.config.device != "cuda" else "cuda"
    world_size = _explained_world(engine, world_size, device)
    args, kwargs, arrived, key, tensors, _ = engine._signature(tuple(example_args), dict(kwargs or {}),
                                                               move=False, world=world_size)
    ran = engine.programs.that_ran(key, tensors)
    if ran is not None and ran.plan.mesh.world_size == world_size:
        return ran.explained()  # the plan that ran, with what running it found (compile times, the step time)
    return engine.plan(list(args), kwargs, world_size, lambda spec: runtime.planning_mesh(spec, device), device,
                       arrived).plan


def _explained_engine(fn, n_args: int, shard_kwargs: dict) -> _Engine:
    """The engine ``shard(fn, **shard_kwargs)`` would make (in_strategy defaulting to None for each argument)."""
    known = ("in_strategy", "out_strategy", "parameter_plan", "level", "device", "dataset_strategy", "mp_policy")
    unknown = sorted(set(shard_kwargs) - set(known))
    if unknown:
        raise TypeError(f"explain: unknown keyword arguments {unknown}; fn's own keyword arguments go in "
                        "kwargs={...}")
    in_strategy = shard_kwargs.get("in_strategy")
    return _engine_for(fn, (None,) * n_args if in_strategy is None else in_strategy, shard_kwargs.get("out_strategy"),
                       shard_kwargs.get("parameter_plan"), shard_kwargs.get("level", 0), shard_kwargs.get("device"),
                       shard_kwargs.get("dataset_strategy", "full_batch"), shard_kwargs.get("mp_policy"))


def _explained_world(engine: _Engine, world_size: int | None, device: str) -> int:
    """The ranks explain() plans for: those asked, a sub-mesh call's, or the world's."""
    if world_size is None and engine.config.ranks is not None:
        return len(engine.config.ranks)
    if world_size is None:
        return runtime.init(device=device).size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"explain: world_size must be a positive int, got {world_size!r}")
    return world_size
