"""Ranks agree on the call they are about to run, before any of its collectives.

Every call of a sharded callable on a real world of several ranks starts with one small all-reduce on the
control group (a gloo group beside the programs' own): each rank contributes the digest of its call's signature
(the callable, its config, the structure, shapes, dtypes, requires_grad and layouts of its arguments, grad mode,
autocast), a running count of its calls, and whether its own checks, capture or planning failed. When all agree,
the program runs; a first call also compares the traced graph and the plan. When they do not, a second exchange
gathers every rank's readable description, and every rank raises the same error naming what differs and where.
So ranks that disagree (a different strategy, a skipped call, another order of calls, a failure on one rank) get
an error on every rank, never a hang or a wrong number.
A repeat call whose program runs traced graphs waits for its all-reduce only before its forward graph's first
collective or write into an input (shardfn.exec.gate): the local ops before it run while it is in flight.

With dataset_strategy="data_parallel" the batch slices' row counts are compared apart from the rest: ranks that
agree on everything else but pass slices of other lengths (an epoch's last batch) make an uneven call, which they
all learn of together (:class:`UnevenBatch`, with every rank's row counts from a second exchange) and which the
engine runs on the whole batch (shardfn.call.uneven_batch).

The values that must be equal on every rank are compared too, by digests of their bytes: every full-batch input
(dataset_strategy="full_batch": the whole batch, the same on every rank), every replicated input DTensor, and, on
a module's first call, its replicated parameters and its buffers (laid out from each rank's own copy, so a model
initialised with different random numbers on each rank would train diverging replicas). A rank whose batch or
model differs (no seed, another seed, a distributed sampler in full-batch mode) would compute wrong numbers
without a word. Inside sf.pipeline's step the stages' inputs are activations, not compared.

``SHARDFN_CHECK`` sets what is compared: ``signature`` (default: the signature on every call, the values on each
signature's first call), ``values`` (the input values on every call too), ``first`` (signature and values on the
first call of each signature only: no collective on repeat calls).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _pytree_internals as pytree
from .. import runtime
from ..capture import split_arguments
from .accumulation import accumulating_call
from .arguments import without_batch_rows

__all__ = ["CHECK_MODES", "Agreement", "alone", "call_agreement", "call_mode", "check_mode", "describe_call", "digest",
           "digests_of_alike", "identity", "inputs_alike", "inputs_compared", "inputs_not_compared",
           "tensor_digest", "UnevenBatch"]

CHECK_MODES = ("signature", "values", "first")


def check_mode() -> str:
    mode = os.environ.get("SHARDFN_CHECK", "signature")
    if mode not in CHECK_MODES:
        raise ValueError(f"SHARDFN_CHECK={mode!r}: use one of {CHECK_MODES}")
    return mode


def digest(text: str) -> int:
    """A 62-bit digest of ``text``, the same in every process."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") >> 2


_CHUNK = 1 << 22  # elements summed at once: a digest of a large tensor needs no copy of it as wide integers


def tensor_digest(t: torch.Tensor) -> int:
    """A digest of a tensor's bytes (integer arithmetic: the same whatever the threads or the reduction order)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    flat = t.reshape(-1)
    sums = []
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].long()
        weights = torch.arange(start + 1, start + part.numel() + 1, device=part.device, dtype=torch.int64) * 1000003
        sums += [part.sum(), (part * weights).sum()]
    return digest(f"{tuple(t.shape)}:{torch.stack(sums).tolist() if sums else []}")


_INPUTS_COMPARED = contextvars.ContextVar("shardfn_inputs_compared", default=True)


@contextlib.contextmanager
def inputs_not_compared():
    """Calls inside compare no input values: a pipeline stage's inputs are the previous stage's activations, and
    torch's pipelining first runs each stage on uninitialised tensors to learn its shapes."""
    token = _INPUTS_COMPARED.set(False)
    try:
        yield
    finally:
        _INPUTS_COMPARED.reset(token)


def inputs_compared() -> bool:
    return _INPUTS_COMPARED.get()


class UnevenBatch(Exception):
    """Raised on every rank of a call whose ranks agree on all but their batch slices' row counts."""

    def __init__(self, rows: dict[int, tuple[int, ...]]):
        super().__init__(f"uneven batch slices: {rows}")
        self.rows = rows  # per (global) rank of the call: the row counts of its batch inputs


_SEQUENCE: dict = {}  # calls of sharded callables made by this process, per set of ranks they run on


@dataclass
class Agreement:
    """What this rank says of one call: its signature digest, and readable descriptions asked for on mismatch."""

    what: str  # the callable's name
    signature: int
    describe: dict[str, str] = field(default_factory=dict)  # field -> readable value (for messages)
    ranks: tuple[int, ...] | None = None  # the ranks the call runs on (None: the world)
    rows: tuple[int, ...] = ()  # data_parallel: the row counts of this rank's batch inputs (compared apart)

    def check(self, first: bool, error: BaseException | None = None,
              values: Callable[[], dict[str, int]] | None = None) -> None:
        """Compare with every other rank (no-op in a world of one); raise on every rank if anything differs.
        ``values``: gives the digests of the values that must be equal on every rank, by name (see the module's
        doc); called only where there are other ranks."""
        self.started(first, error, values)()

    def started(self, first: bool, error: BaseException | None = None,
                values: Callable[[], dict[str, int]] | None = None) -> Callable[[], None]:
        """:meth:`check`'s all-reduce started, not waited for: what settles it (waits, and raises on every rank if
        anything differs). A cached call's program runs its local ops meanwhile, and settles it before its
        first collective (shardfn.exec.gate)."""
        group = _group(self.ranks)
        if group is None:
            if error is not None:
                raise error
            return _settled
        _SEQUENCE[self.ranks] = sequence = _SEQUENCE.get(self.ranks, 0) + 1
        digests: dict[str, int] = {}
        if values is not None and error is None:
            try:  # a failure here is this rank's failure to prepare the call: the others hear of it, none waits
                digests = values()
            except Exception as e:  # noqa: BLE001 - re-raised below, reported on the others
                error = e
        mine = [self.signature, sequence, 0 if error is None else 1, int(first),
                digest(repr(sorted(digests.items()))), digest(repr(self.rows))]
        reduced = _highest_and_lowest(mine, group)

        def settle() -> None:
            top, low = reduced()
            if top == low and error is None:
                return
            if top[:3] == low[:3] == mine[:3] and top[5] != low[5]:
                # the same call but for its slices' lengths (whether a rank met those lengths before, and so
                # compared values, may differ too): every rank learns every rank's row counts
                rows: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(rows, self.rows, group=group)
                raise UnevenBatch(dict(zip(dist.get_process_group_ranks(group), rows)))
            self._disagree(group, error, digests)

        return settle

    def check_program(self, graph: str | None, plan: str | None, error: BaseException | None = None) -> None:
        """A first call, once all agree on the signature and each rank has captured and planned it (or failed
        to: ``error``): the traced graph and the plan must agree too; a rank's failure is raised on every rank."""
        group = _group(self.ranks)
        if group is None:
            if error is not None:
                raise error
            return
        mine = [digest(graph or ""), digest(plan or ""), 0 if error is None else 1]
        top, low = _highest_and_lowest(mine, group)()
        if top != mine or low != mine or error is not None:
            if error is None:
                self.describe = {**self.describe, "traced graph": graph, "plan": plan}
            self._disagree(group, error, {})

    def _disagree(self, group, error: BaseException | None, values: dict[str, int]) -> None:
        """Second exchange: every rank's description and error; the same message raised everywhere."""
        me = {"sequence": str(_SEQUENCE.get(self.ranks, 0)), **self.describe,
              **{f"{_VALUES_OF}{name}": f"digest {v:x}" for name, v in values.items()}}
        failure = None if error is None else f"{type(error).__name__}: {error}"
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (me, failure), group=group)
        failed = [r for r, (_, f) in enumerate(everyone) if f is not None]
        if failed:  # a rank that failed gave no values: only its failure is news
            everyone = [({k: v for k, v in d.items() if not k.startswith(_VALUES_OF)}, f) for d, f in everyone]
        ranks = dist.get_process_group_ranks(group)
        if error is not None and len({f for _, f in everyone}) == 1:
            raise error  # every rank failed alike in its own checks: its own error, as in a world of one
        lines = []
        for k in sorted({k for d, _ in everyone for k in d} - {"sequence"}):
            lines += _differs(k, [d.get(k, "(not given)") for d, _ in everyone], ranks)
        if failed:
            lines += _differs("could not prepare this call", [f or "(prepared)" for _, f in everyone], ranks)
        if not lines:  # the same call, but some rank made more calls: one skipped or repeated one
            lines = _differs("calls made so far", [d["sequence"] for d, _ in everyone], ranks)
        if any(line.startswith(f"  {_VALUES_OF}") for line in lines):
            lines.append(_VALUES_DIFFER)
        message = ("shardfn: the ranks are not making the same call, so its collectives would not match (a "
                   "hang or wrong numbers); every rank stops here. What differs:\n" + "\n".join(lines) + "\n"
                   "Every rank must call sharded callables in the same order with the same strategies and arguments "
                   "of the same shapes, dtypes and layouts (with dataset_strategy='data_parallel' only the batch "
                   "slices' lengths may differ).")
        raise ValueError(message) from error


def _settled() -> None:
    """What settles a check with nobody to agree with."""


def _highest_and_lowest(mine: list[int], group) -> Callable[[], tuple[list[int], list[int]]]:
    """Every rank's highest and lowest value of each of ``mine`` (one all-reduce, started now; the callable
    returned waits for it): all agree where they meet."""
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result() -> tuple[list[int], list[int]]:
        work.wait()
        return both[: len(mine)].tolist(), [-v for v in both[len(mine):].tolist()]

    return result


_VALUES_OF = "values of "  # the description's key of a digest, before the tensor's name
_VALUES_DIFFER = (
    "  Values that every rank must hold alike differ: with dataset_strategy='full_batch' each tensor input is the "
    "whole batch, and a replicated parameter is laid out from each rank's own copy. Make them equal on every rank "
    "(the same torch.manual_seed before building the model and drawing the data, one data order and no distributed "
    "sampler, or torch.distributed.broadcast from one rank), or give each rank its slice of the batch with "
    "dataset_strategy='data_parallel'.")


def _differs(what: str, per_rank: list[str], ranks: list[int]) -> list[str]:
    """``what``'s values grouped by the (global) ranks that hold them, or nothing when all ranks hold the same."""
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, per_rank):
        groups.setdefault(v, []).append(r)
    if len(groups) == 1:
        return []
    if any("\n" in v for v in groups):  # a traced graph or a plan: the first line where they part
        texts = [v.splitlines() for v in groups]
        at = next((i for i in range(max(map(len, texts))) if len({t[i] if i < len(t) else "" for t in texts}) > 1), 0)
        groups = {f"line {at + 1}: {(t[at] if at < len(t) else '(end)').strip()}": rs
                  for t, rs in zip(texts, groups.values())}
    return [f"  {what}: " + "; ".join(f"{_ranks(rs)}: {v}" for v, rs in groups.items())]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def alone(ranks: tuple[int, ...] | None) -> bool:
    """Whether a call on ``ranks`` has nobody to agree with (a world of one, a simulated world, a call on one
    rank): its agreement compares nothing, so it needs no description."""
    return not dist.is_initialized() or dist.get_world_size() == 1 or runtime.is_simulated() or \
        (ranks is not None and len(ranks) == 1)


def _group(ranks: tuple[int, ...] | None):
    """The call's control group, or None where there is nothing to agree on (:func:`alone`)."""
    return None if alone(ranks) else runtime.call_control_group(ranks)


# -- what a call is, as the ranks compare it ----------------------------------------------------------------------


def identity(name: str, target: Any, config) -> str:
    """The sharded callable as ranks compare it: its name, where its code is defined, its config."""
    code = getattr(target, "__code__", None) or getattr(getattr(target, "forward", None), "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{name} ({where})|{config!r}"


def call_mode(module: Any, accumulating: bool) -> str:
    """The modes a call runs in: grad on or off; a module's train or eval, and accumulation without sync."""
    mode = f"grad {'on' if torch.is_grad_enabled() else 'off'}"
    if module is not None:
        mode += ", train" if module.training else ", eval"
        if accumulating and torch.is_grad_enabled():
            mode += ", no sync (gradients accumulated unreduced: sf.no_sync)"
    return mode


def inputs_alike(config, args, kwargs) -> dict[str, int]:
    """Digests of a call's tensor inputs that every rank holds alike: whole full-batch inputs, replicated
    DTensors, data_parallel's 0-dim tensors inside arguments (a StaticCache's counter: no rows, held whole) ({}
    where inputs are not compared: inputs_not_compared)."""
    if not inputs_compared():
        return {}
    tensors, names, _ = split_arguments(args, kwargs, names=True)
    return digests_of_alike({name: t for name, t in zip(names, tensors)
                             if config.dataset_strategy == "full_batch" or isinstance(t, DTensor) or t.dim() == 0})


def describe_call(who: str, config, args, kwargs, mode: str) -> dict[str, str]:
    """A call as every rank describes it (read only where ranks differ): the callable (``who``: its
    :func:`identity`), each config field, the tensor inputs' names, shapes, dtypes and layouts,
    the other arguments, and ``mode`` (grad, train or eval, accumulation)."""
    tensors, names, _ = split_arguments(args, kwargs, names=True)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    described = "; ".join(f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                          + (" requires_grad" if t.requires_grad else "")
                          + (f" {tuple(t.placements)}" if isinstance(t, DTensor) else "")
                          for n, t in zip(names, tensors))
    others = [_short(a) for a in leaves if not isinstance(a, torch.Tensor)]
    fields = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return {"callable": who.split("|")[0], **fields, "tensor inputs": described,
            "other arguments": f"{others} in {spec}", "mode": mode}


def _short(a: Any) -> str:
    """A constant argument as ranks compare it: its value, or for an object its type."""
    return repr(a) if isinstance(a, (int, float, str, bool, type(None), torch.dtype)) else type(a).__name__


def digests_of_alike(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Digests of what of ``tensors`` must be equal on every rank: plain tensors, and replicated DTensors' local
    tensors (a split one holds another piece on each rank)."""
    return {name: tensor_digest(t if not isinstance(t, DTensor) else t.to_local()) for name, t in tensors.items()
            if not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements)}


def call_agreement(engine, key: tuple, args, kwargs, batch: dict[int, int] | None = None) -> Agreement:
    """What the ranks compare for a call of this signature (its sizes included; data_parallel slices' row
    counts apart: ranks may pass slices of other lengths, shardfn.call.uneven_batch)."""
    rows: tuple[int, ...] = ()
    if engine.config.dataset_strategy == "data_parallel":
        tensors = split_arguments(args, kwargs)[0]
        key = without_batch_rows(key, tensors)
        rows = tuple(sorted(batch.items())) if batch else \
            tuple(t.shape[0] for t in tensors if engine.in_batch(t))
    ranks = engine.ranks()
    if alone(ranks):  # nothing to compare (a generation's every token asks: no description to build)
        return Agreement(engine.name, 0, ranks=ranks, rows=rows)
    who = identity(engine.name, engine.module if engine.module is not None else engine.fn, engine.config)
    mode = call_mode(engine.module, accumulating_call(engine))
    return Agreement(engine.name, digest(f"{who}|{key!r}"), describe_call(who, engine.config, args, kwargs, mode),
                     ranks=ranks, rows=rows)
