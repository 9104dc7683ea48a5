"""materialize(): a module built on meta and sharded gets its pieces, each rank only its own, initialised as the
unsharded model would be.

Each rank allocates its own pieces (``module.to_empty``), then the model's initialisation runs one submodule at
a time on *whole* stand-ins of that submodule's own parameters: every rank draws the same random numbers in the
same order as the unsharded model does, keeps its piece and frees the rest. So a seed gives the unsharded
model's values, whatever the layout, and a rank holds at most its pieces plus one submodule's parameters whole.

The model's own initialisation (``init="auto"``): a transformers model's ``initialize_weights()`` (its
``_init_weights`` per module, children first, flags and all); any other module's ``reset_parameters()`` per
submodule, in ``module.modules()`` order, which is the order an ordinary construction runs them in. Both match
the unsharded model initialised the same way from the same seed; transformers' constructor draws numbers of its
own besides (its submodules' default inits, before ``post_init`` initialises again), so a model built with
``Model(config)`` on the CPU differs from ``initialize_weights()`` on any model, sharded or not.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import runtime
from ..call import parameters
from .checkpoint import UNWRITTEN_BUFFERS

__all__ = ["materialize"]


def materialize(module: nn.Module, device: str | torch.device | None = None,
                init: Callable[[nn.Module], None] | str | None = "auto") -> nn.Module:
    """Give ``module`` (sharded or not) its parameters and buffers on ``device`` (default: the device shardfn
    runs on), each rank its own pieces, initialised by ``init``: "auto" (the model's own initialisation, see the
    module's docs), a function called with each submodule that owns parameters or buffers, or None (allocated
    only: load a checkpoint into them with :func:`shardfn.load`). Returns ``module``."""
    if not (init is None or init == "auto" or callable(init)):
        raise TypeError(f"materialize: init must be 'auto', a function of a submodule, or None; got {init!r}")
    device = torch.device(device if device is not None else runtime.resolve_device(None))
    was_meta = {name for name, b in module.named_buffers() if parameters.on_meta(b)}
    # to_empty for what is on meta (a DTensor parameter: its pieces alone); what has values moves as it is
    module._apply(lambda t: torch.empty_like(t, device=device) if parameters.on_meta(t) else t.to(device))
    before = {name: (b, b._version) for name, b in module.named_buffers() if name in was_meta}
    if init is None:  # sf.load checks that the checkpoint wrote them
        module.__dict__[UNWRITTEN_BUFFERS] = before
        return module
    stand_ins = _StandIns(module)
    with torch.no_grad(), _WholeDraws():
        if init == "auto" and _is_transformers_model(module):
            _transformers_init(module, stand_ins)
        else:
            run = init if callable(init) else _reset_parameters
            for sub in module.modules():
                if sub._parameters or sub._buffers:
                    with stand_ins.whole(sub):
                        run(sub)
    _check_buffers(module, before, init)
    return module


def _reset_parameters(sub: nn.Module) -> None:
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()


def _is_transformers_model(module: nn.Module) -> bool:
    return callable(getattr(module, "initialize_weights", None)) and callable(getattr(module, "_init_weights", None))


def _transformers_init(model: nn.Module, stand_ins: "_StandIns") -> None:
    """transformers' own ``initialize_weights()`` (its traversal, guards and flags), each module's
    ``_initialize_weights`` call wrapped so that it works on whole stand-ins."""
    wrapped = []
    for sub in model.modules():
        own = sub.__dict__.get("_initialize_weights")
        method = getattr(sub, "_initialize_weights", None)
        if own is None and callable(method) and _is_transformers_model(sub):
            def around(target, *args, _method=method, **kwargs):
                with stand_ins.whole(target):
                    return _method(target, *args, **kwargs)

            sub._initialize_weights = around
            wrapped.append(sub)
    try:
        model.initialize_weights()
    finally:
        for sub in wrapped:
            del sub._initialize_weights


class _StandIns:
    """Whole stand-ins of sharded parameters while a submodule initialises them. A parameter several submodules
    hold (tied weights: an embedding and the head) keeps what its first holder made of it, as an unsharded
    model tied after its submodules initialise does; a later holder initialises a scratch copy, drawing the
    numbers the unsharded model draws for it."""

    def __init__(self, module: nn.Module):
        self.holders: dict[int, int] = {}
        for sub in module.modules():
            for p in sub._parameters.values():
                if isinstance(p, DTensor):
                    self.holders[id(p)] = self.holders.get(id(p), 0) + 1
        self.done: dict[int, tuple[DTensor, nn.Parameter]] = {}  # tied parameters a first holder initialised

    def whole(self, sub: nn.Module):
        return _Whole(self, sub)

    def enter(self, sub: nn.Module) -> list[tuple[str, DTensor, nn.Parameter]]:
        swapped = []
        for name, p in sub._parameters.items():
            if isinstance(p, DTensor):
                stand_in = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device),
                                        requires_grad=p.requires_grad)
                sub._parameters[name] = stand_in
                swapped.append((name, p, stand_in))
        return swapped

    def leave(self, sub: nn.Module, swapped: list[tuple[str, DTensor, nn.Parameter]]) -> None:
        for name, p, stand_in in swapped:
            sub._parameters[name] = p
            self.holders[id(p)] -= 1
            if id(p) not in self.done:  # the first holder's values are the parameter's
                _keep_piece(p, stand_in)
                self.done[id(p)] = p
            if not self.holders[id(p)]:
                self.done.pop(id(p))


class _Whole:
    def __init__(self, stand_ins: _StandIns, sub: nn.Module):
        self.stand_ins, self.sub = stand_ins, sub

    def __enter__(self):
        self.swapped = self.stand_ins.enter(self.sub)

    def __exit__(self, *exc):
        self.stand_ins.leave(self.sub, self.swapped)
        return False


# in-place random fills: on a DTensor, drawn whole (the unsharded model's numbers) and cut to this rank's piece
_DRAWS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
          torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_}


_INITS = {name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")}


class _WholeDraws(torch.overrides.TorchFunctionMode):
    """While the model initialises: an init function or random fill of a sharded tensor that no whole stand-in
    stands for (an init that reaches a descendant's parameter, as GPT-2's does for its projections) runs on the
    whole tensor, drawing what the unsharded model draws, and this rank keeps its piece."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.nn.init's functions by name: a library may wrap them (transformers' guard swaps in its own)
        initialises = func in _DRAWS or getattr(func, "__name__", None) in _INITS
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        if initialises and isinstance(target, DTensor):
            whole = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            if args:
                func(whole, *args[1:], **kwargs)
            else:
                func(**{**kwargs, "tensor": whole})
            _keep_piece(target, whole)
            return target
        return func(*args, **kwargs)


def _keep_piece(param: DTensor, whole: torch.Tensor) -> None:
    """This rank's piece of ``whole``, written into the DTensor parameter ``param`` (no communication)."""
    piece = distribute_tensor(whole.detach(), param.device_mesh, param.placements, src_data_rank=None).to_local()
    with torch.no_grad():
        param.to_local().copy_(piece)


def _check_buffers(module: nn.Module, before: dict, init) -> None:
    """Buffers built on meta hold uninitialised memory after to_empty unless the initialisation wrote them (a
    new tensor, or a write into the one there)."""
    untouched = [name for name, b in module.named_buffers()
                 if name in before and before[name][0] is b and b._version == before[name][1]]
    if untouched:
        shown = ", ".join(untouched[:5]) + (f" and {len(untouched) - 5} more" if len(untouched) > 5 else "")
        how = "the model's own initialisation" if init == "auto" else "init"
        raise ValueError(
            f"materialize: buffer(s) {shown} were built on meta and {how} did not compute them, so they hold "
            "uninitialised memory. Pass init=fn that computes them (fn is called with each submodule that owns "
            "parameters or buffers; e.g. recompute a rotary table there), or build those buffers off meta.")
