"""The programs of one sharded callable: one per call signature, and per structure one for every size.

A call's signature (shapes, dtypes, layouts, structure, modes) picks its program. Programs are kept by signature
in a bounded LRU (``SHARDFN_CACHE_SIZE``, as torch.compile's cache size limit). Once a structure is called with
other sizes, the dims whose size changed are traced as symbols and one program serves every size of them
(capture.dynamic): :class:`Programs` remembers, per structure (the signature without sizes), the sizes first seen,
that program, and structures whose symbolic capture failed (one program per size for them). What to capture,
plan and lower is the engine's (call.engine); which program a call takes is decided here. Everything kept
per signature or structure is kept here, bounded, and ``clear()`` forgets all of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from .agreement import Agreement
from .arguments import sizes_of, without_sizes
from ..capture.graph import CapturedGraph
from ..exec.lower import ParallelProgram
from ..layout import MeshSpec
from .step_times import StepTimes
from ..strategy_search import Plan
from ..strategy_search.lru import LRU
from ..strategy_search.request import PlanRequest

__all__ = ["Compiled", "Planned", "Programs", "cache_limit", "trace_after"]

_log = logging.getLogger("shardfn")


def cache_limit() -> int:
    """How many programs (call signatures) one sharded callable keeps: ``SHARDFN_CACHE_SIZE``, default 16."""
    value = os.environ.get("SHARDFN_CACHE_SIZE", "16")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"SHARDFN_CACHE_SIZE={value!r}: give a positive number of programs")
    return int(value)


def trace_after() -> int:
    """After how many calls of one signature the program for every size traces it into per-rank graphs of its
    own: ``SHARDFN_TRACE_AFTER``, default 16; 0 never. A trace costs many interpreted calls (4 gloo ranks on 2
    cores, a 2-layer GPT-2 step: a trace ~3.1 s, an interpreted step ~0.16 s, a traced one ~0.035 s): traced at
    once, the lengths of one generate() met again in the next would each pay one."""
    value = os.environ.get("SHARDFN_TRACE_AFTER", "16")
    if not value.isdigit():
        raise ValueError(f"SHARDFN_TRACE_AFTER={value!r}: give a number of calls (0: never trace per size)")
    return int(value)


class _BySignature(OrderedDict):
    """The programs of one sharded callable by call signature, the least recently used dropped past
    :func:`cache_limit` (as torch.compile's cache size limit): every new signature costs a capture, a plan and a
    trace, so a run whose shapes change on every call is said aloud, once."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.warned = name, False

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is not default:
            self.move_to_end(key)
        return found

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        limit = cache_limit()
        while len(self) > limit:
            self.popitem(last=False)
            if not self.warned:
                self.warned = True
                message = (f"shardfn: {self.name} has been called with more than {limit} signatures (shapes, "
                           "dtypes, layouts); the least recently used programs are dropped and made again when "
                           "called again (a capture, a plan and a trace each). Keep shapes fixed (pad to a few "
                           "lengths), or raise SHARDFN_CACHE_SIZE.")
                _log.warning(message)
                warnings.warn(message, stacklevel=4)


class _Bounded(OrderedDict):
    """A memo by signature or structure, its least recently written entries dropped past :func:`cache_limit` (a
    run whose shapes change on every call grows nothing without bound)."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > cache_limit():
            self.popitem(last=False)


@dataclass(frozen=True)
class Planned:
    """One call signature captured and planned (local work, no communication): what a program is lowered from."""

    captured: CapturedGraph
    plan: Plan
    mesh_spec: MeshSpec
    # (owning module, attribute) of each parameter and buffer: read per call without walking the module tree
    param_slots: tuple = ()
    buffer_slots: tuple = ()
    # a program for every size of some dims (capture.dynamic): {argument tensor number: dims}
    dynamic: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # what the search was asked (None: not kept): another plan of the same graph is asked with it changed
    # (planning.plan_accumulating)
    request: PlanRequest | None = None


@dataclass
class Compiled:
    """Everything a repeat call with the same signature needs: what was planned, what the ranks agreed on (None
    on a rank outside the call's ranks, which compares nothing), the program, and what its calls found."""

    planned: Planned
    agreement: Agreement | None
    program: ParallelProgram | Callable
    # a program for every size: the argument sizes of the call it was made for (its other dims hold only those)
    sizes: tuple = ()
    verdicts: LRU = field(default_factory=lambda: LRU(4096))  # argument sizes -> why not served (None: served)
    met: LRU = field(default_factory=lambda: LRU(4096))  # signature -> [calls of it served] (real ranks trace
    # it at the SHARDFN_TRACE_AFTER-th: Programs.trace_now)
    times: StepTimes = field(default_factory=StepTimes)  # its calls' wall times: the plan's measured step
    # a program for every size: the same, leaving parameters' gradients pending for one bucketed reduction at
    # the end of an interpreted call's backward (call.sizes); made on first use
    synced_once: ParallelProgram | None = None
    # a program for every size on real ranks: the same traced once with its dynamic dims as symbols (made on first
    # use; call.sizes)
    traced: ParallelProgram | None = None

    @property
    def captured(self) -> CapturedGraph:
        return self.planned.captured

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def mesh_spec(self) -> MeshSpec:
        return self.planned.mesh_spec

    @property
    def dynamic(self) -> dict[int, tuple[int, ...]]:
        return self.planned.dynamic

    def explained(self) -> Plan:
        """The plan with what running it found: the program's notes (compile times), the measured step time."""
        plan = self.plan
        notes = getattr(self.program, "notes", ())
        if notes:
            plan = dataclasses.replace(plan, notes=(*plan.notes, *notes))
        return self.times.on(plan)

    def rejects(self, sizes: tuple, tensors: list) -> str | None:
        """Why the program for every size does not serve a call of these argument sizes (its capture's guards),
        or None; remembered per sizes (a generation asks again for every token)."""
        return self.verdicts.get(sizes, lambda: self.program.dynamic_rejects(tensors))

    def takes(self, sizes: tuple) -> bool:
        """Whether a call of these argument sizes differs from this program's only in its dynamic dims."""
        return len(sizes) == len(self.sizes) and all(
            len(now) == len(then) and all(a == b or d in self.dynamic.get(j, ()) for d, (a, b) in
                                          enumerate(zip(now, then)))
            for j, (now, then) in enumerate(zip(sizes, self.sizes)))


class Programs:
    """What one sharded callable has made: programs by signature, and by structure the program for every size."""

    def __init__(self, name: str):
        self.name = name
        self.by_signature = _BySignature(name)
        # per structure (the signature without sizes), each bounded as the programs are: its program for every
        # size, the argument sizes it was first called with, and whether its symbolic capture failed (then a
        # program per size)
        self.for_every_size = _Bounded()
        self.sizes_seen = _Bounded()
        self.static_only = _Bounded()
        # a sub-mesh call's placeholder programs on a rank outside its ranks (shardfn.call.submesh), by signature
        self.outside = _Bounded()
        # real ranks: the program the last call of this rank's batch slices ran, where the ranks' slices had other
        # lengths (the program for their global batch: explain() cannot learn the others' rows on its own)
        self.last_uneven = _Bounded()

    def clear(self) -> None:
        """Forget every program and everything remembered per signature or structure (made for a process group
        that is gone)."""
        for kept in (self.by_signature, self.for_every_size, self.sizes_seen, self.static_only, self.outside,
                     self.last_uneven):
            kept.clear()

    def get(self, key: tuple) -> Compiled | None:
        return self.by_signature.get(key)

    def __setitem__(self, key: tuple, compiled: Compiled) -> None:
        self.by_signature[key] = compiled

    def __len__(self) -> int:
        return len(self.by_signature)

    def values(self):
        return self.by_signature.values()

    def serving(self, key: tuple, tensors: list) -> Compiled | str | None:
        """The program for every size that serves a call of this signature and these tensors; or why none does
        though one takes these sizes (its capture's guards reject them: a program for these sizes alone); or
        None where none takes them (no program for every size yet, or other dims changed)."""
        compiled = self.for_every_size.get(without_sizes(key))
        sizes = sizes_of(key)
        if compiled is None or not compiled.takes(sizes):
            return None
        return compiled.rejects(sizes, tensors) or compiled

    def that_ran(self, key: tuple, tensors: list) -> Compiled | None:
        """The program a call of this signature runs, where one is made: the last uneven call's, its own, or the
        one for every size."""
        if key in self.last_uneven:
            return self.last_uneven[key]
        serving = self.serving(key, tensors)
        return self.get(key) or (serving if isinstance(serving, Compiled) else None)

    def dims_changed(self, key: tuple, given: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """The dims to trace as symbols for a call of a structure met before: those whose size differs from its
        first call's, those given (shard(dynamic=...)), and those an earlier program for every size had; {} for
        a structure met first (its sizes are remembered) or one whose symbolic capture failed."""
        free = without_sizes(key)
        if free in self.static_only:
            return {}
        sizes = sizes_of(key)
        seen = self.sizes_seen.get(free)
        if seen is None:
            seen = self.sizes_seen[free] = sizes
        earlier = self.for_every_size.get(free)
        dims = {j: tuple(sorted({*(d for d, (a, b) in enumerate(zip(now, then)) if a != b), *given.get(j, ()),
                                 *(earlier.dynamic.get(j, ()) if earlier is not None else ())}))
                for j, (now, then) in enumerate(zip(sizes, seen))}
        return {j: d for j, d in dims.items() if d}

    def keep_for_every_size(self, key: tuple, compiled: Compiled) -> None:
        compiled.sizes = sizes_of(key)
        self.for_every_size[without_sizes(key)] = compiled

    def no_symbols(self, key: tuple) -> None:
        """This structure's symbolic capture failed: a program per size from now on."""
        self.static_only[without_sizes(key)] = True

    def trace_now(self, compiled: Compiled, key: tuple) -> bool:
        """Whether a call of this signature, served by the program for every size, is to be traced into per-rank
        graphs at its sizes: at its :func:`trace_after`-th call, while the programs kept stay below
        SHARDFN_CACHE_SIZE (a trace costs many interpreted calls: sizes met a few times, a generation's tokens
        in a few generate() calls, are not traced; sizes that recur all along, a few padded lengths, are). Every
        rank counts the same calls: all trace at the same call."""
        met = compiled.met.get(key, lambda: [0])
        met[0] += 1
        after = trace_after()
        return after > 0 and met[0] >= after and len(self.by_signature) + 1 < cache_limit()

