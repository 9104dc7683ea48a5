"""Values read in another layout than they are made in: graph inputs (parameters, arguments) gathered whole for
their readers, the copies a rank holds while they are read and the flat buffers exec gathers them through
(exec.passes._fuse_gather: a bucket's pieces concatenated, gathered into one flat buffer, each input copied out
of it); and computed values each reader redistributes on its own (:func:`read_copies`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Container

import numpy as np
import torch
import torch.fx

from . import cost_model as cm
from .buckets import assign_buckets, bucket_bytes, bucket_unit
from .problem import StrategyProblem
from .saved import backward_readers, reads_input

__all__ = ["Gathered", "as_returned", "gathered_copies", "gather_events", "held_copies", "read_copies",
           "reduced_copies", "returned_copies"]


@dataclasses.dataclass
class Gathered:
    """One gathered copy of a graph input (or of a value computed from inputs alone): its per-rank bytes, its
    readers in program order, those whose backward reads it, whether it is a parameter's, its bucket's number
    and the unit its bucket holds (buckets.bucket_unit); ``bucket`` None: a reader's own copy of a computed
    value (:func:`read_copies`), made as it runs, through no flat buffer; ``again``: such a copy made again in
    backward (its reader's region is recomputed)."""

    nbytes: int
    readers: list[torch.fx.Node]
    backward: list[torch.fx.Node]
    param: bool
    bucket: int | None = 0
    unit: str = ""
    again: bool = False


def _from_inputs(problem: StrategyProblem) -> tuple[set, set]:
    """The values exec gathers as graph inputs (exec.passes._from_inputs, its buckets): a graph input, a value made
    from one by ops of one input each (a parameter's cast, its transpose), or a concatenation of such; the
    parameters' among them. (A value computed from several inputs, an activation, is its readers' to copy.)"""
    captured = problem.captured
    kinds = {n: gi.kind == "param" for n, gi in zip(captured.placeholders, captured.inputs)}
    for node in captured.gm.graph.nodes:
        ins = node.all_input_nodes
        if node.op == "call_function" and ins and (len(ins) == 1 or node.target is torch.ops.aten.cat.default) \
                and all(a in kinds for a in ins):
            kinds[node] = all(kinds[a] for a in ins)
    return {n for n, param in kinds.items() if param}, set(kinds)


def gathered_copies(problem: StrategyProblem, chosen) -> tuple[list[Gathered], dict[int, int]]:
    """The plan's gathered copies, in the order first read, and each bucket's flat bytes."""
    captured, mesh = problem.captured, problem.mesh_shape
    from_params, from_inputs = _from_inputs(problem)
    names = {n: gi.name for n, gi in zip(captured.placeholders, captured.inputs) if gi.kind == "param"}
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    copies: dict[tuple, Gathered] = {}
    for d, c in zip(problem.decisions, chosen):
        if d.node is None:
            continue
        for slot, (u, out_idx, value) in enumerate(d.sources):
            val = value.meta["val"]
            if value not in from_inputs or not isinstance(val, torch.Tensor):
                continue
            whole = cm.local_numel(val.shape, c.inputs[slot], mesh) * val.element_size()
            if whole > cm.local_numel(val.shape, chosen[u].outputs[out_idx], mesh) * val.element_size():
                g = copies.setdefault((value, tuple(c.inputs[slot])),
                                      Gathered(whole, [], [], value in from_params, unit=_unit(value, names)))
                if cm.is_view_op(d.node):  # read through the view (a weight's transpose): by the view's readers
                    g.readers += _through_views(d.node)
                    g.backward += backward_readers(d.node, problem.needs_grad)
                    continue
                g.readers.append(d.node)
                if d.node in problem.needs_grad and reads_input(d.node, slot, problem.needs_grad):
                    g.backward.append(d.node)
    found = sorted((g for g in copies.values() if g.readers), key=lambda g: min(order[r] for r in g.readers))
    for g in found:
        g.readers = sorted(set(g.readers), key=order.__getitem__)
        g.backward = sorted(set(g.backward), key=order.__getitem__)
    numbers = assign_buckets([(("all_gather", g.unit), g.nbytes) for g in found], bucket_bytes())
    flat: dict[int, int] = {}
    for g, n in zip(found, numbers):
        g.bucket = n
        flat[n] = flat.get(n, 0) + g.nbytes
    return found, flat


def read_copies(problem: StrategyProblem, chosen) -> tuple[list[Gathered], frozenset]:
    """The copies the plan's readers make of computed values (not of graph inputs: :func:`gathered_copies`), and
    the (node, slot) reads they serve. A value read in another layout than its producer's is redistributed into
    a copy of the read layout's bytes (a collective's result, or a slice: DTensor clones a shard); the traced
    program makes one per value and layout (AOTAutograd's common-subexpression pass merges the readers' equal
    redistributions), made as its first reader runs and alive until its last; where a backward reads it, it is
    what autograd keeps (collectives' results are saved, never recomputed), until the last of those backwards
    (and the value itself only where another backward reads it as made: saved.saved_until's ``copied``). Read
    through a view (a transpose), it lives as the view does: until the view's last reader, or the backward
    reads through it. Where every backward that reads it is recomputed, it is made again for them; a reader
    recomputed selectively keeps, until its backward, a copy reductions alone made (:func:`reduced_copies`,
    StrategyProblem.keeps_reduced_for)."""
    _, from_inputs = _from_inputs(problem)
    mesh, copies, copied = problem.mesh_shape, {}, set()
    kept: dict[tuple, bool] = {}  # (a copy some backward that is not recomputed reads)
    for d, c in zip(problem.decisions, chosen):
        if d.node is None or d.node.op != "call_function":
            continue
        for slot, (u, out_idx, value) in enumerate(d.sources):
            val, made = value.meta["val"], chosen[u].outputs[out_idx]
            if value in from_inputs or not isinstance(val, torch.Tensor) or made is None \
                    or tuple(made) == tuple(c.inputs[slot]):
                continue
            key = (value, tuple(c.inputs[slot]))
            copy = copies.setdefault(key, Gathered(cm.local_numel(val.shape, c.inputs[slot], mesh)
                                                   * val.element_size(), [], [], False, None))
            if cm.is_view_op(d.node):
                copy.readers += _through_views(d.node) or [d.node]
                backward = backward_readers(d.node, problem.needs_grad)
            else:
                copy.readers.append(d.node)
                backward = [d.node] if d.node in problem.needs_grad and \
                    reads_input(d.node, slot, problem.needs_grad) else []
            reduced = problem.keeps_reduced_for(d.node) and bool(reduced_copies([made], [c.inputs[slot]], mesh)[0, 0])
            backward = [*backward, d.node] if reduced else backward  # (kept for its recompute)
            copy.backward += backward
            kept[key] = kept.get(key, False) or reduced or any(b not in problem.recomputed for b in backward)
            copied.add((d.node, slot))
    for key, copy in copies.items():
        copy.again = bool(copy.backward) and not kept[key]
    return list(copies.values()), frozenset(copied)


def _unit(value: torch.fx.Node, names: dict) -> str:
    """The bucket unit of a graph input's gathered copy (of a value computed from inputs: its first input's; ""
    for an argument's, as exec fuses them)."""
    while value.op != "placeholder" and value.all_input_nodes:
        value = value.all_input_nodes[0]
    return bucket_unit(names[value]) if value in names else ""


def gather_events(copies: list[Gathered], flat: dict[int, int], order: dict, reshard: bool, grad: bool):
    """The bytes the gathers add and drop at each node: (forward: added before it runs, dropped after; backward:
    the same around its backward). Forward, a bucket is gathered at its first reader, every copy made out of
    the flat buffer at once, which then goes; a copy lives until its last reader, or, kept whole from forward
    to backward (an argument's; a parameter's unless ``reshard``: FSDP's reshard after forward), until its last
    backward read. With ``reshard`` the backward gathers each bucket's parameters again: its flat buffer lives
    from its first backward read to its last, each copy around its own backward reads (exec copies it out where
    it is first read). A reader's own copy (``bucket`` None) is made as its first reader runs and goes after its
    last, or after the first backward read (made again for the backward reads where ``again``). ``order``: each
    node's place in the program."""
    fwd_add, fwd_drop, bwd_add, bwd_drop = {}, {}, {}, {}

    def at(events, node, nbytes):
        events[node] = events.get(node, 0) + nbytes

    buckets: dict[int, list[Gathered]] = {}
    for g in copies:
        if g.bucket is not None:
            buckets.setdefault(g.bucket, []).append(g)
            continue
        # a reader's own copy: made as its first reader runs, gone after its last or the first backward read
        readers, backward = (sorted(rs, key=order.__getitem__) for rs in (g.readers, g.backward))
        at(fwd_add, readers[0], g.nbytes)
        if grad and backward and not g.again:
            at(bwd_drop, backward[0], g.nbytes)
        else:
            at(fwd_drop, readers[-1], g.nbytes)
        if grad and backward and g.again:
            at(bwd_add, backward[-1], g.nbytes)
            at(bwd_drop, backward[0], g.nbytes)
    for b, gs in buckets.items():
        first = gs[0].readers[0]  # copies are in the order first read
        at(fwd_add, first, flat[b] + sum(g.nbytes for g in gs))
        at(fwd_drop, first, flat[b])
        for g in gs:
            if grad and g.backward and not (reshard and g.param):
                at(bwd_drop, g.backward[0], g.nbytes)
            else:
                at(fwd_drop, g.readers[-1], g.nbytes)
            if grad and g.backward and reshard and g.param:
                at(bwd_add, g.backward[-1], g.nbytes)
                at(bwd_drop, g.backward[0], g.nbytes)
        read = [g for g in gs if grad and g.backward and reshard and g.param]
        if read:
            at(bwd_add, max((g.backward[-1] for g in read), key=order.__getitem__), flat[b])
            at(bwd_drop, min((g.backward[0] for g in read), key=order.__getitem__), flat[b])
    return fwd_add, fwd_drop, bwd_add, bwd_drop



def held_copies(problem: StrategyProblem, memo: dict, reshard: bool, beyond: float | None = None,
                lasting: frozenset = frozenset(), recomputed: frozenset = frozenset(), every_value: bool = False
                ) -> list[tuple[int, int, np.ndarray]]:
    """The bytes of copies each pair of choices keeps from forward to backward: for each edge to a reader whose
    backward reads the value (directly or through a view), a rank holds the copy in the reader's layout wherever
    that is larger than the value's own (a gathered input's, or a reader's copy of an activation). Per edge: the
    walk (:func:`gather_events`, :func:`read_copies`) keeps one copy per value and layout, so readers that read a
    value alike are over-counted here, and a copy as large as the value (an all-to-all's) is not counted. The
    budget weighs these pairs with the decisions' own bytes (a level-2 plan that gathers a layer's weights whole
    keeps them for backward: FSDP without resharding).
    ``reshard`` (level 1): parameters are gathered again in backward, so their copies are not kept; where
    ``beyond`` is given (a bucket's bytes), each counts its bytes beyond it: a bucket's worth is what bucketed
    gathers hold anyway (two at most), a copy larger than a bucket is memory no bucketing bounds (level 1's
    stand-in: DeepSeek-V3's experts gathered whole). ``memo``: per pair of candidate lists (identical layers
    priced once), and the list per problem's decisions and values needing a gradient, which recompute's tries
    leave as they are (found once for all of them: 0.5 s a try for Llama-405B). ``lasting`` (level 1's values
    counted whole, pricing._lasting): readers whose copies count though no backward reads them (a copy made at
    the head lives at the forward's end, with every value saved: Gemma-2-9B's logits read gathered by a detach,
    8.4e9 bytes a rank walked and not counted). ``recomputed`` (the values recomputed, which level 2 counts none of
    and level 1 at a share): a copy of one in any other layout counts, as large as the value or not, where its
    reader (through a view, a reader of the view) is not recomputed and so keeps it from forward (attention,
    never recomputed for its dropout: Llama-405B's level 1 reads each layer's keys and values through
    all-to-alls, 4.2e9 bytes a rank kept, which had gone uncounted; DeepSeek-V3's level 2, its layers recomputed
    selectively, the products kept, read its scores' softmax so, 44e9 bytes a rank walked against 5e9 priced); a
    reader's copy of an activation that only recomputed backwards read is made again for them (read_copies'
    ``again``), none of it kept from forward, and level 2 does not count it (Llama-405B's layers recomputed whole:
    16.9e9 bytes a rank counted for their MLPs' input read gathered, none walked); level 1 (``every_value``),
    which counts transients too, does (without it, the 405B's level 1 read its layers' inputs gathered in
    recomputed regions: 37.9e9 bytes a rank walked against 14.8e9). What a reader recomputed selectively keeps of
    a reduction's (:func:`reduced_copies`) is counted on the value reduced instead, at its pending sum's bytes
    (pricing._pending_bytes: counted here, Llama-405B's 126 layers doubled these pairs, 6,079 to 11,119, and its
    time-bound solve found a plan of a 58 s step where it had found one of 20 s)."""
    if not problem.needs_grad:
        return []
    whole = ("every edge", id(problem.decisions), id(problem.needs_grad), reshard, beyond, id(lasting),
             id(recomputed), every_value)
    hit = memo.get(whole)
    if hit is not None and hit[0] is problem.decisions and hit[1] is problem.needs_grad and hit[3] is recomputed:
        return hit[2]
    from_params, from_inputs = _from_inputs(problem)
    mesh, found = problem.mesh_shape, []
    for v, d in enumerate(problem.decisions):
        if d.node is None or d.node.op != "call_function":
            continue
        view = cm.is_view_op(d.node)
        for slot, (u, out_idx, value) in enumerate(d.sources):
            val = value.meta["val"]
            over = (beyond if reshard and value in from_params else 0.0)  # (None: not counted)
            if over is None or not isinstance(val, torch.Tensor):
                continue
            keepers = backward_readers(d.node, problem.needs_grad) if view else \
                [d.node] if d.node in problem.needs_grad and reads_input(d.node, slot, problem.needs_grad) else []
            if d.node not in lasting and (not keepers or not every_value and value not in from_inputs
                                          and all(k in recomputed for k in keepers)):
                continue  # (no backward reads it, or every one that does is recomputed and makes it again)
            src_cands = problem.decisions[u].candidates
            # (any other layout's copy counts where a backward not recomputed keeps it: through a view, its readers')
            alike = value in recomputed and any(b not in recomputed for b in keepers or [d.node])
            key = (id(src_cands), out_idx, id(d.candidates), slot, tuple(val.shape), val.element_size(), over, alike)
            hit = memo.get(key)
            if hit is None or hit[0] is not src_cands or hit[1] is not d.candidates:
                own = np.array([cm.local_numel(val.shape, c.outputs[out_idx], mesh) for c in src_cands], dtype=float)
                held = np.array([cm.local_numel(val.shape, c.inputs[slot], mesh) for c in d.candidates], dtype=float)
                larger = held[None, :] > own[:, None]
                if alike:
                    ids: dict = {}
                    made = np.array([ids.setdefault(tuple(c.outputs[out_idx]), len(ids)) for c in src_cands])
                    read = np.array([ids.setdefault(tuple(c.inputs[slot]), len(ids)) for c in d.candidates])
                    larger |= made[:, None] != read[None, :]
                copy = np.where(larger, held[None, :], 0.0) * val.element_size()
                copy = np.maximum(copy - over, 0.0)
                hit = memo[key] = (src_cands, d.candidates, copy if copy.any() else None)
            if hit[2] is not None:
                found.append((u, v, hit[2]))
    memo[whole] = (problem.decisions, problem.needs_grad, found, recomputed)
    return found


def reduced_copies(made: list, read: list, mesh) -> np.ndarray:
    """For each layout of ``made`` (rows) and of ``read`` (columns): does reading a value made in the one in the
    other take reductions alone (all-reduces, reduce-scatters: each mesh dim that differs is a pending sum where it
    is made), the collectives whose results a region recomputed selectively keeps
    (exec.passes.recompute_checkpointed)? From a whole value a rank slices its piece alone; a gather or an
    all-to-all on any dim is run again there, and its reader's copy not kept."""
    codes: dict = {}  # (0: Replicate; one code per distinct placement)

    def coded(layouts):
        return np.array([[0 if p.is_replicate() else codes.setdefault(p, len(codes) + 1) for p in pl]
                         if pl is not None else [0] * len(mesh) for pl in layouts],
                        dtype=np.int64).reshape(-1, len(mesh))

    m, r = coded(made), coded(read)
    pending = np.array([[p.is_partial() for p in pl] if pl is not None else [False] * len(mesh) for pl in made],
                       dtype=bool).reshape(-1, len(mesh))
    differs = (m[:, None, :] != r[None, :, :]) & (m[:, None, :] != 0)
    return differs.any(-1) & ~(differs & ~pending[:, None, :]).any(-1)


def _through_views(view: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read ``view``, directly or through further views of it."""
    found = []
    for user in view.users:
        found += _through_views(user) if user.op == "call_function" and cm.is_view_op(user) else [user]
    return found


def as_returned(val: torch.Tensor, made_in, returned_in, mesh_shape, held: bool) -> tuple[int, int]:
    """One output as the caller holds it once the forward ends, per rank: (the copy the exit makes, where it is
    returned in another layout than ``made_in``; the value itself, where it is returned as made, unless the step
    holds it anyway: ``held``). The search's terms (:func:`returned_copies`) and the read-out's walk
    (readout._NodeBytes.returned) both count outputs by this rule."""
    nbytes = cm.local_numel(val.shape, returned_in, mesh_shape) * val.element_size()
    if tuple(made_in) != tuple(returned_in):
        return nbytes, 0
    return 0, 0 if held else nbytes


def returned_copies(problem: StrategyProblem, saved: Container) -> list[tuple[int, int, np.ndarray]]:
    """The bytes the caller holds of the outputs through the backward, per choice of each output's producer (a
    pair with the outputs' sink): each output as it is returned (a copy the exit makes where that is not the
    layout it is made in; the value itself where it is, unless it is a graph input's or kept for backward anyway:
    ``saved``), and its gradient, which arrives in the layout it was returned in and stays until the backward ends
    (as large as its own where that is larger). What the read-out's walk counts (readout._NodeBytes.returned,
    _backward_walk); left out of the budget, a Llama-3-8B's whole logits and their gradient, 15.6 GiB a rank, had
    the search pricing 14.9 GiB for a plan that walked 28."""
    sinks = [v for v, d in enumerate(problem.decisions) if d.node is None and d.name == "output"]
    if not sinks:
        return []
    sink = sinks[0]
    returned = problem.decisions[sink].candidates[0].inputs
    producers = {value: (u, out_idx) for u, out_idx, value in problem.decisions[sink].sources}
    mesh, found, counted = problem.mesh_shape, [], set()
    for out, placements in zip(problem.captured.output_nodes, returned):
        val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
        if out not in producers or placements is None or not isinstance(val, torch.Tensor):
            continue
        u, out_idx = producers[out]
        grad = out in problem.needs_grad and out not in problem.trainable
        whole = cm.local_numel(val.shape, placements, mesh) * val.element_size()
        cands = problem.decisions[u].candidates
        # (a view's gradient starts from none of its own: the walk's, readout._NodeBytes.own)
        own = np.zeros(len(cands)) if cm.is_view_op(out) else np.array(
            [cm.local_numel(val.shape, c.outputs[out_idx], mesh) * val.element_size()
             if c.outputs[out_idx] is not None else 0 for c in cands], float)
        base = cm.view_base(out)
        kept = base.op == "placeholder" or base in saved  # (as made, the walk holds it already)
        first = out not in counted
        counted.add(out)
        copies = np.array([0 if c.outputs[out_idx] is None else
                           sum(as_returned(val, c.outputs[out_idx], placements, mesh, kept or not first))
                           for c in cands], float)
        held = copies + (np.maximum(own, whole) if grad and first else 0.0)
        if held.any():
            found.append((u, sink, held[:, None]))
    return found
