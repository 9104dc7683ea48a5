"""CapturedGraph + PlanRequest -> Plan: build the strategy problem, solve it, read the plan off the solution.

Every placeholder, every op node and the graph's output is one decision; getitem nodes follow their producer.
User constraints (in_strategy, parameter_plan, DTensor inputs, out_strategy) fix their decision to a single
candidate, so the solver propagates them: it prefers choices that need no redistribution, then cheaper ones.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ..capture.graph import CapturedGraph, checkpoint_region
from ..layout import MeshSpec
from . import cost_model as cm
from .buckets import assign_buckets, bucket_bytes
from .candidates import (
    Candidate,
    input_candidates,
    is_alias,
    node_candidates,
    replicated_candidates,
    tensor_inputs,
    warn_fallbacks,
    with_accumulation,
)
from .plan import Collective, Cost, InputPlan, NodePlan, Plan
from .solver import Infeasible, Problem, solve

__all__ = ["InputRequest", "OutputRequest", "PlanRequest", "make_plan"]

Placements = tuple[Placement, ...]
aten = torch.ops.aten


@dataclass(frozen=True)
class InputRequest:
    """What the caller says of one graph input: the layout it arrives in (None: laid out as planned before the
    call, as parameters are) and the layout asked for (None: the search decides)."""

    held: Placements | None = None
    fixed: Placements | None = None


@dataclass(frozen=True)
class OutputRequest:
    """What the caller wants of one graph output: its placements, and whether it is returned as a DTensor (else
    as this rank's local tensor: a whole value, or its batch slice)."""

    placements: Placements
    as_dtensor: bool = False


@dataclass
class PlanRequest:
    """Everything the search is asked, per graph input (placeholder order) and per graph output."""

    inputs: list[InputRequest]
    outputs: list[OutputRequest]
    grad: bool = True  # a backward pass runs
    level: int = 0
    profile: cm.DeviceProfile = cm.CPU
    # mesh dims over which the batch stays split (data parallelism): values computed from the inputs split there
    # are not gathered over them in forward, wherever a plan can avoid it
    keep_split: tuple[int, ...] = ()

    def held(self) -> dict[int, Placements]:
        return {i: r.held for i, r in enumerate(self.inputs) if r.held is not None}

    def fixed(self) -> dict[int, Placements]:
        return {i: r.fixed for i, r in enumerate(self.inputs) if r.fixed is not None}


@dataclass
class _Decision:
    node: torch.fx.Node | None  # None: the graph output sink
    name: str
    candidates: list[Candidate]
    # (producer decision, producer output index, fx node that carries the value) per tensor input slot
    sources: list[tuple[int, int, torch.fx.Node]]


def _val(node: torch.fx.Node) -> torch.Tensor:
    v = node.meta["val"]
    return v


def _split(c: Candidate, mesh_shape: Sequence[int]) -> int:
    """How many ways a candidate splits its work: the mesh dims where some operand is sharded. (A pending-sum
    operand alone splits nothing: every rank still runs the whole op on its piece.)"""
    dims = set()
    for pl in list(c.inputs) + [o for o in c.outputs if o is not None]:
        dims.update(d for d, p in enumerate(pl) if isinstance(p, Shard))
    return int(np.prod([mesh_shape[d] for d in dims])) if dims else 1


def _pending(c: Candidate, slot: int, passes_on: bool = False) -> tuple[bool, ...]:
    """Mesh dims where this candidate leaves the gradient of input ``slot`` as a pending sum. The outputs' sink
    leaves none: each output's gradient comes back as the caller computed it, a replicated output's whole on
    every rank. A view that ``passes_on`` its readers' pending sums (:func:`_offer_accumulation`) leaves them
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


_REPLICATED_ONLY: dict[int, tuple[list, list]] = {}


def _replicated_only(cands: list[Candidate]) -> list[Candidate]:
    hit = _REPLICATED_ONLY.get(id(cands))
    if hit is None or hit[0] is not cands:
        whole = [c for c in cands if all(p.is_replicate() for o in c.outputs if o for p in o)][:1] or cands
        hit = (cands, whole)
        _REPLICATED_ONLY[id(cands)] = hit
    return hit[1]


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


def _fits(cands: list[Candidate], node: torch.fx.Node, inputs: list[torch.fx.Node]) -> list[Candidate]:
    """Candidates whose every Shard(d) names a dim its tensor has, and that split no empty tensor (a rule may offer
    the other operands' placement for cat's empty 1-D tensor, which a cache starts from)."""

    def ok(pl, val) -> bool:
        return pl is None or not isinstance(val, torch.Tensor) or all(
            not isinstance(p, Shard) or (p.dim < val.dim() and val.numel() > 0) for p in pl)

    out_vals = _outputs(node)
    in_vals = [a.meta.get("val") for a in inputs]
    kept = [c for c in cands if all(ok(pl, v) for pl, v in zip(c.inputs, in_vals))
            and all(ok(pl, v) for pl, v in zip(c.outputs, out_vals))]
    # the list itself where nothing is dropped: identical layers share candidate lists, and with them the edge
    # matrices built for them (_terms)
    return cands if len(kept) == len(cands) else (kept or cands)


def _outputs(node: torch.fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _distinct(keys: list) -> tuple[list, np.ndarray]:
    """The distinct keys in first-seen order, and each key's position among them."""
    pos: dict = {}
    idx = np.array([pos.setdefault(k, len(pos)) for k in keys], dtype=np.int64)
    return list(pos), idx


def _needs_grad(captured: CapturedGraph, grad: bool) -> set[torch.fx.Node]:
    if not grad:
        return set()
    out: set[torch.fx.Node] = set()
    for node, gi in zip(captured.placeholders, captured.inputs):
        if gi.requires_grad and gi.dtype.is_floating_point:
            out.add(node)
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and any(a in out for a in node.all_input_nodes):
            vals = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
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


def make_plan(
    captured: CapturedGraph,
    mesh: DeviceMesh,
    mesh_spec: MeshSpec,
    request: PlanRequest,
    time_limit_s: float = 60.0,
) -> Plan:
    mesh_shape = tuple(mesh.shape)
    level, profile, held, fixed_inputs = request.level, request.profile, request.held(), request.fixed()
    decisions: list[_Decision] = []
    producer: dict[torch.fx.Node, tuple[int, int]] = {}  # value node -> (decision, output index)
    fallbacks: set[str] = set()

    written = _written_layouts(captured, request)
    for i, node in enumerate(captured.placeholders):
        fixed = written.get(i, fixed_inputs.get(i))
        cands = [Candidate((fixed,), (), "input")] if fixed is not None else \
            _without_unit_dims(input_candidates(_val(node).shape, mesh), mesh_shape)
        producer[node] = (len(decisions), 0)
        decisions.append(_Decision(node, captured.inputs[i].name, cands, []))

    write_into = {n: written[i] for i, nodes in captured.writes.items() if i in written for n in nodes}
    constant: set[torch.fx.Node] = set()  # values computed from no input (position tables, masks)
    for node in captured.gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.meta.get("val"), torch.Tensor):
            # a tensor the graph holds (made inside fn, or read from outside it): whole on every rank, sliced
            # for free where a reader wants a piece
            constant.add(node)
            producer[node] = (len(decisions), 0)
            replicated = (Replicate(),) * len(mesh_shape)
            decisions.append(_Decision(node, node.name, [Candidate((replicated,), (), "constant")], []))
            continue
        if node.op != "call_function":
            continue
        if all(a in constant for a in node.all_input_nodes):
            constant.add(node)
        if is_alias(node):
            src, idx = node.args
            producer[node] = (producer[src][0], idx)
            continue
        if node in constant and node.all_input_nodes:
            # computed from constants only: every rank computes it whole (no rule needed)
            cands = replicated_candidates(node, mesh)
        else:
            cands = _fits(_without_unit_dims(node_candidates(node, mesh, fallbacks), mesh_shape), node,
                          tensor_inputs(node))
        if node in write_into:  # an update of an input: written where the caller holds it
            into = write_into[node]
            cands = [c for c in cands if c.inputs[0] == into and c.outputs[0] == into]
            if not cands:
                raise ValueError(f"shardfn cannot plan {node.target} into {node.args[0].name}: no rule writes it "
                                 f"in the layout {into} the input is held in")
        if node in constant:
            # every rank computes it whole (cheap, no communication) and slices what its readers need; it then
            # ties no layers together (RoPE's cos/sin feed every layer)
            cands = _replicated_only(cands)
        sources = [(*producer[a], a) for a in tensor_inputs(node)]
        producer[node] = (len(decisions), 0)
        decisions.append(_Decision(node, node.name, cands, sources))

    outs = [a for a in captured.output_nodes if isinstance(a, torch.fx.Node)]
    sink_inputs = tuple(r.placements for r in request.outputs)
    decisions.append(_Decision(None, "output", [Candidate((), sink_inputs, "output")],
                               [(*producer[a], a) for a in outs]))
    _check_core_rules(fallbacks)
    warn_fallbacks(fallbacks)

    needs_grad = _needs_grad(captured, request.grad)
    trainable = {n for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param" and n in needs_grad}
    _offer_accumulation(decisions, needs_grad)
    split_values = _computed_from(captured, [i for i, r in enumerate(request.inputs)
                                             if r.held is not None and _splits(r.held, request.keep_split)])
    recomputed = _recomputed(captured) if request.grad else frozenset()
    terms = _terms(decisions, mesh_shape, needs_grad, trainable, profile, held, request.keep_split, split_values,
                   recomputed)
    solution = _solve_level(level, terms, profile, time_limit_s)
    why = _why_gathered(captured, request, decisions, terms, solution, profile, time_limit_s)

    # --- read the plan off the solution -------------------------------------------------------------------
    chosen = [d.candidates[k] for d, k in zip(decisions, solution.choice)]
    nodes = {}
    for d, c in zip(decisions, chosen):
        if d.node is not None:
            op = "input" if d.node.op == "placeholder" else str(d.node.target)
            nodes[d.node.name] = NodePlan(d.name, op, c.rule, c.inputs, c.outputs)
    fwd_colls, bwd_colls, regathers, regather_s = [], [], [], 0.0
    # level 1 (least memory) gathers a split parameter again in backward instead of keeping the whole copy from
    # forward to backward (FSDP's reshard_after_forward): one more all-gather per gathered parameter
    reshard = level == 1 and request.grad
    from_params = {n for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param"}
    for node in captured.gm.graph.nodes:  # what backward computes again from the shards: ops on parameters alone
        if node.op == "call_function" and node.all_input_nodes and set(node.all_input_nodes) <= from_params:
            from_params.add(node)
    # reductions of a gradient handed straight back: (position in bwd_colls, (mesh dim, dtype), input number)
    gradients = []
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    for d, c in zip(decisions, chosen):
        for slot, (u, out_idx, value_node) in enumerate(d.sources):
            val = _val(value_node)
            src = chosen[u].outputs[out_idx]
            fwd, bwd = terms.comm_ops(val, src, c.inputs[slot], _pending(c, slot, _passes_on(d, c)),
                                      value_node in needs_grad, chosen[u].accumulate)
            where = f"{decisions[u].name if value_node.op == 'placeholder' else value_node.name} -> {d.name}"
            fwd_colls += [Collective(o.kind, "forward", (o.mesh_dim,), o.nbytes, where) for o in fwd]
            if reshard and value_node in from_params and _read_in_backward(d.node, slot, needs_grad):
                again = [o for o in fwd if o.kind == "all_gather"]
                regathers += [Collective(o.kind, "backward", (o.mesh_dim,), o.nbytes, where + " (again)")
                              for o in again]
                regather_s += sum(cm.collective_seconds(o, mesh_shape, profile) for o in again)
            handed_back = _gradient_handed_back(value_node)
            if handed_back is not None:
                gradients += [(len(bwd_colls) + k, (o.mesh_dim, val.dtype), placeholders.index(handed_back))
                              for k, o in enumerate(bwd) if o.kind == "all_reduce"]
            bwd_colls += [Collective(o.kind, "backward", (o.mesh_dim,), o.nbytes, where) for o in bwd]
    for i, (d, c) in enumerate(zip(decisions, chosen)):
        fwd, bwd = _node_collectives(d, c, held.get(i), d.node in needs_grad if d.node is not None
                                     else False, mesh_shape)
        entry = held.get(i) is not None and held[i] != c.outputs[0]  # else its readers' gradients summed
        what = f"{d.name} (entry)" if entry else f"{d.name} (summed)"
        if d.node is not None and d.node.op == "placeholder":  # a graph input's gradient, handed back
            gradients += [(len(bwd_colls) + k, (o.mesh_dim, _val(d.node).dtype), placeholders.index(d.node))
                          for k, o in enumerate(bwd) if o.kind == "all_reduce"]
        fwd_colls = [Collective(o.kind, "forward", (o.mesh_dim,), o.nbytes, what) for o in fwd] + fwd_colls
        bwd_colls += [Collective(o.kind, "backward", (o.mesh_dim,), o.nbytes, what) for o in bwd]
    bwd_colls = _with_buckets(bwd_colls, gradients)
    compute_s = terms.compute_of(solution.choice)
    comm_s = terms.comm_of(solution.choice) + regather_s
    bwd_colls += regathers
    peak = _peak_bytes(captured, decisions, chosen, mesh_shape, needs_grad - recomputed, trainable)
    notes = [solution.message] if solution.message not in ("optimal", "") else []
    notes += why
    if fallbacks:
        notes.append("replicated fallback for: " + ", ".join(sorted(fallbacks)))
    inputs = [InputPlan(gi.kind, gi.name, gi.shape, held.get(i, chosen[i].outputs[0]), chosen[i].outputs[0])
              for i, gi in enumerate(captured.inputs)]
    return Plan(
        mesh=mesh_spec,
        level=level,
        nodes=nodes,
        inputs=inputs,
        outputs=list(sink_inputs),
        returns_dtensor=[r.as_dtensor for r in request.outputs],
        collectives=fwd_colls + list(reversed(bwd_colls)),
        cost=Cost(compute_s, comm_s, peak, terms.savings_of(solution.choice)),
        optimal=solution.optimal,
        notes=notes,
        reshard_after_forward=bool(regathers),
    )


# inputs an op's backward does not read: terms it only adds (a bias, either side of a sum)
_ADDED = {aten.add.Tensor: (0, 1), aten.sub.Tensor: (0, 1), aten.addmm.default: (0,), aten.baddbmm.default: (0,),
          aten.addbmm.default: (0,)}


def _read_in_backward(node: torch.fx.Node | None, slot: int, needs_grad: set) -> bool:
    """Does the backward of ``node``'s op read its tensor input ``slot``? Where another input needs a gradient (a
    weight is read for its input's gradient), unless the op only adds that input. A view's backward reads
    nothing itself, but what its readers' backward reads of the view is its input, seen through it."""
    if node is None or node.op != "call_function":
        return False
    if cm.is_alias_op(node) or is_alias(node):
        return any(_read_in_backward(user, k, needs_grad) for user in node.users
                   for k, a in enumerate([node] if is_alias(user) else tensor_inputs(user)) if a is node)
    if slot in _ADDED.get(node.target, ()):
        return False
    return any(a in needs_grad for k, a in enumerate(tensor_inputs(node)) if k != slot)


def _why_gathered(captured, request, decisions, terms, solution, profile, time_limit_s) -> list[str]:
    """Notes for explain() where the plan gathers a batch that was given split: unavoidably (data_parallel), or
    because the objective prefers it (an in_strategy split), with what keeping it split would have cost."""
    if request.keep_split:
        at = _gathered_at(decisions, solution.choice, terms.violations)
        return [f"data_parallel: no rule runs these on batch slices, so the batch is gathered for them: "
                f"{', '.join(at)}"] if at else []
    dims = sorted({d for r in request.inputs if r.fixed is not None for d, p in enumerate(r.fixed)
                   if isinstance(p, Shard)})
    given = [i for i, r in enumerate(request.inputs) if r.fixed is not None and _splits(r.fixed, tuple(dims))
             and captured.inputs[i].kind == "input"]
    if not given:
        return []
    values = _computed_from(captured, given)
    terms.violations = _violations(decisions, terms.comm_ops, tuple(dims), values)
    at = _gathered_at(decisions, solution.choice, terms.violations)
    if not at:
        return []
    alternative = _solve_level(request.level, terms, profile, time_limit_s)
    names = ", ".join(captured.inputs[i].name for i in given)
    if terms.violations_of(alternative.choice):
        return [f"{names} split as given, then gathered where no rule runs on the pieces: {', '.join(at)}"]

    def figures(choice):
        c, m = terms.compute_of(choice), terms.comm_of(choice)
        ratio = terms.savings_of(choice) / m if m > 0 else float("inf")
        return f"compute {c * 1e3:.3f} ms, comm {m * 1e3:.3f} ms, ratio {ratio:.3g}"

    return [f"{names} split as given, but the level-{request.level} objective gathers it at {', '.join(at)}: "
            f"this plan {figures(solution.choice)}; keeping it split {figures(alternative.choice)}. "
            "For data parallelism give dataset_strategy='data_parallel'."]


# ops every model leans on: running one of them replicated because its rule could not be read would make every
# plan silently serial, so that is an error naming the torch release instead
_CORE_OPS = {str(op) for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.native_layer_norm.default,
    aten.embedding.default, aten._softmax.default, aten._log_softmax.default, aten.sum.dim_IntList,
    aten.mean.dim, aten.add.Tensor, aten.mul.Tensor, aten.view.default, aten.t.default, aten.transpose.int,
)}


def _check_core_rules(fallbacks: set[str]) -> None:
    missing = sorted(fallbacks & _CORE_OPS)
    if missing:
        raise RuntimeError(
            f"shardfn could not read DTensor's sharding rules for {', '.join(missing)} in torch {torch.__version__}: "
            "plans would run these whole on every rank. shardfn supports torch >=2.11,<2.16; use one of those "
            "releases, or report this torch release as unsupported.")


def _recomputed(captured: CapturedGraph) -> frozenset[torch.fx.Node]:
    """The values backward computes again instead of keeping them from forward (activation checkpointing): those
    made in a checkpoint region and read only inside it. (Results of collectives and random draws in a region are
    kept in fact: the model leaves them out.)"""
    return frozenset(n for n in captured.gm.graph.nodes if n.op == "call_function" and (
        region := checkpoint_region(n)) is not None and all(checkpoint_region(u) == region for u in n.users))


def _peak_bytes(captured, decisions, chosen, mesh_shape, kept, trainable) -> int:
    """Per-rank peak bytes of the chosen plan, with liveness.

    Walking the forward in program order: placeholders (and, for trainable parameters, their gradient and two
    optimizer states) are alive throughout; a value ``kept`` for backward stays alive once made; any other value
    lives until its last reader. The peak is the largest total seen.
    """
    by_node = {d.node: c for d, c in zip(decisions, chosen) if d.node is not None}
    last_use: dict[torch.fx.Node, int] = {}
    order = list(captured.gm.graph.nodes)
    for i, node in enumerate(order):
        for a in node.all_input_nodes:
            last_use[a] = i

    def local_bytes(node) -> int:
        c = by_node.get(node)
        if c is None:  # getitem: its producer holds the value
            return 0
        vals = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        return sum(cm.local_numel(v.shape, pl, mesh_shape) * v.element_size()
                   for v, pl in zip(vals, c.outputs) if pl is not None)

    live, peak = 0, 0
    transient: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(order):
        if node.op == "placeholder":
            live += local_bytes(node) * (4 if node in trainable else 1)
        elif node.op == "call_function":
            nbytes = 0 if cm.is_alias_op(node) else local_bytes(node)
            live += nbytes
            if node not in kept:
                transient[node] = nbytes
        peak = max(peak, live)
        for a in node.all_input_nodes:
            if last_use.get(a) == i and a in transient:
                live -= transient.pop(a)
    return int(peak)


@dataclass
class _Terms:
    """The cost model's terms for one problem: per-decision compute, memory and savings, edge communication."""

    decisions: list[_Decision]
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

    def violations_of(self, choice) -> int:
        return int(sum(m[choice[u], choice[v]] for u, v, m in self.violations))

    def compute_of(self, choice) -> float:
        return float(sum(self.compute[v][k] for v, k in enumerate(choice)))

    def comm_of(self, choice) -> float:
        edges = sum(m[choice[u], choice[v]] for u, v, m in self.edges)
        return float(edges + sum(self.reductions[v][k] for v, k in enumerate(choice)))

    def memory_of(self, choice) -> float:
        return float(sum(self.memory[v][k] for v, k in enumerate(choice)))

    def savings_of(self, choice) -> float:
        return float(sum(self.savings[v][k] for v, k in enumerate(choice)))


_EDGE_MEMO: dict = {}
_VIOLATION_MEMO: dict = {}
_COMM_MEMO: dict = {}


def _per_candidate_lists(memo: dict, key: tuple, src_cands: list, dst_cands: list, build: Callable[[], Any]):
    """``build()`` once per pair of candidate lists (``key`` holds their ids): identical layers share candidate
    lists, and with them what is built for their edges. The entry keeps the lists, so their ids are not reused
    while it stands."""
    hit = memo.get(key)
    if hit is None or hit[0] is not src_cands or hit[1] is not dst_cands:
        hit = memo[key] = (src_cands, dst_cands, build())
    return hit[2]


def _splits(placements: Placements, dims: tuple[int, ...]) -> bool:
    return any(isinstance(placements[d], Shard) for d in dims)


def _computed_from(captured: CapturedGraph, inputs: list[int]) -> set[torch.fx.Node]:
    """The values computed (forward) from these graph inputs."""
    found = {captured.placeholders[i] for i in inputs}
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _gathers(ops, dims) -> bool:
    return any(o.kind in ("all_gather", "all_to_all") and o.mesh_dim in dims for o in ops)


def _terms(decisions, mesh_shape, needs_grad, trainable, profile, held, keep_split=(), split_values=frozenset(),
           recomputed=frozenset()) -> _Terms:
    bwd_factor = 3.0  # backward ~ twice the forward's work
    compute, savings, memory = [], [], []
    for d in decisions:
        n = len(d.candidates)
        if d.node is None:
            compute.append(np.zeros(n)), savings.append(np.zeros(n)), memory.append(np.zeros(n))
            continue
        vals = [v for v in torch.utils._pytree.tree_leaves(d.node.meta.get("val")) if isinstance(v, torch.Tensor)]
        if d.node.op == "placeholder":
            compute.append(np.zeros(n)), savings.append(np.zeros(n))
            keep = 4 if d.node in trainable else 1  # value, gradient, two optimizer states
        else:
            # a view moves no bytes: splitting one saves nothing (else a plan might split a weight's transpose
            # only to gather it back for its reader)
            flops = cm.node_flops(d.node)
            nbytes = 0 if cm.is_alias_op(d.node) else cm.node_bytes(d.node)
            # backward's work, and a checkpointed value's forward once more
            factor = (bwd_factor + (d.node in recomputed)) if d.node in needs_grad else 1.0
            dtype = vals[0].dtype if vals else torch.float32
            whole = factor * cm.compute_seconds(flops, nbytes, 1, profile, dtype)
            per = np.array([factor * cm.compute_seconds(flops, nbytes, _split(c, mesh_shape), profile, dtype)
                            for c in d.candidates])
            compute.append(per), savings.append(whole - per)
            keep = 1 if d.node in needs_grad and d.node not in recomputed and not cm.is_alias_op(d.node) else 0
        memory.append(np.array([
            keep * sum(cm.local_numel(v.shape, pl, mesh_shape) * v.element_size()
                       for v, pl in zip(vals, c.outputs) if pl is not None)
            for c in d.candidates], dtype=float))

    share = _BucketShare(bucket_bytes(), sum(d.node is not None and d.node.op == "placeholder"
                                             and d.node in needs_grad for d in decisions))

    def seconds(fwd, bwd, handed_back: bool) -> float:
        """Forward and backward collectives' seconds; a gradient ``handed_back`` has its reduction fused."""
        return sum(cm.collective_seconds(op, mesh_shape, profile) for op in fwd) + sum(
            cm.collective_seconds(op, mesh_shape, profile, share(op) if handed_back else 1.0) for op in bwd)

    def comm_ops(val, src, dst, pending, grad, accumulate, handed_back=False):
        key = (tuple(val.shape), val.dtype, src, dst, pending, grad, accumulate, mesh_shape, profile,
               handed_back and share)
        if key not in _COMM_MEMO:
            item = val.element_size()
            fwd = cm.redistribute_collectives(val.shape, item, src, dst, mesh_shape)
            bwd = cm.backward_collectives(val.shape, item, src, dst, pending, mesh_shape, accumulate) if grad else []
            _COMM_MEMO[key] = (fwd, bwd, seconds(fwd, bwd, handed_back))
        return _COMM_MEMO[key]

    edges, impossible = [], []
    for v, d in enumerate(decisions):
        for slot, (u, out_idx, value_node) in enumerate(d.sources):
            val = _val(value_node)
            grad = value_node in needs_grad
            handed_back = grad and _gradient_handed_back(value_node) is not None
            src_cands = decisions[u].candidates
            from_view = grad and cm.is_alias_op(decisions[u].node)
            key = (id(src_cands), out_idx, id(d.candidates), slot, tuple(val.shape), val.dtype, grad,
                   mesh_shape, profile, cm.is_alias_op(d.node), handed_back and share, from_view)

            def build():
                pending = [_pending(c, slot, _passes_on(d, c)) for c in d.candidates]
                src_keys, src_idx = _distinct([(sc.outputs[out_idx], sc.accumulate) for sc in src_cands])
                dst_keys, dst_idx = _distinct([(c.inputs[slot], p) for c, p in zip(d.candidates, pending)])
                small = np.array([[comm_ops(val, s, t, pend, grad, acc, handed_back)[2] for t, pend in dst_keys]
                                  for s, acc in src_keys])
                return (small[np.ix_(src_idx, dst_idx)],
                        _left_to_view(src_cands, pending, mesh_shape) if from_view else None)

            matrix, forbidden = _per_candidate_lists(_EDGE_MEMO, key, src_cands, d.candidates, build)
            edges.append((u, v, matrix))
            if forbidden is not None:
                impossible.append((u, v, forbidden))
    reductions = []
    for i, d in enumerate(decisions):
        secs = np.zeros(len(d.candidates))
        for k, c in enumerate(d.candidates):
            fwd, bwd = _node_collectives(d, c, held.get(i), d.node in needs_grad if d.node is not None else False,
                                         mesh_shape)
            # a graph input's own reductions (its readers' gradients summed) hand its gradient back
            secs[k] = seconds(fwd, bwd, d.node is not None and d.node.op == "placeholder")
        reductions.append(secs)
    terms = _Terms(decisions, compute, savings, memory, edges, reductions, lambda *a: comm_ops(*a)[:2],
                   impossible=impossible)
    terms.violations = _violations(decisions, terms.comm_ops, keep_split, split_values)
    return terms


def _violations(decisions, comm_ops, keep_split, split_values) -> list[tuple[int, int, np.ndarray]]:
    """Edges where a pair of choices gathers, in forward, a value that must stay split over ``keep_split``."""
    found = []
    if not keep_split:
        return found
    for v, d in enumerate(decisions):
        for slot, (u, out_idx, value_node) in enumerate(d.sources):
            if value_node not in split_values:
                continue
            val = _val(value_node)
            src_cands = decisions[u].candidates
            key = (id(src_cands), out_idx, id(d.candidates), slot, tuple(val.shape), val.dtype, keep_split)

            def build():
                src_keys, src_idx = _distinct([sc.outputs[out_idx] for sc in src_cands])
                dst_keys, dst_idx = _distinct([c.inputs[slot] for c in d.candidates])
                bad = np.array([[float(_gathers(comm_ops(val, a, b, (), False, False)[0], keep_split))
                                 for b in dst_keys] for a in src_keys])
                return bad[np.ix_(src_idx, dst_idx)] if bad.any() else None

            bad = _per_candidate_lists(_VIOLATION_MEMO, key, src_cands, d.candidates, build)
            if bad is not None:
                found.append((u, v, bad))
    return found


def _gathered_at(decisions, choice, violations) -> list[str]:
    """Where the chosen plan gathers a value that was to stay split: "value -> reader"."""
    return [f"{decisions[u].name if decisions[u].node.op == 'placeholder' else decisions[u].node.name} -> "
            f"{decisions[v].name}" for u, v, m in violations if m[choice[u], choice[v]]]


# ops whose gradient is their input's, reshaped: a gradient reduced after them is the input's own
_RESHAPES = (torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


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


def _gradient_handed_back(node: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input whose gradient, as it leaves the program (no other reader adds to it), is what is
    reduced where ``node`` is read; else None. Exec fuses those reductions into buckets."""
    while node.op == "call_function" and node.target in _RESHAPES and len(node.users) == 1:
        node = node.args[0]
    return node if node.op == "placeholder" and len(node.users) == 1 else None


def _with_buckets(bwd_colls: list[Collective], gradients: list[tuple[int, tuple, int]]) -> list[Collective]:
    """The backward collectives with the buckets of the gradients' reductions, where a bucket fuses two or
    more; gradients taken by input number, last first (DDP's reverse parameter order, exec's too)."""
    ready = sorted(gradients, key=lambda g: -g[2])
    numbers = assign_buckets([(kind, bwd_colls[i].nbytes) for i, kind, _ in ready], bucket_bytes())
    sizes = collections.Counter(numbers)
    renumber = {n: k for k, n in enumerate(n for n in dict.fromkeys(numbers) if sizes[n] > 1)}
    out = list(bwd_colls)
    for (i, _, _), n in zip(ready, numbers):
        if n in renumber:
            out[i] = dataclasses.replace(out[i], bucket=renumber[n])
    return out


def _node_collectives(d: _Decision, c: Candidate, held, grad: bool, mesh_shape) -> tuple[list, list]:
    """(forward, backward) collectives that belong to one node rather than an edge."""
    if d.node is None:
        return [], []
    fwd, bwd = [], []
    if c.accumulate and not _passes_on(d, c):  # a view's sum is resolved where its input's is
        val = _val_of_first_output(d.node)
        bwd += cm.accumulated_collectives(val.shape, val.element_size(), c.outputs[0], mesh_shape)
    if held is not None and held != c.outputs[0]:
        val = _val(d.node)
        fwd += cm.redistribute_collectives(val.shape, val.element_size(), held, c.outputs[0], mesh_shape)
        if grad:  # the gradient goes back to the caller in the layout the input came in
            bwd += cm.redistribute_collectives(val.shape, val.element_size(),
                                               cm.gradient_placement(c.outputs[0]), held, mesh_shape)
    return fwd, bwd


def _val_of_first_output(node: torch.fx.Node) -> torch.Tensor:
    return next(v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor))


def _passes_on(d: _Decision, c: Candidate) -> bool:
    """Does ``d``, a view, hand its readers' pending gradient sums on to its input (the accumulating variant of a
    view), where the value it views sums and resolves them? Exec does so at every view; a view's other variant
    is for readers that leave it no pending sum (:func:`_left_to_view`)."""
    return c.accumulate and d.node is not None and cm.is_alias_op(d.node)


def _left_to_view(view_cands: list[Candidate], pending: list[tuple[bool, ...]], mesh_shape) -> np.ndarray | None:
    """1 where a reader leaves a pending gradient sum (over more than one rank) to a view that does not pass it
    on: exec never resolves a sum at a view (it hands it to the value viewed), so such a pair of choices prices
    a reduction no program runs; the view's passing variant prices the one that does. None if there is none."""
    keeps = np.array([not c.accumulate for c in view_cands], dtype=float)
    leaves = np.array([any(p and n > 1 for p, n in zip(pend, mesh_shape)) for pend in pending], dtype=float)
    if not (keeps.any() and leaves.any()) or not any(c.accumulate for c in view_cands):
        return None  # a view without the passing variant (several outputs): priced where it is read, as before
    return np.outer(keeps, leaves)


def _offer_accumulation(decisions: list[_Decision], needs_grad: set) -> None:
    """A single-output value read by several readers that send gradients back may sum them pending and reduce
    once: offer each of its candidates in that variant too. A view is offered handing its readers' pending sums
    on to the value it views (:func:`_passes_on`), as exec does: a tied embedding's head reads it through a
    transpose, and both readers' sums add up at the weight, reduced once."""
    readers: dict[int, int] = {}
    for d in decisions:
        for u, out_idx, value_node in d.sources:
            if value_node in needs_grad:
                readers[u] = readers.get(u, 0) + 1
    for u, d in enumerate(decisions):
        n = readers.get(u, 0)
        if (n > 1 or n and cm.is_alias_op(d.node)) and len(d.candidates[0].outputs) == 1 \
                and d.candidates[0].outputs[0] is not None:
            d.candidates = with_accumulation(d.candidates)


def _solve_level(level: int, t: _Terms, profile: cm.DeviceProfile, time_limit_s: float):
    """Choose candidates for the level's objective (see the README's *Search* section).

    0: maximise the ratio of compute saved by sharding to communication time (Dinkelbach's method: each round
       an exact solve of max savings - lambda * comm, lambda the best ratio so far), then least time on ties;
    1: minimise per-rank memory, then time;
    2: minimise step time (compute + communication) within the device's memory.
    """
    unary_time = [c + r for c, r in zip(t.compute, t.reductions)]
    upper_time = sum(float(c.max()) for c in unary_time) + sum(float(m.max()) for _, _, m in t.edges) + 1e-12

    def kept_split(edges, scale):
        # one gather of a value that must stay split, or one pair of choices no program runs, outweighs
        # everything the objective can gain elsewhere
        return edges + [(u, v, (10 * scale + 1) * m) for u, v, m in t.violations + t.impossible]

    time_problem = Problem(unary_time, kept_split(t.edges, upper_time))
    if level == 2:
        sol = solve(time_problem, time_limit_s)
        if t.memory_of(sol.choice) <= profile.memory_bytes:
            return sol
        try:
            sol = solve(Problem(time_problem.costs, time_problem.edges, (t.memory, profile.memory_bytes)), time_limit_s)
        except Infeasible:
            raise ValueError(
                f"level=2: no plan fits the per-rank memory of the {profile.name} profile "
                f"({profile.memory_bytes / 2**30:.1f} GiB); use level=1 (least memory) or more ranks"
            ) from None
        sol.message = sol.message if sol.message != "optimal" else "memory limit binding"
        return sol
    if level == 1:
        eps = 1e-3 / upper_time  # all time together is worth less than a thousandth of a byte
        costs = [mem + eps * c for mem, c in zip(t.memory, unary_time)]
        scale = sum(float(m.max()) for m in t.memory) + 1.0
        return solve(Problem(costs, kept_split([(u, v, eps * m) for u, v, m in t.edges], scale)), time_limit_s)
    eps = 1e-6 * max(sum(float(s.max()) for s in t.savings), 1e-12) / upper_time
    lam, best = 0.0, None
    for _ in range(50):
        costs = [-s + lam * r + eps * c for s, r, c in zip(t.savings, t.reductions, unary_time)]
        scale = sum(float(np.abs(s).max()) for s in t.savings) + (lam + 1) * upper_time
        sol = solve(Problem(costs, kept_split([(u, v, (lam + eps) * m) for u, v, m in t.edges], scale)),
                    time_limit_s)
        saved, comm = t.savings_of(sol.choice), t.comm_of(sol.choice)
        best = sol
        if comm <= 0 or saved - lam * comm <= 1e-9 * max(saved, 1e-12):
            break
        lam = saved / comm
    best.message = best.message if best.message != "optimal" else ""
    return best
