"""The public face: shard(), explain(), shard_optimizer(), no_sync(), each a short list of named steps. A call of
what shard() returns runs in the call site (shardfn.call)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from . import runtime
from .call import Engine, ShardedFunction, ShardedModule, engine_of
from .call import accumulation, parameters, uneven_batch
from .call.arguments import bind
from .call.planning import call_mesh, param_specs
from .config import ShardConfig
from .layout import TensorSpec, normalize_strategy, to_placements
from .training.optimizer import ShardedOptimizer
from .training.optimizer import check_stage as optimizer_check_stage
from .training.optimizer import gradient_targets as optimizer_gradient_targets
from .training.pipeline import Pipeline
from .strategy_search import Plan, profile_for

__all__ = ["ShardedFunction", "ShardedModule", "engine_of", "explain", "no_sync", "shard", "shard_optimizer"]


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, level=0, device=None,
          dataset_strategy="full_batch", example_inputs=None, mp_policy=None, dynamic=None, recompute=None):
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
    ``recompute``: None (default) lets the search choose layers whose activations backward computes again
    instead of keeping them (where the plan would not fit the memory; at level 1 where it lowers the peak);
    False never; True every layer; "selective" every layer but its matmuls and attention (their results kept, and
    what collectives reduced; the ops between them computed again: Megatron's selective recompute, as the search
    may also choose it for a layer); or per module a dict {layer: True or False}, a layer named as str(plan) shows
    it ("model.layers.3"), by a glob ("model.layers.*") or by a module above it ("model.layers"): True always,
    False never, the last entry naming a layer decides it, and the layers no entry names are the search's.
    Regions checkpointed by hand (torch.utils.checkpoint) stay checkpointed.
    """
    options = {name: value for name, value in locals().items() if name in _OPTIONS}
    engine = _engine_for(fn, options)
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


# shard()'s options, as its signature writes them (the one list of them): what a config is made of, and what
# explain() takes besides its own arguments
_OPTIONS = {name: p.default for name, p in inspect.signature(shard).parameters.items()
            if name not in ("fn", "example_inputs")}


def _engine_for(fn, options: dict) -> Engine:
    if isinstance(fn, (ShardedFunction, ShardedModule)):
        raise ValueError(f"{fn!r} is already sharded; shard the original function or module once")
    if not callable(fn):
        raise TypeError(f"shard: fn must be a function or an nn.Module, got {type(fn).__name__}")
    module = fn if isinstance(fn, nn.Module) else None
    target = fn.forward if module is not None else fn
    return Engine(target, ShardConfig.make(target, module=module, **options), module=module)


_SHARDED_CLASSES: dict[type, type] = {}


def _shard_module(module: nn.Module, engine: Engine, example_inputs=None) -> nn.Module:
    """``module`` sharded in place: its class put behind ShardedModule, its parameters laid out now:
    parameter_plan's layouts, the rest whole until a plan places them (the first call's, or, given example
    inputs, the plan for them, made now: parameters on meta stay meta pieces)."""
    cls = type(module)
    if cls not in _SHARDED_CLASSES:
        # in the module of the original class: libraries that ask where a model class comes from (transformers
        # treats classes from outside it as custom code, initialised otherwise) see the model as it is
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {"__module__": cls.__module__})
    device = runtime.resolve_device(engine.config.device)
    world = engine.world(device)
    specs = param_specs(engine, world)
    given = [normalize_strategy(s, None, world, "in_strategy") for s in engine.config.strategies()]
    mesh_spec = call_mesh(engine.config, [*specs.values(), *given], world, profile_for(device).devices_per_node)
    mesh = runtime.device_mesh(mesh_spec, device, engine.ranks())
    for name, p in list(module.named_parameters()):
        spec = specs.get(name, TensorSpec.replicated(p.dim()))
        parameters.lay_out(module, name, mesh, to_placements(spec, mesh_spec), device)
    module.__class__ = _SHARDED_CLASSES[cls]
    module.__dict__["_shardfn_engine"] = engine
    module._register_load_state_dict_pre_hook(parameters.lay_out_loaded_tensors, with_module=True)
    if example_inputs is not None:
        args, kwargs = _example_call(example_inputs)
        engine.may_cut_mesh = True  # (no optimizer holds the parameters yet)
        try:
            planned = engine.plan(args, kwargs, world, device)
        finally:
            engine.may_cut_mesh = False
        parameters.lay_out_planned(module, planned.plan,
                                   runtime.device_mesh(planned.mesh_spec, device, engine.ranks()), device)
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
    args, kwargs, arrived, key, tensors, _ = engine.signature(tuple(example_args), dict(kwargs or {}),
                                                              move=False, world=world_size)
    call = None
    if (rows := uneven_batch.simulated_rows(engine, tensors)) is not None:  # slices of other lengths: as a call
        uneven = uneven_batch.uneven_inputs(engine, rows, args, kwargs, tensors)  # runs them
        args, kwargs, tensors = uneven.args, uneven.kwargs, uneven.tensors
        key = engine.key(args, kwargs, arrived, batch=uneven.batch)
        with runtime.outside_simulation():
            call = bind(engine.config, engine.fn, engine.name, args, kwargs, world_size, rows=uneven.batch)
    ran = engine.programs.that_ran(key, tensors)
    if ran is not None and ran.plan.mesh.world_size == world_size:
        return ran.explained()  # the plan that ran, with what running it found (compile times, the step time)
    return engine.plan(list(args), kwargs, world_size, device, arrived, call=call).plan


def _explained_engine(fn, n_args: int, shard_kwargs: dict) -> Engine:
    """The engine ``shard(fn, **shard_kwargs)`` would make (in_strategy defaulting to None for each argument)."""
    unknown = sorted(set(shard_kwargs) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"explain: unknown keyword arguments {unknown}; shard's options are {sorted(_OPTIONS)}, "
                        "and fn's own keyword arguments go in kwargs={...}")
    options = {**_OPTIONS, "in_strategy": (None,) * n_args, **{k: v for k, v in shard_kwargs.items()
                                                                if v is not None or k != "in_strategy"}}
    return _engine_for(fn, options)


def _explained_world(engine: Engine, world_size: int | None, device: str) -> int:
    """The ranks explain() plans for: those asked, a sub-mesh call's, or the world's."""
    if world_size is None and engine.config.ranks is not None:
        return len(engine.config.ranks)
    if world_size is None:
        return runtime.init(device=device).size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"explain: world_size must be a positive int, got {world_size!r}")
    return world_size


def shard_optimizer(optimizer: torch.optim.Optimizer, *modules: nn.Module, stage: int = 2):
    """``optimizer`` (over the parameters of the sharded ``modules``) with its states split over the ranks the
    parameters are whole on: stage 1 the states, stage 2 the gradients too (reduce-scattered in backward). Every
    rank calls it alike; the modules' next calls are planned again for it. See shardfn.training.optimizer."""
    stage = optimizer_check_stage(stage)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ShardedOptimizer):
        raise TypeError(f"shard_optimizer takes a torch.optim optimizer (not already sharded); got "
                        f"{type(optimizer).__name__}")
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
    ends. Every rank enters it alike (a rank that does not is told so with the others). See
    shardfn.call.accumulation."""
    engines = []
    for s in sharded:
        if not isinstance(s, ShardedModule):
            raise TypeError(f"no_sync takes sharded modules (sf.shard(module, ...)); got {type(s).__name__}: a "
                            "sharded function has no parameters whose gradients it reduces")
        engines.append(engine_of(s))
    return accumulation.accumulating(engines)
