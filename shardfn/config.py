"""ShardConfig: the arguments of ``shard`` (and ``explain``), checked once, frozen.

Each strategy given (in_strategy's, out_strategy's, parameter_plan's) is read here once into a
:class:`~shardfn.layout.Strategy` (as given, and the TensorSpec it names), and in_strategy's entries are told apart
here once (a strategy, None, or a tuple, list or dict of entries for a container argument, kept in its form); a call
binding its arguments reads them so. Every check here is local (no communication) and runs on every rank, so a bad
argument raises the same error everywhere. What can only be checked against a call's inputs (shapes, the number of
arguments, the world size) is checked when the call binds them (:mod:`shardfn.call.arguments`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from .layout import Layout, Strategy, TensorLayout

__all__ = ["Precision", "ShardConfig", "check_strategy"]

DATASET_STRATEGIES = ("full_batch", "data_parallel")


def check_strategy(s: Any, arg: str) -> None:
    """One tensor's strategy: a tuple of split counts, a layout, or None."""
    if s is None or isinstance(s, TensorLayout):
        return
    if isinstance(s, Layout):
        raise TypeError(f"{arg} is a Layout; call it to lay out one tensor, e.g. layout('dp', 'None')")
    if not isinstance(s, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in s):
        raise TypeError(
            f"{arg} must be a tuple of ints (split count per dim), an sf.Layout(...)(...), or None; got {s!r}"
        )


def _strategy(s: Any, arg: str) -> Strategy | None:
    """One tensor's strategy checked and read (:class:`Strategy`), or None."""
    check_strategy(s, arg)
    return None if s is None else Strategy.of(s, arg)


def _entry(e: Any, arg: str) -> Any:
    """An in_strategy entry read: a strategy (a :class:`Strategy`) or None, or (for an argument that is a container
    of tensors) a tuple, list or dict of entries matching it, of the same kind. Whether it matches shows when a
    call binds it to its argument."""
    if isinstance(e, dict):
        return {k: _entry(v, f"{arg}[{k!r}]") for k, v in e.items()}
    if _is_container_entry(e):
        return type(e)(_entry(v, f"{arg}[{i}]") for i, v in enumerate(e))
    return _strategy(e, arg)


def _is_container_entry(e: Any) -> bool:
    """A tuple/list of entries (for a container argument), as opposed to a strategy (a tuple of ints)."""
    return isinstance(e, (tuple, list)) and bool(e) and all(
        v is None or isinstance(v, (tuple, list, dict, TensorLayout)) for v in e)


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_recompute(recompute: Any) -> bool | str | None | tuple[tuple[str, bool], ...]:
    """None, True, False, "selective", or per module a dict {layer pattern: True or False}, kept as a tuple of
    pairs."""
    if isinstance(recompute, dict) and recompute and all(
            isinstance(k, str) and k and isinstance(v, bool) for k, v in recompute.items()):
        return tuple(recompute.items())
    if recompute is None or isinstance(recompute, bool) or recompute == "selective":
        return recompute
    raise ValueError(
        f"recompute must be None (the search decides: where the plan does not fit the memory, and at level 1 "
        f"where it lowers the peak), False (never), True (every layer), 'selective' (every layer but its "
        f"matmuls and attention, whose results are kept), or per module a dict of layer names "
        f"(as str(plan) shows them; a glob such as 'model.layers.*', or a module above them) to True (always) "
        f"or False (never), the rest left to the search; got {recompute!r}")


def _check_dynamic(dynamic: Any) -> Any:
    """None, False, or {argument (position or keyword name): dim or dims} with dims as a sorted tuple."""
    if dynamic is None or dynamic is False:
        return dynamic
    if isinstance(dynamic, dict):
        out = {}
        for name, dims in dynamic.items():
            dims = (dims,) if _is_index(dims) else dims
            if not (_is_index(name) or isinstance(name, str)) or not isinstance(dims, (tuple, list)) or not dims \
                    or not all(_is_index(d) for d in dims):
                break
            out[name] = tuple(sorted(set(dims)))
        else:
            return out
    raise ValueError(
        f"dynamic must be None (dims whose size changes become symbols once a second size is seen), False (one "
        f"program per size) or a dict {{argument position or name: dim or tuple of dims}} (e.g. {{'input_ids': 1, "
        f"'past_key_values': 2}}), got {dynamic!r}")


def _check_in_strategy(in_strategy: Any, fn: Callable) -> tuple | dict:
    if in_strategy is None:
        raise TypeError("in_strategy is required: a tuple with one entry per positional input (a tuple of ints, a "
                        "layout, or None), or a dict {argument name: entry}")
    if isinstance(in_strategy, TensorLayout):
        in_strategy = (in_strategy,)
    if isinstance(in_strategy, dict):
        names, read = _parameter_names(fn), {}
        for key, entry in in_strategy.items():
            if not isinstance(key, str):
                raise TypeError(f"in_strategy keys must be argument names (str), got {key!r}")
            if names is not None and key not in names:
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.3)
                raise ValueError(f"in_strategy names {key!r}, which is not an argument of {_name(fn)} (its "
                                 f"arguments: {', '.join(names)})" + (f"; did you mean {close[0]!r}?" if close else ""))
            read[key] = _entry(entry, f"in_strategy[{key!r}]")
        return read
    if not isinstance(in_strategy, (tuple, list)):
        raise TypeError(f"in_strategy must be a tuple with one entry per positional input, or a dict {{argument "
                        f"name: entry}}; got {type(in_strategy).__name__}")
    return tuple(_entry(e, f"in_strategy[{i}]") for i, e in enumerate(in_strategy))


def _check_out_strategy(out_strategy: Any) -> tuple | None:
    if out_strategy is None:
        return None
    if isinstance(out_strategy, TensorLayout):
        out_strategy = (out_strategy,)
    if not isinstance(out_strategy, (tuple, list)):
        raise TypeError(f"out_strategy must be a tuple with one entry per output tensor, got "
                        f"{type(out_strategy).__name__}")
    return tuple(_strategy(s, f"out_strategy[{i}]") for i, s in enumerate(out_strategy))


def _parameter_names(fn: Callable) -> list[str] | None:
    """fn's argument names, or None where any keyword is accepted (``**kwargs``) or there is no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _strip_self(name: str) -> str:
    return name[len("self.") :] if name.startswith("self.") else name


def _check_parameter_plan(module: nn.Module | None, parameter_plan: Any) -> dict[str, Any]:
    if parameter_plan is None:
        return {}
    if module is None:
        raise TypeError("parameter_plan applies to nn.Module parameters; fn is a function, so pass its tensors as "
                        "inputs and give their layouts in in_strategy")
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
        read = _strategy(strategy, f"parameter_plan[{raw!r}]")
        name = canonical[name]
        if name in plan and getattr(plan[name], "given", None) != strategy:
            raise ValueError(f"parameter_plan gives {raw!r} and {given[name]!r}, one tied parameter, two different "
                             "strategies; give one")
        plan[name], given[name] = read, raw
    return plan


def _call_ranks(strategies: list) -> tuple[int, ...] | None:
    """The ranks a call runs on: those its layouts name (all the same), or None for the whole world."""
    named = {s.layout.ranks: s for s in strategies if s.layout is not None and s.layout.ranks is not None}
    if len(named) > 1:
        a, b = list(named.values())[:2]
        raise ValueError(f"the layouts of one shard call name different ranks: {a!r} and {b!r}; a call runs on one "
                         "set of ranks: give every layout the same ranks (move tensors between meshes with "
                         "sf.reshard outside the call)")
    return next(iter(named), None)


_PRECISIONS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Precision:
    """A mixed precision policy (the fields of torch's ``MixedPrecisionPolicy``): parameters, kept in their own
    dtype, are used in ``param_dtype`` (gathered, computed with), their gradients reduced in ``reduce_dtype``
    (default: ``param_dtype``), outputs returned in ``output_dtype`` (default: as computed). None: as they are."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, policy: Any) -> "Precision | None":
        if policy is None:
            return None
        if not all(hasattr(policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype")):
            raise TypeError(f"mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy (or an object with "
                            f"param_dtype, reduce_dtype and output_dtype), got {type(policy).__name__}")
        fields = {f: getattr(policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype")}
        for name, dtype in fields.items():
            if dtype is not None and dtype not in _PRECISIONS:
                raise ValueError(f"mp_policy.{name} is {dtype}, which shardfn cannot compute or reduce in; use one "
                                 f"of {', '.join(str(d) for d in _PRECISIONS)} (or None: as the parameters are)")
        if fields["reduce_dtype"] is None:
            fields["reduce_dtype"] = fields["param_dtype"]
        return cls(**fields)

    def __str__(self) -> str:
        def name(d):
            return "as given" if d is None else str(d).replace("torch.", "")

        return (f"parameters used in {name(self.param_dtype)}, gradients reduced in {name(self.reduce_dtype)}, "
                f"outputs {name(self.output_dtype)}")


@dataclass(frozen=True)
class ShardConfig:
    """What a sharded callable was asked to do: shard's arguments, validated (see :func:`shardfn.shard`)."""

    in_strategy: tuple | dict  # entries read: Strategy or None, or a tuple, list or dict of entries
    out_strategy: tuple | None  # Strategy or None per output
    parameter_plan: dict  # canonical parameter name -> Strategy (or None)
    level: int
    device: str | None
    dataset_strategy: str
    ranks: tuple[int, ...] | None = None  # the ranks the call runs on (its layouts' ranks); None: the whole world
    precision: Precision | None = None  # mp_policy's
    # dims whose size changes: None traces those that changed as symbols once a second size is seen (one
    # program for every size), False keeps one program per size; {argument: dims} names some up front
    dynamic: Any = None
    # None: the search decides; False: never; True: every layer; per module: (layer pattern, True or False) pairs
    recompute: bool | str | None | tuple[tuple[str, bool], ...] = None

    @classmethod
    def make(cls, fn: Callable, *, module: nn.Module | None, in_strategy: Any, out_strategy: Any,
             parameter_plan: Any, level: Any, device: Any, dataset_strategy: Any, mp_policy: Any,
             dynamic: Any, recompute: Any) -> "ShardConfig":
        """shard()'s options checked and normalised (their defaults are shard()'s)."""
        in_strategy = _check_in_strategy(in_strategy, fn)
        out_strategy = _check_out_strategy(out_strategy)
        if isinstance(level, bool) or not isinstance(level, int) or level not in (0, 1, 2):
            raise ValueError(
                f"level must be 0 (max compute/communication ratio), 1 (min memory) or 2 (min step time), "
                f"got {level!r}")
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None (cuda when available), got {device!r}")
        if dataset_strategy not in DATASET_STRATEGIES:
            raise ValueError(
                f"dataset_strategy must be 'full_batch' (inputs are global, identical on every rank) or "
                f"'data_parallel' (each rank passes its dim-0 slice), got {dataset_strategy!r}")
        plan = _check_parameter_plan(module, parameter_plan)
        precision = Precision.of(mp_policy)
        if precision is not None and module is None:
            raise TypeError("mp_policy applies to a module's parameters; fn is a function: cast its inputs yourself "
                            "(or use torch.autocast)")
        dynamic = _check_dynamic(dynamic)
        recompute = _check_recompute(recompute)
        config = cls(in_strategy, out_strategy, plan, level, device, dataset_strategy, precision=precision,
                     dynamic=dynamic, recompute=recompute)
        return dataclasses.replace(config, ranks=_call_ranks(config.strategies()))

    def strategies(self) -> list[Strategy]:
        """Every strategy given (for mesh axis names), in a fixed order."""
        found: list = []

        def walk(e):
            if isinstance(e, dict):
                for v in e.values():
                    walk(v)
            elif isinstance(e, (tuple, list)):
                for v in e:
                    walk(v)
            elif e is not None:
                found.append(e)

        walk(self.in_strategy)
        found += [s for s in self.parameter_plan.values() if s is not None]
        found += [s for s in (self.out_strategy or ()) if s is not None]
        return found
