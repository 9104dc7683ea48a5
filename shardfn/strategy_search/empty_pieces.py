"""Candidates that leave a rank an empty piece, kept only where the op runs on one.

A dim split unevenly can leave a rank nothing (5 rows over 4 ranks: 2, 2, 1, 0). Most kernels take an empty tensor;
some refuse it (MKL's FFT: "Inconsistent configuration parameters"), and then that rank alone raises while the
others wait in the next collective (on gloo, "Connection closed by peer"). Rather than keep a list of such kernels,
the op is run once, at planning, on real tensors of the empty rank's local shapes (the result remembered per op
and shapes): a candidate whose empty piece the op refuses is dropped, so the plan gives no rank an empty piece
there (another split, or the op run whole). Every rank plans alike, so none runs the layout another refuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh

from .. import _pytree_internals as pytree
from .._simulation_internals import not_simulated
from ..capture.graph import is_seeded
from ._dtensor_adapter import local_shapes
from .registry import REGISTRY

__all__ = ["runs_on_empty_pieces"]

# a probe allocates the empty rank's other pieces: bounded, beyond it the candidate is kept untried
_MAX_PROBE_ELEMENTS = 1 << 20
_RUNS = REGISTRY.memo("runs_on_empty_pieces", 1024)  # (op, argument shapes) -> whether the op runs on them


def _maybe_empty(shape, placements, mesh: DeviceMesh) -> bool:
    """Whether some split dim of ``shape`` may leave a piece empty: torch.chunk's pieces of s rows over n ranks
    hold ceil(s / n) each, so the last is empty where n - 1 of them already hold all s (checked exactly only then:
    a plan for many ranks has many uneven splits and few empty pieces)."""
    counts: dict[int, int] = {}
    for m, p in enumerate(placements):
        d = getattr(p, "dim", None)
        if d is not None and p.is_shard():
            counts[d] = counts.get(d, 1) * mesh.shape[m]
    return any(n > 1 and -(-shape[d] // n) * (n - 1) >= shape[d] for d, n in counts.items())


def _empty_rank(node: torch.fx.Node, inputs: list, cand, mesh: DeviceMesh) -> tuple[list, list] | None:
    """The inputs' local shapes on the first rank holding an empty piece of an input or output of ``cand``, and on
    rank 0 (None: every rank's pieces hold elements, or the values hold none anyway)."""
    vals = node.meta.get("val")
    outs = [vals] if isinstance(vals, torch.Tensor) else [v for v in (vals or ()) if isinstance(v, torch.Tensor)]
    if len(cand.inputs) != len(inputs) or any(t.numel() == 0 for t in inputs + outs):
        return None
    pairs = (*zip(inputs, cand.inputs), *zip(outs, cand.outputs))
    if not any(_maybe_empty(t.shape, pl, mesh) for t, pl in pairs if pl):
        return None
    per_input = [local_shapes(t.shape, pl, mesh) for t, pl in zip(inputs, cand.inputs)]
    per_output = [local_shapes(t.shape, pl, mesh) for t, pl in zip(outs, cand.outputs) if pl is not None]
    for rank in range(mesh.size()):
        if any(math.prod(shapes[rank]) == 0 for shapes in per_input + per_output):
            return [shapes[rank] for shapes in per_input], [shapes[0] for shapes in per_input]
    return None


def _runs(node: torch.fx.Node, shapes: list[tuple[int, ...]]) -> bool:
    """Whether ``node``'s op runs on real CPU tensors of ``shapes`` (zeros; its other arguments as they are)."""
    if sum(math.prod(s) for s in shapes) > _MAX_PROBE_ELEMENTS:
        return True
    it = iter(shapes)

    def real(x: Any) -> Any:
        if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
            v = x.meta["val"]
            return torch.zeros(next(it), dtype=v.dtype)
        return x

    try:
        with not_simulated(), torch.no_grad():  # ordinary tensors, also inside a simulated world
            args, kwargs = pytree.tree_map(real, (node.args, node.kwargs))
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any refusal: the op cannot run on this rank's pieces
        return False
    return True


def runs_on_empty_pieces(node: torch.fx.Node, inputs: list[torch.fx.Node], mesh: DeviceMesh,
                         cands: list | None) -> list | None:
    """``cands`` (of ``node``, whose tensor inputs are ``inputs``) less those leaving a rank an empty piece the op
    refuses (None stays None; none left: None)."""
    if not cands or not isinstance(node.target, torch._ops.OpOverload) or \
            is_seeded(node.target):  # a probe would draw from the generator
        return cands
    vals = [a.meta["val"] for a in inputs]
    kept = []
    for cand in cands:
        found = _empty_rank(node, vals, cand, mesh)
        # refused only where the op runs on rank 0's pieces and not on the empty one's: an op given global sizes
        # (a view's) fails on both, and DTensor's dispatch hands it local ones
        if found is not None and _probed(node, found[1]) and not _probed(node, found[0]):
            continue
        kept.append(cand)
    return kept or None


def _probed(node: torch.fx.Node, shapes: list) -> bool:
    key = (node.target, _described(node), tuple(shapes))
    return _RUNS.get(key, lambda: _runs(node, shapes))


def _described(node: torch.fx.Node) -> str:
    """The node's arguments with tensors as their dtypes (what a probe depends on besides the shapes)."""
    return repr(pytree.tree_map(lambda x: x.meta["val"].dtype if isinstance(x, torch.fx.Node) and isinstance(
        x.meta.get("val"), torch.Tensor) else x, (node.args, node.kwargs)))
