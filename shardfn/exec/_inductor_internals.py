"""The Inductor internals exec uses to compile each rank's traced graphs (private torch API, kept here alone): its
decomposition table, its graph compiler (with the layouts AOTAutograd traced, inside a tracing context its FX
graph cache can key), and whether that cache served the graph."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx

__all__ = ["compile_graph", "decompositions"]


def decompositions() -> dict:
    """The ops Inductor decomposes before it lowers (as under torch.compile)."""
    import torch._inductor.lowering  # noqa: F401 - some of its decompositions consult it
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[Callable, bool]:
    """Inductor's code for ``gm`` (boxed), and whether its FX graph cache (on disk) served it: an identical graph,
    from an identical layer or an earlier process, is loaded instead of compiled. The backward graph takes the
    saved tensors in the strides AOTAutograd traced: Inductor may not choose other layouts for them
    (channels-last convolutions), as it can under torch.compile, which tells the backward what the forward chose."""
    import torch._inductor.config
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx_inner

    hits = counters["inductor"]["fxgraph_cache_hit"]
    with torch._inductor.config.patch(layout_optimization=False), _tracing_context(gm):
        compiled = compile_fx_inner(gm, example_inputs)
    return compiled, counters["inductor"]["fxgraph_cache_hit"] > hits


def _tracing_context(gm: torch.fx.GraphModule) -> Any:
    """A tracing context around Inductor's compile of ``gm``: its FX graph cache keys a graph by the guards of the
    context's shape environment, and without one compiles every graph again (identical layers, later processes).
    AOTAutograd traced with static shapes, in a fake mode with no shape environment: it gets an empty one (no
    symbols, no guards), which changes nothing else."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    if TracingContext.try_get() is not None or fake is None:
        return contextlib.nullcontext()
    if fake.shape_env is None:
        fake.shape_env = ShapeEnv()
    return tracing(TracingContext(fake))
