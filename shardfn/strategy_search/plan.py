"""Plan: the chosen placements, the collectives they imply, and their estimated cost."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from ..layout import MeshSpec
from ._summary import summary_lines

__all__ = ["Collective", "Cost", "InputPlan", "NodePlan", "Plan"]

Placements = tuple[Placement, ...]


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


@dataclass(frozen=True)
class Cost:
    """Estimated per-rank costs of one step (forward, and backward when gradients are needed)."""

    compute_s: float  # roofline compute time of every op at its chosen split
    comm_s: float  # alpha-beta time of every collective, forward and backward
    peak_bytes: int  # peak memory with liveness (parameters, gradients, optimizer states, activations)
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
    """What runs at one graph node: its op, how (rule), where each input must be, where each output lands."""

    name: str
    op: str
    rule: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements | None, ...]
    module: str = ""  # the path of the submodule that computed it ("" for the module's own code, a function's)


@dataclass(frozen=True)
class InputPlan:
    """One graph input: how the caller holds it (``held``) and the layout the program reads it in (``planned``).
    A parameter is laid out as planned before the call, so its two agree."""

    kind: str  # "param" | "buffer" | "input"
    name: str
    shape: tuple[int, ...]
    held: Placements
    planned: Placements


@dataclass
class Plan:
    """The partitioned program ``shard()`` runs and ``explain()`` shows.

    ``nodes`` maps each fx node name (placeholders and ops) to its NodePlan; ``inputs`` says how each graph input
    arrives and is laid out; ``outputs`` gives the placements the results are returned in, ``returns_dtensor``
    whether each comes back as a DTensor. ``collectives`` lists forward and backward collectives in program order.
    ``reshard_after_forward``: the program frees each parameter's gathered copy after forward and gathers it again
    for backward (the backward all-gathers are in ``collectives``), as FSDP does, trading one all-gather per
    parameter for the memory of the whole parameters.
    """

    mesh: MeshSpec
    level: int
    nodes: dict[str, NodePlan]
    inputs: list[InputPlan]
    outputs: list[Placements | None]
    returns_dtensor: list[bool]
    collectives: list[Collective]
    cost: Cost
    optimal: bool = True
    notes: list[str] = field(default_factory=list)
    # parameters gathered in forward are gathered again in backward, not kept whole in between (level 1)
    reshard_after_forward: bool = False
    gap: float = 0.0  # relative distance of the objective to the search's best bound (0: proven optimal)
    search: dict = field(default_factory=dict)  # the search's sizes and seconds (decisions, ILP residue, ...)

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum((kind is None or c.kind == kind) and (phase is None or c.phase == phase) for c in self.collectives)

    def _header(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.shape))
        return (f"shardfn plan  mesh [{mesh}]  level {self.level}  "
                f"compute {self.cost.compute_s * 1e3:.3f} ms  comm {self.cost.comm_s * 1e3:.3f} ms  "
                f"peak {self.cost.peak_bytes / 2**20:.2f} MiB/rank"
                + ("" if self.optimal else f"  (best found, within {self.gap:.2%} of the best bound)")
                + ("  parameters gathered again in backward" if self.reshard_after_forward else ""))

    def __str__(self) -> str:
        """The plan per layer (repeated layers folded): each layer's parameters by layout and its collectives by
        kind; then what is returned and the notes. ``table()`` lists every op and every collective."""
        lines = [self._header(), *summary_lines(self, _fmt)]
        if not self.collectives:
            lines.append("no collectives")
        lines.append(f"returns {', '.join(_fmt(p) for p in self.outputs)}  "
                     f"({len(self.nodes)} ops and {len(self.collectives)} collectives: plan.table())")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def table(self) -> str:
        """Every op (its rule, input and output placements) and every collective, in program order."""
        lines = [self._header(), f"{'node':<28} {'op':<36} {'inputs':<40} outputs"]
        for n in self.nodes.values():
            ins = ", ".join(_fmt(p) for p in n.inputs) or "-"
            outs = ", ".join(_fmt(p) for p in n.outputs)
            lines.append(f"{n.name:<28} {n.op:<36} {ins:<40} {outs}")
        lines.append(f"returns {', '.join(_fmt(p) for p in self.outputs)}")
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

    def to_json(self) -> str:
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
                "mesh": {"shape": list(self.mesh.shape), "names": list(self.mesh.names)},
                "level": self.level,
                "nodes": [enc(asdict(n)) for n in self.nodes.values()],
                "inputs": [enc(asdict(i)) for i in self.inputs],
                "outputs": enc(self.outputs),
                "returns_dtensor": self.returns_dtensor,
                "collectives": [asdict(c) for c in self.collectives],
                "cost": asdict(self.cost),
                "optimal": self.optimal,
                "gap": self.gap,
                "search": self.search,
                "notes": self.notes,
                "reshard_after_forward": self.reshard_after_forward,
            },
            default=str,
        )


def _fmt(p: Placements | None) -> str:
    if p is None:
        return "-"
    short = []
    for x in p:
        s = str(x)
        s = s.replace("Replicate()", "R").replace("Shard(dim=", "S(").replace("Partial(sum)", "P")
        short.append(s)
    return "(" + ",".join(short) + ")"
