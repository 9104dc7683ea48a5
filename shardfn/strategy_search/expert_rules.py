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
from . import cost_model as cm
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
# experts' share of every token, the output (and the gradients of the tokens and routing weights) pending sums;
# tokens and experts split over one mesh dim send each (token, slot) pair to the rank holding its expert and back
# (exec.expert_dispatch: run mode "dispatch", over one mesh dim a call)
_MOE_CHOICES = [
    ((R,), (R,) * 6),
    ((Shard(0),), (Shard(0),) * 3 + (R,) * 3),  # tokens
    ((Partial(),), (R,) * 3 + (Shard(0),) * 3),  # experts
    ((Shard(0),), (Shard(0),) * 6),  # dispatch
]


def dispatch_dims(inputs) -> tuple[int, ...]:
    """The mesh dims over which a MoEExperts call's layouts (its inputs' placements) split both its tokens and its
    experts: there each pair is sent to its expert's rank (all_to_all), not computed where the tokens are."""
    tokens, experts = inputs[EXPERT_INPUTS[MoEExperts][0]], inputs[EXPERT_INPUTS[MoEExperts][1]]
    return tuple(m for m, (t, e) in enumerate(zip(tokens, experts)) if t == Shard(0) and e == Shard(0))


@register_rule(MoEExperts)
def _moe_experts(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    found = []
    for c in _valid(node, mesh, _MOE_CHOICES):
        dims = dispatch_dims(c.inputs)
        # one group a call (over two dims at once it would be their flattened group's), of more than one rank
        if len(dims) <= 1 and all(mesh.shape[m] > 1 for m in dims):
            found.append(Candidate(c.outputs, c.inputs, "dispatch") if dims else c)
    return found


def dispatch_collectives(node: torch.fx.Node, cand: Candidate, mesh_shape, grad: bool) -> tuple[list, list]:
    """(forward, backward) collectives a ``dispatch`` candidate of MoEExperts runs inside its call, over its
    dispatch mesh dim (exec.expert_dispatch): each way the group's experts (small) and the counts, forward the
    pairs' token rows out (with each pair's expert and weight) and their results back, backward the token rows
    with their gradients out and the tokens' and weights' gradients back. A pair goes out where the group holds
    its expert: every pair, but where the experts are split along other mesh dims too (a share of them then)."""
    (m,) = dispatch_dims(cand.inputs)
    hidden, index, weights = (a.meta["val"] for a in tensor_inputs(node)[:3])
    n, others = mesh_shape[m], 1
    for j, p in enumerate(cand.inputs[EXPERT_INPUTS[MoEExperts][1]]):
        others *= mesh_shape[j] if j != m and p == Shard(0) else 1
    pairs = n * cm.local_numel(index.shape, cand.inputs[1], mesh_shape) // others  # the group's, all ranks'
    rows = pairs * hidden.size(1) * hidden.element_size()
    small = [cm.CommOp("all_gather", m, 16 * n), cm.CommOp("all_to_all", m, 8 * n * n)]
    routing = pairs * (index.element_size() + weights.element_size())
    fwd = [*small, cm.CommOp("all_to_all", m, rows + routing), cm.CommOp("all_to_all", m, rows)]
    bwd = [*small, cm.CommOp("all_to_all", m, 2 * rows + routing),
           cm.CommOp("all_to_all", m, rows + pairs * weights.element_size())] if grad else []
    return fwd, bwd
