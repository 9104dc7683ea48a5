"""Sharding rules for mixture-of-experts layers: expert parallelism as a placement.

The grouped expert matmul (:class:`shardfn.capture.experts.ExpertMM`: x (S, K) rows sorted by expert, w (E, K, N),
bounds (E, 2) each expert's [start, end) rows) runs per mesh dim as one of:

  experts : w and bounds split on the expert dim, x whole. Each rank computes its experts' rows (zeros in the
            others): the result is their sum, a pending sum (reduced, or reduce-scattered to the tokens' split, where
            the plan reads it). The gradient of x is pending the same way, w's is split as w. With the tokens split
            over the same mesh dim before the routing, that is all-gather of the tokens, each rank's experts, and a
            reduce-scatter back (Megatron's all-gather token dispatcher): exact and dropless.
  columns : w split on N, x whole: the result split on its last dim (tensor parallelism inside each expert).
  rows    : w split on K, x split on its last dim: a pending sum.
  whole   : everything replicated.

Proven against running the op on each rank's pieces, forward and backward, by tests/strategy_search/
test_expert_rules.py.
"""

from __future__ import annotations

import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..capture.experts import ExpertMM, MoEExperts
from ._dtensor_adapter import valid_placements
from .candidates import Candidate, _per_mesh_dim, tensor_inputs
from .registry import register_rule

R = Replicate()

_CHOICES = [
    ((R,), (R, R, R)),
    ((Partial(),), (R, Shard(0), Shard(0))),  # experts
    ((Shard(1),), (R, Shard(2), R)),  # columns
    ((Partial(),), (Shard(1), Shard(1), R)),  # rows
]


def _valid(node: torch.fx.Node, mesh: DeviceMesh, choices: list) -> list[Candidate]:
    """``choices`` per mesh dim (run on the local pieces), those whose inputs' placements fit their shapes."""
    valid = [set(valid_placements(a.meta["val"].shape, mesh)) for a in tensor_inputs(node)]
    return [c for c in _per_mesh_dim(mesh, choices, "local") if all(pl in ok for pl, ok in zip(c.inputs, valid))]


@register_rule(ExpertMM)
def _expert_mm(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    return _valid(node, mesh, _CHOICES)


def expert_dims(cand: Candidate) -> tuple[int, ...]:
    """The mesh dims over which a candidate of ExpertMM splits the experts."""
    return tuple(m for m, p in enumerate(cand.inputs[1]) if isinstance(p, Shard) and p.dim == 0)


# each experts op's inputs: the position of its tokens and of its (first) expert weights
EXPERT_INPUTS = {MoEExperts: (0, 4), ExpertMM: (0, 1)}


def dispatches_tokens(node: torch.fx.Node, cand: Candidate, mesh_dims) -> bool:
    """Whether ``cand``, a candidate of an experts op, splits the experts over every one of ``mesh_dims``: there
    the tokens it reads whole are dispatched to the ranks holding their experts (their sum comes back split where
    it is read so), not gathered to run whole: data parallelism over those dims is kept."""
    target = getattr(getattr(node, "target", None), "function", None)
    if target not in EXPERT_INPUTS:
        return False
    weight = EXPERT_INPUTS[target][1]
    return all(isinstance(cand.inputs[weight][m], Shard) and cand.inputs[weight][m].dim == 0
                                      for m in mesh_dims)


# MoEExperts (hidden (T, H), top-k index and weights (T, k), the experts' global ids (E,), gate_up (E, 2I, H),
# down (E, H, I)): tokens are independent, so a token split runs on its pieces; split experts give each rank its
# experts' share of every token, the output (and the gradients of the tokens and routing weights) pending sums.
_MOE_CHOICES = [
    ((R,), (R,) * 6),
    ((Shard(0),), (Shard(0),) * 3 + (R,) * 3),  # tokens
    ((Partial(),), (R,) * 3 + (Shard(0),) * 3),  # experts
]


@register_rule(MoEExperts)
def _moe_experts(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    return _valid(node, mesh, _MOE_CHOICES)
