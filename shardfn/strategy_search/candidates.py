"""Per-node candidate placements.

Where they come from, first match wins:

1. shardfn's own rules (:mod:`.rules`), registered with :func:`register_rule` (ops DTensor has no right rule for)
   in the one registry of rules (:mod:`.registry`), which also keeps the candidates found between plans;
2. DTensor's registered op strategies, through :mod:`._dtensor_adapter`;
3. the replicated fallback (Paddle's replicated SPMD rule): every input and output replicated, the op run on
   whole tensors by every rank. Correct for any op, never parallel; the ops that use it are named in one warning.

Of these, candidates that leave a rank an empty piece the op refuses (MKL's FFT) are dropped (:mod:`.empty_pieces`).

A candidate's ``rule`` tells exec how to run it: ``"dtensor"`` through DTensor dispatch, ``"local"`` by running
the op on each rank's local shards (own rules and the fallback), ``"random"`` drawn whole and sliced,
``"input"``/``"factory"`` for values that are laid out, not computed from other tensors.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from .. import _pytree_internals as pytree
from ..capture.graph import is_seeded
from ._dtensor_adapter import dtensor_strategies, is_local_from_replicate, valid_placements
from .empty_pieces import runs_on_empty_pieces
from .registry import REGISTRY

__all__ = [
    "RANDOM_FILLS",
    "ReplicatedFallbackWarning",
    "Candidate",
    "input_candidates",
    "node_candidates",
    "register_check",
    "register_rule",
    "tensor_inputs",
    "warn_fallbacks",
]

aten = torch.ops.aten
Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Candidate:
    """One way to run a node: the placement of each output and the placement each tensor input must have."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    rule: str
    # backward: the output's gradient is summed from its readers as a pending sum and reduced once
    accumulate: bool = False


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued fx inputs in flat order (args then kwargs, lists flattened)."""
    leaves = pytree.graph_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _outputs_of(val: Any) -> list[torch.Tensor | None]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return [None]


# Random fills that read only their input's shape (drawn whole from the seed and sliced): the registry's table
RANDOM_FILLS = REGISTRY.random_fills()


# --- own rules ----------------------------------------------------------------------------------------------

# the registry's decorators (registry.register_rule, register_check), here too where they were first
register_rule = REGISTRY.register_rule
register_check = REGISTRY.register_check


def _per_mesh_dim(mesh: DeviceMesh, choices: list[tuple[Placements | None, tuple[Placement, ...]]], rule: str):
    """Expand single-mesh-dim choices (outputs, inputs) to every combination over the mesh dims."""
    out = []
    for combo in itertools.product(choices, repeat=mesh.ndim):
        n_out, n_in = len(combo[0][0]), len(combo[0][1])
        outs = tuple(tuple(c[0][i] for c in combo) if combo[0][0][i] is not None else None for i in range(n_out))
        ins = tuple(tuple(c[1][i] for c in combo) for i in range(n_in))
        out.append(Candidate(outs, ins, rule))
    return out


# --- assembling ---------------------------------------------------------------------------------------------

# DTensor's (and the own rules') answers per op, argument shapes and mesh are kept between plans by the registry
# (REGISTRY.candidates): one shared list per key, so identical layers share candidate lists (and what is priced
# per list)


def _key(node: torch.fx.Node, mesh: DeviceMesh):
    def meta(x):
        if isinstance(x, torch.fx.Node):
            v = x.meta.get("val")
            return ("T", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("N", repr(v))
        return x

    args = pytree.tree_map(meta, (node.args, node.kwargs))
    return (node.target, repr(args), tuple(mesh.shape))


def _meta_value(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


_PENDING_KINDS = ("sum", "max", "min", "product")


def _plannable(p: Placement, read: bool = False) -> bool:
    # Strided shards (a merged dim split over mesh dims out of order) are not carried through plans, and pending
    # averages lose their scaling in DTensor's backward (a replicated gradient is not divided by the ranks). Plans
    # carry pending sums (and embedding's masked sum), and pending maxima, minima and products (amax, aminmax, prod,
    # all over a split dim): DTensor's backward of those reads the reduced result, and a gradient reaches such a
    # pending value whole, as the gradient of the value it stands for. Those three only as a result (``read``
    # False): an op that reads one pending is not taken (DTensor's rules pass a pending maximum through monotone
    # ops, and torch 2.13's _fft_r2c rule through an FFT, which is wrong), so each is reduced before any op reads it.
    if type(p).__name__ == "_StridedShard":
        return False
    kind = getattr(p, "reduce_op", "sum")
    return not p.is_partial() or is_local_from_replicate(p) or kind == "sum" or (kind in _PENDING_KINDS and not read)


def _from_dtensor(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate] | None:
    args, kwargs = pytree.tree_map(_meta_value, (node.args, node.kwargs))
    found = dtensor_strategies(node.target, args, kwargs, mesh)
    if found is None:
        return None
    n_out = len(_outputs_of(node.meta["val"]))
    cands = []
    for out, ins in found:
        # Embedding's mask placement is reached from Replicate inside DTensor's dispatch: on the edge it is
        # Replicate. A pending-sum input (a bias added once to a row-parallel matmul) is reached from Replicate
        # inside the dispatch too, or arrives pending from its producer.
        outs = (out,) if n_out == 1 and (out is None or isinstance(out[0], Placement)) else tuple(out)
        if not (all(_plannable(p, read=True) for pl in ins for p in pl)
                and all(_plannable(p) for pl in outs if pl for p in pl)):
            continue
        ins = tuple(tuple(Replicate() if is_local_from_replicate(p) else p for p in pl) for pl in ins)
        cands.append(Candidate(outs, ins, "dtensor"))
    check = REGISTRY.check(node.target)
    if check is not None:
        cands = [c for c in cands if check(node, mesh, c)]
    return cands or None


def _replicated(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    rep = (Replicate(),) * mesh.ndim
    outs = tuple(rep if v is not None else None for v in _outputs_of(node.meta.get("val")))
    return [Candidate(outs, (rep,) * len(tensor_inputs(node)), "local")]


def _rules_say(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate] | None:
    """The candidates the rules give ``node`` (None: no rule)."""
    rule = REGISTRY.rule(node.target)
    if rule is not None:
        return rule(node, mesh)
    if is_seeded(node.target) and not REGISTRY.is_random_fill(node.target):
        return _replicated(node, mesh)
    if not tensor_inputs(node):
        # factory ops (zeros, arange, ...): made whole on every rank and sliced to any layout
        val = node.meta["val"]
        outs = valid_placements(val.shape, mesh) if isinstance(val, torch.Tensor) else [None]
        return [Candidate((o,), (), "factory") for o in outs]
    try:
        return _from_dtensor(node, mesh) if isinstance(node.target, torch._ops.OpOverload) else None
    except Exception:  # noqa: BLE001 - a rule that fails on these shapes: treat as no rule
        return None


def node_candidates(node: torch.fx.Node, mesh: DeviceMesh, fallbacks: set[str]) -> list[Candidate]:
    """Candidates of a call_function node. Ops that fall back to replication are added to ``fallbacks``."""
    cands = REGISTRY.candidates(_key(node, mesh), lambda: runs_on_empty_pieces(node, tensor_inputs(node), mesh,
                                                                                _rules_say(node, mesh)))
    if cands is None:
        fallbacks.add(str(node.target))
        return _replicated(node, mesh)
    return cands


def input_candidates(shape: tuple[int, ...], mesh: DeviceMesh) -> list[Candidate]:
    """A graph input the user left open: any Replicate/Shard layout of its shape (one shared list per shape)."""
    return REGISTRY.candidates(("input", tuple(shape), tuple(mesh.shape)),
                               lambda: [Candidate((p,), (), "input") for p in valid_placements(shape, mesh)])


class ReplicatedFallbackWarning(UserWarning):
    """Ops with no sharding rule run whole on every rank: correct, never parallel."""


def warn_fallbacks(fallbacks: set[str]) -> None:
    if fallbacks:
        warnings.warn(
            "shardfn: no sharding rule for " + ", ".join(sorted(fallbacks)) + "; these ops run replicated on "
            "every rank (correct, not parallel). Register a rule with "
            "shardfn.strategy_search.candidates.register_rule to shard them.",
            ReplicatedFallbackWarning,
            stacklevel=3,
        )


def replicated_candidates(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    """The replicated rule alone: every input and output whole, the op run on whole tensors by every rank."""
    return _replicated(node, mesh)

