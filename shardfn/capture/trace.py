"""fn + example inputs -> CapturedGraph, traced with make_fx on fake tensors of the global shapes."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

from .graph import CapturedGraph, GraphInput

__all__ = ["CaptureError", "capture", "capturing", "check_not_transformed"]

_STATE = threading.local()

# batch norms whose schema does not declare that they update running_mean/var in place: functionalization would
# keep them as they are, and the update would land in whatever layout the plan gives those buffers (on a copy).
# Decomposed, the update is an explicit copy_ into the buffer, planned and run like any other write.
_HIDDEN_MUTATIONS = get_decompositions([
    torch.ops.aten.native_batch_norm, torch.ops.aten.cudnn_batch_norm, torch.ops.aten.miopen_batch_norm,
])


class CaptureError(RuntimeError):
    """``fn`` could not be traced into a graph (data-dependent control flow, an unsupported construct)."""


def capturing() -> bool:
    """True while some shard call is tracing its fn (a shard call inside it is then a nested misuse)."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _capture_scope():
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def check_not_transformed(tensors: Sequence[torch.Tensor], what: Callable[[], str]) -> None:
    """Reject tensors wrapped by torch.func transforms (vmap/grad around a sharded callable). ``what()`` names
    the callable (asked for only when there is an error)."""
    for t in tensors:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise TypeError(
                f"{what()} was called inside a torch.func transform (vmap, grad, jacrev, ...) applied around it. "
                "Sharded callables cannot be transformed from outside; put the transform inside fn instead: "
                "sf.shard(lambda x: torch.func.vmap(f)(x), ...)"
            )


def _user_frame(tb) -> str:
    """The innermost traceback frame outside torch and shardfn: the user's line that failed to trace."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    found = None
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith((torch_dir, here)) and "functorch" not in frame.filename:
            found = frame
    if found is None:
        return "<unknown location>"
    return f'File "{found.filename}", line {found.lineno}, in {found.name}: {found.line}'


def capture(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: dict[str, torch.Tensor] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
    call: Callable[..., Any] | None = None,
    device: str = "cpu",
) -> CapturedGraph:
    """Trace ``fn(*args, **kwargs)`` into an aten graph on fake tensors of the global shapes.

    ``args`` hold global-shape descriptions of the positional inputs: tensors (real, fake or meta: only shape,
    dtype and requires_grad are read) or constants. For a module, ``params``/``buffers`` are its state and
    ``call(state, *args, **kwargs)`` runs it with that state substituted; they become the first placeholders.
    """
    params, buffers = params or {}, buffers or {}
    inputs: list[GraphInput] = []
    for kind, state in (("param", params), ("buffer", buffers)):
        for i, (name, t) in enumerate(state.items()):
            inputs.append(GraphInput(kind, name, i, tuple(t.shape), t.dtype, bool(t.requires_grad)))
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in tensor_pos:
        a = args[i]
        inputs.append(GraphInput("input", f"input {i}", i, tuple(a.shape), a.dtype, bool(a.requires_grad)))

    n_params, n_buffers = len(params), len(buffers)
    names = list(params) + list(buffers)

    def flat_fn(*flat):
        state = dict(zip(names, flat[: n_params + n_buffers]))
        full_args = list(args)
        for pos, t in zip(tensor_pos, flat[n_params + n_buffers :]):
            full_args[pos] = t
        out = call(state, *full_args, **kwargs) if call is not None else fn(*full_args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        flat_fn.out_spec = spec
        return leaves

    fake_mode = FakeTensorMode()
    with fake_mode:
        fakes = [torch.empty(gi.shape, dtype=gi.dtype, device=device) for gi in inputs]
    try:
        with _capture_scope(), torch.no_grad(), fake_mode:
            # functionalized: in-place ops become out-of-place, so every node is a pure function of its inputs
            gm = make_fx(torch.func.functionalize(flat_fn), decomposition_table=_HIDDEN_MUTATIONS,
                         tracing_mode="real")(*fakes)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise CaptureError(
            f"shardfn could not trace {getattr(fn, '__qualname__', fn)}: its control flow or output shape depends "
            f"on tensor values ({e}).\n  at {_user_frame(sys.exc_info()[2])}\n"
            "Make the branch depend on shapes or Python values, use torch.where/torch.cond, or compute it "
            "outside the sharded function."
        ) from None
    except Exception as e:
        if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__:
            raise CaptureError(
                f"shardfn could not trace {getattr(fn, '__qualname__', fn)}: it depends on tensor values.\n"
                f"  at {_user_frame(sys.exc_info()[2])}"
            ) from e
        raise
    # identical ops on the same inputs (q, k and v each viewing the same normalised activations) become one node,
    # so the search sees one value with several readers; random ops are never merged
    result = CSEPass(banned_ops=get_CSE_banned_ops())(gm)
    gm = result.graph_module
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    constants = {i: v for i, v in enumerate(out_node.args[0]) if not isinstance(v, torch.fx.Node)}
    return CapturedGraph(gm, inputs, flat_fn.out_spec, constants)
