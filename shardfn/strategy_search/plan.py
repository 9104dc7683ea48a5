"""Plan: the chosen placements, the collectives they imply, and their estimated cost; its JSON file (written by
``to_json``, read back by ``from_json``/``load``, versioned so a file from another format is refused by name)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..config import Precision
from ..layout import Axis, MeshSpec
from ._summary import experts_lines, mesh_text, placements_text, recompute_lines, summary_lines

__all__ = ["PLAN_FORMAT", "Collective", "Cost", "InputPlan", "NodePlan", "Plan", "Recompute", "gap_text", "mesh_text",
           "parse_placement", "placements_text"]

Placements = tuple[Placement, ...]

# how to_html draws a plan as a page: set by the presentation (shardfn.show.plan_page) with set_page_writer
_PAGE_WRITER: Callable[[Any, str], str] | None = None


def gap_text(gap: float) -> str:
    """How far a plan not proven best may be from the best: its gap to the best bound, or, where elimination
    past the time limit kept a shortlist of candidates (solver._SHORTLIST), that no bound is known."""
    if math.isinf(gap):
        return "no bound known: past the time limit each large decision kept a shortlist of its candidates"
    return f"within {gap:.2%} of the best bound"


def set_page_writer(write: Callable[[Any, str], str]) -> None:
    """Register ``write(plan, path) -> path``, what :meth:`Plan.to_html` calls (shardfn.show.plan_page registers
    its ``write_page`` as it is imported): the page belongs to a later layer, which this one does not import."""
    global _PAGE_WRITER
    _PAGE_WRITER = write

# The version of to_json's layout; from_json reads this one only (a file of another version is refused by name,
# never half read). Raise it whenever a field changes meaning or goes away.
PLAN_FORMAT = 1


@dataclass(frozen=True)
class Collective:
    """One collective the program runs.

    ``nbytes`` is the logical size of the collective's full operand within its group: all_reduce the reduced
    tensor, all_gather the gathered output, reduce_scatter the input before scattering, all_to_all the input.
    """

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send_recv
    phase: str  # forward | backward
    mesh_dims: tuple[int, ...]
    nbytes: int
    where: str  # the tensor it moves: "producer -> consumer"
    bucket: int | None = None  # a gradient's all-reduce fused with others: the number of its bucket
    seconds: float | None = None  # the cost model's estimate (its share of a bucket's latency); None: not priced


@dataclass(frozen=True)
class Cost:
    """Estimated per-rank costs of one step (forward, and backward when gradients are needed)."""

    compute_s: float  # roofline compute time of every op at its chosen split
    comm_s: float  # alpha-beta time of every collective, forward and backward
    peak_bytes: int  # peak memory with liveness over forward and backward (parameters, gradients, optimizer
    # states, activations kept for backward, activations' gradients)
    saved_s: float = 0.0  # compute time sharding saves against running every op whole

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def ratio(self) -> float:
        """Level 0's objective: compute saved per second of communication (inf when nothing is communicated)."""
        return self.saved_s / self.comm_s if self.comm_s > 0 else float("inf")


@dataclass(frozen=True)
class NodePlan:
    """What runs at one graph node: its op, by which rule, where each input must be, where each output lands, and
    how exec runs it (``run``: strategy_search.run_modes)."""

    name: str
    op: str
    rule: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    module: str = ""  # the path of the submodule that computed it ("" for the module's own code, a function's)
    shapes: tuple[tuple[int, ...] | None, ...] = ()  # each output's global shape (None: not a tensor)
    compute_s: float | None = None  # the cost model's per-rank seconds at the chosen split (backward included)
    live_bytes: int | None = None  # per-rank bytes alive once it has run (the forward's memory over the program)
    # per-rank bytes alive as its backward runs (the backward's memory, read in reverse program order); None where
    # no backward runs at it
    backward_live_bytes: int | None = None
    run: str = "dtensor"  # how exec runs it (run_modes.RUN_MODES); a plan file without it: as its rule says


@dataclass(frozen=True)
class InputPlan:
    """One graph input: how the caller holds it (``held``) and the layout the program reads it in (``planned``).
    A parameter is laid out as planned before the call, so its two agree."""

    kind: str  # "param" | "buffer" | "input"
    name: str
    shape: tuple[int, ...]
    held: Placements
    planned: Placements
    # where ``planned`` came from: "in_strategy", "dtensor" (the argument's own layout), "data_parallel",
    # "parameter_plan", "laid out" (by an earlier call), "buffer" (kept whole) or "search"; "" where not recorded
    origin: str = ""


@dataclass(frozen=True)
class Recompute:
    """A region backward computes again instead of keeping its values from forward (activation checkpointing)."""

    region: str  # the layer's path (model.layers.3); "checkpoint N (layer)" for a region checkpointed by hand
    origin: str  # "search" (to fit the memory; level 1: to lower the peak), "recompute=True", "recompute=" (per
    # module, asked for), "checkpoint" (by hand)
    nodes: tuple[str, ...]  # its ops (node names), which exec marks as torch.utils.checkpoint's are (none: by hand)
    saved_bytes: int  # per-rank bytes not kept from forward to backward
    extra_s: float  # the cost model's seconds of forward computed again
    selective: bool = False  # its matmuls' and attention's results kept, the ops between them computed again
    # what its collectives reduced kept too, gathers and all-to-alls run again (selectively, at levels 0 and 2;
    # level 1, the least memory, runs every collective again)
    keeps_reduced: bool = False

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))


@dataclass(frozen=True)
class Plan:
    """The partitioned program ``shard()`` runs and ``explain()`` shows: everything exec needs to lower the
    captured graph it was made for, and nothing exec adds (compile times live on the program). Frozen: a plan
    with something added (a measured step time) is a new plan (``dataclasses.replace``).

    ``nodes`` maps each op's graph node, by the node's name (unique in its graph; a plan file keeps it), to its
    NodePlan; exec resolves the names to the graph's nodes once, when it lowers the plan, and refuses a plan that
    misses one of the graph's ops. ``inputs`` says how each graph input arrives and is laid out; ``outputs``
    gives the placements the results are returned in, ``returns_dtensor`` whether each comes back as a DTensor.
    ``collectives`` lists forward and backward collectives in program order (inputs arriving from other ranks'
    point-to-point moves included). ``reshard_after_forward``: the program frees each parameter's gathered copy
    after forward and gathers it again for backward (the backward all-gathers are in ``collectives``), as FSDP
    does, trading one all-gather per parameter for the memory of the whole parameters. ``to_json`` writes it as a
    file (versioned: PLAN_FORMAT) that ``from_json`` and ``load`` read back, ``to_html`` as a page.
    """

    mesh: MeshSpec
    level: int
    nodes: Mapping[str, NodePlan]
    inputs: tuple[InputPlan, ...]
    outputs: tuple[Placements | None, ...]
    returns_dtensor: tuple[bool, ...]
    collectives: tuple[Collective, ...]
    cost: Cost
    optimal: bool = True
    notes: tuple[str, ...] = ()
    # parameters gathered in forward are gathered again in backward, not kept whole in between (level 1)
    reshard_after_forward: bool = False
    gap: float = 0.0  # relative distance of the objective to the search's best bound (0: proven optimal)
    search: Mapping[str, Any] = field(default_factory=dict)  # the search's sizes and seconds (decisions, ...)
    output_shapes: tuple[tuple[int, ...] | None, ...] = ()  # each output's global shape
    measured_s: float | None = None  # a measured step time, where whoever ran the plan recorded one
    # what ``measured_s`` measured: shardfn's own (sf.explain of a signature that ran) says which calls and how
    measured: str = ""
    name: str = "fn"  # the sharded callable's (exec's error messages name it)
    # gradients the program leaves pending (Partial) where their parameters are whole, for someone else to
    # reduce: every parameter's under accumulation without sync (sf.no_sync), and those a stage-2 sharded
    # optimizer reduce-scatters itself (by parameter name)
    accumulate: bool = False
    pending_grads: frozenset[str] = frozenset()
    precision: Precision | None = None  # a mixed precision policy the program runs under
    recompute: tuple[Recompute, ...] = ()  # the regions backward computes again, in program order

    def __post_init__(self):
        # read-only all the way down: the containers are tuples and read-only mappings
        for name in ("inputs", "outputs", "returns_dtensor", "collectives", "notes", "output_shapes", "recompute"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))
        object.__setattr__(self, "search", MappingProxyType(dict(self.search)))
        object.__setattr__(self, "pending_grads", frozenset(self.pending_grads))

    def pending(self, param: str) -> bool:
        """Whether the program leaves parameter ``param``'s gradient pending where the parameter is whole."""
        return self.accumulate or param in self.pending_grads

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum((kind is None or c.kind == kind) and (phase is None or c.phase == phase) for c in self.collectives)

    def _header(self) -> str:
        mesh = mesh_text(self.mesh)
        return (f"shardfn plan  mesh [{mesh}]  level {self.level}  "
                f"compute {self.cost.compute_s * 1e3:.3f} ms  comm {self.cost.comm_s * 1e3:.3f} ms  "
                f"peak {self.cost.peak_bytes / 2**20:.2f} MiB/rank"
                + ("" if self.optimal else f"  (best found, {gap_text(self.gap)})")
                + ("  parameters gathered again in backward" if self.reshard_after_forward else "")
                + (f"  recompute {sum(r.extra_s for r in self.recompute) * 1e3:.3f} ms" if self.recompute else ""))

    def __str__(self) -> str:
        """The plan per layer (repeated layers folded): each layer's parameters by layout and its collectives by
        kind; then what is returned and the notes. ``table()`` lists every op and every collective."""
        lines = [self._header(), *summary_lines(self, placements_text), *experts_lines(self),
                 *recompute_lines(self)]
        if not self.collectives:
            lines.append("no collectives")
        lines.append(f"returns {', '.join(placements_text(p) for p in self.outputs)}  "
                     f"({len(self.nodes)} ops and {len(self.collectives)} collectives: plan.table())")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def table(self) -> str:
        """Every op (its rule, input and output placements) and every collective, in program order."""
        lines = [self._header(), f"{'node':<28} {'op':<36} {'inputs':<40} outputs"]
        for n in self.nodes.values():
            ins = ", ".join(placements_text(p) for p in n.inputs) or "-"
            outs = ", ".join(placements_text(p) for p in n.outputs)
            lines.append(f"{n.name:<28} {n.op:<36} {ins:<40} {outs}")
        lines.append(f"returns {', '.join(placements_text(p) for p in self.outputs)}")
        if self.collectives:
            lines.append(f"{'collective':<16} {'phase':<9} {'mesh dims':<10} {'bytes':>12}  {'bucket':<7} tensor")
            for c in self.collectives:
                bucket = "-" if c.bucket is None else str(c.bucket)
                lines.append(f"{c.kind:<16} {c.phase:<9} {str(c.mesh_dims):<10} {c.nbytes:>12}  {bucket:<7} "
                             f"{c.where}")
            buckets = {}
            for c in self.collectives:
                if c.bucket is not None:
                    buckets.setdefault(c.bucket, []).append(c.nbytes)
            lines += [f"bucket {b}: {len(sizes)} gradient all-reduces fused into one of {sum(sizes)} bytes"
                      for b, sizes in sorted(buckets.items())]
        else:
            lines.append("no collectives")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_html(self, path: str) -> str:
        """Write the plan as one self-contained HTML page (no network needed to view it) and return ``path``: the
        module tree with repeated layers folded, every tensor's pieces on the device mesh, the collectives, the
        costs per layer. ``python -m shardfn.show plan.json`` writes the same page from a saved plan. The page is
        drawn by the presentation (shardfn.show.plan_page), which registers its writer here as it is imported
        (with the package): this stage never imports a later one."""
        if _PAGE_WRITER is None:
            raise RuntimeError("Plan.to_html: no page writer is registered (import shardfn.show.plan_page, which "
                               "the shardfn package imports)")
        return _PAGE_WRITER(self, path)

    @classmethod
    def load(cls, path: str) -> Plan:
        """The plan saved in the file at ``path`` (``to_json``'s text); a ValueError naming the file where it is
        not one, or was written in another plan format."""
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a shardfn plan file (not UTF-8 text: {e})") from e
        return cls.from_json(text, source=path)

    @classmethod
    def from_json(cls, text: str, source: str = "plan JSON") -> Plan:
        """The plan ``to_json`` wrote. Placements come back as DTensor's placement objects where they are
        Shard, Replicate, Partial or a strided shard, else as their text. ``source`` names the text in errors."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{source}: not a shardfn plan file (not JSON: {e})") from None
        if not isinstance(data, dict) or "shardfn_plan_format" not in data:
            raise ValueError(f"{source}: not a shardfn plan file (no 'shardfn_plan_format' field; plan.to_json() "
                             "writes one)")
        version = data["shardfn_plan_format"]
        if version != PLAN_FORMAT:
            raise ValueError(f"{source}: written by plan format {version}, this shardfn reads {PLAN_FORMAT}; "
                             "write it again with this shardfn (sf.explain(...).to_json())")
        try:
            return _decode(data)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: not a shardfn plan file (a field is missing or malformed: "
                             f"{type(e).__name__}: {e})") from e

    def to_json(self) -> str:
        """The plan as JSON text, placements as their text; ``from_json`` reads it back."""

        def enc(x: Any):
            if isinstance(x, Placement):
                return str(x)
            if isinstance(x, (list, tuple)):
                return [enc(v) for v in x]
            if isinstance(x, dict):
                return {k: enc(v) for k, v in x.items()}
            return x

        return json.dumps(
            {
                "shardfn_plan_format": PLAN_FORMAT,
                "mesh": {"shape": list(self.mesh.shape), "names": list(self.mesh.names),
                         **({"links": list(self.mesh.links)} if self.mesh.links is not None else {})},
                "level": self.level,
                "nodes": [{"key": key, **enc(_fields(n))} for key, n in self.nodes.items()],  # key: the node's name
                "inputs": [enc(_fields(i)) for i in self.inputs],
                "outputs": enc(self.outputs),
                "returns_dtensor": self.returns_dtensor,
                "collectives": [asdict(c) for c in self.collectives],
                "cost": asdict(self.cost),
                "optimal": self.optimal,
                "gap": self.gap,
                "search": dict(self.search),
                "notes": list(self.notes),
                "reshard_after_forward": self.reshard_after_forward,
                "output_shapes": enc(self.output_shapes),
                "measured_s": self.measured_s,
                "measured": self.measured,
                "name": self.name,
                "accumulate": self.accumulate,
                "pending_grads": sorted(self.pending_grads),
                "recompute": [asdict(r) for r in self.recompute],
                "precision": None if self.precision is None else
                {k: None if v is None else str(v) for k, v in _fields(self.precision).items()},
            },
            default=str,
        )


def _fields(record) -> dict:
    # one level only: asdict would also take apart placements where a torch release makes them dataclasses
    return {f.name: getattr(record, f.name) for f in fields(record)}


# placement text as str() writes it, in torch releases' two spellings ("S(1)" or "Shard(dim=1)", ...)
_SHARD = re.compile(r"(?:S|Shard)\((?:dim=)?(-?\d+)\)")
_STRIDED = re.compile(r"(?:_S|_StridedShard)\((?:dim=)?(-?\d+), (?:sf=)?(\d+)\)")
_PARTIAL = re.compile(r"(?:P|Partial)\((\w+)\)")


def parse_placement(text: str) -> Placement | str:
    """The placement object a placement's text names; the text itself where it names another kind (a
    masked partial: the plan's text shows it, the page draws no pieces for it)."""
    if text in ("R", "Replicate()"):
        return Replicate()
    if m := _SHARD.fullmatch(text):
        return Shard(int(m[1]))
    if m := _PARTIAL.fullmatch(text):
        return Partial(m[1])
    if text == "P":  # placements_text's shorthand of a sum
        return Partial()
    if m := _STRIDED.fullmatch(text):
        from ._dtensor_adapter import strided_shard

        return strided_shard(int(m[1]), int(m[2]))
    return text


def _placements(items) -> Placements | None:
    if items is None:
        return None
    if isinstance(items, str):
        raise ValueError(f"placements {items!r}: expected a list")
    return tuple(parse_placement(p) for p in items)


def _shape(items) -> tuple[int, ...] | None:
    return None if items is None else tuple(int(n) for n in items)


def _decode(data: dict) -> Plan:
    shape = [int(n) for n in data["mesh"]["shape"]]
    # shardfn's meshes are row-major over the call's ranks: each axis' stride is the size of the axes inside it
    axes = tuple(Axis(n, math.prod(shape[i + 1:])) for i, n in enumerate(shape))
    nodes = {}
    for n in data["nodes"]:
        nodes[n["key"]] = NodePlan(
            n["name"], n["op"], n["rule"], tuple(_placements(p) for p in n["inputs"]),
            tuple(_placements(p) for p in n["outputs"]), n.get("module", ""),
            tuple(_shape(s) for s in n.get("shapes", ())), n.get("compute_s"), n.get("live_bytes"),
            n.get("backward_live_bytes"),
            # (a plan written before run modes: DTensor's dispatch wherever the rule is DTensor's, as correct)
            n.get("run", n["rule"]))
    inputs = [InputPlan(i["kind"], i["name"], _shape(i["shape"]), _placements(i["held"]), _placements(i["planned"]),
                        i.get("origin", "")) for i in data["inputs"]]
    collectives = [Collective(c["kind"], c["phase"], tuple(c["mesh_dims"]), int(c["nbytes"]), c["where"],
                              c.get("bucket"), c.get("seconds")) for c in data["collectives"]]
    return Plan(
        mesh=MeshSpec(axes, tuple(data["mesh"]["names"]),
                      tuple(data["mesh"]["links"]) if data["mesh"].get("links") is not None else None),
        level=int(data["level"]),
        nodes=nodes,
        inputs=inputs,
        outputs=[_placements(p) for p in data["outputs"]],
        returns_dtensor=[bool(b) for b in data["returns_dtensor"]],
        collectives=collectives,
        cost=Cost(**data["cost"]),
        optimal=bool(data["optimal"]),
        notes=[str(n) for n in data["notes"]],
        reshard_after_forward=bool(data["reshard_after_forward"]),
        gap=float(data["gap"]),
        search=dict(data["search"]),
        output_shapes=[_shape(s) for s in data.get("output_shapes", [])],
        measured_s=data.get("measured_s"),
        measured=str(data.get("measured", "")),
        name=str(data.get("name", "fn")),
        accumulate=bool(data.get("accumulate", False)),
        pending_grads=frozenset(str(n) for n in data.get("pending_grads", ())),
        precision=_precision(data.get("precision")),
        recompute=[Recompute(str(r["region"]), str(r["origin"]), tuple(str(n) for n in r["nodes"]),
                             int(r["saved_bytes"]), float(r["extra_s"]), bool(r.get("selective", False)),
                             bool(r.get("keeps_reduced", False)))
                   for r in data.get("recompute", ())],
    )


def _precision(data: dict | None) -> Precision | None:
    """A mixed precision policy from its dtypes' text ("torch.bfloat16")."""
    if data is None:
        return None
    dtypes = {}
    for k, v in data.items():
        dtype = None if v is None else getattr(torch, str(v).removeprefix("torch."), None)
        if v is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"precision.{k}: {v!r} is not a torch dtype")
        dtypes[k] = dtype
    return Precision(**dtypes)
