"""Recompute as a decision of the search: which regions backward computes again instead of keeping their values.

A region is a layer of the module as ``str(plan)`` reads layers (the submodule path up to its index,
``model.layers.3``; else its first two names, ``model.norm``). Recomputing it keeps, from forward to backward, only
what enters and leaves it, as ``torch.utils.checkpoint`` around the layer would: its values read only inside it
are computed again when the backward reaches it (random draws are kept: computed again they would differ). The
memory model is the read-out's one liveness walk (``readout._live_bytes``), which brings a region's values back
when the backward enters it; pricing counts a recomputed value's forward once more and keeps none of its bytes.

A region may also be recomputed selectively (Megatron's selective recompute, torchtitan's op-level policy): its
matmuls' and attention's results are kept, and only the cheap ops between them (norms, activations, rotary
embeddings, casts) are computed again: less memory saved, for much less forward again. Each layer offers both;
the selective one, saving more bytes per second computed again, is tried first, the whole layer after it.

Identical layers (one name but for the index, the same ops on the same shapes) decide alike: they form one group.
The policy (``PlanRequest.recompute``): None lets the search decide: at levels 0 and 2, only where the plan does
not fit the memory without it, groups added in order of bytes saved per second of forward computed again until
the plan fits (level 2 keeps the fastest plan where memory allows), and of the last group added only as many of
its layers (its first ones) as the memory needs (:func:`_fewest`), the plan without it not tried where even with
every value split as far as it goes it would hold most of the memory (``_KEPT_SHARE``); at level 1, every group
that lowers the peak.
True recomputes every region; "selective" every region selectively; False none. Regions the user checkpointed
stay checkpointed in every case.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import operator
import re
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from .. import _pytree_internals as pytree
from ..capture.graph import checkpoint_region, module_path, replayable
from . import cost_model as cm
from ._summary import layer_group, layer_of
from .plan import Plan, Recompute
from .pricing import _BACKWARD_FACTOR, Pricing, Terms
from .problem import StrategyProblem
from .registry import REGISTRY
from .request import PlanRequest

__all__ = ["Region", "plan_with_recompute", "region_groups", "with_recompute"]

# plan_within(problem, terms, final, optional=False) -> Plan: the level's plan within the memory, raising a
# ValueError (OverBudget or the level's "no plan fits") where none fits; ``final``: a nominal memory's over-budget
# plan returned, said; ``optional``: a try to improve on a plan found, given up where none fits by the deadline
PlanWithin = Callable[..., Plan]


@dataclass(frozen=True)
class Region:
    name: str  # the layer's path
    nodes: tuple[torch.fx.Node, ...]  # its ops in program order that exec marks, as checkpoint's region
    recomputed: frozenset[torch.fx.Node]  # those whose values are not kept: read only inside it, not random
    saved_whole: int  # bytes of those values, whole (what recomputing saves, before any split)
    seconds_whole: float  # their forward's seconds, whole on one device (what recomputing costs)
    selective: bool = False  # its matmuls and attention left out (kept: the registry's kept_selectively)


def _kept_selectively(node: torch.fx.Node) -> bool:
    """A matmul or an attention, an item of one's results, or one reshaped by ``_unsafe_view`` (a linear layer's
    3-D product: no view to autograd, the same storage; what a backward reads of it)."""
    if node.target in (operator.getitem, torch.ops.aten._unsafe_view.default):
        return isinstance(node.args[0], torch.fx.Node) and _kept_selectively(node.args[0])
    return REGISTRY.kept_selectively(node.target)


def plan_with_recompute(problem: StrategyProblem, request: PlanRequest, pricing: Pricing, terms: Terms,
                        plan_within: PlanWithin, deadline: float = math.inf, try_s: float = 0.0) -> Plan:
    """The plan of the request's level with the regions it recomputes chosen by ``request.recompute``; past
    ``deadline`` (the search's time limit, on time.perf_counter) no solve is added to recompute fewer layers.
    ``try_s``: about what one try (a solve and its read-out) takes, as pricing did (level 1's first try).
    Per module (pairs of a layer pattern and True or False): the layers a True names are recomputed in every
    plan tried, those a False names never, the rest as the search decides (None)."""
    if not isinstance(request.recompute, tuple) or not request.grad:
        return _chosen(problem, request, pricing, terms, plan_within, deadline, try_s=try_s)
    required, forbidden = _steered(request.recompute, region_groups(problem, request.profile))
    if required:
        problem = with_recompute(problem, required, _keeps_reduced(request))
        pricing.problem = problem
        terms = pricing.terms(request.keep_split)
    steered = dataclasses.replace(request, recompute=None)
    names = {r.name for r in required}
    try:
        plan = _chosen(problem, steered, pricing, terms, plan_within, deadline, forbidden | names, try_s)
    except ValueError as e:
        if hasattr(e, "plan"):
            e.plan = dataclasses.replace(e.plan, recompute=_origins(e.plan.recompute, names))
        raise
    return dataclasses.replace(plan, recompute=_origins(plan.recompute, names))


def _steered(patterns: tuple[tuple[str, bool], ...], groups: list[list[Region]]) -> tuple[list[Region], set[str]]:
    """(the regions ``patterns`` require recomputed, the names of those they forbid): the last pattern naming a
    region decides it; a pattern that names no region is refused with the names there are."""
    said: dict[str, bool] = {}
    regions = [r for g in groups for r in g]
    for pattern, value in patterns:
        named = [r.name for r in regions if _names_layer(pattern, r.name)]
        if not named:
            shown = sorted({re.sub(r"\.\d+$", ".*", r.name) for r in regions})
            raise ValueError(f"recompute: {pattern!r} names no layer the search may recompute; the layers are "
                             f"named as str(plan) shows them: {', '.join(shown) or 'none here'}")
        said.update((name, value) for name in named)
    return [r for r in regions if said.get(r.name)], {n for n, v in said.items() if not v}


def _names_layer(pattern: str, name: str) -> bool:
    """A layer ``name`` (``model.layers.3``) is named by itself, a glob (``model.layers.*``) or a module above it
    (``model.layers``)."""
    return fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")


def _origins(records_: tuple[Recompute, ...], required: set[str]) -> tuple[Recompute, ...]:
    """The records with the regions the user required said as such."""
    return tuple(dataclasses.replace(r, origin="recompute=") if r.region in required else r for r in records_)


def _chosen(problem, request, pricing, terms, plan_within, deadline, left_out: set[str] = frozenset(),
            try_s: float = 0.0) -> Plan:
    """:func:`plan_with_recompute` for a policy of None, True or False; ``left_out``: regions (by name) the
    search does not decide (required already, or forbidden)."""
    if not request.grad or request.recompute is False:
        return _planned(problem, request, pricing, terms, [], plan_within, True)
    kept = None  # the plan keeping every value, where the memory bound it (recompute may then be faster)
    if request.recompute is None and not request.policy.recomputes_to_lower_peak \
            and sum(float(m.min()) for m in terms.memory if len(m)) <= _KEPT_SHARE * request.profile.memory_bytes:
        try:  # the level's plan without recompute, where it fits (nothing more to price)
            start = time.perf_counter()
            kept = _planned(problem, request, pricing, terms, [], plan_within, False)
            # the fastest plan fits (recompute would only slow it), or no time is left for two solves as long (a
            # try of recompute is one at least, and a second finds how few layers need it)
            if "lagrangian_rounds" not in kept.search or time.perf_counter() + 2 * (time.perf_counter() - start) \
                    > deadline:
                return kept
        except ValueError:
            pass
    groups = [g for g in ([r for r in g if r.name not in left_out] for g in region_groups(problem, request.profile))
              if g]
    if kept is not None and not groups:
        return kept
    if request.recompute == "selective":
        return _planned(problem, request, pricing, terms, [g for g in groups if g[0].selective], plan_within, True,
                        "recompute=selective")
    if request.recompute is True or not groups:
        return _planned(problem, request, pricing, terms, groups, plan_within, True, "recompute=True")
    if request.policy.recomputes_to_lower_peak:
        return _least_peak(problem, request, pricing, terms, groups, plan_within, deadline, try_s)
    # groups by bytes saved per second computed again, until the plan fits; where no plan fits yet and the time
    # left holds no try (about ``try_s``), every group at once (Llama-405B's: three tries that could not fit took
    # 1.5 s before the one that did, a solve of 4 s however late it starts)
    k = len(groups) if kept is None and time.perf_counter() + try_s > deadline else 1
    while k <= len(groups):
        if kept is not None and time.perf_counter() > deadline:
            return kept  # (a plan that fits is there: past the limit no more is tried)
        start = time.perf_counter()
        try:
            # (with a plan that fits found, each try is optional: given up where it has none by the limit)
            plan = _planned(problem, request, pricing, terms, groups[:k], plan_within, k == len(groups) and not kept,
                            optional=kept is not None)
        except ValueError:
            if k < len(groups):
                # (past the limit the rest all at once: a try that cannot fit takes a solve to say so, 5-7 s
                # each for Llama-405B's, whose layers selectively and its two small regions did not fit)
                k = len(groups) if time.perf_counter() > deadline else k + 1
                continue
            if kept is not None:
                return kept
            raise  # (its figures: with every group recomputed)
        plan = _fewest(problem, request, pricing, terms, groups[:k - 1], groups[k - 1], plan, plan_within, deadline,
                       time.perf_counter() - start)
        # the faster of the two (the memory bound the plan keeping every value: it may have paid in collectives)
        return plan if kept is None or plan.cost.total_s < kept.cost.total_s else kept
    raise AssertionError("unreachable: the last try raises or returns")


_PROBES = 3  # solves to find how few of a group's layers need recomputing
# Where a plan keeping every value would hold more than this share of the memory with each value split as far as
# it goes, it is not tried: none fits or all pay in collectives what recompute pays in forward (Llama-405B's
# least is 0.76 of 80e9 bytes; its try took the time left, 5-9 s, and walked 89-134e9; Llama-3-70B's is 0.51)
_KEPT_SHARE = 0.75


def _peak_of(e: ValueError) -> float | None:
    return e.plan.cost.peak_bytes if hasattr(e, "plan") else None


def _fewest(problem, request, pricing, terms, kept, group, plan, plan_within, deadline, took: float) -> Plan:
    """``plan`` recomputes ``kept`` and every layer of ``group`` and fits: the fewest of ``group``'s first layers
    recomputed that still fit, of ``_PROBES`` solves, and of the plans that fit the fastest (a probe's solve cut
    short by the time limit may be slower than one recomputing more). Each layer kept adds about as many bytes to
    the peak: first what its recompute saves in ``plan`` (its record's), then the slope between the last two peaks
    walked; each count tried keeps as many layers as that leaves room for (halfway, where a count tried had no
    plan, hence no peak). Tried only before ``deadline``, and only where two solves as long as the last fit
    (``took``: the seconds ``plan`` took; a probe given no time would return a plan no better proven than the
    incumbent's first guess)."""
    budget, lo, hi = request.profile.memory_bytes, 0, len(group)
    names = {r.name for r in group}
    saved = [r.saved_bytes for r in plan.recompute if r.region in names]
    if not saved or plan.cost.peak_bytes > budget:  # (a nominal memory's plan returned over it: none fewer fits)
        return plan
    per_layer = sum(saved) / len(saved)
    best = plan
    for _ in range(_PROBES):
        # (twice the last solve's time: fewer layers recomputed leave the solve more to decide, and its exact
        # elimination is not cut at the limit: DeepSeek-V3's third probe took 44.6 s after one of 10.6)
        if hi - lo <= 1 or time.perf_counter() + 2 * took > deadline:
            break
        start = time.perf_counter()
        m = (lo + hi + 1) // 2 if per_layer is None else hi - int((budget - plan.cost.peak_bytes) // per_layer)
        m = min(max(m, lo + 1), hi - 1)
        try:
            trial = _planned(problem, request, pricing, terms, [*kept, group[:m]], plan_within, False, optional=True)
            peak = trial.cost.peak_bytes
        except ValueError as e:  # (no peak where the solve found nothing within its estimate: halved)
            trial, lo, peak = None, m, _peak_of(e)
        took = time.perf_counter() - start
        if peak is not None and peak <= plan.cost.peak_bytes and trial is None:
            break  # (over the memory, though no higher than a plan that fits: the walk is not what bound it)
        # (no more for more layers kept: the line says nothing, the next count is halfway)
        per_layer = None if peak is None or peak <= plan.cost.peak_bytes else \
            (peak - plan.cost.peak_bytes) / (hi - m)
        if trial is not None:
            plan, hi = trial, m
            best = min(best, trial, key=lambda p: p.cost.total_s)
    return best


def _least_peak(problem, request, pricing, terms, groups, plan_within, deadline: float, try_s: float = 0.0) -> Plan:
    """Level 1: every group whose recompute lowers the plan's peak (each tried on top of those kept); past
    ``deadline``, the groups not tried yet are tried once, all together. Where the time left holds no two tries
    (each about ``try_s``), every group is tried at once and alone (Llama-405B's try without recompute walked
    206e9 bytes a rank and took the time: 24 s against a limit of 20). The plan of the least peak is the one its
    try found (solved again only where it did not fit: the final try's error, or a nominal memory's warning)."""
    def tried(chosen) -> tuple[Plan | None, float]:
        try:
            plan = _planned(problem, request, pricing, terms, chosen, plan_within, False)
            return plan, plan.cost.peak_bytes
        except ValueError as e:  # (over a device's memory: the plan that did not fit, for its figures)
            peak = _peak_of(e)
            return None, float("inf") if peak is None else peak

    if time.perf_counter() + 2 * try_s > deadline:
        plan, _ = tried(groups)
        return plan if plan is not None else _planned(problem, request, pricing, terms, groups, plan_within, True)
    kept, (plan, best) = [], tried([])
    for i, group in enumerate(groups):
        rest = groups[i:] if time.perf_counter() > deadline else [group]
        trial, peak = tried([*kept, *rest])
        if peak < best * (1 - 1e-3):
            kept, plan, best = [*kept, *rest], trial, peak
        if len(rest) > 1:
            break
    return plan if plan is not None else _planned(problem, request, pricing, terms, kept, plan_within, True)


def _planned(problem, request, pricing, terms, groups, plan_within, final: bool, origin: str = "search",
             optional: bool = False) -> Plan:
    """The plan with ``groups`` recomputed (priced again for them), carrying its recompute records; ``optional``:
    a try to improve on a plan found (given up where it has none within the memory by the deadline)."""
    if groups:
        problem = with_recompute(problem, [r for g in groups for r in g], _keeps_reduced(request))
    pricing.problem = problem  # (its memos hold for every such problem: recompute changes no candidate list)
    if groups:
        terms = pricing.terms(request.keep_split)
    try:
        plan = plan_within(problem, terms, final, optional)
    except ValueError as e:
        if hasattr(e, "plan"):  # OverBudget: its plan shows what it recomputed, and the error says so
            e.plan = dataclasses.replace(e.plan, recompute=records(problem, e.plan, origin))
            if groups:
                e.args = (f"{e.args[0]} (with recompute of {_names(groups)})",)
        if request.recompute is False and e.args:  # (the level's "no plan fits": what else would)
            e.args = (f"{e.args[0]}, or let the search recompute layers in backward (recompute=None)",)
        raise
    return dataclasses.replace(plan, recompute=records(problem, plan, origin))


def _names(groups) -> str:
    return ", ".join(f"{g[0].name}" + (f" and {len(g) - 1} more like it" if len(g) > 1 else "") for g in groups)


def _keeps_reduced(request: PlanRequest) -> bool:
    """Do the regions recomputed selectively keep what their collectives reduced (not at level 1, the least
    memory: StrategyProblem.keeps_reduced_for)?"""
    return not request.policy.recomputes_to_lower_peak


def with_recompute(problem: StrategyProblem, regions: list[Region], keeps_reduced: bool = True) -> StrategyProblem:
    """``problem`` with ``regions`` recomputed: their values are not kept (pricing, the read-out's walk); those
    recomputed selectively keep what their collectives reduced where ``keeps_reduced``."""
    where = {n: r.name for r in regions for n in r.nodes}
    whole = {r.name for r in regions if not r.selective}  # (a layer recomputed whole and selectively: whole)
    selective = (problem.selective - whole) | {r.name for r in regions if r.selective and r.name not in whole}
    return dataclasses.replace(problem, recomputed=problem.recomputed | {n for r in regions for n in r.recomputed},
                               regions={**problem.regions, **where}, selective=frozenset(selective),
                               selective_keeps_reduced=keeps_reduced)


def region_groups(problem: StrategyProblem, profile: cm.DeviceProfile) -> list[list[Region]]:
    """The regions the search may recompute, identical layers in one group, groups by bytes saved per second of
    forward computed again (most first); regions that would save nothing left out."""
    layers: dict[str, list[torch.fx.Node]] = {}
    captured = problem.captured
    # ops on parameters alone (a weight's transpose) are left out: graph order hoists them out of their layer,
    # and the backward reads them as it reads the parameters
    from_params = {n for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param"}
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.all_input_nodes and set(node.all_input_nodes) <= from_params:
            from_params.add(node)
        elif checkpoint_region(node) is None and module_path(node):
            layers.setdefault(layer_of(module_path(node)), []).append(node)
    groups: dict[tuple, list[Region]] = {}
    for name, nodes in layers.items():
        whole = _region(problem, name, nodes, profile)
        part = _region(problem, name, [n for n in nodes if not _kept_selectively(n)], profile, nodes)
        for region in (whole, part) if part.recomputed != whole.recomputed else (whole,):
            if region.saved_whole > 0:
                # (by what it recomputes: a layer may also hold a value every layer reads, made once: dropout's
                # scalar)
                groups.setdefault((region.selective, _likeness(name, [n for n in nodes if n in region.recomputed])),
                                  []).append(region)
    # each group's layers in program order, by their last op read (graph order may hoist a layer's first ops, and
    # an unread item of a multi-output op may trail the graph), as records() orders them
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    in_order = [sorted(g, key=lambda r: order[next((n for n in reversed(r.nodes) if n.users), r.nodes[-1])])
                for g in groups.values()]
    return sorted(in_order, key=lambda g: -g[0].saved_whole / max(g[0].seconds_whole, 1e-15))


def _region(problem: StrategyProblem, name: str, nodes: list[torch.fx.Node], profile: cm.DeviceProfile,
            layer: list[torch.fx.Node] | None = None) -> Region:
    """The region of ``nodes``, of the layer's ops ``layer`` (the same where None; else a selective region: the
    layer's ops but those it keeps)."""
    inside = set(nodes if layer is None else layer)
    recomputed = frozenset(n for n in nodes if n in problem.needs_grad and n.users and set(n.users) <= inside
                           and replayable(n))
    saved = seconds = 0.0
    for n in recomputed:
        vals = [v for v in pytree.graph_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
        if not cm.is_view_op(n):
            saved += sum(v.numel() * v.element_size() for v in vals)
            seconds += cm.compute_seconds(cm.node_flops(n), cm.node_bytes(n), 1, profile,
                                          vals[0].dtype if vals else torch.float32)
    return Region(name, tuple(nodes), recomputed, int(saved), seconds, layer is not None)


def _likeness(name: str, nodes: list[torch.fx.Node]) -> tuple:
    """What identical layers share: the name but for its index, and each op with its shapes."""
    def shapes(n):
        return tuple(tuple(v.shape) for v in pytree.graph_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor))

    return layer_group(name), tuple(sorted((str(n.target), shapes(n)) for n in nodes))


def records(problem: StrategyProblem, plan: Plan, origin: str) -> tuple[Recompute, ...]:
    """What the plan recomputes, per region in program order: the search's regions (their ops, which exec marks)
    and those the user checkpointed (exec reads their marks from the graph), each with the per-rank bytes it
    does not keep and the seconds of forward it computes again."""
    regions: dict = {}
    last: dict = {}  # each region's last op: regions in program order (graph order may hoist a layer's mask ops)
    for i, node in enumerate(problem.captured.gm.graph.nodes):
        key = problem.regions.get(node)
        key = key if key is not None else checkpoint_region(node)
        if key is not None and node.op == "call_function":
            regions.setdefault(key, []).append(node)
            if node.users:  # (an unread item of a multi-output op may trail the graph)
                last[key] = i
    out = []
    for key in sorted(regions, key=lambda k: last.get(k, -1)):
        nodes = regions[key]
        saved, extra = 0, 0.0
        for n in nodes:
            np_ = plan.nodes.get(n.name)
            if n not in problem.recomputed or np_ is None:
                continue
            extra += (np_.compute_s or 0.0) / (_BACKWARD_FACTOR + 1)  # (priced: forward, backward, forward again)
            if not cm.is_view_op(n):
                vals = [v for v in pytree.graph_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
                saved += sum(cm.local_numel(v.shape, pl, problem.mesh_shape) * v.element_size()
                             for v, pl in zip(vals, np_.outputs) if pl is not None)
        if isinstance(key, str):
            selective = key in problem.selective
            out.append(Recompute(key, origin, tuple(n.name for n in nodes), int(saved), extra, selective,
                                 selective and problem.selective_keeps_reduced))
        else:  # a region the user checkpointed: named by the layer of its first op
            where = layer_of(module_path(nodes[0])) if module_path(nodes[0]) else "fn"
            out.append(Recompute(f"checkpoint {key} ({where})", "checkpoint", (), int(saved), extra))
    return tuple(out)
