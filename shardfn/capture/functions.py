"""Custom torch.autograd.Functions inside fn: each call captured as one node that calls the Function itself.

fn may call autograd.Functions: a custom activation, a straight-through estimator, a gradient reversal, a fused
kernel. Their gradient is the Function's own ``backward``, which tracing the forward's ops would lose (and torch's
functionalization refuses them). So while fn is captured each ``Function.apply`` becomes one node whose target
is a :class:`FunctionCall`; called with the call's tensors (at run time a rank's pieces), it calls the Function
itself, so autograd, and AOTAutograd's trace of a rank's backward, run its own backward. Capture also records the
ops its forward and its backward run at the captured shapes (``forward_ops``, ``backward_ops``); from them the
search tells a Function that is elementwise (it may run on pieces) from one that must run on whole tensors.

torch.utils.checkpoint's reentrant Function is traced through instead, its ops marked as a checkpoint region
(recomputing in backward is a memory choice, not a different gradient). A Function that writes into its input
(``ctx.mark_dirty``) is refused.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.fx

from .. import _pytree_internals as pytree
from ._function_internals import OpRecorder, applies_routed_to, is_reentrant_checkpoint, original_apply
from ._tracing import checkpoint_region
from .graph import CaptureError

__all__ = ["FunctionCall", "functions_as_calls", "functions_as_targets", "substitute_function"]

_STATE = threading.local()  # .calls: the FunctionCall of each call so far in the capture running on this thread
# Function class name -> fn(*args, **kwargs) captured in its place (same result, a form the search can split)
_SUBSTITUTES: dict[str, Any] = {}


def substitute_function(name: str, fn) -> None:
    """While fn is captured, calls of the Function class named ``name`` run ``fn(*args, **kwargs)`` instead."""
    _SUBSTITUTES[name] = fn


class FunctionCall:
    """The target of a captured Function's node: ``call(*tensors)`` calls ``function.apply`` with the call's
    other arguments as they were at capture, and returns the tensors of its result in pytree order."""

    def __init__(self, function: type, spec: pytree.TreeSpec, leaves: list, tensor_at: list[int]):
        self.function = function
        self.__name__ = f"{function.__name__}_apply"  # how the graph's code names it
        self._spec, self._leaves, self._tensor_at = spec, leaves, tensor_at
        self._out: tuple[pytree.TreeSpec, list] | None = None  # the result's structure, tensors left out
        # (op, args, kwargs, out) of each aten op forward and backward ran at the captured shapes, tensors as
        # meta tensors; backward_ops None where backward could not run on fake tensors
        self.forward_ops: list[tuple] = []
        self.backward_ops: list[tuple] | None = None

    def arguments(self, tensors) -> tuple[tuple, dict]:
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self._spec)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        args, kwargs = self.arguments(tensors)
        return [t for t in pytree.tree_leaves(self.function.apply(*args, **kwargs)) if isinstance(t, torch.Tensor)]

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"

    # -- capture ----------------------------------------------------------------------------------------------

    def _trace_forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The result's tensors on fake inputs (no autograd here), its structure kept for :meth:`_result`."""
        args, kwargs = self.arguments(tensors)
        try:
            out = original_apply(self.function, args, kwargs)
        except Exception as e:
            raise _capture_error(
                f"shardfn could not run {self!r} on fake tensors of the call's shapes ({type(e).__name__}: {e}). "
                "A Function whose forward calls a kernel torch cannot run on fake tensors (Triton, a C++ "
                "extension) needs a fake implementation: wrap the kernel with torch.library.custom_op and give it "
                "register_fake."
            ) from e
        leaves, spec = pytree.tree_flatten(out)
        self._out = (spec, [None if isinstance(x, torch.Tensor) else x for x in leaves])
        return [x.clone() for x in leaves if isinstance(x, torch.Tensor)]  # an op's results alias no input

    def _result(self, tensors: list[torch.Tensor]) -> Any:
        spec, leaves = self._out
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if x is None else x for x in leaves], spec)

    def _record_ops(self, vals: list[torch.Tensor]) -> None:
        """Run forward and backward on fakes of ``vals`` (in their fake mode), recording their ops."""
        inputs = []
        for v in vals:
            t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            inputs.append(t.requires_grad_().clone() if v.is_floating_point() or v.is_complex() else t)
        args, kwargs = self.arguments(inputs)
        versions = [t._version for t in inputs]
        recorder = OpRecorder()
        with torch.enable_grad(), recorder:
            out = original_apply(self.function, args, kwargs)
        self.forward_ops = recorder.ops
        if [t._version for t in inputs] != versions:
            raise _capture_error(
                f"{self!r} writes into its input (ctx.mark_dirty): shardfn runs a Function on the pieces the plan "
                "gives it, where a write would land on a copy. Return a new tensor instead of writing in place.")
        outs = out if isinstance(out, tuple) else (out,)
        ctx = next((o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
        if ctx is None:  # no gradient flows through it
            self.backward_ops = []
            return
        grads = [torch.empty_like(o) if isinstance(o, torch.Tensor) else None for o in outs]
        recorder = OpRecorder()
        try:
            with torch.no_grad(), recorder:
                self.function.backward(ctx, *grads)
            self.backward_ops = recorder.ops
        except Exception:  # noqa: BLE001 - a backward that fakes cannot run: its ops stay unknown (run whole)
            self.backward_ops = None


def _capture_error(message: str) -> Exception:
    return CaptureError(message)


class _VmappedCall(FunctionCall):
    """A Function call under torch.func.vmap inside fn: the Function called on each sample (its tensors' slices
    at their batch dims), the results stacked, which is what vmap of it means. (torch runs a Function under vmap
    as a higher-order op that neither fake tensors nor AOTAutograd's trace take.) Its backward is not recorded:
    the call runs whole."""

    def __init__(self, inner: FunctionCall, dims: tuple[int | None, ...]):
        self.inner, self.dims, self.function = inner, dims, inner.function
        self.__name__ = f"vmap_{inner.__name__}"
        self.forward_ops, self.backward_ops = [], None

    def _per_sample(self, run, tensors) -> list[torch.Tensor]:
        n = next(t.shape[d] for t, d in zip(tensors, self.dims) if d is not None)
        samples = [run([t if d is None else t.select(d, b) for t, d in zip(tensors, self.dims)]) for b in range(n)]
        return [torch.stack(outs) for outs in zip(*samples)]

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self._per_sample(lambda ts: self.inner(*ts), tensors)

    def __repr__(self) -> str:
        return f"vmap({self.inner!r})"

    def _trace_forward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._per_sample(self.inner._trace_forward, tensors)

    def _record_ops(self, vals: list[torch.Tensor]) -> None:
        recorder = OpRecorder()
        with torch.no_grad(), recorder:
            self(*(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals))
        self.forward_ops = recorder.ops


def _routed(cls: type, args: tuple, kwargs: dict) -> Any:
    """``cls.apply(*args, **kwargs)`` while Function.apply is routed: inside this thread's capture one node."""
    calls = getattr(_STATE, "calls", None)
    if calls is None:
        return original_apply(cls, args, kwargs)
    if cls.__name__ in _SUBSTITUTES:
        return _SUBSTITUTES[cls.__name__](*args, **kwargs)
    if is_reentrant_checkpoint(cls):
        function, _preserve_rng_state, *inputs = args
        with checkpoint_region():
            return function(*inputs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_at]
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    # identical calls (a layer's activation in every layer) share one target: the search then shares their
    # candidates and edge costs as it does for identical ops
    key = (cls, str(spec), repr(constants), tuple((tuple(t.shape), t.dtype) for t in tensors))
    call = _STATE.interned.get(key)
    if call is None:
        call = _STATE.interned[key] = FunctionCall(cls, spec, constants, tensor_at)
    calls.append(call)
    # each call its own number: two calls on the same inputs stay two nodes (a Function may draw random numbers)
    return call._result(_opaque_call(tensors, len(calls) - 1))


@torch.library.custom_op("shardfn::autograd_function", mutates_args=())
def _opaque_call(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    raise RuntimeError("shardfn::autograd_function stands for a Function call only while fn is captured")


@_opaque_call.register_fake
def _(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    calls = _STATE.calls
    _STATE.calls = None  # Functions the forward itself calls run as they are
    try:
        return calls[call]._trace_forward(tensors)
    finally:
        _STATE.calls = calls


@_opaque_call.register_vmap
def _(info, in_dims, tensors: list[torch.Tensor], call: int):
    # torch.func.vmap inside fn around a Function call: one call of the vmapped Function on the batched tensors
    calls = _STATE.calls
    calls.append(_VmappedCall(calls[call], tuple(in_dims[0])))
    outs = _opaque_call(list(tensors), len(calls) - 1)
    return outs, [0] * len(outs)


@contextlib.contextmanager
def functions_as_calls() -> Iterator[list[FunctionCall]]:
    """Context of one capture: each Function.apply inside it becomes one opaque call. Yields the list of the
    calls' FunctionCalls, indexed by the call number each node carries."""
    saved = getattr(_STATE, "calls", None), getattr(_STATE, "interned", None)
    _STATE.calls, _STATE.interned = [], {}
    try:
        with applies_routed_to(_routed):
            yield _STATE.calls
    finally:
        _STATE.calls, _STATE.interned = saved


def functions_as_targets(gm: torch.fx.GraphModule, calls: list[FunctionCall], fake_mode) -> None:
    """The opaque call nodes of a captured graph become calls of their FunctionCall with the tensors as arguments,
    and each FunctionCall records the ops of its forward and backward (once, at the captured shapes)."""
    recorded: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.shardfn.autograd_function.default:
            continue
        tensors, number = node.args
        call = calls[number]
        node.target, node.args = call, tuple(tensors)
        if id(call) not in recorded:
            recorded.add(id(call))
            with fake_mode:
                call._record_ops([t.meta["val"] for t in tensors])
    if calls:  # (a big model's graph takes a while to compile into code)
        gm.recompile()
