"""The strategy problem of one captured graph: a decision per value, its candidates, and where its inputs come from.

Every placeholder, every op node and the graph's output is one decision; getitem nodes follow their producer.
User constraints (in_strategy, parameter_plan, DTensor inputs, out_strategy) fix their decision to a single
candidate, so the solver propagates them. Values computed from nothing the caller lays out (constants the graph
holds, module buffers, which stay whole) are computed whole on every rank: they tie no layers together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from .. import _pytree_internals as pytree
from ..capture.graph import CapturedGraph, checkpoint_region, is_getitem
from . import cost_model as cm
from .candidates import (
    Candidate,
    input_candidates,
    node_candidates,
    replicated_candidates,
    tensor_inputs,
    warn_fallbacks,
)
from .registry import REGISTRY
from .request import PlanRequest

__all__ = ["REDUCTIONS", "Decision", "StrategyProblem", "build_problem", "computed_from", "splits"]

# the collectives whose results a region recomputed selectively keeps (StrategyProblem.keeps_reduced_for; exec
# reads the same kinds in its collectives' names)
REDUCTIONS = ("all_reduce", "reduce_scatter")

Placements = tuple[Placement, ...]


@dataclass
class Decision:
    node: torch.fx.Node | None  # None: the graph output sink
    name: str
    candidates: list[Candidate]
    # (producer decision, producer output index, fx node that carries the value) per tensor input slot
    sources: list[tuple[int, int, torch.fx.Node]]


@dataclass
class StrategyProblem:
    """The decisions of one graph, and what pricing them needs to know of its values."""

    captured: CapturedGraph
    mesh_shape: tuple[int, ...]
    decisions: list[Decision]
    needs_grad: set[torch.fx.Node]  # values whose gradient backward computes
    trainable: set[torch.fx.Node]  # parameters that get a gradient (and optimizer states)
    recomputed: frozenset[torch.fx.Node]  # values backward computes again (activation checkpointing)
    split_values: set[torch.fx.Node]  # values computed from inputs that stay split (data parallelism)
    fallbacks: set[str] = field(default_factory=set)  # ops run replicated for want of a rule
    # the region of each op of a region the search recomputes (the layer's path; :mod:`.recompute`): the
    # read-out's walk brings its values back where the backward enters it, as for a checkpointed one
    regions: dict[torch.fx.Node, str] = field(default_factory=dict)
    # of those regions, the ones recomputed selectively (their matmuls' and attention's results kept)
    selective: frozenset[str] = frozenset()
    # whether those keep what their collectives reduced too (levels 0 and 2; level 1 runs every one again)
    selective_keeps_reduced: bool = True

    def keeps_reduced_for(self, node: torch.fx.Node) -> bool:
        """Is ``node`` recomputed in a region recomputed selectively, which keeps what collectives reduced for it
        (an all-reduce's, a reduce-scatter's) and gathers and exchanges (all-to-all) again
        (exec.passes.recompute_checkpointed; gathered.reduced_copies)? Not at level 1: the least memory
        (Gemma-2-9B's level 1 on 8 x 8, its layers tried selectively first, walked 59.9 GiB a rank so, against
        10.3 running them again, and its search then kept no more of the regions it adds: 7.1 GiB, not 6.6)."""
        return self.selective_keeps_reduced and node in self.recomputed and self.regions.get(node) in self.selective

    def run_again(self, node: torch.fx.Node, ops: list) -> list:
        """Of the forward collectives ``ops`` (each with its ``kind``) that move ``node``'s operands, or are its
        own, those the backward runs again: every one where it is recomputed, all but its reductions where
        selectively (:meth:`keeps_reduced_for`), none where it is not."""
        if node not in self.recomputed:
            return []
        if not self.keeps_reduced_for(node):
            return list(ops)
        return [o for o in ops if o.kind not in REDUCTIONS]


class CandidateLists:
    """The candidate lists one search derives, one shared list per list it derives from: identical layers share
    candidate lists, and with them everything priced for them (edge matrices are built once per pair of lists)."""

    def __init__(self):
        self._derived: dict[tuple, tuple[list, list]] = {}

    def derive(self, kind, cands: list[Candidate], make) -> list[Candidate]:
        hit = self._derived.get((kind, id(cands)))
        if hit is None or hit[0] is not cands:  # the entry keeps the list: its id is not reused meanwhile
            hit = self._derived[(kind, id(cands))] = (cands, make(cands))
        return hit[1]

    def replicated_only(self, cands: list[Candidate]) -> list[Candidate]:
        return self.derive("whole", cands, lambda cs: [c for c in cs if all(
            p.is_replicate() for o in c.outputs if o for p in o)][:1] or cs)

    def with_accumulation(self, cands: list[Candidate]) -> list[Candidate]:
        """``cands`` followed by each in its gradient-accumulating variant."""
        return self.derive("accumulate", cands,
                           lambda cs: cs + [dataclasses.replace(c, accumulate=True) for c in cs])


def build_problem(captured: CapturedGraph, mesh: DeviceMesh, request: PlanRequest,
                  lists: CandidateLists) -> StrategyProblem:
    REGISTRY.register_in_dtensor()  # (the first time: DTensor's own registry, which the programs' dispatch reads)
    mesh_shape = tuple(mesh.shape)
    fixed_inputs = request.fixed()
    decisions: list[Decision] = []
    producer: dict[torch.fx.Node, tuple[int, int]] = {}  # value node -> (decision, output index)
    fallbacks: set[str] = set()
    needs_grad = _needs_grad(captured, request.grad)

    written = _written_layouts(captured, request)
    # values computed from nothing the caller lays out: tensors the graph holds (made inside fn, or read from
    # outside it) and buffers (whole on every rank, needing no gradient): position tables, masks, RoPE's cos/sin
    constant: set[torch.fx.Node] = set()
    for i, node in enumerate(captured.placeholders):
        fixed = written.get(i, fixed_inputs.get(i))
        cands = [Candidate((fixed,), (), "input")] if fixed is not None else \
            _without_unit_dims(input_candidates(_tensor_value(node).shape, mesh), mesh_shape)
        producer[node] = (len(decisions), 0)
        decisions.append(Decision(node, captured.inputs[i].name, cands, []))
        if captured.inputs[i].kind == "buffer" and node not in needs_grad and fixed is not None \
                and all(p.is_replicate() for p in fixed) and i not in captured.writes:
            constant.add(node)

    write_into = {n: written[i] for i, nodes in captured.writes.items() if i in written for n in nodes}
    for node in captured.gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.meta.get("val"), torch.Tensor):
            # whole on every rank, sliced for free where a reader wants a piece
            constant.add(node)
            producer[node] = (len(decisions), 0)
            replicated = (Replicate(),) * len(mesh_shape)
            decisions.append(Decision(node, node.name, [Candidate((replicated,), (), "constant")], []))
            continue
        if node.op != "call_function":
            continue
        if all(a in constant for a in node.all_input_nodes):
            constant.add(node)
        if is_getitem(node):
            src, idx = node.args
            producer[node] = (producer[src][0], idx)
            continue
        if node in constant and node.all_input_nodes:
            # computed from constants only: every rank computes it whole (no rule needed)
            cands = replicated_candidates(node, mesh)
        else:
            cands = _fits(_without_unit_dims(node_candidates(node, mesh, fallbacks), mesh_shape), node,
                          tensor_inputs(node), lists)
        if node in write_into:  # an update of an input: written where the caller holds it
            into = write_into[node]
            cands = [c for c in cands if c.inputs[0] == into and c.outputs[0] == into]
            if not cands:
                raise ValueError(f"shardfn cannot plan {node.target} into {node.args[0].name}: no rule writes it "
                                 f"in the layout {into} the input is held in")
        if node in constant:
            # every rank computes it whole (cheap, no communication) and slices what its readers need; it then
            # ties no layers together (RoPE's cos/sin feed every layer)
            cands = lists.replicated_only(cands)
        sources = [(*producer[a], a) for a in tensor_inputs(node)]
        producer[node] = (len(decisions), 0)
        decisions.append(Decision(node, node.name, cands, sources))

    outs = [a for a in captured.output_nodes if isinstance(a, torch.fx.Node)]
    sink_inputs = tuple(r.placements for r in request.outputs)
    decisions.append(Decision(None, "output", [Candidate((), sink_inputs, "output")],
                              [(*producer[a], a) for a in outs]))
    _check_core_rules(fallbacks)
    warn_fallbacks(fallbacks)

    trainable = {n for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param" and n in needs_grad}
    _offer_accumulation(decisions, needs_grad, lists)
    split_values = computed_from(captured, [i for i, r in enumerate(request.inputs)
                                            if r.held is not None and splits(r.held, request.keep_split)])
    recomputed = _recomputed(captured) if request.grad else frozenset()
    return StrategyProblem(captured, mesh_shape, decisions, needs_grad, trainable, recomputed, split_values,
                           fallbacks)


def _tensor_value(node: torch.fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _without_unit_dims(cands: list[Candidate], mesh_shape: Sequence[int]) -> list[Candidate]:
    """On a mesh dim of one rank, Shard and Partial hold the whole value, as Replicate does: keep the candidates
    that say Replicate there, so a world of one plans no redistribution at all."""
    unit = [d for d, n in enumerate(mesh_shape) if n == 1]
    if not unit:
        return cands

    def whole(pl):
        return pl is None or all(pl[d].is_replicate() for d in unit)

    kept = [c for c in cands if all(whole(pl) for pl in (*c.inputs, *c.outputs))]
    return kept or cands


def _fits(cands: list[Candidate], node: torch.fx.Node, inputs: list[torch.fx.Node],
          lists: CandidateLists) -> list[Candidate]:
    """Candidates whose every Shard(d) names a dim its tensor has, and that split no empty tensor (a rule may offer
    the other operands' placement for cat's empty 1-D tensor, which a cache starts from). Once per list and
    tensors' ranks (identical layers check their lists once)."""

    def shape(val):
        return (val.dim(), val.numel() > 0) if isinstance(val, torch.Tensor) else None

    def ok(pl, val) -> bool:
        return pl is None or val is None or all(not isinstance(p, Shard) or (p.dim < val[0] and val[1]) for p in pl)

    out_vals = tuple(shape(v) for v in _outputs(node))
    in_vals = tuple(shape(a.meta.get("val")) for a in inputs)

    def fitting(cands):
        kept = [c for c in cands if all(ok(pl, v) for pl, v in zip(c.inputs, in_vals))
                and all(ok(pl, v) for pl, v in zip(c.outputs, out_vals))]
        # the list itself where nothing is dropped: identical layers share candidate lists, and with them the edge
        # matrices built for them (pricing)
        return cands if len(kept) == len(cands) else (kept or cands)

    return lists.derive(("fits", in_vals, out_vals), cands, fitting)


def _outputs(node: torch.fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _needs_grad(captured: CapturedGraph, grad: bool) -> set[torch.fx.Node]:
    if not grad:
        return set()
    out: set[torch.fx.Node] = set()
    for node, gi in zip(captured.placeholders, captured.inputs):
        if gi.requires_grad and gi.dtype.is_floating_point:
            out.add(node)
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and not REGISTRY.carries_no_gradient(node.target) and any(
                a in out for a in node.all_input_nodes):
            vals = [v for v in pytree.graph_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
            if any(v.dtype.is_floating_point for v in vals):
                out.add(node)
    return out


def _written_layouts(captured: CapturedGraph, request: PlanRequest) -> dict[int, Placements]:
    """The layout each input ``fn`` updates in place (a buffer's running statistics) is written in: the one asked
    for, else the one the caller holds it in (the update then lands in the caller's tensor as it is; another
    layout is written back after the call)."""
    layouts = {}
    for i in captured.writes:
        fixed, held = request.inputs[i].fixed, request.inputs[i].held
        layout = fixed if fixed is not None else held
        if layout is not None:
            layouts[i] = layout
    return layouts


def _offer_accumulation(decisions: list[Decision], needs_grad: set, lists: CandidateLists) -> None:
    """A single-output value read by several readers that send gradients back may sum them pending and reduce
    once: offer each of its candidates in that variant too. A view is offered handing its readers' pending sums
    on to the value it views (pricing's ``passes_on``), as exec does: a tied embedding's head reads it through a
    transpose, and both readers' sums add up at the weight, reduced once."""
    readers: dict[int, int] = {}
    for d in decisions:
        for u, out_idx, value_node in d.sources:
            if value_node in needs_grad:
                readers[u] = readers.get(u, 0) + 1
    for u, d in enumerate(decisions):
        n = readers.get(u, 0)
        if (n > 1 or n and cm.is_view_op(d.node)) and len(d.candidates[0].outputs) == 1 \
                and d.candidates[0].outputs[0] is not None:
            d.candidates = lists.with_accumulation(d.candidates)


def splits(placements: Placements, dims: tuple[int, ...]) -> bool:
    return any(isinstance(placements[d], Shard) for d in dims)


def computed_from(captured: CapturedGraph, inputs: list[int]) -> set[torch.fx.Node]:
    """The values computed (forward) from these graph inputs."""
    found = {captured.placeholders[i] for i in inputs}
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _recomputed(captured: CapturedGraph) -> frozenset[torch.fx.Node]:
    """The values backward computes again instead of keeping them from forward (activation checkpointing): those
    made in a checkpoint region and read only inside it. (Random draws in a region are kept in fact: the model
    leaves them out; its collectives on activations run again, exec.passes.recompute_checkpointed.)"""
    return frozenset(n for n in captured.gm.graph.nodes if n.op == "call_function" and (
        region := checkpoint_region(n)) is not None and all(checkpoint_region(u) == region for u in n.users))


def _check_core_rules(fallbacks: set[str]) -> None:
    # ops every model leans on (the registry's table): replicating one for want of its rule would make every plan
    # silently serial, so that is an error naming the torch release instead
    missing = sorted(fallbacks & REGISTRY.core_ops())
    if missing:
        raise RuntimeError(
            f"shardfn could not read DTensor's sharding rules for {', '.join(missing)} in torch {torch.__version__}: "
            "plans would run these whole on every rank. shardfn supports torch >=2.11,<2.16; use one of those "
            "releases, or report this torch release as unsupported.")
