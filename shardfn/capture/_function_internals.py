"""torch's autograd.Function machinery as capture uses it (private torch API, kept here alone): routing
``Function.apply`` while fn is traced, torch.utils.checkpoint's reentrant Function, and a dispatch mode that
records the ops a Function runs."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from ._tracing import patched
from .. import _pytree_internals as pytree

__all__ = ["OpRecorder", "applies_routed_to", "is_reentrant_checkpoint", "original_apply"]

_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod every Function inherits


def original_apply(cls: type, args: tuple, kwargs: dict) -> Any:
    """``cls.apply(*args, **kwargs)`` as torch defines it, whatever is routed."""
    return _APPLY.__get__(None, cls)(*args, **kwargs)


def applies_routed_to(handler: Callable[[type, tuple, dict], Any]) -> contextlib.AbstractContextManager:
    """While active, every ``Function.apply`` calls ``handler(cls, args, kwargs)``, on every thread: the handler
    calls :func:`original_apply` where the call is not its own (another thread's)."""

    def apply(cls, *args, **kwargs):
        return handler(cls, args, kwargs)

    return patched(torch.autograd.Function, "apply", classmethod(apply))


def is_reentrant_checkpoint(cls: type) -> bool:
    """torch.utils.checkpoint's reentrant Function: apply(function, preserve_rng_state, *args)."""
    return cls is getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _as_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        with unset_fake_temporarily():  # a plain meta tensor, not one of the fake mode's
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    return x


class OpRecorder(TorchDispatchMode):
    """Records each op run inside it that computes tensors (not metadata queries such as a tensor's device):
    (op, args, kwargs, out), tensors as meta tensors of their shapes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out)):
            self.ops.append((func, *pytree.tree_map(_as_meta, (args, kwargs, out))))
        return out


def autograd_inside_an_op():
    """A context where autograd records again inside a custom op's implementation (which torch runs with the
    autograd dispatch keys excluded): the op computes its gradient with autograd on its own real tensors."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "AutogradFunctionality", "ADInplaceOrView"):
        if hasattr(C.DispatchKey, key):
            exclude = exclude.remove(getattr(C.DispatchKey, key))
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)
