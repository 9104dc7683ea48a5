"""Clean-ups of the traced per-rank graphs, applied once before they first run.

AOTAutograd's graphs are functional: every all-reduce writes a fresh buffer, and the entry/exit of the local
program leaves views and transposes that undo each other. Each op costs a Python call per step when the graph
runs, and each fresh all-reduce buffer a copy, so :func:`simplify` removes what nothing needs:

- an all-reduce of a buffer nothing else reads (an intermediate, not an input or output, reached through views
  with no other reader) runs in place, as hand-written code does (``dist.all_reduce(y)``), and so does an
  addition into such a buffer (a residual add, gradients accumulated), as autograd's accumulation does;
- a fill (``new_zeros``) made whole only to be cut to a piece is made as the piece (:mod:`.filled_pieces`);
- ``view`` to the tensor's own shape and ``t(t(x))`` become their input, a ``view`` of a ``view`` one view,
  and ``detach`` its input (the graphs run without autograd);
- each collective starts as soon as its input is computed and is waited for just before its result is first
  read, so work that does not need it (a weight gradient's matmul beside the input gradient's all-reduce) runs
  while it is in flight. Every rank runs the same graph, so collectives keep one order on all of them. On gloo
  one collective is in flight at a time (the next starts once the previous is waited for): see _one_in_flight.

Only nodes that are not graph outputs are rewritten away, so what the graph returns (and what aliases what) is
unchanged.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import operator
import re
from typing import Any, Sequence

import torch
import torch.fx

from .. import _pytree_internals as pytree
from ..capture.graph import checkpoint_region, is_in_place, is_seeded, is_view, made_from_alone, replayable
from ..strategy_search.buckets import assign_buckets, bucket_bytes
from ..strategy_search.problem import REDUCTIONS
from ._graph_internals import MADE_WHOLE, held_elsewhere
from .filled_pieces import fill_pieces

_log = logging.getLogger("shardfn")

__all__ = ["check_buckets", "keep_pieces", "recompute_checkpointed", "regather_in_backward", "restore_replayable",
           "simplify"]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_DROPPABLE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.alias.default)


def _node_value(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _nbytes(val: torch.Tensor) -> int:
    """A value's bytes; where its size is symbolic (a graph traced for every size), at the size it was traced at:
    buckets are assigned once, and a comparison of symbolic sizes would add to what the trace assumes."""
    numel = val.numel()
    return (numel if isinstance(numel, int) else numel.node.hint) * val.element_size()


def _sized(val) -> bool:
    """Whether a value's size is a number: a graph traced for every size of some dims (exec.for_every_size)
    fuses into its buckets only what has one, a bucket being one buffer of a fixed size."""
    return isinstance(val, torch.Tensor) and isinstance(val.numel(), int)


def _same_shape(node: torch.fx.Node) -> bool:
    a, b = _node_value(node.args[0]), _node_value(node)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
        and a.stride() == b.stride()


def _identity_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node this one is the same tensor as (up to aliasing), or None."""
    if node.target in (aten.view.default, aten._unsafe_view.default) and _same_shape(node):
        return node.args[0]
    if node.target is aten.detach.default:
        return node.args[0]
    if node.target is aten.t.default and getattr(node.args[0], "target", None) is aten.t.default:
        return node.args[0].args[0]
    return None


def _drop_identities(graph: torch.fx.Graph, outputs: set) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or node in outputs:
            continue
        src = _identity_input(node)
        if src is not None:
            node.replace_all_uses_with(src)
        elif node.target is aten.view.default and getattr(node.args[0], "target", None) is aten.view.default:
            node.args = (node.args[0].args[0], *node.args[1:])  # view(view(x, a), b) -> view(x, b)
    # what lost its readers; only views and the like (pure, no random state), so nothing else changes
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node not in outputs and (
                node.target in _DROPPABLE_VIEWS or node.target in (aten.detach.default, aten.t.default)):
            graph.erase_node(node)


# ops that return their first input or a view of it without being marked views (besides in-place ops)
_ALIAS_FIRST_INPUT = (aten._unsafe_view.default, _c10d.wait_tensor.default)


def _alias_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose storage ``node``'s value shares (views, in-place ops, an item of a view op's list), or
    None where it is a fresh buffer."""
    target = node.target
    if target is operator.getitem:
        return node.args[0] if _alias_of(node.args[0]) is not None else None
    if isinstance(node.kwargs.get("out"), torch.fx.Node):  # an out= variant returns its out
        return node.kwargs["out"]
    if target in _ALIAS_FIRST_INPUT or is_in_place(target) or (
            isinstance(target, torch._ops.OpOverload) and target.is_view):
        return node.args[0]
    return None


def _owned(node: torch.fx.Node) -> bool:
    """Is ``node`` a fresh buffer (or an alias of one) that only its single reader reads?"""
    while True:
        if not isinstance(node, torch.fx.Node) or len(node.users) != 1 or node.op != "call_function":
            return False
        src = _alias_of(node)
        if src is None:
            return True
        node = src


def _accumulate_in_place(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        out = _node_value(node)
        for i, into in enumerate(node.args):  # a + b == b + a exactly, so either operand can take the sum
            val = _node_value(into)
            if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.shape == out.shape \
                    and val.dtype == out.dtype and val.stride() == out.stride() and val.is_contiguous() \
                    and _owned(into):
                node.target, node.args = aten.add_.Tensor, (into, node.args[1 - i])
                break


def _reduce_in_place(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.target is _c10d.all_reduce.default:
            buf = node.args[0]
            val = _node_value(buf)
            if isinstance(val, torch.Tensor) and val.is_contiguous() and _owned(buf):
                node.target = _c10d.all_reduce_.default


def _is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional" \
        and node.target is not _c10d.wait_tensor.default


def _movable(node: torch.fx.Node) -> bool:
    """Can ``node`` run earlier? Pure ops can, and in-place ops on a buffer only they read; placeholders, waits,
    writes into anything else (an input's update) and random ops (their order sets the numbers they draw)
    stay where they are, and so do a checkpoint region's ops computed again (the partitioner puts each just
    before the backward that reads it: hoisted to the graph's start, every region's values would live at once)."""
    target = node.target
    if node.op != "call_function" or target is _c10d.wait_tensor.default:
        return False
    if checkpoint_region(node) is not None and node.meta.get("recompute") is not None \
            and node.meta["recompute"].name == "MUST_RECOMPUTE":
        return False
    if is_in_place(target):
        return _owned(node.args[0])
    return replayable(node)


def _value_bytes(node: torch.fx.Node) -> int:
    return sum(_nbytes(v) for v in pytree.graph_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor))


def _aliases(node: torch.fx.Node) -> bool:
    """Is ``node``'s result memory it read (a view, a write into its input, a getitem of its producer's)?"""
    return is_view(node.target) or is_in_place(node.target) or node.target is operator.getitem


def _own_bytes(node: torch.fx.Node) -> int:
    """What running ``node`` allocates (an alias: nothing)."""
    return 0 if node.op != "call_function" or _aliases(node) else _value_bytes(node)


def _freed_bytes(node: torch.fx.Node) -> int:
    """What the graph frees once ``node``'s value is read for the last time: an op's result, a value the forward
    saved for the backward; not a forward's input ("primals": parameters, the caller's arguments: the caller
    holds them)."""
    if node.op == "placeholder":
        return 0 if node.name.startswith("primals") else _value_bytes(node)
    return _own_bytes(node)


def _releasing(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The ops that free more bytes than they make, being the last reader of values larger than their result: a
    weight gradient's matmul frees the activation the forward saved for it (an alias frees nothing: the value
    lives on in it)."""
    last = {a: n for n in graph.nodes for a in n.all_input_nodes}
    freed: collections.Counter = collections.Counter()
    for value, reader in last.items():
        freed[reader] += _freed_bytes(value)
    return {n for n, nbytes in freed.items() if n.op == "call_function" and not _aliases(n) and nbytes > _own_bytes(n)}


def _overlap(graph: torch.fx.Graph) -> None:
    """Collectives as early as their inputs allow (the ops computing those inputs first), waits as late. The ops
    computing a collective's input move up no further than the last op before them that frees memory
    (:func:`_releasing`): hoisted above it, a chain of gradients through layers no collective reads would hold
    each layer's saved activations until the chain's end (an MLP whose second block runs replicated: 31.5 MiB
    where the plan's order holds 27.5)."""
    placed: set = set()
    at = _Positions(graph, _releasing(graph))
    top = [n for n in graph.nodes if n.op == "placeholder"][-1:]

    def hoist(node: torch.fx.Node) -> None:
        if node in placed:
            return
        placed.add(node)
        for a in node.all_input_nodes:
            if _movable(a):
                hoist(a)
        after = top + node.all_input_nodes
        if not _is_collective(node):  # (a collective itself may start above it: its result waits)
            after += at.releasing_before(node)
        last = max(after, key=at.of, default=None)
        if last is not None and at.of(last) < at.of(node) and last.next is not node:
            last.append(node)
            at.moved(node)

    for node in [n for n in graph.nodes if _is_collective(n)]:
        hoist(node)
    order = {n: i for i, n in enumerate(graph.nodes)}  # (only waits move below: the others keep their order)
    for node in [n for n in graph.nodes if n.target is _c10d.wait_tensor.default]:
        if not node.users:  # a result nothing reads (a dead collective): waited for where it stands
            continue
        first = min(node.users, key=lambda u: order[u])
        if node.next is not first:
            first.prepend(node)
    _prefetch_one_ahead(graph)


_GAP_BITS = 256  # (halves of 2**256: 256 moves to one place before all are renumbered)


class _Positions:
    """Each node's place in ``graph``'s order as :func:`_overlap` moves nodes, and the last of the ``releasing``
    ops before a node: a number per node, 2**256 apart, a moved node's halfway between its new neighbours' (all
    renumbered where the halves run out), so a move costs no walk of the graph (a walk per move made the pass
    quadratic: 3 s for a graph of 7,000 nodes, 0.1 s now)."""

    def __init__(self, graph: torch.fx.Graph, releasing: set):
        self.graph, self.releasing = graph, releasing
        self._renumber()

    def _renumber(self) -> None:
        self.at = {n: i << _GAP_BITS for i, n in enumerate(self.graph.nodes)}
        self.ordered = sorted(self.releasing, key=self.at.__getitem__)
        self.keys = [self.at[n] for n in self.ordered]

    def of(self, node: torch.fx.Node) -> int:
        return self.at[node]

    def moved(self, node: torch.fx.Node) -> None:
        before = self.at[node.prev]
        after = self.at[node.next] if node.next.op != "root" else before + (2 << _GAP_BITS)
        if node in self.releasing:
            k = bisect.bisect_left(self.keys, self.at[node])
            del self.ordered[k], self.keys[k]
        self.at[node] = (before + after) // 2
        if not before < self.at[node] < after:  # (no number left between them)
            self._renumber()
        elif node in self.releasing:
            k = bisect.bisect(self.keys, self.at[node])
            self.ordered.insert(k, node)
            self.keys.insert(k, self.at[node])

    def releasing_before(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The last releasing op before ``node`` (none: empty)."""
        k = bisect.bisect_left(self.keys, self.at[node])
        return self.ordered[k - 1:k] if k else []


def _one_in_flight(graph: torch.fx.Graph) -> None:
    """Each collective's wait moves up to just before the next collective starts, so compute still overlaps the
    collective in flight but no two are in flight at once. gloo (torch 2.14.1, 8 ranks on 2 cores) loses a
    message every few thousand steps when they are: every rank then waits in an all-reduce until the timeout, or
    one aborts with a corrupted heap. bench/gloo_stress.py shows it with torch alone; serialised, it ran clean."""
    pending = None  # the wait of the collective in flight
    for node in list(graph.nodes):
        if node is pending:
            pending = None
        elif _is_collective(node):
            if pending is not None:
                node.prepend(pending)
            pending = next((u for u in node.users if u.target is _c10d.wait_tensor.default), None)


def _of_an_input(node: torch.fx.Node) -> bool:
    """Does collective ``node`` move graph inputs (through ops on one alone: views, copies, casts), or their
    concatenation (a bucket of split parameters gathered at once: :func:`_fuse_gather`)?"""
    return _from_inputs(node.args[0])


def _from_inputs(arg) -> bool:
    while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and len(arg.all_input_nodes) == 1:
        arg = arg.all_input_nodes[0]
    if isinstance(arg, torch.fx.Node) and arg.target is aten.cat.default:
        return all(_from_inputs(a) for a in arg.args[0])
    return isinstance(arg, torch.fx.Node) and arg.op == "placeholder"


def _prefetch_one_ahead(graph: torch.fx.Graph) -> None:
    """Collectives of graph inputs (a split parameter's all-gather) could all start at the top of the graph, and
    every whole result would then be held from there to its reader: all the whole parameters at once. Each
    all-gather starts instead once the previous one is waited for and taken apart (:func:`_taken_apart`), its
    input's ops with it (:func:`_own_inputs`), as FSDP prefetches: one in flight while the previous result is
    read, so communication still overlaps compute and at most two whole results are held early (another
    collective of an input starts just before the previous one's wait)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    waited = []
    for node in graph.nodes:
        if _is_collective(node) and _of_an_input(node) and len(node.users) == 1:
            (wait,) = node.users
            if wait.target is _c10d.wait_tensor.default and wait.users:
                waited.append((node, wait))
    waited.sort(key=lambda cw: order[cw[1]])
    for (_, previous_wait), (node, wait) in zip(waited, waited[1:]):
        if order[node] < order[previous_wait] < order[wait]:
            if node.target is not _c10d.all_gather_into_tensor.default:  # (no whole result: before the wait)
                previous_wait.prepend(node)
                continue
            start = _taken_apart(previous_wait).next
            for a in sorted(_own_inputs(node), key=order.__getitem__):
                start.prepend(a)
            start.prepend(node)


def _taken_apart(wait: torch.fx.Node) -> torch.fx.Node:
    """The last of the ops right after ``wait`` that only take its result apart (a bucket's rows split, each
    parameter copied out of them; a gathered parameter's views): the next gather starts after them, so that its
    buffer is not made while this one's whole buffer and its copies are both held."""
    apart, last = {wait}, wait
    while (n := last.next).op == "call_function" and n.all_input_nodes and not _is_collective(n) \
            and n.target is not _c10d.wait_tensor.default and replayable(n) \
            and all(a in apart for a in n.all_input_nodes):
        apart.add(n)
        last = n
    return last


def _own_inputs(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The movable ops that compute ``node``'s input for it alone (a bucket's concatenation of its pieces, their
    flat views, a contiguous copy): started later, a collective takes them along, so that its input buffer is
    not made at the graph's top and held there until the collective starts."""
    own: set = set()
    stack = list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in own or not _movable(a) or not all(u is node or u in own for u in a.users):
            continue
        own.add(a)
        stack.extend(a.all_input_nodes)
    return own


_TAIL_LIMIT = 8  # ops after a reduction that may wait for its bucket (a few: a loss's division, an embedding's
# backward), so that no long computation loses its overlap with the bucket in flight


def _tail_to_output(wait: torch.fx.Node, out: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The ops (pure, no collectives, at most _TAIL_LIMIT) through which ``wait``'s result only reaches the graph
    outputs, in no order: [] when it is handed back itself; None when something else reads it. A reduced
    activation the output is computed from (the position embedding's gradient from its rows' sum, a loss's
    division by a reduced count) may join a bucket as well as a gradient handed back as it is reduced."""
    tail: set = set()
    todo = [u for u in wait.users if u is not out]
    while todo:
        node = todo.pop()
        if node in tail:
            continue
        if node.op != "call_function" or _is_collective(node) or node.target is _c10d.wait_tensor.default \
                or not replayable(node) or len(tail) == _TAIL_LIMIT:
            return None
        tail.add(node)
        todo += [u for u in node.users if u is not out]
    return list(tail)


def _reduced_for_output(node: torch.fx.Node, out: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The tail (:func:`_tail_to_output`) if ``node`` is a sum all-reduce whose result only leads out of the
    graph (a gradient handed back, or computed from it by a few ops), else None."""
    if node.target is not _c10d.all_reduce.default or node.args[1] != "sum" or len(node.users) != 1:
        return None
    (wait,) = node.users
    if wait.target is not _c10d.wait_tensor.default or not wait.users:
        return None
    val = _node_value(node.args[0])
    return _tail_to_output(wait, out) if isinstance(val, torch.Tensor) else None


# ops through which a reduced value is still the gradient the plan lists: its reshapes, as pricing's
# gradient_handed_back follows them, a cast back from the reduce dtype, and this rank's piece cut from it (a
# gradient DTensor reduces whole and then cuts, as the plan prices it: the whole reduced, a split free)
_GRADIENT_TAIL = (aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int,
                  aten.permute.default, aten.reshape.default, aten._to_copy.default,
                  torch.ops.prims.convert_element_type.default,
                  aten.split.Tensor, aten.split_with_sizes.default, operator.getitem, aten.slice.Tensor,
                  aten.narrow.default, aten.clone.default, aten.contiguous.default)


def _fuse_reductions(graph: torch.fx.Graph, limit: int, in_place: bool = True) -> list[list[int]]:
    """Gradients' all-reduces into buckets of up to ``limit`` bytes (strategy_search.buckets' rule, taking the
    gradients last input first, as the plan lists them): one collective each, launched where the bucket's last
    gradient is ready (the overlap pass then starts it as early as that allows). A reduction whose result is
    read inside the graph joins only where a few ops lead it to the outputs (its tail, then run after the
    bucket): a forward's reduced loss and its reduced count so make one all-reduce. ``in_place``: each bucket
    is a buffer kept between calls (see :func:`_fuse`). Returns the buckets fused, each its gradients' bytes
    (:func:`check_buckets` compares a backward graph's with the plan's)."""
    out = next(n for n in graph.nodes if n.op == "output")
    returned = list(out.args[0])
    tails = {n: t for n in graph.nodes if (t := _reduced_for_output(n, out)) is not None}
    found = list(tails)

    def handed_back(n):  # the first output this reduction leads to
        (wait,) = n.users
        return min(returned.index(x) for x in [wait, *tails[n]] if x in out.args[0])

    found.sort(key=lambda n: -handed_back(n))  # the input whose gradient it is, last first
    vals = [_node_value(n.args[0]) for n in found]
    gradient = [all(t.target in _GRADIENT_TAIL for t in tails[n]) for n in found]
    numbers = _bucket_numbers([((n.args[2], v.dtype), _nbytes(v)) for n, v in zip(found, vals)],
                              gradient, limit)
    order = {n: i for i, n in enumerate(graph.nodes)}
    fused = []
    for number in set(numbers):
        bucket = sorted((n for n, k in zip(found, numbers) if k == number), key=order.__getitem__)
        if len(bucket) > 1:
            fused.append(sorted(_nbytes(v) for n, v, g, k in zip(found, vals, gradient, numbers)
                                if g and k == number))
            _fuse(graph, bucket, in_place, [t for n in bucket for t in tails[n]])
    return [b for b in fused if len(b) > 1]


def _bucket_numbers(items: list[tuple], gradient: list[bool], limit: int) -> list[int]:
    """The bucket of each ``(kind, nbytes)`` reduction, in the order they are ready: the gradients' by the
    plan's rule among themselves (so the gradients share buckets as the plan lists them); each other reduction
    (one computed further by its tail: a reduced count, an embedding's rows' sum) joins the bucket of the
    nearest gradient of its kind, the last before it else the first after it, and those of a kind no gradient
    has by the rule among themselves."""
    at = [i for i, g in enumerate(gradient) if g]
    numbers: list = [None] * len(items)
    for i, number in zip(at, assign_buckets([items[i] for i in at], limit)):
        numbers[i] = number
    alone = []
    for i, (kind, _) in enumerate(items):
        if gradient[i]:
            continue
        same = [j for j in at if items[j][0] == kind]
        nearest = [j for j in same if j < i][-1:] or same[:1]
        if nearest:
            numbers[i] = numbers[nearest[0]]
        else:
            alone.append(i)
    first = max((n for n in numbers if n is not None), default=-1) + 1
    for i, number in zip(alone, assign_buckets([items[i] for i in alone], limit)):
        numbers[i] = first + number
    return numbers


def check_buckets(plan, fused: list[list[int]]) -> None:
    """The plan lists each gradient all-reduce's bucket (strategy_search.readout, explain shows them); each
    bucket a backward graph fuses (``fused``: :func:`_fuse_reductions`' buckets, each its gradients' bytes) must
    lie within one of the plan's, else a ValueError: exec never fuses gradients the plan keeps apart. Exec
    cannot just read the plan's: a Collective names the tensor it moves by the captured graph's nodes
    ("producer -> consumer"), and the traced per-rank graph is another graph (AOTAutograd's, DTensor's dispatch
    traced), whose all-reduces are found by what they do (a sum whose result only leads to the outputs, through
    a tail of a few ops); so exec applies the plan's rule to what it finds, and this checks the two. A plan's
    bucket may hold more than exec fuses (a reduction whose tail computes on it, an embedding's rows' sum, rides
    in a bucket without being counted, and a bucket of one is not fused). Forward graphs are not compared:
    their fused reductions (a loss and its count) are not gradients, which the plan does not bucket."""
    planned: dict[int, list[int]] = {}
    for c in plan.collectives:
        if c.bucket is not None and c.kind == "all_reduce" and c.phase == "backward":
            planned.setdefault(c.bucket, []).append(c.nbytes)
    free = [collections.Counter(b) for b in planned.values()]
    for bucket in sorted(fused, key=len, reverse=True):
        within = next((b for b in free if not collections.Counter(bucket) - b), None)
        if within is None:
            raise ValueError(f"{plan.name}: the backward graph fuses gradient all-reduces of {sorted(bucket)} "
                             f"bytes into one bucket, which no bucket of its plan holds (the plan's: "
                             f"{sorted(sorted(b) for b in planned.values())}; strategy_search.buckets' rule, "
                             "SHARDFN_BUCKET_MB alike for both?): exec runs only the plan it was given")
        free.remove(within)


def _gathered_input(node: torch.fx.Node) -> bool:
    """Is ``node`` an all-gather of a graph input (a split parameter's, through views, copies, casts) whose
    result is read?"""
    return node.target is _c10d.all_gather_into_tensor.default and _of_an_input(node) and len(node.users) == 1 \
        and next(iter(node.users)).target is _c10d.wait_tensor.default and bool(next(iter(node.users)).users)


def _fuse_gathers(graph: torch.fx.Graph, limit: int, units: Sequence[str] = ()) -> None:
    """Split parameters' all-gathers into buckets of up to ``limit`` bytes (gathered), in the order they are first
    read, one unit's parameters to a bucket (``units``: each parameter's, strategy_search.buckets.bucket_unit, in
    the order the step takes them), as the plan lists them: one all-gather each, of the pieces concatenated,
    launched where the bucket's first result is read (the overlap pass then starts it as early as its inputs
    allow), each parameter then cut out of the gathered rows. FSDP2 gathers a block's parameters so, in one
    collective: one per parameter costs a collective's latency each (on gloo, milliseconds), and a bucket of
    several layers holds them all whole at once (four GPT blocks gathered together: a level-1 step's tensor peak
    1.12x FSDP2's; by block 0.85x)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    # (not an output's gradient, a backward's input too: an activation's move, which the plan does not bucket)
    found = sorted((n for n in graph.nodes if _gathered_input(n) and _sized(_node_value(n))
                    and not _input_of(n).name.startswith("tangents_")), key=lambda n: order[next(iter(n.users))])
    vals = [_node_value(n) for n in found]
    numbers = assign_buckets([((n.args[1], n.args[2], v.dtype, _unit_of(n, units)), v.numel() * v.element_size())
                              for n, v in zip(found, vals)], limit)
    for number in set(numbers):
        bucket = [n for n, k in zip(found, numbers) if k == number]
        first_read = next(iter(bucket[0].users))
        # a gather's input may be a parameter cut out of a bucket fused before (gathered over two mesh dims, one
        # after the other): a node new since the order was taken
        order = {n: i for i, n in enumerate(graph.nodes)}
        # a piece cast from its parameter (mixed precision) just before its reader, or in backward where a level-1
        # plan gathers it again: cast by the bucket's first read instead (a piece, not the whole, held earlier)
        moved: set = set()
        for n in bucket:
            chain, a = [], n.args[0]
            while isinstance(a, torch.fx.Node) and a.op == "call_function" and len(a.all_input_nodes) == 1 \
                    and replayable(a) and not _is_collective(a) and a.target is not _c10d.wait_tensor.default:
                chain.append(a)
                a = a.all_input_nodes[0]
            if chain and chain[0] not in moved and order[chain[0]] > order[first_read] and \
                    isinstance(a, torch.fx.Node) and a.op == "placeholder":
                # (the order, taken once, still tells which side of first_read each op not moved is on)
                for c in reversed(chain):
                    if c not in moved and order[c] > order[first_read]:
                        first_read.prepend(c)
                        moved.add(c)
        order = {n: i for i, n in enumerate(graph.nodes)}
        bucket = [n for n in bucket if order[n.args[0]] < order[first_read]]  # (inputs computed by then)
        if len(bucket) > 1:
            _fuse_gather(graph, bucket, first_read)


def _input_of(gather: torch.fx.Node) -> torch.fx.Node:
    """The graph input a gather of one (:func:`_gathered_input`) moves, through the ops on it alone."""
    arg = gather.args[0]
    while arg.op == "call_function" and len(arg.all_input_nodes) == 1:
        arg = arg.all_input_nodes[0]
    return arg


def _unit_of(gather: torch.fx.Node, units: Sequence[str]) -> str:
    """The bucket unit of the parameter ``gather`` gathers ("" for another input): AOTAutograd names the step's
    inputs primals_1, primals_2, ... in both graphs (a level-1 backward gathers the parameters it saved), the
    parameters first."""
    found = re.fullmatch(r"primals_(\d+)", _input_of(gather).name)
    return units[int(found.group(1)) - 1] if found and int(found.group(1)) <= len(units) else ""


def _fuse_gather(graph: torch.fx.Graph, bucket: list[torch.fx.Node], before: torch.fx.Node) -> None:
    """One all-gather for ``bucket``: each rank's pieces concatenated, gathered as rows of ranks, each gathered
    parameter the rows of its columns (the all-gather's dim-0 concatenation of the ranks' pieces)."""
    pieces = [_node_value(n.args[0]) for n in bucket]
    ranks, group, dtype = bucket[0].args[1], bucket[0].args[2], pieces[0].dtype
    sizes = [p.numel() for p in pieces]
    total = sum(sizes)

    add = functools.partial(_add, graph)

    with graph.inserting_before(before):
        flat = [add(aten.reshape.default, (n.args[0], [-1]), _meta((k,), dtype)) for n, k in zip(bucket, sizes)]
        joined = add(aten.cat.default, (flat,), _meta((total,), dtype))
        gathered = add(_c10d.all_gather_into_tensor.default, (joined, ranks, group), _meta((ranks * total,), dtype))
        waited = add(_c10d.wait_tensor.default, (gathered,), _meta((ranks * total,), dtype))
        rows = add(aten.view.default, (waited, [ranks, total]), _meta((ranks, total), dtype))
        parts = add(aten.split_with_sizes.default, (rows, sizes, 1), [_meta((ranks, k), dtype) for k in sizes])
        for i, (n, p) in enumerate(zip(bucket, pieces)):
            columns = add(operator.getitem, (parts, i), parts.meta["val"][i])
            shape = [ranks * p.shape[0], *p.shape[1:]] if p.dim() else [ranks]
            (old_wait,) = n.users
            old_wait.replace_all_uses_with(add(aten.reshape.default, (columns, shape), _meta(tuple(shape), dtype)))
    for n in bucket:
        (old_wait,) = n.users
        graph.erase_node(old_wait)
        graph.erase_node(n)


def _scattered_for_output(node: torch.fx.Node, out: torch.fx.Node) -> bool:
    """Is ``node`` a sum reduce-scatter whose result only leaves the graph (a split parameter's gradient)?"""
    if node.target is not _c10d.reduce_scatter_tensor.default or node.args[1] != "sum" or len(node.users) != 1:
        return False
    (wait,) = node.users
    return wait.target is _c10d.wait_tensor.default and set(wait.users) == {out} and \
        isinstance(_node_value(node.args[0]), torch.Tensor) and _node_value(node.args[0]).dim() > 0


def _fuse_reduce_scatters(graph: torch.fx.Graph, limit: int, units: Sequence[str] = ()) -> None:
    """Split parameters' gradient reduce-scatters into buckets of up to ``limit`` bytes (before scattering), in
    the order the gradients are ready, one unit's to a bucket (``units``: each parameter's, whose gradients
    the backward returns in that order; a bucket of several layers holds their whole gradients until the last
    is ready): one each, launched where the bucket's last gradient is ready, each gradient a view of its piece
    of the result (as FSDP2 reduce-scatters a block's gradients at once)."""
    out = next(n for n in graph.nodes if n.op == "output")
    found = [n for n in graph.nodes if _scattered_for_output(n, out) and _sized(_node_value(n.args[0]))]
    vals = [_node_value(n.args[0]) for n in found]
    returned = {a: i for i, a in enumerate(out.args[0]) if isinstance(a, torch.fx.Node)}

    def unit(n):  # (the reduce-scatter's wait is what the backward returns)
        i = returned.get(next(iter(n.users)))
        return units[i] if i is not None and i < len(units) else ""

    numbers = assign_buckets([((n.args[2], n.args[3], v.dtype, unit(n)), v.numel() * v.element_size())
                              for n, v in zip(found, vals)], limit)
    for number in set(numbers):
        bucket = [n for n, k in zip(found, numbers) if k == number]
        if len(bucket) > 1:
            _fuse_reduce_scatter(graph, bucket)


def _fuse_reduce_scatter(graph: torch.fx.Graph, bucket: list[torch.fx.Node]) -> None:
    """One reduce-scatter for ``bucket``: each gradient as rows of ranks (a rank's piece a row), the rows put side
    by side, scattered; each rank's result holds its piece of every gradient, one after the other."""
    grads = [_node_value(n.args[0]) for n in bucket]
    ranks, group, dtype = bucket[0].args[2], bucket[0].args[3], grads[0].dtype
    sizes = [g.numel() // ranks for g in grads]
    total = sum(sizes)

    add = functools.partial(_add, graph)

    with graph.inserting_before(bucket[-1]):
        rows = [add(aten.reshape.default, (n.args[0], [ranks, k]), _meta((ranks, k), dtype))
                for n, k in zip(bucket, sizes)]
        joined = add(aten.cat.default, (rows, 1), _meta((ranks, total), dtype))
        flat = add(aten.view.default, (joined, [-1]), _meta((ranks * total,), dtype))
        scattered = add(_c10d.reduce_scatter_tensor.default, (flat, "sum", ranks, group), _meta((total,), dtype))
        waited = add(_c10d.wait_tensor.default, (scattered,), _meta((total,), dtype))
        parts = add(aten.split_with_sizes.default, (waited, sizes), [_meta((k,), dtype) for k in sizes])
        for i, n in enumerate(bucket):
            (old_wait,) = n.users
            shape = list(_node_value(old_wait).shape)
            piece = add(operator.getitem, (parts, i), parts.meta["val"][i])
            old_wait.replace_all_uses_with(add(aten.view.default, (piece, shape), _meta(tuple(shape), dtype)))
    for n in bucket:
        (old_wait,) = n.users
        graph.erase_node(old_wait)
        graph.erase_node(n)


def _add(graph: torch.fx.Graph, target, args, val, kwargs=None) -> torch.fx.Node:
    """A call of ``target`` at the graph's insertion point, with its value's description."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class _KeptBuffer:
    """A graph op returning a flat buffer of ``numel`` elements for a bucket, the same one on every call while
    nothing else holds it and the size is the same (as DDP keeps its buckets): a fresh buffer of megabytes each
    step costs its page faults again on the CPU (a 25 MB concatenation ~4x slower than into a buffer in use). The
    bucket's gradients leave the graph as views of it, so it is free again once they are released
    (``zero_grad()``, or autograd consuming them); while any is alive (gradients accumulated over calls,
    ``zero_grad(set_to_none=False)``), a call takes a new buffer, and keeps that one. ``numel`` is the graph's to
    give: a graph traced for every size computes a bucket's size at each call."""

    __name__ = "kept_buffer"  # what the graph's code calls it

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.buffer: torch.Tensor | None = None

    def __call__(self, numel: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() != numel or held_elsewhere(self.buffer):
            self.buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.buffer


def _sizes_of(graph: torch.fx.Graph, node: torch.fx.Node, val: torch.Tensor) -> tuple[Any, list]:
    """``node``'s number of elements and shape as graph arguments: numbers, or (a graph traced for every size)
    nodes that read a symbolic size off the value at each call."""
    def size(d):
        n = val.shape[d]
        return n if isinstance(n, int) else _add(graph, aten.sym_size.int, (node, d), n)

    numel = val.numel()
    return (numel if isinstance(numel, int) else _add(graph, aten.sym_numel.default, (node,), numel)), \
        [size(d) for d in range(val.dim())]


def _fuse(graph: torch.fx.Graph, bucket: list[torch.fx.Node], in_place: bool,
          tail: list[torch.fx.Node] = ()) -> None:
    """One all-reduce for the gradients of ``bucket``: concatenated, reduced, each gradient a view of its piece.
    ``in_place``: concatenated into a :class:`_KeptBuffer` and reduced there (functional, for Inductor: into a
    new buffer). ``tail``: ops that read the reduced values (only leading to the outputs), moved after the
    pieces where they stood before them. A symbolic size (a graph traced for every size) is read at each call."""
    vals = [_node_value(n.args[0]) for n in bucket]
    dtype, group = vals[0].dtype, bucket[0].args[2]

    add = functools.partial(_add, graph)
    with graph.inserting_before(bucket[-1]):
        sizes, shapes = zip(*(_sizes_of(graph, n.args[0], v) for n, v in zip(bucket, vals)))
        total = sum(v.numel() for v in vals)
        if isinstance(total, int):
            flats, whole = [_meta((v.numel(),), dtype) for v in vals], _meta((total,), dtype)
        else:  # (the values' own fake tensors give the symbolic sizes' descriptions)
            flats = [v.reshape(-1) for v in vals]
            whole = torch.cat(flats)
            total = functools.reduce(lambda a, b: add(operator.add, (a, b), None), sizes)
        flat = [add(aten.reshape.default, (n.args[0], [-1]), f) for n, f in zip(bucket, flats)]
        if in_place:
            kept = add(_KeptBuffer(dtype, vals[0].device), (total,), whole)
            joined = add(aten.cat.out, (flat,), whole, {"out": kept})
            reduced = add(_c10d.all_reduce_.default, (joined, "sum", group), whole)
        else:
            joined = add(aten.cat.default, (flat,), whole)
            reduced = add(_c10d.all_reduce.default, (joined, "sum", group), whole)
        waited = add(_c10d.wait_tensor.default, (reduced,), whole)
        parts = add(aten.split_with_sizes.default, (waited, list(sizes)), flats)
        for i, (n, v, shape) in enumerate(zip(bucket, vals, shapes)):
            piece = add(operator.getitem, (parts, i), flats[i])
            (old_wait,) = n.users
            old_wait.replace_all_uses_with(add(aten.view.default, (piece, shape),
                                               v if not isinstance(total, int) else _meta(tuple(v.shape), dtype)))
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = bucket[-1].prev  # the last piece's view
    end = order[anchor]
    for node in sorted(tail, key=order.__getitem__):  # (each read only by the tail and the output: free to move)
        if order[node] < end:
            anchor.append(node)
            anchor = node
    for n in bucket:
        (old_wait,) = n.users
        graph.erase_node(old_wait)
        graph.erase_node(n)


def simplify(gm: torch.fx.GraphModule, in_place: bool = True, one_in_flight: bool = False,
             plan=None, n_params: int = 0, units: Sequence[str] = ()) -> torch.fx.GraphModule:
    """All the clean-ups; ``in_place=False`` keeps the graph functional (for Inductor, which plans its own
    buffers); ``one_in_flight``: no collective starts before the previous one is waited for (gloo, see
    :func:`_one_in_flight`). ``plan``: a backward graph's program's plan, whose gradient buckets its fused
    reductions must be (:func:`check_buckets`: a ValueError where not). ``n_params``: a forward graph's first
    inputs that are parameters, whose ops are put by their readers (:func:`_parameters_where_read`). ``units``:
    each parameter's bucket unit, within which its gathers share buckets (:func:`_fuse_gathers`)."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    if n_params:
        _parameters_where_read(graph, n_params)
    fill_pieces(graph)
    _drop_identities(graph, set(out.all_input_nodes))
    fused = _fuse_reductions(graph, bucket_bytes(), in_place) if bucket_bytes() > 0 else []
    if plan is not None and plan.pending_grads:
        # a stage-2 sharded optimizer's plan: said, not raised. Its read-out tells the optimizer's reduce-scatters
        # from the reductions the graph runs (readout._synced), but not yet under autocast, where a parameter's
        # bf16 copy's gradient is reduced in the graph for some parameters (GPT block, data parallel)
        try:
            check_buckets(plan, fused)
        except ValueError as e:
            _log.info("shardfn: %s", e)
    elif plan is not None:
        check_buckets(plan, fused)
    if bucket_bytes() > 0:
        _fuse_gathers(graph, bucket_bytes(), units)
        _fuse_reduce_scatters(graph, bucket_bytes(), units)
    if in_place:
        _reduce_in_place(graph)
        _accumulate_in_place(graph)
    _overlap(graph)
    if one_in_flight:
        _one_in_flight(graph)
    graph.lint()
    gm.recompile()
    return gm


def _parameters_where_read(graph: torch.fx.Graph, n_params: int) -> None:
    """Each op computed from parameters alone (the first ``n_params`` inputs: a split parameter's all-gather, its
    wait, the transpose a linear reads) moved down to just before its first reader. The captured graph's
    canonical order (capture.order) puts such ops, ready from the start, near its top: traced there, every
    parameter would be gathered whole as the forward starts and held until its reader, all of them at once.
    By their readers, the gathers are bucketed in the order the forward reads them and started one ahead
    (:func:`_prefetch_one_ahead`), as FSDP gathers a block's parameters as the block starts."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    of_params = set(placeholders[:n_params])
    for node in graph.nodes:  # (a parameter the graph writes into is read where it was: before or after)
        if node.op == "call_function" and is_in_place(node.target) and node.args:
            root = node.args[0]
            while isinstance(root, torch.fx.Node) and root.op == "call_function" and root.args:
                root = root.args[0]
            of_params.discard(root)
    of_params = made_from_alone(graph, of_params, where=replayable)
    later = {n for n in of_params if n.op == "call_function"}
    placed: list[torch.fx.Node] = []
    done: set = set()

    def place(node: torch.fx.Node) -> None:  # its inputs still to place, then itself
        if node in done:
            return
        done.add(node)
        for a in node.all_input_nodes:
            if a in later:
                place(a)
        placed.append(node)

    for node in list(graph.nodes):
        if node.op == "output":  # (ops nothing reads: before it, as they stood)
            for n in [n for n in graph.nodes if n in later]:
                place(n)
        if node not in later:
            place(node)
    for before, node in zip(placed, placed[1:]):  # (one pass over the graph)
        if before.next is not node:
            before.append(node)


def regather_in_backward(joint: torch.fx.GraphModule, n_params: int) -> torch.fx.GraphModule:
    """Tag the joint forward/backward graph so that AOTAutograd's partitioner recomputes every gathered parameter
    in backward instead of saving it: every op computed from the parameters alone (the first ``n_params``
    primals): the contiguous copy a gather reads, the all-gather and its wait, the concatenation of a split dim,
    transposes, casts. Backward then gathers them again from the shards, which it holds anyway (FSDP's
    reshard_after_forward); the forward frees each whole parameter after its last reader, and saves no copy of
    a shard either."""
    from torch.utils.checkpoint import CheckpointPolicy

    params = _primals(joint)[:n_params]
    for node in made_from_alone(joint.graph, params, where=replayable).difference(params):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return joint


def _primals(joint: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The joint graph's forward inputs, in order (the parameters first)."""
    return [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]


_REPLAYABLE: dict = {}


def _replayable(op: torch._ops.OpOverload):
    """``op`` under a name without torch's tags, for the partitioner: a seeded op that draws nothing here (attention
    of dropout 0), which it would otherwise recompute under a generator state saved in forward and restored in
    backward (a higher-order op a user's TorchDispatchMode, a memory tracker, has no rule for). The graphs get
    ``op`` back before they run (:func:`restore_replayable`)."""
    stand_in = _REPLAYABLE.get(op)
    if stand_in is None:
        def stand_in(*args, **kwargs):
            return op(*args, **kwargs)

        stand_in.__name__ = stand_in.__qualname__ = "replayable_" + op.name().replace("::", "_").replace(".", "_")
        stand_in.replayable_op = op
        _REPLAYABLE[op] = stand_in
    return stand_in


def restore_replayable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The ops :func:`_replayable` renamed for the partitioner, as they were."""
    renamed = [n for n in gm.graph.nodes if hasattr(n.target, "replayable_op")]
    for node in renamed:
        node.target = node.target.replayable_op
    if renamed:
        gm.recompile()
    return gm


def keep_pieces(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Tag the joint graph so that AOTAutograd's partitioner saves, for the backwards that read it, the piece
    kept of a value made whole and laid out (NodePlan.run "whole": a mask every rank makes from constants): made
    again in backward from its constants, the whole would be alive there too."""
    from torch.utils.checkpoint import CheckpointPolicy

    def tagged(n: torch.fx.Node) -> bool:
        return bool((n.meta.get("custom") or {}).get(MADE_WHOLE))

    for node in joint.graph.nodes:
        if node.op == "call_function" and tagged(node) and any(not tagged(u) for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return joint


def _reduces(node: torch.fx.Node) -> bool:
    """Is ``node`` a collective that sums (an all-reduce, a reduce-scatter)?"""
    name = str(node.target)
    return any(kind in name for kind in REDUCTIONS)


def recompute_checkpointed(joint: torch.fx.GraphModule, n_params: int = 0, keeping_reduced: frozenset = frozenset()
                           ) -> torch.fx.GraphModule:
    """Tag the joint forward/backward graph so that AOTAutograd's partitioner computes the forward ops of each
    activation-checkpoint region again in backward instead of saving their results (what torch.utils.checkpoint
    does in eager, and Megatron's full recompute): it then keeps only the regions' inputs and outputs. The
    collectives on activations run again too (a region's all-to-alls and gathers would otherwise keep their
    results: Llama-405B's level 1 held its layers' gathered activations, tens of GB a rank); random draws are kept
    (drawn again they would differ), and so are parameters gathered whole (the first ``n_params`` primals: level
    2 keeps them for backward, level 1 gathers them again anyway: :func:`regather_in_backward`). The regions of
    ``keeping_reduced`` (recomputed selectively) keep what their collectives reduced too (all-reduces and
    reduce-scatters: a sum's result, as torchtitan's selective policy keeps reduce-scatters'), and gather and
    exchange again (a gathered copy is the memory recompute saves; an all-to-all's is as large as the value it
    moves, which the region does not keep either)."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = {n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in joint.graph.nodes:
        if node.op == "call_function" and any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    from_params = made_from_alone(joint.graph, _primals(joint)[:n_params])
    for node in joint.graph.nodes:
        region = checkpoint_region(node)
        if region is None or node.op != "call_function" or node in backward or "recompute" in node.meta:
            continue  # (an op on parameters alone is gathered again already: regather_in_backward)
        if node.target is operator.getitem:  # an item of a multi-output op: as its op is (a tuple is not saved)
            policy = node.args[0].meta.get("recompute", CheckpointPolicy.MUST_RECOMPUTE)
        elif node.target is _c10d.wait_tensor.default:  # (as its collective)
            policy = node.args[0].meta.get("recompute", CheckpointPolicy.MUST_SAVE)
        elif not replayable(node) or (_is_collective(node) and (node in from_params or region in keeping_reduced
                                                                 and _reduces(node))):
            policy = CheckpointPolicy.MUST_SAVE
        else:
            policy = CheckpointPolicy.MUST_RECOMPUTE
            if is_seeded(node.target):
                node.target = _replayable(node.target)  # (it draws nothing: not replayed under a saved state)
        node.meta["recompute"], node.meta["ac_graph_id"] = policy, region
    return joint
