"""What library code sees of the trace while fn is captured (private torch state, kept here alone).

transformers, torch.utils.checkpoint and others skip value-dependent shortcuts when ``torch.compiler.
is_compiling()`` is true, and pick trace-friendly paths when a non-strict (make_fx-based) trace is running.
torch.export's non-strict mode sets both while it runs the user's code; capture sets them the same way.

Library code may also mark an activation as requiring grad (transformers' gradient checkpointing makes the
embeddings' output require grad, so a checkpointed first layer gets gradients under frozen embeddings), which
functionalization refuses. The captured graph is forward only and its program differentiates what needs it, so
while fn is captured such a mark leaves the traced tensor as it is.

Activation checkpointing (``torch.utils.checkpoint``, transformers' ``gradient_checkpointing_enable()``) runs a
region's forward under saved-tensor hooks, which a trace does not keep. While fn is captured, each region's ops
carry its number instead (``node.meta["custom"]``, :func:`~.graph.checkpoint_region`), for the programs to
compute them again in backward.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.compiler
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint

from .graph import CHECKPOINT_REGION, MODULE_PATH

__all__ = ["checkpoint_region", "checkpoint_regions_marked", "checkpoint_regions_so_far", "looks_like_tracing",
           "own_global_hooks", "patched", "requires_grad_marks_ignored", "skip_checkpoint_regions"]

_FLAGS = ("_is_compiling_flag", "_is_non_strict_tracing_flag")


@contextlib.contextmanager
def looks_like_tracing() -> Iterator[None]:
    """While it is active, ``torch.compiler.is_compiling()`` is true, as inside torch.compile/torch.export."""
    present = [f for f in _FLAGS if hasattr(torch.compiler, f)]
    old = {f: getattr(torch.compiler, f) for f in present}
    try:
        for f in present:
            setattr(torch.compiler, f, True)
        yield
    finally:
        for f, v in old.items():
            setattr(torch.compiler, f, v)


_LOCK = threading.Lock()
_PATCHES: dict[tuple[int, str], list] = {}  # (owner, name) -> [patches active, torch's own attribute or None]


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` is ``replacement`` while any capture (on any thread) is inside this; torch's own after. The
    replacement must hand calls that are not its thread's capture's to torch's own."""
    key = (id(owner), name)
    with _LOCK:
        entry = _PATCHES.setdefault(key, [0, owner.__dict__.get(name)])
        entry[0] += 1
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _PATCHES[key]
                if entry[1] is None:
                    delattr(owner, name)  # it was inherited (torch._C.TensorBase's)
                else:
                    setattr(owner, name, entry[1])


_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_


def requires_grad_marks_ignored(applies: Callable[[], bool]) -> contextlib.AbstractContextManager:
    """While active, ``t.requires_grad_()`` on a tensor of this thread's trace (``applies()``: this thread is
    capturing) returns ``t`` as it is."""

    def requires_grad_(self, requires_grad: bool = True):
        if applies() and torch._C._functorch.is_functorch_wrapped_tensor(self):
            return self
        return _REQUIRES_GRAD_(self, requires_grad)

    return patched(torch.Tensor, "requires_grad_", requires_grad_)


_REGIONS = threading.local()  # .count: checkpoint regions met so far by this thread's capture


# The generator torch.utils.checkpoint runs a non-reentrant region's function inside (torch 2.14 calls the
# second name; the first is kept for other callers). A torch release with neither, or without node annotations,
# leaves regions unmarked: their activations are kept, as without checkpointing.
_ANNOTATE = getattr(fx_traceback, "annotate", None)
_GENERATORS = {name: getattr(torch.utils.checkpoint, name) for name in (
    "_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
    if hasattr(torch.utils.checkpoint, name)}


@contextlib.contextmanager
def checkpoint_region() -> Iterator[None]:
    """The ops traced inside are marked with the number of a new activation-checkpoint region."""
    _REGIONS.count = getattr(_REGIONS, "count", 0) + 1
    with _ANNOTATE({CHECKPOINT_REGION: _REGIONS.count}) if _ANNOTATE else contextlib.nullcontext():
        yield


def checkpoint_regions_so_far() -> int:
    """How many checkpoint regions this thread's capture has met."""
    return getattr(_REGIONS, "count", 0)


def skip_checkpoint_regions(n: int) -> None:
    """Count ``n`` regions as met (a copied layer's, capture.repeated): later ones are numbered as in a trace."""
    _REGIONS.count = checkpoint_regions_so_far() + n


@contextlib.contextmanager
def checkpoint_regions_marked(applies: Callable[[], bool]) -> Iterator[None]:
    """While active, the traced nodes keep their annotations, and ``torch.utils.checkpoint(...,
    use_reentrant=False)`` on this thread's trace (``applies()``) runs its function in a :func:`checkpoint_region`
    (its saved-tensor hooks, which the trace would not keep, are not installed)."""

    def around_the_forward(torchs):
        def generator(*args, **kwargs):  # checkpoint runs its function between this generator's two steps
            if not applies():
                yield from torchs(*args, **kwargs)
                return
            with checkpoint_region():
                yield

        return generator

    _REGIONS.count = 0
    with contextlib.ExitStack() as stack:
        if _ANNOTATE is not None and _GENERATORS:
            stack.enter_context(fx_traceback.preserve_node_meta())
            for name, torchs in _GENERATORS.items():
                stack.enter_context(patched(torch.utils.checkpoint, name, around_the_forward(torchs)))
        yield


@contextlib.contextmanager
def module_paths_marked(root: torch.nn.Module | None, applies: Callable[[], bool]) -> Iterator[None]:
    """While active, the ops traced inside a submodule of ``root`` on this thread's trace (``applies()``) are
    annotated with the submodule's path in ``root`` (the innermost one's): plans are read per layer by it. A torch
    release without node annotations leaves them unmarked."""
    if _ANNOTATE is None or root is None:
        yield
        return
    paths = {id(m): name for name, m in root.named_modules() if name}
    entered: list[tuple[torch.nn.Module, contextlib.AbstractContextManager]] = []

    def enter(module, _args):
        if applies() and id(module) in paths:
            annotation = _ANNOTATE({MODULE_PATH: paths[id(module)]})
            annotation.__enter__()
            entered.append((module, annotation))

    def leave(module, _args, _out):
        if entered and entered[-1][0] is module:
            entered.pop()[1].__exit__(None, None, None)

    enter._shardfn_own = leave._shardfn_own = True
    with contextlib.ExitStack() as stack:
        stack.enter_context(fx_traceback.preserve_node_meta())
        stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(enter).remove)
        stack.callback(torch.nn.modules.module.register_module_forward_hook(leave).remove)
        try:
            yield
        finally:
            while entered:  # a forward that raised leaves its annotations open
                entered.pop()[1].__exit__(None, None, None)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def own_global_hooks() -> bool:
    """Whether every global module hook is capture's own (:func:`module_paths_marked`'s)."""
    module = torch.nn.modules.module
    return all(getattr(h, "_shardfn_own", False) for name in _GLOBAL_HOOKS
               for h in getattr(module, name, {}).values())
