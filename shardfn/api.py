"""shard(), ShardedFunction, ShardedModule, explain(): argument checks, the program cache, and the glue of the
three stages (capture -> strategy_search -> exec).

Every argument check here is local and runs on every rank before the first collective of a call, so a bad
argument raises the same error everywhere and nothing hangs.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from . import runtime
from .capture import capture, capturing, check_not_transformed
from .capture.graph import CapturedGraph
from .exec.lower import ParallelProgram, lower
from .exec.run import Entry
from .layout import (
    Axis,
    Layout,
    MeshSpec,
    TensorLayout,
    TensorSpec,
    common_mesh,
    normalize_strategy,
    spec_of_dtensor,
    to_placements,
)
from .strategy_search import Constraints, Plan, make_plan, profile_for

__all__ = ["ShardedFunction", "ShardedModule", "explain", "shard"]

_DATASET_STRATEGIES = ("full_batch", "data_parallel")


# --- argument checks ----------------------------------------------------------------------------------------


def _check_strategy_entry(s: Any, arg: str) -> None:
    if s is None or isinstance(s, TensorLayout):
        return
    if isinstance(s, Layout):
        raise TypeError(f"{arg} is a Layout; call it to lay out one tensor, e.g. layout('dp', 'None')")
    if not isinstance(s, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in s):
        raise TypeError(
            f"{arg} must be a tuple of ints (split count per dim), an sf.Layout(...)(...), or None; got {s!r}"
        )


def _check_strategies(strategies: Any, arg: str, allow_none: bool) -> tuple | None:
    if strategies is None:
        if allow_none:
            return None
        raise TypeError(f"{arg} is required: one entry per positional input (a tuple of ints, a layout, or None)")
    if isinstance(strategies, TensorLayout):
        strategies = (strategies,)
    if not isinstance(strategies, (tuple, list)):
        raise TypeError(f"{arg} must be a tuple with one entry per tensor, got {type(strategies).__name__}")
    for i, s in enumerate(strategies):
        _check_strategy_entry(s, f"{arg}[{i}]")
    return tuple(strategies)


def _check_common(in_strategy, out_strategy, level, device, dataset_strategy):
    in_strategy = _check_strategies(in_strategy, "in_strategy", allow_none=False)
    out_strategy = _check_strategies(out_strategy, "out_strategy", allow_none=True)
    if isinstance(level, bool) or not isinstance(level, int) or level not in (0, 1, 2):
        raise ValueError(
            f"level must be 0 (max compute/communication ratio), 1 (min memory) or 2 (min step time), got {level!r}"
        )
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None (cuda when available), got {device!r}")
    if dataset_strategy not in _DATASET_STRATEGIES:
        raise ValueError(
            f"dataset_strategy must be 'full_batch' (inputs are global, identical on every rank) or "
            f"'data_parallel' (each rank passes its dim-0 slice), got {dataset_strategy!r}"
        )
    return in_strategy, out_strategy


def _strip_self(name: str) -> str:
    return name[len("self.") :] if name.startswith("self.") else name


def _check_parameter_plan(module: nn.Module, parameter_plan: dict | None) -> dict[str, Any]:
    if parameter_plan is None:
        return {}
    if not isinstance(parameter_plan, dict):
        raise TypeError(f"parameter_plan must be a dict {{name: strategy}}, got {type(parameter_plan).__name__}")
    # every name a parameter answers to -> its first name (tied weights: head.weight -> emb.weight)
    first: dict[int, str] = {}
    canonical = {n: first.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    names = list(canonical)
    plan, given = {}, {}
    for raw, strategy in parameter_plan.items():
        if not isinstance(raw, str):
            raise TypeError(f"parameter_plan keys must be parameter names (str), got {raw!r}")
        name = _strip_self(raw)
        if name not in canonical:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.3) or names[:5]
            raise ValueError(
                f"parameter_plan names an unknown parameter {raw!r} of {type(module).__name__}; "
                f"names are relative to the module. Closest real names: {close}"
            )
        _check_strategy_entry(strategy, f"parameter_plan[{raw!r}]")
        name = canonical[name]
        if name in plan and plan[name] != strategy:
            raise ValueError(f"parameter_plan gives {raw!r} and {given[name]!r}, one tied parameter, two different "
                             "strategies; give one")
        plan[name], given[name] = strategy, raw
    return plan


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    def one(a: Any):
        if isinstance(a, DTensor):
            return ("D", tuple(a.shape), a.dtype, a.requires_grad, tuple(a.placements), tuple(a.device_mesh.shape))
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.dtype, a.requires_grad, a.device.type)
        try:
            hash(a)
        except TypeError:
            return ("C", repr(a))
        return ("C", type(a), a)

    return (tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            torch.is_grad_enabled(), _autocast_state())


def _autocast_state() -> tuple:
    """torch.autocast regions change the captured ops' dtypes: a program traced inside one is not reused outside."""
    return tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cpu", "cuda"))


# --- the engine ----------------------------------------------------------------------------------------------


@dataclass
class _Compiled:
    """Everything a repeat call with the same signature needs."""

    captured: CapturedGraph
    plan: Plan
    program: ParallelProgram | None
    mesh_spec: MeshSpec
    entries: list[Entry]  # per graph input (parameters, buffers, tensor inputs): how it arrives, where it goes
    param_names: list[str]
    out_dtensor: list[bool]
    # (owning module, attribute) of each parameter and buffer: read per call without walking the module tree
    param_slots: list = field(default_factory=list)
    buffer_slots: list = field(default_factory=list)

    @property
    def single_output(self) -> bool:
        """fn returns one tensor (not in a container): the call returns it without rebuilding a structure."""
        return self.captured.out_spec.is_leaf() and len(self.out_dtensor) == 1


class _Engine:
    """Plans and runs one sharded callable: the shared core of ShardedFunction and ShardedModule."""

    def __init__(self, fn, in_strategy, out_strategy, parameter_plan, level, device, dataset_strategy,
                 module: nn.Module | None = None):
        self.fn, self.module = fn, module
        self.in_strategy, self.out_strategy = in_strategy, out_strategy
        self.parameter_plan = parameter_plan or {}
        self.level, self.device_arg, self.dataset_strategy = level, device, dataset_strategy
        self.cache: dict[tuple, _Compiled] = {}
        self.group = None  # the process group the cached programs were made for
        self.params_laid_out = False  # set by the first call's plan; later plans keep the layouts
        self.capturing_self = False

    @property
    def name(self) -> str:
        target = self.module if self.module is not None else self.fn
        return getattr(target, "__qualname__", type(target).__name__)

    # -- checks and layouts (local, every rank) --

    def _input_specs(self, args, world: int) -> tuple[list, list, list]:
        """Per positional tensor input: global shape, TensorSpec it arrives in, fixed TensorSpec or None."""
        if len(self.in_strategy) != len(args):
            raise ValueError(
                f"in_strategy has {len(self.in_strategy)} entries but {self.name} was called with {len(args)} "
                f"positional inputs; give one entry per positional input (None for non-tensors or to let "
                f"shardfn decide)"
            )
        shapes, held, fixed = [], [], []
        for i, (a, s) in enumerate(zip(args, self.in_strategy)):
            arg = f"in_strategy[{i}]"
            if not isinstance(a, torch.Tensor):
                if s is not None:
                    raise ValueError(f"{arg} is {s!r} but input {i} is a {type(a).__name__}, not a tensor; use None")
                continue
            if isinstance(a, DTensor):
                shape = tuple(a.shape)
                arrives = spec_of_dtensor(a, world, f"input {i}")
                given = arrives if s is None else normalize_strategy(s, shape, world, arg, f"input {i}")
            elif self.dataset_strategy == "data_parallel":
                if a.dim() == 0:
                    raise ValueError(f"input {i}: data_parallel inputs need a batch dim 0; got a 0-dim tensor")
                shape = (a.shape[0] * world,) + tuple(a.shape[1:])
                dp = normalize_strategy((world,) + (1,) * (a.dim() - 1), shape, world, f"input {i} (data_parallel)")
                if s is not None and normalize_strategy(s, shape, world, arg, f"input {i}") != dp:
                    raise ValueError(
                        f"{arg} = {s!r}: with dataset_strategy='data_parallel' each input arrives split over all "
                        f"{world} ranks on dim 0; use None or {(world,) + (1,) * (a.dim() - 1)!r}"
                    )
                arrives, given = dp, dp
            else:
                shape = tuple(a.shape)
                arrives = TensorSpec.replicated(a.dim())
                given = None if s is None else normalize_strategy(s, shape, world, arg, f"input {i}")
            shapes.append(shape)
            held.append(arrives)
            fixed.append(given)
        return shapes, held, fixed

    def _param_specs(self, world: int) -> dict[str, TensorSpec]:
        """Fixed parameter layouts: parameter_plan's, and once a call has laid the parameters out, all of them
        as they are (programs of other signatures hold their layouts: a later plan may not move them)."""
        if self.module is None:
            return {}
        params = dict(self.module.named_parameters())
        if self.params_laid_out:
            return {name: spec_of_dtensor(p, world, name) for name, p in params.items() if isinstance(p, DTensor)}
        return {
            name: normalize_strategy(s, tuple(params[name].shape), world, f"parameter_plan[{name!r}]", name)
            for name, s in self.parameter_plan.items() if s is not None
        }

    def _check_same_shapes(self, args) -> None:
        """Inputs must agree across ranks (whole values, or equal slices); checked before the program runs."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or runtime.is_simulated():
            return
        desc = repr([(tuple(a.shape), str(a.dtype)) for a in args if isinstance(a, torch.Tensor)])
        h = int.from_bytes(hashlib.sha1(desc.encode()).digest()[:7], "big")  # same on every rank
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([h, -h], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != h or int(t[1]) != -h:
            raise ValueError(
                f"{self.name}: tensor input shapes differ across ranks (this rank: {desc}). With "
                f"dataset_strategy={self.dataset_strategy!r} every rank must pass "
                + ("the same global tensors" if self.dataset_strategy == "full_batch" else "equal-size slices")
            )

    # -- planning --

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

    def plan(self, args, kwargs, world: int, mesh_of: Callable[[MeshSpec], Any], device: str) -> _Compiled:
        """Check, capture and plan one call signature (no communication)."""
        with runtime.outside_simulation():
            return self._plan(args, kwargs, world, mesh_of, device)

    def _plan(self, args, kwargs, world, mesh_of, device) -> _Compiled:
        shapes, held, fixed = self._input_specs(args, world)
        param_specs = self._param_specs(world)
        out_given = [normalize_strategy(s, None, world, f"out_strategy[{i}]")
                     for i, s in enumerate(self.out_strategy or ()) if s is not None]
        names = _alias_names([*self.in_strategy, *self.parameter_plan.values(), *(self.out_strategy or ())])
        mesh_spec = common_mesh([*(h for h in held), *(f for f in fixed if f is not None),
                                 *param_specs.values(), *out_given], world, names)
        mesh = mesh_of(mesh_spec)

        params, buffers = self._state()
        example = list(args)
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        for pos, shape in zip(tensor_pos, shapes):
            a = args[pos]
            example[pos] = torch.empty(shape, dtype=a.dtype, device="meta").requires_grad_(a.requires_grad)
        state = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
                 for n, t in {**params, **buffers}.items()}
        p_meta = {n: state[n] for n in params}
        b_meta = {n: state[n] for n in buffers}
        # planning for CUDA on a machine without it (explain) traces on the CPU: only shapes matter
        trace_device = device if device != "cuda" or torch.cuda.is_available() else "cpu"
        captured = capture(self.fn, example, kwargs, p_meta, b_meta,
                           call=self._call_module if self.module is not None else None, device=trace_device)

        n_out = len([a for a in captured.output_nodes if isinstance(a, torch.fx.Node)])
        out_vals = [a.meta["val"] for a in captured.output_nodes if isinstance(a, torch.fx.Node)]
        if self.out_strategy is not None and len(self.out_strategy) != n_out:
            raise ValueError(
                f"out_strategy has {len(self.out_strategy)} entries but {self.name} returns {n_out} tensors; "
                "give one entry per output tensor"
            )
        outputs = []
        for j, v in enumerate(out_vals):
            s = self.out_strategy[j] if self.out_strategy is not None else None
            if s is not None:
                spec = normalize_strategy(s, tuple(v.shape), world, f"out_strategy[{j}]", f"output {j}")
            elif self.dataset_strategy == "data_parallel" and v.dim() > 0:
                spec = normalize_strategy((world,) + (1,) * (v.dim() - 1), tuple(v.shape), world,
                                          f"output {j} (data_parallel)")
            else:
                spec = TensorSpec.replicated(v.dim())
            outputs.append(to_placements(spec, mesh_spec))

        constraints = Constraints(outputs=outputs, grad=torch.is_grad_enabled())
        n_state = len(params) + len(buffers)
        for k, name in enumerate(params):
            if name in param_specs:
                constraints.inputs[k] = to_placements(param_specs[name], mesh_spec)
        for k in range(len(params), n_state):
            constraints.inputs[k] = (Replicate(),) * len(mesh_spec.axes)  # buffers stay whole
            constraints.held[k] = constraints.inputs[k]
        for j, spec in enumerate(fixed):
            if spec is not None:
                constraints.inputs[n_state + j] = to_placements(spec, mesh_spec)
            constraints.held[n_state + j] = to_placements(held[j], mesh_spec)
        plan = make_plan(captured, mesh, mesh_spec, constraints, level=self.level, profile=profile_for(device))
        entries = []
        for k, (gi, node) in enumerate(zip(captured.inputs, captured.placeholders)):
            planned = plan.nodes[node.name].outputs[0]
            held = constraints.held.get(k, planned)  # parameters are laid out as planned before the call
            entries.append(Entry(gi.kind, held, planned, gi.shape))
        return _Compiled(
            captured, plan, None, mesh_spec, entries, param_names=list(params),
            out_dtensor=[self.out_strategy is not None and self.out_strategy[j] is not None for j in range(n_out)],
            param_slots=[_slot(self.module, n) for n in params], buffer_slots=[_slot(self.module, n) for n in buffers],
        )

    # -- running --

    def _relay_parameters(self, compiled: _Compiled, mesh) -> None:
        """Lay parameters out as planned, in place (same Parameter objects: optimizers keep working)."""
        placeholders = compiled.captured.placeholders
        for k, name in enumerate(compiled.param_names):
            want = compiled.plan.nodes[placeholders[k].name].outputs[0]
            p = dict(self.module.named_parameters())[name]
            if isinstance(p, DTensor) and p.device_mesh == mesh and tuple(p.placements) == want:
                continue
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            new = nn.Parameter(distribute_tensor(whole.detach(), mesh, want, src_data_rank=None),
                               requires_grad=p.requires_grad)
            _replace_parameter(self.module, name, new)

    def __call__(self, *args, **kwargs):
        if capturing():
            raise ValueError(
                f"{self.name} is a sharded callable called while another shard call traces its fn: nested "
                "shard calls are not supported. Shard the outer function only, or call the inner one outside it."
            )
        check_not_transformed([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)],
                              lambda: self.name)
        key = _signature(args, kwargs) + ((self.module.training,) if self.module is not None else ())
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not self.group:  # a new process group: programs made for the old one are void
            self.cache.clear()
        compiled = self.cache.get(key)
        if compiled is None:
            device = runtime.resolve_device(self.device_arg)
            world = runtime.init(device=device).size()
            self.group = dist.group.WORLD
            # shapes first: a shape-dependent argument error must be raised on every rank or on none
            self._check_same_shapes(args)
            compiled = self.plan(args, kwargs, world, lambda spec: runtime.device_mesh(spec, device), device)
            mesh = runtime.device_mesh(compiled.mesh_spec, device)
            if self.module is not None:
                self._relay_parameters(compiled, mesh)
                self.params_laid_out = True
            compiled.program = lower(compiled.captured, compiled.plan, mesh, compiled.entries, compiled.out_dtensor,
                                     compiled=not runtime.is_simulated())
            self.cache[key] = compiled
        args_in = [owner._parameters[leaf] for owner, leaf in compiled.param_slots]
        args_in += [owner._buffers[leaf] for owner, leaf in compiled.buffer_slots]
        args_in += [a for a in args if isinstance(a, torch.Tensor)]
        outs = compiled.program(*args_in)
        if compiled.single_output:
            return outs[0]
        outs = iter(outs)
        flat = [next(outs) if isinstance(node, torch.fx.Node) else node for node in compiled.captured.output_nodes]
        return pytree.tree_unflatten(flat, compiled.captured.out_spec)


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


def _replace_parameter(module: nn.Module, name: str, new: nn.Parameter) -> None:
    """Put ``new`` where parameter ``name`` is. A DTensor parameter is swapped in place (the same Parameter object,
    so optimizers built on it keep working); a plain one is replaced, as FSDP2's fully_shard does, in every slot
    that holds it (tied weights stay tied)."""
    owner, leaf = _slot(module, name)
    old = owner._parameters[leaf]
    if isinstance(old, DTensor) and isinstance(old, nn.Parameter):
        torch.utils.swap_tensors(old, new)
        return
    for slot_name, p in list(module.named_parameters(remove_duplicate=False)):
        if p is old:
            slot_owner, slot_leaf = _slot(module, slot_name)
            slot_owner._parameters[slot_leaf] = new


def _alias_names(strategies) -> dict:
    """Mesh-dim names from the user's Layout aliases (used when a user axis is exactly one mesh dim)."""
    names = {}
    for s in strategies:
        if isinstance(s, TensorLayout):
            for i, n in enumerate(s.alias_name):
                names[Axis(s.device_matrix[i], math.prod(s.device_matrix[i + 1 :]))] = n
    return names


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


_SHARDED_CLASSES: dict[type, type] = {}


def _shard_module(module: nn.Module, engine: _Engine) -> nn.Module:
    if isinstance(module, ShardedModule):
        raise ValueError(f"{type(module).__name__} is already sharded; shard each module once")
    cls = type(module)
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    device = runtime.resolve_device(engine.device_arg)
    world = runtime.init(device=device).size()
    # Lay parameters out now: parameter_plan's layouts, the rest whole until the first call plans them.
    specs = engine._param_specs(world)
    in_specs = [normalize_strategy(s, None, world, f"in_strategy[{i}]")
                for i, s in enumerate(engine.in_strategy) if s is not None]
    names = _alias_names([*engine.in_strategy, *engine.parameter_plan.values()])
    mesh_spec = common_mesh([*specs.values(), *in_specs], world, names)
    mesh = runtime.device_mesh(mesh_spec, device)
    for name, p in list(module.named_parameters()):
        spec = specs.get(name, TensorSpec.replicated(p.dim()))
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        new = nn.Parameter(distribute_tensor(whole.detach().to(device), mesh, to_placements(spec, mesh_spec),
                                             src_data_rank=None), requires_grad=p.requires_grad)
        _replace_parameter(module, name, new)
    module.__class__ = _SHARDED_CLASSES[cls]
    module.__dict__["_shardfn_engine"] = engine
    module._register_load_state_dict_pre_hook(_lay_out_loaded_tensors, with_module=True)
    return module


def _lay_out_loaded_tensors(module, state_dict, prefix, *_):
    """A state_dict of whole tensors (from the unsharded module) loads: each is laid out like its parameter."""
    for name, p in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                                          src_data_rank=None)


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, level=0, device=None,
          dataset_strategy="full_batch"):
    """Shard ``fn`` (a function of tensors, or an nn.Module, sharded in place) over all ranks.

    See the README for the full semantics: ``in_strategy`` has one entry per positional input (a tuple of split
    counts, an ``sf.Layout(...)(...)``, or None to let shardfn decide); ``out_strategy`` None returns whole tensors
    (or this rank's batch slice with ``dataset_strategy="data_parallel"``), a tuple returns DTensors in those
    layouts; ``parameter_plan`` fixes module parameters' layouts; ``level`` picks the search objective.
    """
    in_strategy, out_strategy = _check_common(in_strategy, out_strategy, level, device, dataset_strategy)
    if isinstance(fn, ShardedFunction) or isinstance(fn, ShardedModule):
        raise ValueError(f"{fn!r} is already sharded; shard the original function once")
    if isinstance(fn, nn.Module):
        plan = _check_parameter_plan(fn, parameter_plan)
        engine = _Engine(fn.forward, in_strategy, out_strategy, plan, level, device, dataset_strategy, module=fn)
        return _shard_module(fn, engine)
    if parameter_plan is not None:
        raise TypeError("parameter_plan applies to nn.Module parameters; fn is a function, so pass its tensors as "
                        "inputs and give their layouts in in_strategy")
    if not callable(fn):
        raise TypeError(f"shard: fn must be a function or an nn.Module, got {type(fn).__name__}")
    return ShardedFunction(_Engine(fn, in_strategy, out_strategy, None, level, device, dataset_strategy))


def explain(fn_or_sharded, *example_args, world_size: int | None = None, **shard_kwargs) -> Plan:
    """The plan ``shard(fn, **shard_kwargs)(*example_args)`` runs, made without running anything.

    ``world_size`` plans for that many ranks with no processes; example args (and module parameters) may be
    meta tensors; ``device="cuda"`` plans with the GPU cost profile even where CUDA is absent. Keyword
    arguments of fn cannot be passed here; bind them with functools.partial.
    """
    if isinstance(fn_or_sharded, ShardedFunction):
        engine = fn_or_sharded._engine
    elif isinstance(fn_or_sharded, ShardedModule):
        engine = fn_or_sharded.__dict__["_shardfn_engine"]
    else:
        in_strategy = shard_kwargs.pop("in_strategy", None)
        if in_strategy is None:
            in_strategy = (None,) * len(example_args)
        parameter_plan = shard_kwargs.pop("parameter_plan", None)
        out_strategy = shard_kwargs.pop("out_strategy", None)
        level = shard_kwargs.pop("level", 0)
        device = shard_kwargs.pop("device", None)
        dataset_strategy = shard_kwargs.pop("dataset_strategy", "full_batch")
        if shard_kwargs:
            raise TypeError(f"explain: unknown keyword arguments {sorted(shard_kwargs)}")
        in_strategy, out_strategy = _check_common(in_strategy, out_strategy, level, device, dataset_strategy)
        if isinstance(fn_or_sharded, nn.Module):
            plan = _check_parameter_plan(fn_or_sharded, parameter_plan)
            engine = _Engine(fn_or_sharded.forward, in_strategy, out_strategy, plan, level, device,
                             dataset_strategy, module=fn_or_sharded)
        else:
            if parameter_plan is not None:
                raise TypeError("parameter_plan applies to nn.Module parameters, not to a function")
            engine = _Engine(fn_or_sharded, in_strategy, out_strategy, None, level, device, dataset_strategy)
    device = runtime.resolve_device(engine.device_arg) if engine.device_arg != "cuda" else "cuda"
    if world_size is None:
        world_size = runtime.init(device=device).size()
        mesh_of = lambda spec: runtime.device_mesh(spec, device)  # noqa: E731
    else:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"explain: world_size must be a positive int, got {world_size!r}")
        mesh_of = lambda spec: runtime.planning_mesh(spec, device)  # noqa: E731
    return engine.plan(list(example_args), {}, world_size, mesh_of, device).plan
