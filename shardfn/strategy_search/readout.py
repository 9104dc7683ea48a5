"""The plan read off a solution: each node's placements, the collectives they imply, costs, notes."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Container, Sequence

import torch
import torch.fx
from torch.distributed.tensor.placement_types import Shard

from .. import _pytree_internals as pytree
from ..capture.graph import checkpoint_region, is_getitem, is_in_place, made_from_alone, module_path
from ..layout import MeshSpec
from . import cost_model as cm
from .as_read import laid_out_as_read
from .buckets import assign_buckets, bucket_bytes, bucket_unit
from .candidates import tensor_inputs
from .gathered import as_returned, gather_events, gathered_copies, read_copies
from .plan import Collective, Cost, InputPlan, NodePlan, Plan, gap_text
from .pricing import (
    Pricing,
    Terms,
    gathered_at,
    gradient_copies,
    gradient_handed_back,
    node_collectives,
    parameter_copies,
    passes_on,
    pending,
)
from .problem import StrategyProblem, computed_from, splits
from .registry import REGISTRY
from .request import PlanRequest
from .run_modes import run_mode
from .saved import saved_until
from .solver import Solution

__all__ = ["OverBudget", "read_plan"]


def read_plan(problem: StrategyProblem, request: PlanRequest, mesh_spec: MeshSpec, pricing: Pricing, terms: Terms,
              solution: Solution) -> Plan:
    captured, decisions = problem.captured, problem.decisions
    held, level = request.held(), request.level
    # (values every rank makes whole, laid out as their readers all read them: as_read)
    chosen, made_whole = laid_out_as_read(problem, [d.candidates[k] for d, k in zip(decisions, solution.choice)])
    returned = [r.placements for r in request.outputs]
    live, live_backward, resident, outputs, end = _live_bytes(problem, chosen, set(captured.gm.graph.nodes) -
                                                              problem.recomputed, request.optimizer_stage, returned,
                                                              request.accumulate, request.policy.regathers and request.grad,
                                                              made_whole, held)
    read = _Collectives(problem, request, pricing, terms, chosen)
    fwd_colls, bwd_colls, regathers = read.all()
    last = next(reversed(live_backward), None)  # the backward's last point: its end, every gradient made, the
    if last is not None:  # largest bucket of their reductions copied as it is reduced
        live_backward[last] = max(live_backward[last], end + _largest_reduction(bwd_colls, read.gradients))
    nodes = {}
    writes = any(is_in_place(n.target) for n in captured.gm.graph.nodes)
    for v, (d, c) in enumerate(zip(decisions, chosen)):
        if d.node is not None:
            op = "input" if d.node.op == "placeholder" else str(d.node.target)
            nodes[d.node.name] = NodePlan(d.name, op, c.rule, c.inputs, c.outputs, module_path(d.node),
                                          _shapes(d.node), float(terms.compute[v][solution.choice[v]]),
                                          live.get(d.node), live_backward.get(d.node),
                                          run_mode(d.node, c.rule, c.inputs, c.outputs, writes))
    compute_s = terms.compute_of(solution.choice)
    comm_s = terms.comm_of(solution.choice) + read.regather_s
    peak = max(max(live.values(), default=0), max(live_backward.values(), default=0))  # forward and backward
    inputs = tuple(InputPlan(gi.kind, gi.name, gi.shape, held.get(i, chosen[i].outputs[0]), chosen[i].outputs[0],
                             request.inputs[i].origin)
                   for i, gi in enumerate(captured.inputs))
    plan = Plan(
        mesh=dataclasses.replace(mesh_spec, links=pricing.links),  # each dim's link, as priced
        level=level,
        nodes=nodes,
        inputs=inputs,
        outputs=tuple(r.placements for r in request.outputs),
        returns_dtensor=tuple(r.as_dtensor for r in request.outputs),
        # arguments arriving from other ranks move before the call, their gradients go back after its backward
        collectives=(*(c for c in request.arrivals if c.phase == "forward"), *fwd_colls, *reversed(bwd_colls),
                     *(c for c in request.arrivals if c.phase == "backward")),
        cost=Cost(compute_s, comm_s, peak, terms.savings_of(solution.choice)),
        optimal=solution.optimal,
        notes=_notes(problem, request, pricing, terms, solution),
        reshard_after_forward=bool(regathers),
        gap=solution.gap,
        search={**solution.stats, **({"timed_out": True} if solution.timed_out else {})},
        output_shapes=tuple(_shapes(n)[0] for n in captured.output_nodes),
        name=request.name,
        accumulate=request.accumulate,
        pending_grads=request.pending_grads,
        precision=request.precision,
    )
    _check_budget(problem, request, plan, resident, outputs)
    return plan


def _notes(problem: StrategyProblem, request: PlanRequest, pricing: Pricing, terms: Terms,
           solution: Solution) -> list[str]:
    """What the plan says of itself: how the solve ended, why values were gathered, fallbacks, the caller's."""
    notes = [solution.message] if solution.message not in ("optimal", "") else []
    if solution.timed_out:
        notes.append(f"the search stopped at its time limit (SHARDFN_SEARCH_TIME_LIMIT): this plan is "
                     f"{gap_text(solution.gap)}")
    notes += _why_gathered(problem, request, pricing, terms, solution)
    if problem.fallbacks:
        notes.append("replicated fallback for: " + ", ".join(sorted(problem.fallbacks)))
    notes += request.notes
    if request.precision is not None:
        notes.append(f"mixed precision: {request.precision}")
    return notes


class _Collectives:
    """The collectives of the chosen candidates, forward and backward, priced as the search priced them, with
    their buckets: gradients' reductions, split parameters' all-gathers (forward, and at level 1 again in
    backward: FSDP's reshard_after_forward)."""

    def __init__(self, problem: StrategyProblem, request: PlanRequest, pricing: Pricing, terms: Terms,
                 chosen: list):
        self.problem, self.request, self.pricing, self.terms, self.chosen = problem, request, pricing, terms, chosen
        captured = problem.captured
        self.fwd: list[Collective] = []
        self.bwd: list[Collective] = []
        self.regathers: list[Collective] = []
        self.regather_s = 0.0
        # split parameters' all-gathers (forward, and again in backward), with their kind: exec fuses them in
        # buckets
        self.gathered: list[tuple[Collective, tuple]] = []
        self.regathered: list[tuple[Collective, tuple]] = []
        # reductions of a gradient handed straight back: (position in bwd, (kind, mesh dim, dtype), input number)
        self.gradients: list[tuple[int, tuple, int]] = []
        self.position = {n: i for i, n in enumerate(captured.placeholders)}
        self.params = {n for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param"}
        self.units = {n: bucket_unit(gi.name) for n, gi in zip(captured.placeholders, captured.inputs)
                      if gi.kind == "param"}  # (other inputs' collectives: no unit, as exec fuses them)
        # those whose gradients a stage-2 sharded optimizer takes pending (the rest are reduced in the graph)
        self.optimizer_reduces = {n for n, gi in zip(captured.placeholders, captured.inputs)
                                  if gi.kind == "param" and gi.name in request.pending_grads}
        # what backward computes again from the shards: ops on parameters alone
        self.from_params = made_from_alone(captured.gm.graph, self.params)
        roots = {p: {p} for p in self.params}  # the parameters each of those is computed from
        for node in captured.gm.graph.nodes:
            if node in self.from_params and node not in roots:
                roots[node] = set().union(*(roots[a] for a in node.all_input_nodes))
        # parameters a reader takes in another layout (directly or from ops on them): the backward of that
        # redistribution resolves their gradients' pending sums in the graph
        self.resolved = {p for d, c in zip(self.problem.decisions, self.chosen)
                         for slot, (u, out_idx, value_node) in enumerate(d.sources)
                         if value_node in roots and _resolves(self.chosen[u].outputs[out_idx], c.inputs[slot])
                         for p in roots[value_node]}
        # level 1 (least memory) gathers a split parameter again in backward instead of keeping the whole copy
        # from forward to backward: one more all-gather per gathered parameter
        self.reshard = request.policy.regathers and request.grad
        self.held = request.held()

    def all(self) -> tuple[list[Collective], list[Collective], list[Collective]]:
        """(forward, backward, backward's gathers again), each in buckets."""
        self._sum_pending()
        for i, (d, c) in enumerate(zip(self.problem.decisions, self.chosen)):
            for slot, source in enumerate(d.sources):
                self._edge(i, d, c, slot, *source)
        for i, (d, c) in enumerate(zip(self.problem.decisions, self.chosen)):
            self._node(i, d, c)
        bwd = _with_buckets(self.bwd, self.gradients)
        first = max((c.bucket for c in bwd if c.bucket is not None), default=-1) + 1
        fwd, first = _gathers_in_buckets(self.fwd, self.gathered, first)
        regathers, _ = _gathers_in_buckets(self.regathers, self.regathered, first)
        return fwd, bwd + regathers, regathers

    def _sum_pending(self) -> None:
        """``self.summed``: per decision, the mesh dims where some reader's gradient contribution arrives as a
        pending sum (a view that passes its readers' sums on passes on those it got; an edge that moves the value
        resolves them in its backward): where a chosen candidate accumulates, only these are reduced, as
        autograd's sum of DTensors is pending only where a contribution was (GPT-2's tied embedding on a data x
        tensor-parallel mesh: summed over the data dim alone)."""
        decisions = self.problem.decisions
        self.summed: dict[int, set[int]] = collections.defaultdict(set)
        for i in reversed(range(len(decisions))):  # (readers after the values they read)
            d, c = decisions[i], self.chosen[i]
            for slot, (u, out_idx, _) in enumerate(d.sources):
                if self.chosen[u].outputs[out_idx] == c.inputs[slot]:
                    self.summed[u] |= {k for k, p in enumerate(self._pending(i, slot)) if p}

    def _pending(self, i: int, slot: int) -> tuple[bool, ...]:
        """Where decision ``i`` leaves the gradient of its input ``slot`` pending; a view passing its readers' sums
        on passes those it got (``self.summed``, filled from the last reader back)."""
        d, c = self.problem.decisions[i], self.chosen[i]
        on = passes_on(d, c)
        pend = pending(c, slot, on)
        return tuple(p and k in self.summed[i] for k, p in enumerate(pend)) if on else pend

    def _priced(self, o: cm.CommOp, phase: str, where: str, handed_back: bool = False) -> Collective:
        # as the search priced it: a gradient handed back bears its share of its bucket's latency
        share = self.pricing.share(o) if handed_back else 1.0
        seconds = cm.collective_seconds(o, self.problem.mesh_shape, self.request.profile, share, self.pricing.links)
        return Collective(o.kind, phase, (o.mesh_dim,), o.nbytes, where, seconds=seconds)

    def _synced(self, ops, placeholder, direct: bool = True):
        """A parameter's gradient reductions as the program runs them: accumulating without sync none where it
        leaves the program; for a stage-2 sharded optimizer reduce-scattered into the optimizer's piece where it
        takes the gradient pending (``request.pending_grads``), but not for a parameter a reader takes in another
        layout (``self.resolved``), whose gradient the graph reduces in that redistribution's backward, nor where
        the reduction is of a value computed from the parameter by more than views (``direct`` False: Gemma 3's
        ``1 + weight``, whose backward takes its gradient whole)."""
        if placeholder not in self.params:
            return ops
        if self.request.accumulate:
            return [o for o in ops if o.kind != "all_reduce"]
        if self.request.optimizer_stage == 2 and placeholder in self.optimizer_reduces \
                and placeholder not in self.resolved and direct:
            return [dataclasses.replace(o, kind="reduce_scatter") if o.kind == "all_reduce" else o for o in ops]
        return ops

    def _edge(self, i: int, d, c, slot: int, u: int, out_idx: int, value_node: torch.fx.Node) -> None:
        """The collectives between a value's producer (decision ``u``) and its reader ``d`` (decision ``i``)'s
        input ``slot``."""
        val, terms = value_node.meta["val"], self.terms
        grad_dtype = terms.grad_dtypes.get(value_node)
        fwd, bwd = terms.comm_ops(val, self.chosen[u].outputs[out_idx], c.inputs[slot], self._pending(i, slot),
                                  value_node in self.problem.needs_grad, self.chosen[u].accumulate, grad_dtype)
        decisions = self.problem.decisions
        where = f"{decisions[u].name if value_node.op == 'placeholder' else value_node.name} -> {d.name}"
        handed_back = gradient_handed_back(value_node)
        gathers = [self._priced(o, "forward", where) for o in fwd]
        self.fwd += gathers
        if d.node in self.problem.recomputed and value_node not in self.from_params:
            # (a recomputed reader's activation moved again before its backward: exec computes the region again;
            # selectively, it keeps what reductions made and gathers again)
            again = self.problem.run_again(d.node, fwd)
            self.bwd += [self._priced(o, "backward", where + " (recomputed)") for o in again]
        if handed_back is not None:  # a split parameter's all-gathers: exec fuses them into buckets too
            unit = self.units.get(handed_back, "")
            self.gathered += [(g, ("all_gather", o.mesh_dim, val.dtype, unit)) for g, o in zip(gathers, fwd)
                              if o.kind == "all_gather"]
        if self.reshard and value_node in self.from_params and \
                _read_in_backward(d.node, slot, self.problem.needs_grad):
            gathers_again = [o for o in fwd if o.kind == "all_gather"]
            again = [self._priced(o, "backward", where + " (again)") for o in gathers_again]
            self.regathers += again
            if handed_back is not None:
                self.regathered += [(g, ("all_gather", o.mesh_dim, val.dtype, self.units.get(handed_back, "")))
                                    for g, o in zip(again, gathers_again)]
            self.regather_s += sum(c.seconds for c in again)
        bwd = self._synced(bwd, handed_back, _through_views(value_node))
        if handed_back is not None:
            self.gradients += [(len(self.bwd) + k, self._kind(bwd[k], grad_dtype or val.dtype, handed_back),
                                self.position[handed_back]) for k in _last_reduction(bwd)]
        self.bwd += [self._priced(o, "backward", where, handed_back is not None) for o in bwd]

    def _kind(self, op, dtype: torch.dtype, placeholder: torch.fx.Node) -> tuple:
        """The bucket kind of a gradient's reduction: an all-reduce's (DDP's) crosses layers, a reduce-scatter's
        (FSDP's) stays within its parameter's unit, as exec fuses them."""
        unit = (self.units.get(placeholder, ""),) if op.kind == "reduce_scatter" else ()
        return (op.kind, op.mesh_dim, dtype) + unit

    def _node(self, i: int, d, c) -> None:
        """Decision ``i``'s own collectives: a graph input entering in another layout than it is held in, the
        summing of its readers' gradients."""
        held = self.held.get(i)
        needs = d.node in self.problem.needs_grad if d.node is not None else False
        fwd, bwd = node_collectives(d, c, held, needs, self.problem.mesh_shape, self.terms.grad_dtypes.get(d.node),
                                    self.summed[i])
        bwd = self._synced(bwd, d.node)
        entry = held is not None and held != c.outputs[0]  # else its readers' gradients summed
        what = f"{d.name} (entry)" if entry else f"{d.name} (dispatch)" if c.rule == "dispatch" else \
            f"{d.name} (summed)"
        placeholder = d.node is not None and d.node.op == "placeholder"
        if placeholder:  # a graph input's gradient, handed back
            grad_dtype = self.terms.grad_dtypes.get(d.node) or d.node.meta["val"].dtype
            self.gradients += [(len(self.bwd) + k, self._kind(bwd[k], grad_dtype, d.node),
                                self.position[d.node]) for k in _last_reduction(bwd)]
        self.fwd = [self._priced(o, "forward", what) for o in fwd] + self.fwd
        self.bwd += [self._priced(o, "backward", what, placeholder) for o in bwd]
        # (its forward's collectives again, as its region is computed again)
        self.bwd += [self._priced(o, "backward", what + " (recomputed)") for o in self.problem.run_again(d.node, fwd)]


def _through_views(node: torch.fx.Node) -> bool:
    """Is ``node`` a graph input, or views of one (whose readers' pending sums pass through to it)?"""
    return cm.view_base(node).op == "placeholder"


def _resolves(src, dst) -> bool:
    """Does the backward of moving a value from layout ``src`` to ``dst`` resolve its gradient's pending sums?
    DTensor's redistribution back to ``src`` does (a gathered weight's gradient reduced whole, then cut); a value
    taken as a pending sum (Replicate to Partial: a bias added once across a row-parallel matmul's pieces) passes
    its gradient through as it came."""
    return any(s != t and not t.is_partial() for s, t in zip(src, dst))


def _shapes(node: torch.fx.Node) -> tuple[tuple[int, ...] | None, ...]:
    """The global shape of each of ``node``'s outputs (None where one is not a tensor), for the plan page."""
    vals = node.meta.get("val")
    return tuple(tuple(int(n) for n in v.shape) if isinstance(v, torch.Tensor) else None
                 for v in (vals if isinstance(vals, (list, tuple)) else [vals]))


def _read_in_backward(node: torch.fx.Node | None, slot: int, needs_grad: set) -> bool:
    """Does the backward of ``node``'s op read its tensor input ``slot``? Where another input needs a gradient (a
    weight is read for its input's gradient), unless the op only adds that input. A view's backward reads
    nothing itself, but what its readers' backward reads of the view is its input, seen through it."""
    if node is None or node.op != "call_function":
        return False
    if cm.is_view_op(node) or is_getitem(node):
        return any(_read_in_backward(user, k, needs_grad) for user in node.users
                   for k, a in enumerate([node] if is_getitem(user) else tensor_inputs(user)) if a is node)
    if slot in REGISTRY.added_inputs(node.target):  # terms it only adds (a bias, either side of a sum)
        return False
    return any(a in needs_grad for k, a in enumerate(tensor_inputs(node)) if k != slot)


def _why_gathered(problem: StrategyProblem, request: PlanRequest, pricing: Pricing, terms: Terms,
                  solution: Solution) -> list[str]:
    """Notes for explain() where the plan gathers a batch that was given split: unavoidably (data_parallel), or,
    for an in_strategy split, where the reader has no rule for the pieces or where the objective preferred it.
    Read off the solution: nothing is solved again."""
    decisions, choice = problem.decisions, solution.choice
    if request.keep_split:
        at = gathered_at(decisions, choice, terms.violations)
        return [f"data_parallel: no rule runs these on batch slices, so the batch is gathered for them: "
                f"{', '.join(at)}"] if at else []
    dims = tuple(sorted({d for r in request.inputs if r.fixed is not None for d, p in enumerate(r.fixed)
                         if isinstance(p, Shard)}))
    captured = problem.captured
    given = [i for i, r in enumerate(request.inputs) if r.fixed is not None and splits(r.fixed, dims)
             and captured.inputs[i].kind == "input"]
    if not given:
        return []
    found = [(u, v, m) for u, v, m in pricing.violations(dims, computed_from(captured, given), choice)
             if decisions[v].node is not None]  # returned whole, as out_strategy asks: not the plan's choice
    forced = [(u, v, m) for u, v, m in found if m[0].all()]  # every way to run the reader gathers
    chose = [(u, v, m) for u, v, m in found if not m[0].all()]
    names = ", ".join(captured.inputs[i].name for i in given)
    notes = []
    at = gathered_at(decisions, choice, forced, rows=True)
    if at:
        notes.append(f"{names} split as given, then gathered where no rule runs on the pieces: {', '.join(at)}")
    at = gathered_at(decisions, choice, chose, rows=True)
    if at:
        c, m = terms.compute_of(choice), terms.comm_of(choice)
        notes.append(f"{names} split as given, but the level-{request.level} objective gathers it at {', '.join(at)} "
                     f"(this plan: compute {c * 1e3:.3f} ms, comm {m * 1e3:.3f} ms). "
                     "For data parallelism give dataset_strategy='data_parallel'.")
    return notes


def _last_reduction(bwd: list) -> list[int]:
    """Which of a gradient's reductions (``bwd``: its backward collectives) exec may fuse into a bucket: the last,
    whose result is the gradient handed back. A gradient pending over several mesh dims is reduced over one
    after the other, in mesh-dim order (DTensor's redistribute), each earlier reduction's result the next one's
    operand: exec (passes._fuse_reductions) finds only the last, over the highest dim, and checks that the
    buckets it fuses are the plan's."""
    at = [k for k, o in enumerate(bwd) if o.kind in ("all_reduce", "reduce_scatter")]
    last = max((bwd[k].mesh_dim for k in at), default=None)
    return [k for k in at if bwd[k].mesh_dim == last]


def _with_buckets(bwd_colls: list[Collective], gradients: list[tuple[int, tuple, int]]) -> list[Collective]:
    """The backward collectives with the buckets of the gradients' reductions, where a bucket fuses two or
    more; gradients taken by input number, last first (DDP's reverse parameter order, exec's too)."""
    ready = [(i, kind) for i, kind, _ in sorted(gradients, key=lambda g: -g[2])]
    return _in_buckets(bwd_colls, ready, 0)[0]


def _gathers_in_buckets(colls: list[Collective], gathered: list[tuple[Collective, tuple]],
                        first: int) -> tuple[list[Collective], int]:
    """``colls`` with the buckets of the split parameters' all-gathers among them (``gathered``: each gather and
    its kind), numbered from ``first``; and the next free number. Gathers are taken in program order, as exec
    fuses them."""
    at = {id(c): i for i, c in enumerate(colls)}
    return _in_buckets(colls, sorted(((at[id(c)], kind) for c, kind in gathered if id(c) in at),
                                     key=lambda r: r[0]), first)


def _in_buckets(colls: list[Collective], ready: list[tuple[int, tuple]], first: int) -> tuple[list[Collective], int]:
    """``colls`` with the collectives at ``ready``'s positions (in the order they are ready, with their kind) in
    buckets (strategy_search.buckets' rule), where a bucket fuses two or more, numbered from ``first``; and the
    next free number."""
    numbers = assign_buckets([(kind, colls[i].nbytes) for i, kind in ready], bucket_bytes())
    sizes = collections.Counter(numbers)
    renumber = {n: first + k for k, n in enumerate(n for n in dict.fromkeys(numbers) if sizes[n] > 1)}
    out = list(colls)
    for (i, _), n in zip(ready, numbers):
        if n in renumber:
            out[i] = dataclasses.replace(out[i], bucket=renumber[n])
    return out, first + len(renumber)


def _live_bytes(problem: StrategyProblem, chosen, kept, optimizer_stage: int = 0, returned: Sequence | None = None,
                grads_held: bool = False, reshard: bool = False, made_whole: dict | None = None,
                arrived: dict | None = None) -> tuple[dict, dict, int, int, int]:
    """Per-rank bytes alive as each node of the chosen plan runs, forward and backward, with liveness; the step's
    peak is the largest of either. Returns (forward: each node's bytes once it has run, backward: each node's
    bytes as its backward runs, for the nodes whose backward runs; the bytes the graph's inputs hold with every
    gradient made; the bytes the exit adds for the outputs; the bytes alive at the end of the step).

    Walking the forward in program order: placeholders (and, for trainable parameters, their optimizer states)
    are alive throughout; a value some backward reads (saved.saved_until) stays alive once made, unless the plan
    recomputes it (``kept``: the values it does not); any other value lives until its last reader. The outputs
    leave in the layouts the call returns them in (``returned``: a whole value gathered onto every rank holds
    all of its bytes there), alive from the end of the forward through the backward (what the caller computes
    from them keeps them). Then the backward in reverse program order, from where the forward ended: the
    outputs' gradients arrive, in the layouts the outputs were returned in, and stay (the caller's autograd holds
    them until the backward ends: an output the loss does not read gets zeros); each op's
    backward makes its inputs' gradients (where one is not there yet: readers' gradients are summed into one),
    then its own gradient is consumed and the values only it still reads are released. A checkpointed region's
    values that backwards still to run read come back when the walk enters the region, and go as kept ones do.
    A trainable parameter's gradient is made from none by its first reader's backward (``grads_held``: held
    from before the step, as gradients accumulated without sync are); an input's stays until it is handed back;
    a view's is a view (no bytes), as its value is. Split parameters gathered whole take their bytes as
    gathered.gather_events says (``reshard``: gathered again in backward, as level 1 does). A value made whole and
    then laid out (``made_whole``: its whole bytes, as_read) holds them while its op runs. A tensor argument
    arriving in another layout than the plan's (``arrived``: by graph input, the layout it is held in) is held
    by the caller through the step beside the piece the plan reads (:func:`_arrival_bytes`).
    """
    sizes = _NodeBytes(problem, chosen, optimizer_stage, arrived)
    nodes = list(problem.captured.gm.graph.nodes)
    reads, copied = read_copies(problem, chosen)
    until = saved_until(nodes, problem.needs_grad, copied) if problem.needs_grad else {}
    saving = {v: r for v, r in until.items() if v in kept}
    gathered, flat = gathered_copies(problem, chosen)
    events = gather_events(gathered + reads, flat, {n: i for i, n in enumerate(nodes)}, reshard,
                           bool(problem.needs_grad))
    for node, nbytes in (made_whole or {}).items():  # (before its op runs, gone after)
        for add in events[:2]:
            add[node] = add.get(node, 0) + nbytes
    for node, nbytes in _backward_scratch(problem, sizes).items():  # (while its backward runs)
        for add in events[2:]:
            add[node] = add.get(node, 0) + nbytes
    at, resident, outputs, live, saved = _forward_walk(problem, sizes, saving, returned, grads_held, events[:2])
    if not problem.needs_grad:
        return at, {}, resident, outputs, live
    back, end = _backward_walk(problem, sizes, live, saved, until, grads_held, events[2:], returned)
    return at, back, resident, outputs, end


def _backward_scratch(problem: StrategyProblem, sizes: "_NodeBytes") -> dict[torch.fx.Node, int]:
    """The scratch each backward allocates beside the gradient it makes (REGISTRY.backward_scratch), by node."""
    found = {}
    for node in problem.needs_grad:
        slot = REGISTRY.backward_scratch(getattr(node, "target", None))
        source = tensor_inputs(node)[slot] if slot is not None else None
        if source in problem.needs_grad:
            found[node] = sizes.local(source)
    return found


class _NodeBytes:
    """A node's per-rank bytes in the chosen plan."""

    def __init__(self, problem: StrategyProblem, chosen, optimizer_stage: int = 0, arrived: dict | None = None):
        self.by_node = {d.node: c for d, c in zip(problem.decisions, chosen) if d.node is not None}
        self.mesh_shape, self.stage = problem.mesh_shape, optimizer_stage
        inputs = problem.captured.placeholders
        self.arrived = {inputs[i]: held for i, held in (arrived or {}).items()}

    def local(self, node) -> int:
        c = self.by_node.get(node)
        if c is None:  # getitem: its producer holds the value
            return 0
        vals = [v for v in pytree.graph_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        return sum(cm.local_numel(v.shape, pl, self.mesh_shape) * v.element_size()
                   for v, pl in zip(vals, c.outputs) if pl is not None)

    def own(self, node) -> int:
        """What computing it allocates: a view none."""
        return 0 if node.op == "call_function" and cm.is_view_op(node) else self.local(node)

    def gradient(self, param) -> int:
        """A trainable parameter's gradient: its local bytes, or a stage-2 sharded optimizer's share of them."""
        pl = self.by_node[param].outputs[0]
        return int(self.local(param) * gradient_copies(pl, self.mesh_shape, self.stage, param.meta["val"].dim()))

    def held(self, node, trainable: set) -> int:
        """A graph input's bytes through the step: a trainable parameter's with its gradient and optimizer states,
        an argument's with the caller's tensor where it arrives in another layout."""
        if node not in trainable:
            val, pl = node.meta["val"], self.by_node[node].outputs[0]
            return self.local(node) + (_arrival_bytes(val, self.arrived[node], pl, self.mesh_shape)
                                       if node in self.arrived and isinstance(val, torch.Tensor) else 0)
        pl = self.by_node[node].outputs[0]
        return int(self.local(node) * parameter_copies(pl, self.mesh_shape, self.stage, node.meta["val"].dim()))

    def returned(self, output_nodes, returned, held: Container) -> tuple[int, dict]:
        """What the caller holds of the outputs once the forward ends: (the bytes of the copies the exit makes,
        of outputs returned in another layout than their own; the outputs returned as they are made, with their
        bytes, but those the walk holds anyway: ``held``, a graph input's, or a value kept for backward, or what
        one views)."""
        copies, made = 0, {}
        for out, placements in zip(output_nodes, returned or ()):
            if not isinstance(out, torch.fx.Node) or not isinstance(out.meta.get("val"), torch.Tensor):
                continue
            own = _chosen_output(out, self.by_node)
            if own is None:
                continue
            copy, as_made = as_returned(out.meta["val"], own, placements, self.mesh_shape, cm.view_base(out) in held)
            copies += copy
            if as_made:
                made[out] = as_made
        return copies, made


def _arrival_bytes(val: torch.Tensor, held, placements, mesh_shape) -> int:
    """What a tensor argument arriving in ``held`` (the caller's layout) adds where the plan lays it out in
    ``placements`` instead: the caller's tensor stays alive beside the piece the plan reads (a batch given whole
    and split over "dp": the whole batch and its piece), through the step as the caller holds it. (The search's
    memory terms leave it out: charged there, level 1 kept arguments given whole whole, and its peaks rose: Alpa's
    MLP as a function of four whole weights, 2.3 GB a rank where level 2's plan holds 1.9.)"""
    if held is None or tuple(held) == tuple(placements):
        return 0
    return cm.local_numel(val.shape, held, mesh_shape) * val.element_size()


def _forward_walk(problem: StrategyProblem, sizes: _NodeBytes, saving: dict, returned, grads_held: bool,
                  gathers: tuple[dict, dict]):
    """The forward in program order: (bytes after each node, the inputs' bytes with every gradient, the exit's
    bytes, the bytes alive at the end, the values saved for backward with their bytes)."""
    order = list(problem.captured.gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(order):
        for a in node.all_input_nodes:
            last_use[a] = i
    live, at, resident, outputs = 0, {}, 0, 0
    transient: dict[torch.fx.Node, int] = {}
    saved: dict[torch.fx.Node, int] = {}  # values held for backward: released as the backward walk passes them
    for i, node in enumerate(order):
        if node.op == "placeholder":
            resident += sizes.held(node, problem.trainable)
            live += sizes.held(node, problem.trainable)
            if node in problem.trainable and not grads_held:  # made by the backward
                live -= sizes.gradient(node)
        elif node.op == "call_function":
            nbytes = sizes.own(node)
            live += nbytes + gathers[0].get(node, 0)
            (saved if node in saving else transient)[node] = nbytes
        elif node.op == "output":  # (the caller holds the outputs as returned: one made so is not freed)
            outputs, made = sizes.returned(problem.captured.output_nodes, returned,
                                           {*saved, *problem.captured.placeholders})
            live += outputs
            for out, nbytes in made.items():
                outputs += nbytes
                if not transient.pop(cm.view_base(out), 0):  # (a view of a value gone, an item: its bytes)
                    live += nbytes
        at[node] = int(live)
        live -= gathers[1].get(node, 0)
        for a in node.all_input_nodes:
            if last_use.get(a) == i and a in transient:
                live -= transient.pop(a)
    return at, resident, outputs, live, saved


def _backward_walk(problem: StrategyProblem, sizes: _NodeBytes, live: int, saved: dict, until: dict,
                   grads_held: bool, gathers: tuple[dict, dict], returned) -> tuple[dict, int]:
    """The backward in reverse program order from where the forward ended: bytes alive as each node's backward
    runs, and at its end."""
    needs_grad, trainable = problem.needs_grad, problem.trainable

    def region(n):  # a checkpointed region's number, or the layer the search recomputes
        return problem.regions.get(n, checkpoint_region(n))

    regions: dict[int | str, list[torch.fx.Node]] = {}
    for n in problem.recomputed:
        regions.setdefault(region(n), []).append(n)
    released: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # the node after whose backward a value goes
    for v in saved:
        released.setdefault(until[v], []).append(v)
    order = {n: i for i, n in enumerate(problem.captured.gm.graph.nodes)}
    grads: dict[torch.fx.Node, int] = {}  # gradients alive, by the value they are the gradient of

    def gradient(a) -> None:
        nonlocal live
        base = cm.view_base(a)  # a parameter's view: the parameter's gradient
        if base in trainable and base not in grads:
            grads[base] = 0 if grads_held else sizes.gradient(base)
            live += grads[base]
        if a in needs_grad and a not in grads:
            grads[a] = 0 if a in trainable else sizes.own(a)
            live += grads[a]

    outputs = {out for out in problem.captured.output_nodes if isinstance(out, torch.fx.Node)}
    for out in outputs:  # from the caller
        gradient(out)
    for out, placements in zip(problem.captured.output_nodes, returned or ()):  # in the layout returned
        if out in grads and out not in trainable and isinstance(out.meta.get("val"), torch.Tensor):
            v = out.meta["val"]
            whole = cm.local_numel(v.shape, placements, sizes.mesh_shape) * v.element_size()
            live += max(0, whole - grads[out])
            grads[out] = max(grads[out], whole)
    back = {}
    for node in reversed(list(problem.captured.gm.graph.nodes)):
        if node.op != "call_function":
            continue
        for n in regions.pop(region(node), ()):  # a checkpointed (or recomputed) region computed again: what
            last = until.get(n)  # backwards still to run read of it stays, until the last of them
            if last is not None and order[last] <= order[node]:
                saved[n] = sizes.own(n)
                released.setdefault(last, []).append(n)
                live += saved[n]
        if node in needs_grad:
            for a in node.all_input_nodes:
                gradient(a)
            live += gathers[0].get(node, 0)
            back[node] = int(live)
            live -= gathers[1].get(node, 0)
            if node not in outputs:
                live -= grads.pop(node, 0)
        for v in released.pop(node, ()):
            live -= saved.pop(v, 0)
    return back, int(live)


def _largest_reduction(bwd_colls: list[Collective], gradients: list[tuple[int, tuple, int]]) -> int:
    """The bytes of the largest reduction of gradients handed back, a bucket's all together: exec concatenates a
    bucket's gradients into one flat buffer (a lone gradient's reduction makes its result), and both are alive
    as it does."""
    by_bucket: dict = collections.Counter()
    for i, _, _ in gradients:
        c = bwd_colls[i]
        by_bucket[("bucket", c.bucket) if c.bucket is not None else i] += c.nbytes
    return max(by_bucket.values(), default=0)


def _chosen_output(node: torch.fx.Node, by_node: dict):
    """The placements the plan gives ``node``'s value (a getitem's: its producer's output it names)."""
    c = by_node.get(node)
    if c is not None:
        return c.outputs[0]
    if is_getitem(node) and node.args[0] in by_node:
        outs = by_node[node.args[0]].outputs
        return outs[node.args[1]] if isinstance(node.args[1], int) and node.args[1] < len(outs) else None
    return None


class OverBudget(ValueError):
    """The plan read off a solution (``plan``) holds more than the device's memory; ``outputs``: the bytes of the
    outputs the caller holds as they are returned, which no plan lowers."""

    def __init__(self, plan: Plan, outputs: int, message: str):
        super().__init__(message)
        self.plan, self.peak, self.outputs = plan, plan.cost.peak_bytes, outputs


def _check_budget(problem: StrategyProblem, request: PlanRequest, plan: Plan, resident: int, outputs: int) -> None:
    """No plan over the device's memory is returned: the error gives the figures and what would fit."""
    budget, peak = request.profile.memory_bytes, plan.cost.peak_bytes
    if peak <= budget:
        return
    GiB = 2**30
    trainable = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in problem.trainable)
    world = math.prod(problem.mesh_shape)
    states = trainable * parameter_copies((), problem.mesh_shape)  # value, gradient, AdamW's two moments
    ways = []
    if states > budget * world:
        ways.append(f"more ranks: the parameters, gradients and optimizer states alone are {states / GiB:.1f} GiB, "
                    f"at least {math.ceil(states / budget)} ranks split over all of them")
    if request.policy.solves_again_lower and peak - outputs > budget:  # (not already the least memory)
        ways.append("level=1 (least memory)")
    if request.policy.solves_again_lower and request.optimizer_stage < 2 and resident > budget / 4:
        ways.append("sf.shard_optimizer(opt, model, stage=2) (optimizer states and gradients of whole "
                    "parameters split)")
    if outputs > 0.1 * budget:
        ways.append(f"outputs returned split (out_strategy, or dataset_strategy='data_parallel': each rank its "
                    f"rows) or not at all (a model's logits where only its loss is wanted): as returned, the "
                    f"caller holds {outputs / GiB:.1f} GiB of them on every rank")
    what = "a shorter sequence or smaller batch" if problem.regions else \
        "recompute (recompute=True, or torch.utils.checkpoint around layers) or a shorter sequence or smaller batch"
    ways.append(f"{what}: activations and gathered parameters take {(peak - resident - outputs) / GiB:.1f} GiB a "
                f"rank")
    raise OverBudget(plan, outputs,
        f"level={request.level}: no plan found fits the per-rank memory of the {request.profile.name} profile "
        f"({budget / GiB:.1f} GiB): this plan's peak is {peak / GiB:.1f} GiB a rank, of which parameters, "
        f"gradients, optimizer states and inputs {resident / GiB:.1f} GiB. What would fit: " + "; ".join(ways))
