"""The cost model's terms for one strategy problem: per-decision compute, memory and savings, edge communication.

Edges are priced per pair of candidate lists, not per edge: identical layers share candidate lists, so a model's
repeated layers are priced once (``Pricing``, one per search; nothing it holds outlives the search). A pair of
lists is priced over its distinct (placement, pending-sum) keys only, then spread to the full matrix.
"""

from __future__ import annotations

import collections
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
from torch.distributed.tensor.placement_types import Placement, Shard

from .. import _pytree_internals as pytree
from ..capture.graph import checkpoint_region, made_from_alone, module_path
from . import cost_arrays
from . import cost_model as cm
from ._summary import layer_group, layer_of
from .buckets import bucket_bytes
from .candidates import Candidate
from .expert_rules import dispatch_collectives, dispatches_tokens
from .gathered import held_copies, reduced_copies, returned_copies
from .problem import Decision, StrategyProblem
from .registry import REGISTRY
from .saved import saved_until

__all__ = ["Pricing", "Terms", "gathered_at", "gradient_copies", "gradient_handed_back", "node_collectives",
           "parameter_copies", "parameter_values", "passes_on", "pending"]

Placements = tuple[Placement, ...]

# backward ~ twice the forward's work
_BACKWARD_FACTOR = 3.0


@dataclass
class Terms:
    """The cost model's terms for one problem: per-decision compute, memory and savings, edge communication."""

    decisions: list[Decision]
    compute: list[np.ndarray]  # per-rank compute seconds (forward, plus backward where needed)
    savings: list[np.ndarray]  # compute seconds saved against running the node whole on one rank
    memory: list[np.ndarray]  # per-rank bytes held at the peak of a training step (the level-1/2 model)
    edges: list[tuple[int, int, np.ndarray]]  # communication seconds, forward and backward
    # per decision: seconds of collectives that belong to one node: an accumulated gradient's one reduction, and
    # a graph input's move from the layout it arrives in to its planned one (and its gradient's way back)
    reductions: list[np.ndarray]
    comm_ops: Any  # (value, src, dst, pending, grad, accumulate) -> (forward CommOps, backward CommOps)
    # edges where a choice gathers a value that must stay split (keep_split): 1 per such pair of choices
    violations: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    # edges where a pair of choices prices what no program runs (:func:`_left_to_view`): 1 per such pair
    impossible: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    # parameters whose gradients are reduced in another dtype than they are used in (a mixed precision policy's
    # reduce_dtype): their backward collectives are priced in it
    grad_dtypes: dict = field(default_factory=dict)
    # edges where a pair of choices keeps a gathered copy from forward to backward: its per-rank bytes, which
    # the memory model adds to the decisions' own (gathered.held_copies)
    edge_memory: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    def violations_of(self, choice) -> int:
        return int(sum(m[choice[u], choice[v]] for u, v, m in self.violations))

    def compute_of(self, choice) -> float:
        return float(sum(self.compute[v][k] for v, k in enumerate(choice)))

    def comm_of(self, choice) -> float:
        edges = sum(m[choice[u], choice[v]] for u, v, m in self.edges)
        return float(edges + sum(self.reductions[v][k] for v, k in enumerate(choice)))

    def memory_of(self, choice) -> float:
        return float(sum(self.memory[v][k] for v, k in enumerate(choice))
                     + sum(m[choice[u], choice[v]] for u, v, m in self.edge_memory))

    def savings_of(self, choice) -> float:
        return float(sum(self.savings[v][k] for v, k in enumerate(choice)))


class Pricing:
    """Prices one search's problem; its memos live as long as the search."""

    def __init__(self, problem: StrategyProblem, profile: cm.DeviceProfile, held: dict[int, Placements],
                 optimizer_stage: int = 0, reduce_dtype: torch.dtype | None = None,
                 links: tuple[str, ...] | None = None, reshard: bool = False, every_value: bool = False):
        self.problem, self.profile, self.held = problem, profile, held
        self.reshard = reshard  # parameters gathered again in backward (level 1), not kept from forward
        # the memory counts every value needing a gradient, not only those kept for backward: the least-memory
        # objective (level 1) then splits the transients too (the loss's logits), which no term of its own prices;
        # a recomputed value too, and a parameter's copy gathered again in backward beyond a bucket's bytes. Else
        # free: DeepSeek-V3's level 1 ran attention and a layer's experts whole
        self.every_value = every_value
        self.links = links if links is not None else cm.mesh_links(problem.mesh_shape, profile)  # dims' links
        self.optimizer_stage = optimizer_stage
        self.grad_dtypes = {n: reduce_dtype for n in problem.trainable
                            if reduce_dtype is not None and n.meta["val"].dtype != reduce_dtype}
        self.mesh_shape = problem.mesh_shape
        self._edges, self._unaries, self._violations, self._comm, self._held = {}, {}, {}, {}, {}  # memos
        self._nodes = {}  # node -> what pricing reads of it, the same in every try (recompute's too)
        self._splits = {}  # each candidate list's split ways (recompute's tries price its nodes again)
        self._pairs = cost_arrays.PairMemo()  # each pair of layouts of a shape priced once
        # values some backward reads, needing a gradient or not (a mask read by attention's backward): kept
        self._saved = set(saved_until(list(problem.captured.gm.graph.nodes), problem.needs_grad)) \
            if problem.needs_grad else set()
        self._lasting = _lasting(problem, every_value) if every_value or problem.needs_grad else frozenset()
        self._parameter_values = parameter_values(problem.captured)
        self.share = _BucketShare(bucket_bytes(), sum(d.node is not None and d.node.op == "placeholder"
                                                      and d.node in problem.needs_grad for d in problem.decisions))

    # -- collectives ---------------------------------------------------------------------------------------------

    def seconds(self, fwd, bwd, handed_back: bool) -> float:
        """Forward and backward collectives' seconds; a gradient ``handed_back`` has its reduction fused."""
        mesh_shape, profile, share, links = self.mesh_shape, self.profile, self.share, self.links
        return sum(cm.collective_seconds(op, mesh_shape, profile, links=links) for op in fwd) + sum(
            cm.collective_seconds(op, mesh_shape, profile, share(op) if handed_back else 1.0, links)
            for op in bwd)

    def comm(self, val, src, dst, pending, grad, accumulate, handed_back=False, grad_dtype=None):
        """(forward CommOps, backward CommOps, seconds) of moving ``val`` from ``src`` to ``dst`` (its gradient back
        in ``grad_dtype``, if given)."""
        key = (tuple(val.shape), val.dtype, src, dst, pending, grad, accumulate, handed_back, grad_dtype)
        hit = self._comm.get(key)
        if hit is None:
            item, mesh_shape = val.element_size(), self.mesh_shape
            fwd = cm.redistribute_collectives(val.shape, item, src, dst, mesh_shape)
            bwd = cm.backward_collectives(val.shape, _grad_item(val, grad_dtype), src, dst, pending, mesh_shape,
                                          accumulate) if grad else []
            hit = self._comm[key] = (fwd, bwd, self.seconds(fwd, bwd, handed_back))
        return hit

    def _edge_seconds(self, val, src_keys, dst_keys, grad, handed_back, grad_dtype) -> np.ndarray:
        """Seconds of each (output layout, accumulates) x (input layout, pending) pair: all at once on arrays
        (cost_arrays, the same figures), else one pair at a time."""
        small = cost_arrays.edge_seconds(val.shape, val.element_size(), _grad_item(val, grad_dtype), src_keys,
                                         dst_keys, self.mesh_shape, self.profile, self.links, grad,
                                         self.share.many if handed_back else None, self._pairs)
        if small is None:
            small = np.array([[self.comm(val, s, t, pd, grad, acc, handed_back, grad_dtype)[2] for t, pd in dst_keys]
                              for s, acc in src_keys])
        return small

    def comm_ops(self, val, src, dst, pending, grad, accumulate, grad_dtype=None):
        return self.comm(val, src, dst, pending, grad, accumulate, grad_dtype=grad_dtype)[:2]

    # -- the terms -----------------------------------------------------------------------------------------------

    def terms(self, keep_split: tuple[int, ...] = ()) -> Terms:
        p = self.problem
        share = _recomputed_share(p)
        compute, savings, memory, reductions = [], [], [], []
        for i, d in enumerate(p.decisions):
            c, s, m, r = self._unary(d, self.held.get(i), share)
            compute.append(c), savings.append(s), memory.append(m), reductions.append(r)
        edges, impossible = self._edge_terms()
        terms = Terms(p.decisions, compute, savings, memory, edges, reductions, self.comm_ops, impossible=impossible,
                      grad_dtypes=self.grad_dtypes)
        terms.violations = self.violations(keep_split, p.split_values)
        terms.edge_memory = held_copies(p, self._held, self.reshard, bucket_bytes() if self.every_value else None,
                                        self._lasting, p.recomputed, self.every_value) \
            + returned_copies(p, self._saved)
        return terms

    def _unary(self, d: Decision, held, share: float = 1.0):
        """(compute, savings, memory, node reductions) of each candidate of ``d`` (a recomputed value's memory
        times ``share``); once per candidate list and node description (identical layers price theirs once)."""
        p, profile, mesh_shape = self.problem, self.profile, self.mesh_shape
        n = len(d.candidates)
        if d.node is None:
            return np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        facts = self._nodes.get(d.node)
        if facts is None:  # (the same in every try: once per node)
            facts = self._nodes[d.node] = _node_facts(d.node)
        vals, placeholder, flops, nbytes, view, shapes = facts
        grad = d.node in p.needs_grad
        if placeholder:
            factor = 0
            keep = -1 if d.node in p.trainable else 1  # value, gradient, two optimizer states (per candidate)
        else:
            # backward's work, and a checkpointed value's forward once more
            factor = (_BACKWARD_FACTOR + (d.node in p.recomputed)) if grad else 1.0
            keep = 0 if view else _kept_share(d.node, grad, self, share)
        dtype = vals[0].dtype if vals else torch.float32
        grad_dtype = self.grad_dtypes.get(d.node)
        # (its forward collectives run again in backward: exec's recompute; selectively, all but reductions)
        again = (d.node in p.recomputed, p.keeps_reduced_for(d.node))
        reduced = not view and not placeholder and any(p.keeps_reduced_for(u) for u in d.node.users)
        key = (id(d.candidates), placeholder, flops, nbytes, factor, keep, dtype, held, grad, self.optimizer_stage,
               view, shapes, grad_dtype, again, reduced)
        hit = self._unaries.get(key)
        if hit is not None and hit[0] is d.candidates:
            return hit[1]
        if placeholder:
            compute = savings = np.zeros(n)
        else:
            whole = factor * cm.compute_seconds(flops, nbytes, 1, profile, dtype)
            ways = _per_candidate_lists(self._splits, id(d.candidates), d.candidates, d.candidates,
                                        lambda: np.array([_split_ways(c, mesh_shape) for c in d.candidates]))
            compute = factor * cm.compute_seconds(flops, nbytes, ways, profile, dtype)
            savings = whole - compute
        memory = np.array([
            (parameter_copies(c.outputs[0], mesh_shape, self.optimizer_stage, vals[0].dim()) if keep < 0 else keep)
            * sum(cm.local_numel(v.shape, pl, mesh_shape) * v.element_size()
                  for v, pl in zip(vals, c.outputs) if pl is not None)
            for c in d.candidates], dtype=float) if keep else np.zeros(n)
        if reduced:
            memory = memory + _pending_bytes(d.candidates, vals, mesh_shape)
        reductions = np.zeros(n)
        for k, c in enumerate(d.candidates):
            fwd, bwd = node_collectives(d, c, held, grad, mesh_shape, grad_dtype)
            # a graph input's own reductions (its readers' gradients summed) hand its gradient back
            reductions[k] = self.seconds(fwd + p.run_again(d.node, fwd), bwd, placeholder) if fwd or bwd else 0.0
        self._unaries[key] = (d.candidates, (compute, savings, memory, reductions))
        return compute, savings, memory, reductions

    def _edge_terms(self):
        p = self.problem
        edges, impossible = [], []
        for v, d in enumerate(p.decisions):
            for slot, (u, out_idx, value_node) in enumerate(d.sources):
                val = value_node.meta["val"]
                grad = value_node in p.needs_grad
                handed_back = grad and gradient_handed_back(value_node) is not None
                src_cands = p.decisions[u].candidates
                from_view = grad and cm.is_view_op(p.decisions[u].node)
                grad_dtype = self.grad_dtypes.get(value_node)
                key = (id(src_cands), out_idx, id(d.candidates), slot, tuple(val.shape), val.dtype, grad,
                       cm.is_view_op(d.node), handed_back, from_view, grad_dtype)

                def build(d=d, slot=slot, src_cands=src_cands, out_idx=out_idx, val=val, grad=grad,
                          handed_back=handed_back, from_view=from_view, grad_dtype=grad_dtype):
                    pend = [pending(c, slot, passes_on(d, c)) for c in d.candidates]
                    src_keys, src_idx = _distinct([(sc.outputs[out_idx], sc.accumulate) for sc in src_cands])
                    dst_keys, dst_idx = _distinct([(c.inputs[slot], pd) for c, pd in zip(d.candidates, pend)])
                    small = self._edge_seconds(val, src_keys, dst_keys, grad, handed_back, grad_dtype)
                    return (small[np.ix_(src_idx, dst_idx)],
                            _left_to_view(src_cands, pend, self.mesh_shape) if from_view else None)

                priced = _per_candidate_lists(self._edges, key, src_cands, d.candidates, build)
                if d.node in p.recomputed and value_node not in self._parameter_values:
                    # a recomputed reader's redistribution of an activation runs again before its backward
                    # (exec's recompute; parameters gathered whole are kept), but a reduction's in a region
                    # recomputed selectively (its result kept)
                    kept = p.keeps_reduced_for(d.node)
                    again = functools.partial(_moved_again, self, priced, val, src_cands, out_idx, d.candidates,
                                              slot, grad_dtype, kept)
                    priced = _per_candidate_lists(self._edges, ("again", kept, *key), src_cands, d.candidates, again)
                matrix, forbidden = priced
                edges.append((u, v, matrix))
                if forbidden is not None:
                    impossible.append((u, v, forbidden))
                if grad and _views_a_cast(value_node, self.grad_dtypes):  # (moved as the parameter, not its view)
                    moved = functools.partial(_moved, src_cands, out_idx, d.candidates, slot)
                    impossible.append((u, v, _per_candidate_lists(self._edges, ("moved", *key), src_cands,
                                                                  d.candidates, moved)))
        return edges, impossible

    def violations(self, keep_split, values, chosen=None) -> list[tuple[int, int, np.ndarray]]:
        """Edges where a pair of choices gathers, in forward, a value of ``values`` that must stay split over the
        mesh dims ``keep_split``; with ``chosen`` (a plan's choice), only the producer's chosen row of each."""
        found, p = [], self.problem
        if not keep_split:
            return found
        for v, d in enumerate(p.decisions):
            for slot, (u, out_idx, value_node) in enumerate(d.sources):
                if value_node not in values:
                    continue
                val = value_node.meta["val"]
                src_cands = p.decisions[u].candidates
                pick = None if chosen is None else chosen[u]
                rows = range(len(src_cands)) if pick is None else (pick,)
                key = (id(src_cands), out_idx, id(d.candidates), slot, tuple(val.shape), val.dtype, keep_split, pick)

                def build(d=d, slot=slot, src_cands=src_cands, out_idx=out_idx, val=val, rows=rows):
                    src_keys = [src_cands[k].outputs[out_idx] for k in rows]
                    dst_keys = [c.inputs[slot] for c in d.candidates]
                    bad = _pairs_gathering(self, val, src_keys, dst_keys, keep_split)
                    bad[:, [dispatches_tokens(d.node, c, keep_split) for c in d.candidates]] = 0.0
                    return bad if bad.any() else None

                bad = _per_candidate_lists(self._violations, key, src_cands, d.candidates, build)
                if bad is not None:
                    found.append((u, v, bad))
        return found


def _pairs_gathering(pricing: Pricing, val, srcs, dsts, keep_split) -> np.ndarray:
    """1 for each pair of layouts whose forward redistribution gathers over a mesh dim of ``keep_split``."""
    partials: dict = {}
    a, b = [cost_arrays.codes(s, partials) for s in srcs], [cost_arrays.codes(t, partials) for t in dsts]
    if None not in a and None not in b:
        return cost_arrays.pair_seconds(val.shape, val.element_size(), a, b, pricing.mesh_shape, pricing.profile,
                                        pricing.links, gathers_on=keep_split, memo=pricing._pairs)[1].astype(float)
    src_keys, src_idx = _distinct(srcs)
    dst_keys, dst_idx = _distinct(dsts)
    bad = np.array([[float(_gathers(pricing.comm(val, s, t, (), False, False)[0], keep_split)) for t in dst_keys]
                    for s in src_keys])
    return bad[np.ix_(src_idx, dst_idx)]


def _moved_again(pricing: Pricing, priced, val, src_cands, out_idx, dst_cands, slot, grad_dtype, reduced_kept):
    """An edge's (matrix, forbidden) with its forward redistribution's seconds once more; ``reduced_kept``: but
    where it is reductions alone, whose result the reader keeps (gathered.reduced_copies; a redistribution that
    also gathers or exchanges is priced again whole, where exec runs those again and keeps the reduction)."""
    matrix, forbidden = priced
    src_keys, src_idx = _distinct([(sc.outputs[out_idx], False) for sc in src_cands])
    dst_keys, dst_idx = _distinct([(c.inputs[slot], ()) for c in dst_cands])
    moved = pricing._edge_seconds(val, src_keys, dst_keys, False, False, grad_dtype)
    if reduced_kept:  # (on the distinct layouts, as the seconds)
        moved = np.where(reduced_copies([k for k, _ in src_keys], [k for k, _ in dst_keys], pricing.mesh_shape),
                         0.0, moved)
    moved = moved[np.ix_(src_idx, dst_idx)]
    moved += matrix  # (in place: Llama-405B's edges hold 41 M pairs)
    return moved, forbidden


def parameter_values(captured) -> set:
    """The parameters and the values made from them alone (a transpose, a cast): what exec gathers as a parameter,
    kept for backward in a recomputed region where an activation's collectives run again."""
    return made_from_alone(captured.gm.graph, [n for n, gi in zip(captured.placeholders, captured.inputs)
                                                if gi.kind == "param"])


def _node_facts(node) -> tuple:
    """(tensor values, placeholder, FLOPs, bytes, view, shapes) of ``node``, as pricing reads it."""
    vals = [v for v in pytree.graph_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    placeholder, view = node.op == "placeholder", cm.is_view_op(node)
    # a view moves no bytes: splitting one saves nothing (else a plan might split a weight's transpose only to
    # gather it back for its reader)
    flops = 0 if placeholder else cm.node_flops(node)
    nbytes = 0 if placeholder or view else cm.node_bytes(node)
    return vals, placeholder, flops, nbytes, view, tuple((tuple(v.shape), v.dtype) for v in vals)


def parameter_copies(placements: Placements, mesh_shape: Sequence[int], optimizer_stage: int = 0,
                     ndim: int | None = None) -> float:
    """How many times a trained parameter's local bytes a rank holds: its value, its gradient, two optimizer
    states (AdamW's); a sharded optimizer splits the states (stage 1) and the gradient too (stage 2) over the first
    mesh dim the parameter is whole on, unless each of its ``ndim`` dims is split already (as
    shardfn.training.optimizer.piece_placements)."""
    n = _states_split(placements, mesh_shape, optimizer_stage, ndim)
    return 1.0 + gradient_copies(placements, mesh_shape, optimizer_stage, ndim) + 2.0 / n


def gradient_copies(placements: Placements, mesh_shape: Sequence[int], optimizer_stage: int = 0,
                    ndim: int | None = None) -> float:
    """Of :func:`parameter_copies`, the gradient's: 1, or a share where a stage-2 sharded optimizer splits it."""
    return 1.0 / _states_split(placements, mesh_shape, optimizer_stage, ndim) if optimizer_stage == 2 else 1.0


def _states_split(placements, mesh_shape, optimizer_stage, ndim) -> int:
    """In how many pieces a sharded optimizer splits a parameter's states (1: not split)."""
    whole = [d for d, q in enumerate(placements) if q.is_replicate()]
    split = {q.dim for q in placements if q.is_shard()}
    if not optimizer_stage or not whole or (ndim is not None and len(split) >= ndim):
        return 1
    return mesh_shape[whole[0]]


def _recomputed_share(problem: StrategyProblem) -> float:
    """The share of a recomputed value's bytes level 1 counts: backward brings back one region at a time, so a
    region's values are one region's transient, not a sum over every layer (Llama-405B's exact level-1 plan kept
    each layer's input whole over "tp", 43.7e9 bytes a rank walked, to split 126 layers' values never alive
    together)."""
    return 1.0 / max(len({problem.regions.get(n, checkpoint_region(n)) for n in problem.recomputed}), 1)


def _pending_bytes(candidates: list[Candidate], vals: list, mesh_shape) -> np.ndarray:
    """Per candidate, the bytes of its outputs left pending sums: what a reader recomputed selectively keeps of
    their reduction until its backward (StrategyProblem.keeps_reduced_for; the walk counts the reader's copy,
    gathered.read_copies) is no larger, an all-reduce's as large, a reduce-scatter's smaller. Counted on the maker:
    on the edge, these pairs doubled Llama-405B's (gathered.held_copies) and slowed its time-bound solve."""
    return np.array([sum(cm.local_numel(v.shape, pl, mesh_shape) * v.element_size()
                         for v, pl in zip(vals, c.outputs) if pl is not None and any(q.is_partial() for q in pl))
                     for c in candidates], dtype=float)


def _kept_share(node: torch.fx.Node, grad: bool, pricing: Pricing, share: float) -> float:
    """The share of a value's bytes the memory counts: a value kept for backward whole, none else; level 1 (its
    ``every_value``) every value needing a gradient, a recomputed one at ``share``, and its lasting ones whole."""
    if node in pricing._lasting:  # (level 1: alive at the forward's end, or across its layers)
        return 1
    recomputed = node in pricing.problem.recomputed
    kept = node in pricing._saved or (grad and pricing.every_value)
    if not kept or (recomputed and not pricing.every_value):
        return 0
    return share if recomputed else 1


def _lasting(problem: StrategyProblem, every_value: bool) -> frozenset[torch.fx.Node]:
    """The values counted whole, whatever backward does with them: read in another layer than their own (a mask
    every layer reads), or of a layer with no identical sibling and alive while a repeated layer runs or after the
    last (the head's logits, made at the forward's end where every value saved for backward is alive); at level 1
    (``every_value``) any value of a layer with no sibling. Counted at a share where recomputed (or not at all
    where no backward reads them), Llama-405B's level 1 had left its logits a pending sum split 16 ways (8.4e9
    bytes a rank walked); level 2, counting what backward keeps, had left its logits' product split two ways
    (67e9). Level 2 leaves out what is made and gone before the layers (a mask's making: Llama-3-70B's four of a
    GB each, alive one or two at a time, with nothing yet saved)."""
    layers = {n: layer_of(module_path(n)) for n in problem.captured.gm.graph.nodes if n.op == "call_function"}
    alike = collections.Counter(layer_group(name) for name in set(layers.values()))
    single = {n: alike[layer_group(name)] < 2 for n, name in layers.items()}
    crossing = {n for n, name in layers.items() if any(layers.get(u, name) != name for u in n.users)}
    if every_value:
        return frozenset(n for n, one in single.items() if one) | crossing
    # (a repeated layer's values by place, views left out: the saved values' detaches come at the graph's end)
    ran = list(itertools.accumulate(not one and not cm.is_view_op(n) for n, one in single.items()))
    place = {n: i for i, n in enumerate(single)}
    last = ran.index(ran[-1]) if ran and ran[-1] else len(ran)  # (the last value a repeated layer makes)
    return crossing | frozenset(
        n for n, one in single.items()
        if one and (place[n] > last or ran[max((place.get(u, 0) for u in n.users), default=0)] > ran[place[n]]))


def _per_candidate_lists(memo: dict, key: tuple, src_cands: list, dst_cands: list, build: Callable[[], Any]):
    """``build()`` once per pair of candidate lists (``key`` holds their ids). The entry keeps the lists, so their
    ids are not reused while it stands."""
    hit = memo.get(key)
    if hit is None or hit[0] is not src_cands or hit[1] is not dst_cands:
        hit = memo[key] = (src_cands, dst_cands, build())
    return hit[2]


def _split_ways(c: Candidate, mesh_shape: Sequence[int]) -> int:
    """How many ways a candidate splits its work: the mesh dims where some operand is sharded. (A pending-sum
    operand alone splits nothing: every rank still runs the whole op on its piece.)"""
    dims = set()
    for pl in list(c.inputs) + [o for o in c.outputs if o is not None]:
        dims.update(d for d, p in enumerate(pl) if isinstance(p, Shard))
    return int(np.prod([mesh_shape[d] for d in dims])) if dims else 1


def pending(c: Candidate, slot: int, passes_on: bool = False) -> tuple[bool, ...]:
    """Mesh dims where this candidate leaves the gradient of input ``slot`` as a pending sum. The outputs' sink
    leaves none: each output's gradient comes back as the caller computed it, a replicated output's whole on
    every rank. A view that ``passes_on`` its readers' pending sums (problem's accumulation offer) leaves them
    pending on its input wherever its result accumulates them."""
    pl = c.inputs[slot]
    if c.rule == "output":
        return (False,) * len(pl)
    if passes_on:
        return tuple(a.is_partial() and not isinstance(p, Shard)
                     for a, p in zip(cm.accumulator_placement(c.outputs[0]), pl))
    working = set()
    for other in list(c.inputs) + [o for o in c.outputs if o is not None]:
        working.update(d for d, p in enumerate(other) if not p.is_replicate())
    return tuple(p.is_replicate() and d in working for d, p in enumerate(pl))


def passes_on(d: Decision, c: Candidate) -> bool:
    """Does ``d``, a view, hand its readers' pending gradient sums on to its input (the accumulating variant of a
    view), where the value it views sums and resolves them? Exec does so at every view; a view's other variant
    is for readers that leave it no pending sum (:func:`_left_to_view`)."""
    return c.accumulate and d.node is not None and cm.is_view_op(d.node)


def _left_to_view(view_cands: list[Candidate], pend: list[tuple[bool, ...]], mesh_shape) -> np.ndarray | None:
    """1 where a reader leaves a pending gradient sum (over more than one rank) to a view that does not pass it
    on: exec never resolves a sum at a view (it hands it to the value viewed), so such a pair of choices prices
    a reduction no program runs; the view's passing variant prices the one that does. None if there is none.
    (Where the edge moves the value its backward resolves the sum itself, and the pair would do; it stays
    refused: let through, level 1 chose to gather GPT blocks' weights after their transposes, which exec's
    backward regathers cannot fuse into the plan's one bucket.)"""
    keeps = np.array([not c.accumulate for c in view_cands], dtype=float)
    leaves = np.array([any(p and n > 1 for p, n in zip(pd, mesh_shape)) for pd in pend], dtype=float)
    if not (keeps.any() and leaves.any()) or not any(c.accumulate for c in view_cands):
        return None  # a view without the passing variant (several outputs): priced where it is read, as before
    return np.outer(keeps, leaves)


def _views_a_cast(node: torch.fx.Node, grad_dtypes: dict) -> bool:
    """Is ``node`` a view (a transpose) of a parameter a mixed precision policy casts? Exec casts the parameter
    where it enters and sends its gradient back through reduce_dtype there: a layout change of its view would
    reduce the gradient in param_dtype instead (bf16), so such a value is read in its own layout, and any move is
    the parameter's (gathered in param_dtype, reduced in reduce_dtype, as FSDP2 does)."""
    return node.op == "call_function" and cm.is_view_op(node) and cm.view_base(node) in grad_dtypes


def _moved(src_cands: list[Candidate], out_idx: int, dst_cands: list[Candidate], slot: int) -> np.ndarray:
    """1 for each pair of choices whose layouts differ (the value moves between them)."""
    return np.array([[float(tuple(s.outputs[out_idx]) != tuple(c.inputs[slot])) for c in dst_cands]
                     for s in src_cands])


def _distinct(keys: list) -> tuple[list, np.ndarray]:
    """The distinct keys in first-seen order, and each key's position among them."""
    pos: dict = {}
    idx = np.array([pos.setdefault(k, len(pos)) for k in keys], dtype=np.int64)
    return list(pos), idx


def _gathers(ops, dims) -> bool:
    # an all_to_all moves the split to another dim (a transpose of the batch, a scan over it): the value stays
    # split, each rank's bytes as they were, so it is no gather (exec runs it as one all_to_all on every backend:
    # exec.split_moves)
    return any(o.kind == "all_gather" and o.mesh_dim in dims for o in ops)


def gathered_at(decisions, choice, found, rows: bool = False) -> list[str]:
    """Where the chosen plan gathers a value that was to stay split: "value -> reader" (``rows``: each matrix of
    ``found`` is the producer's chosen row alone)."""
    return [f"{decisions[u].name if decisions[u].node.op == 'placeholder' else decisions[u].node.name} -> "
            f"{decisions[v].name}" for u, v, m in found if m[0 if rows else choice[u], choice[v]]]


@dataclass(frozen=True)
class _BucketShare:
    """The part of its collective's fixed costs a gradient's reduction bears once exec fuses it into a bucket of
    ``limit`` bytes (buckets.bucket_bytes): its bytes' share of a full bucket, and no less than an equal share
    among the ``grads`` gradients of graph inputs (a small model's all fit in one bucket, whose latency they
    then share)."""

    limit: int
    grads: int

    def __call__(self, op: cm.CommOp) -> float:
        if op.kind != "all_reduce" or self.limit <= 0:
            return 1.0
        return min(1.0, max(op.nbytes / self.limit, 1 / max(self.grads, 1)))

    def many(self, kind: str, nbytes: np.ndarray):
        """The same for collectives of one kind and many sizes (cost_arrays)."""
        if kind != "all_reduce" or self.limit <= 0:
            return 1.0
        return np.minimum(1.0, np.maximum(nbytes / self.limit, 1 / max(self.grads, 1)))


# a number added to or taken from a tensor: the tensor's gradient is the result's, unchanged
_ADDS_A_NUMBER = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.add.Scalar,
                  torch.ops.aten.sub.Scalar)


def _passes_gradient(node: torch.fx.Node) -> bool:
    """Is ``node``'s gradient, reduced, its first input's (reshaped, cast, or unchanged)? A reshape's is; so is
    a cast's (autocast's bf16 copy of a bias: its backward casts the gradient back, so exec finds the bf16
    reduction handed back as the parameter's, and buckets it with the other bf16 gradients); so is a number
    added to its input (Gemma 3's norms scale by ``1 + weight``): its backward is nothing at all."""
    if REGISTRY.reshapes_gradient(node.target) or _casts(node):
        return True
    return node.target in _ADDS_A_NUMBER and len(node.args) >= 2 and isinstance(node.args[0], torch.fx.Node) \
        and isinstance(node.args[1], (int, float, bool))


def _casts(node: torch.fx.Node) -> bool:
    """A copy of its input in another dtype alone (autocast's casts), whose backward casts the gradient back."""
    return node.target is torch.ops.prims.convert_element_type.default or \
        (node.target is torch.ops.aten._to_copy.default and set(node.kwargs) <= {"dtype"})


def gradient_handed_back(node: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input whose gradient, as it leaves the program (no other reader adds to it), is what is
    reduced where ``node`` is read; else None. Exec fuses those reductions into buckets."""
    while node.op == "call_function" and _passes_gradient(node) and len(node.users) == 1:
        node = node.args[0]
    return node if node.op == "placeholder" and len(node.users) == 1 else None


def node_collectives(d: Decision, c: Candidate, held, grad: bool, mesh_shape,
                     grad_dtype: torch.dtype | None = None, summed=None) -> tuple[list, list]:
    """(forward, backward) collectives that belong to one node rather than an edge (its gradient's in
    ``grad_dtype``, if given). ``summed``: where its readers' gradients accumulate, the mesh dims where some
    arrives as a pending sum (the read-out knows them from the chosen readers; None: wherever one may)."""
    if d.node is None:
        return [], []
    fwd, bwd = dispatch_collectives(d.node, c, mesh_shape, grad) if c.rule == "dispatch" else ([], [])
    if c.accumulate and not passes_on(d, c):  # a view's sum is resolved where its input's is
        val = _first_output(d.node)
        bwd += cm.accumulated_collectives(val.shape, _grad_item(val, grad_dtype), c.outputs[0], mesh_shape,
                                          summed)
    if held is not None and held != c.outputs[0]:
        val = d.node.meta["val"]
        fwd += cm.redistribute_collectives(val.shape, val.element_size(), held, c.outputs[0], mesh_shape)
        if grad:  # the gradient goes back to the caller in the layout the input came in
            bwd += cm.redistribute_collectives(val.shape, _grad_item(val, grad_dtype),
                                               cm.gradient_placement(c.outputs[0]), held, mesh_shape)
    return fwd, bwd



def _first_output(node: torch.fx.Node) -> torch.Tensor:
    return next(v for v in pytree.graph_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor))


def _grad_item(val: torch.Tensor, grad_dtype: torch.dtype | None) -> int:
    """The bytes of one element of ``val``'s gradient as it is reduced: in ``grad_dtype`` if given, else its own."""
    return grad_dtype.itemsize if grad_dtype is not None else val.element_size()
