"""The torch internals exec uses to run traced graphs as AOTAutograd runs them (private torch API, kept here
alone): the "boxed" calling convention, where a graph takes one list of its inputs and empties it as it reads
them, so each input is freed after its last use inside the graph instead of living until the graph returns;
releasing a backward's saved tensors into that list; whether a buffer's memory is held by anything else; the
node annotations that carry an activation-checkpoint region from the captured graph into AOTAutograd's; and
the effect mark that keeps linear algebra's error checks in traced graphs."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from ..capture.graph import CHECKPOINT_REGION

__all__ = ["annotated_as", "boxed_graph", "held_elsewhere", "in_region", "keep_linalg_error_checks",
           "keeping_annotations", "release_saved"]


def keep_linalg_error_checks() -> None:
    """Mark ``aten._linalg_check_errors`` effectful where this torch does not (2.11), as later releases do: it has
    no output, so AOTAutograd's dead-code pass dropped it and a singular matrix was solved into infs instead of
    raising as eager does (torch.compile on 2.11 drops it too)."""
    from torch._higher_order_ops.effects import _EffectType, _get_effect, _register_effectful_op

    op = torch.ops.aten._linalg_check_errors.default
    if _get_effect(op) is None:
        _register_effectful_op(op, _EffectType.ORDERED)


def boxed_graph(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    """``gm`` as a function of one list of its inputs, which it clears (AOTAutograd's convention: the
    ``_boxed_call`` mark; ``.graph``: the graph it runs). Where this torch has no boxed code generation, the inputs
    live until it returns."""
    # gm.forward, not gm(): a graph is no module of the user's, and module hooks (CommDebugMode's tracker)
    # would read the list it empties
    try:
        from torch.fx.graph import _BoxedCodeGen
    except ImportError:
        def run(args: list) -> Any:
            return gm.forward(*args)
    else:
        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()

        def run(args: list) -> Any:
            return gm.forward(args)
    run._boxed_call, run.graph = True, gm
    return run


def release_saved(ctx: Any) -> None:
    """Drop the tensors ``ctx`` saved for backward, unless the backward now running keeps the graph
    (retain_graph): the caller holds them in the list it hands a boxed graph, which frees each after its last
    use (as AOTAutograd's own backward does)."""
    ctx.maybe_clear_saved_tensors()


def held_elsewhere(buffer: torch.Tensor) -> bool:
    """Does anything but ``buffer`` itself hold its memory (a view of it handed out earlier, still alive)? Where
    this torch cannot tell, yes."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return True
    return count(buffer.untyped_storage()._cdata) > 2  # buffer's own tensor, and the storage object asked here


def keeping_annotations() -> contextlib.AbstractContextManager:
    """While a function is traced inside it, the nodes traced keep the annotations of :func:`annotated_as`."""
    return fx_traceback.preserve_node_meta()


# the annotation of the nodes that make a value whole and lay it out (NodePlan.run "whole": passes.keep_pieces)
MADE_WHOLE = "shardfn_made_whole"


def made_whole() -> contextlib.AbstractContextManager:
    """The nodes traced inside carry MADE_WHOLE (with the annotations they carry already)."""
    return fx_traceback.annotate({MADE_WHOLE: True}) if hasattr(fx_traceback, "annotate") else contextlib.nullcontext()


def annotated_as(node: torch.fx.Node, region: int | None = None) -> contextlib.AbstractContextManager:
    """The nodes traced inside carry ``node``'s annotations (``meta["custom"]``: its checkpoint region), the
    checkpoint region ``region`` where one is given (a region the plan recomputes, or a user's renumbered)."""
    custom = node.meta.get("custom")
    if region is not None:
        custom = {**(custom or {}), CHECKPOINT_REGION: region}
    return fx_traceback.annotate(custom) if custom and hasattr(fx_traceback, "annotate") else contextlib.nullcontext()


@contextlib.contextmanager
def in_region(region: int) -> Iterator[None]:
    """Inside an fx Interpreter's run of a node (whose meta is the current one): the nodes traced carry checkpoint
    region ``region``. The current meta's annotations are copied first: they are the node's own dict."""
    meta = fx_traceback.get_current_meta()
    if not hasattr(fx_traceback, "annotate") or meta is None:
        yield
        return
    had = "custom" in meta
    own = meta.get("custom")
    meta["custom"] = dict(own or {})
    try:
        with fx_traceback.annotate({CHECKPOINT_REGION: region}):
            yield
    finally:
        if had:
            meta["custom"] = own
        else:
            meta.pop("custom", None)
