"""CapturedGraph + constraints -> Plan: build the strategy problem, solve it, read the plan off the solution.

Every placeholder, every op node and the graph's output is one decision; getitem nodes follow their producer.
User constraints (in_strategy, parameter_plan, DTensor inputs, out_strategy) fix their decision to a single
candidate, so the solver propagates them: it prefers choices that need no redistribution, then cheaper ones.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from ..capture.graph import CapturedGraph
from ..layout import MeshSpec
from . import cost_model as cm
from .candidates import Candidate, input_candidates, is_alias, node_candidates, tensor_inputs, warn_fallbacks
from .plan import Collective, Cost, NodePlan, Plan
from .solver import Problem, solve

__all__ = ["Constraints", "make_plan"]

Placements = tuple[Placement, ...]


@dataclass
class Constraints:
    """Fixed layouts: ``inputs[i]`` for placeholder i (params, buffers, positional inputs in graph order),
    ``outputs[j]`` for flat output j. ``grad`` says whether a backward pass will run."""

    inputs: dict[int, Placements] = field(default_factory=dict)
    outputs: list[Placements | None] = field(default_factory=list)
    grad: bool = True


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
    """How many ways a candidate splits its work: the mesh dims where any operand is not replicated."""
    dims = set()
    for pl in list(c.inputs) + [o for o in c.outputs if o is not None]:
        dims.update(d for d, p in enumerate(pl) if not p.is_replicate())
    return int(np.prod([mesh_shape[d] for d in dims])) if dims else 1


def _pending(c: Candidate, slot: int) -> tuple[bool, ...]:
    """Mesh dims where this candidate leaves the gradient of input ``slot`` as a pending sum."""
    pl = c.inputs[slot]
    working = set()
    for other in list(c.inputs) + [o for o in c.outputs if o is not None]:
        working.update(d for d, p in enumerate(other) if not p.is_replicate())
    return tuple(p.is_replicate() and d in working for d, p in enumerate(pl))


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
        if node.op == "call_function" and any(a in out for a in tensor_inputs(node)):
            vals = [v for v in torch.utils._pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
            if any(v.dtype.is_floating_point for v in vals):
                out.add(node)
    return out


def make_plan(
    captured: CapturedGraph,
    mesh: DeviceMesh,
    mesh_spec: MeshSpec,
    constraints: Constraints,
    level: int = 0,
    profile: cm.DeviceProfile = cm.CPU,
    time_limit_s: float = 60.0,
) -> Plan:
    mesh_shape = tuple(mesh.shape)
    decisions: list[_Decision] = []
    index: dict[torch.fx.Node, int] = {}
    producer: dict[torch.fx.Node, tuple[int, int]] = {}  # value node -> (decision, output index)
    fallbacks: set[str] = set()

    for i, node in enumerate(captured.placeholders):
        fixed = constraints.inputs.get(i)
        cands = [Candidate((fixed,), (), "input")] if fixed is not None else input_candidates(_val(node).shape, mesh)
        index[node] = len(decisions)
        producer[node] = (len(decisions), 0)
        decisions.append(_Decision(node, captured.inputs[i].name, cands, []))

    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if is_alias(node):
            src, idx = node.args
            producer[node] = (producer[src][0], idx)
            continue
        cands = node_candidates(node, mesh, fallbacks)
        sources = [(*producer[a], a) for a in tensor_inputs(node)]
        index[node] = len(decisions)
        producer[node] = (len(decisions), 0)
        decisions.append(_Decision(node, node.name, cands, sources))

    outs = [a for a in captured.output_nodes if isinstance(a, torch.fx.Node)]
    sink_inputs = tuple(
        constraints.outputs[j] if j < len(constraints.outputs) and constraints.outputs[j] is not None
        else (Replicate(),) * len(mesh_shape)
        for j in range(len(outs))
    )
    decisions.append(_Decision(None, "output", [Candidate((), sink_inputs, "output")],
                               [(*producer[a], a) for a in outs]))
    warn_fallbacks(fallbacks)

    needs_grad = _needs_grad(captured, constraints.grad)
    bwd_factor = 3.0 if needs_grad else 1.0

    # --- costs --------------------------------------------------------------------------------------------
    costs = []
    for d in decisions:
        if d.node is None or d.node.op == "placeholder":
            costs.append(np.zeros(len(d.candidates)))
            continue
        flops, nbytes = cm.node_flops(d.node), cm.node_bytes(d.node)
        factor = bwd_factor if d.node in needs_grad else 1.0
        costs.append(np.array([factor * cm.compute_seconds(flops, nbytes, _split(c, mesh_shape), profile)
                               for c in d.candidates]))

    comm_memo: dict = {}

    def edge_comm(val: torch.Tensor, src: Placements, dst: Placements, pending, grad: bool):
        key = (tuple(val.shape), val.dtype, src, dst, pending, grad)
        if key not in comm_memo:
            item = val.element_size()
            fwd = cm.redistribute_collectives(val.shape, item, src, dst, mesh_shape)
            bwd = cm.backward_collectives(val.shape, item, src, dst, pending, mesh_shape) if grad else []
            comm_memo[key] = (fwd, bwd)
        return comm_memo[key]

    def edge_seconds(*args) -> float:
        fwd, bwd = edge_comm(*args)
        return sum(cm.collective_seconds(op, mesh_shape, profile) for op in fwd + bwd)

    edges = []
    for v, d in enumerate(decisions):
        for slot, (u, out_idx, value_node) in enumerate(d.sources):
            val = _val(value_node)
            grad = value_node in needs_grad
            # distinct producer placements x distinct (consumer placement, pending) pairs, then expanded
            src_keys, src_idx = _distinct([sc.outputs[out_idx] for sc in decisions[u].candidates])
            dst_keys, dst_idx = _distinct([(c.inputs[slot], _pending(c, slot)) for c in d.candidates])
            small = np.array([[edge_seconds(val, s, t, pend, grad) for t, pend in dst_keys] for s in src_keys])
            edges.append((u, v, small[np.ix_(src_idx, dst_idx)]))

    solution = solve(Problem(costs, edges), time_limit_s)

    # --- read the plan off the solution -------------------------------------------------------------------
    chosen = [d.candidates[k] for d, k in zip(decisions, solution.choice)]
    nodes = {}
    for d, c in zip(decisions, chosen):
        if d.node is not None:
            op = "input" if d.node.op == "placeholder" else str(d.node.target)
            nodes[d.node.name] = NodePlan(d.name, op, c.rule, c.inputs, c.outputs)
    fwd_colls, bwd_colls = [], []
    comm_s = 0.0
    for d, c in zip(decisions, chosen):
        for slot, (u, out_idx, value_node) in enumerate(d.sources):
            val = _val(value_node)
            src = chosen[u].outputs[out_idx]
            args = (val, src, c.inputs[slot], _pending(c, slot), value_node in needs_grad)
            fwd, bwd = edge_comm(*args)
            comm_s += edge_seconds(*args)
            where = f"{decisions[u].name if value_node.op == 'placeholder' else value_node.name} -> {d.name}"
            fwd_colls += [Collective(o.kind, "forward", (o.mesh_dim,), o.nbytes, where) for o in fwd]
            bwd_colls += [Collective(o.kind, "backward", (o.mesh_dim,), o.nbytes, where) for o in bwd]
    compute_s = float(sum(costs[v][k] for v, k in enumerate(solution.choice)))
    peak = _peak_bytes(decisions, chosen, mesh_shape, needs_grad)
    notes = []
    if fallbacks:
        notes.append("replicated fallback for: " + ", ".join(sorted(fallbacks)))
    if not solution.optimal:
        notes.append(f"solver stopped early: {solution.message}")
    return Plan(
        mesh=mesh_spec,
        level=level,
        nodes=nodes,
        outputs=list(sink_inputs),
        collectives=fwd_colls + list(reversed(bwd_colls)),
        cost=Cost(compute_s, comm_s, peak),
        optimal=solution.optimal,
        notes=notes,
    )


def _peak_bytes(decisions, chosen, mesh_shape, needs_grad) -> int:
    """Per-rank bytes of every placeholder and kept activation, plus gradients of trainable inputs.

    A liveness-free upper bound: values needed by backward stay alive through the forward anyway.
    """
    total = 0
    for d, c in zip(decisions, chosen):
        if d.node is None:
            continue
        vals = [v for v in torch.utils._pytree.tree_leaves(d.node.meta.get("val")) if isinstance(v, torch.Tensor)]
        for v, pl in zip(vals, c.outputs):
            if pl is None:
                continue
            nbytes = cm.local_numel(v.shape, pl, mesh_shape) * v.element_size()
            total += nbytes * (2 if d.node.op == "placeholder" and d.node in needs_grad else 1)
    return int(total)
