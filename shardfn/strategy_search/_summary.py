"""A plan read per layer: the parameters' layouts and the collectives of each layer of the module, repeated layers
folded into one line with a count. What ``str(plan)`` shows first; ``plan.table()`` lists every op."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["layer_of", "summary_lines"]

_TOP = "(top level)"


def layer_of(path: str) -> str:
    """The layer a submodule path belongs to: the path up to its first index (``model.layers.3`` for
    ``model.layers.3.self_attn.q_proj``), else its first two names (``model.embed_tokens``)."""
    if not path:
        return _TOP
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


class _Layer:
    def __init__(self, name: str):
        self.name = name
        self.params: list[tuple[str, str]] = []  # (name within the layer, layout)
        self.collectives = {"forward": {}, "backward": {}}  # phase -> kind -> [count, bytes]

    def signature(self) -> tuple:
        return (tuple(self.params),
                tuple((phase, tuple(sorted((k, tuple(v)) for k, v in kinds.items())))
                      for phase, kinds in self.collectives.items()))


def _within(name: str, layer: str) -> str:
    return name[len(layer) + 1:] if layer != _TOP and name.startswith(layer + ".") else name


def _layers(plan: Plan, fmt) -> list[_Layer]:
    layers: dict[str, _Layer] = {}

    def layer(name: str) -> _Layer:
        return layers.setdefault(name, _Layer(name))

    for i in plan.inputs:
        if i.kind == "param":
            owner = layer(layer_of(i.name.rpartition(".")[0]))
            owner.params.append((_within(i.name, owner.name), fmt(i.planned)))
    for n in plan.nodes.values():
        layer(layer_of(n.module))
    params = {i.name for i in plan.inputs if i.kind == "param"}
    for c in plan.collectives:
        producer, _, consumer = c.where.partition(" -> ")
        if producer in params:
            where = layer_of(producer.rpartition(".")[0])
        else:
            node = plan.nodes.get(producer) or plan.nodes.get(consumer)
            where = layer_of(node.module) if node is not None else _TOP
        count = layer(where).collectives.setdefault(c.phase, {}).setdefault(c.kind, [0, 0])
        count[0] += 1
        count[1] += c.nbytes
    return list(layers.values())


def _index_free(name: str) -> str:
    return re.sub(r"\.\d+(\.|$)", r".#\1", name)


def _folded(layers: list[_Layer]) -> list[tuple[str, _Layer]]:
    """Runs of consecutive layers that differ only in their index and plan alike, as one: (label, first layer)."""
    out: list[tuple[list[_Layer], _Layer]] = []
    for lay in layers:
        if out and _index_free(out[-1][1].name) == _index_free(lay.name) != lay.name \
                and out[-1][1].signature() == lay.signature():
            out[-1][0].append(lay)
            continue
        out.append(([lay], lay))
    labels = []
    for run, first in out:
        if len(run) == 1:
            labels.append((first.name, first))
            continue
        last = run[-1].name.rpartition(".")[2]
        labels.append((f"{first.name}-{last} (x{len(run)})", first))
    return labels


def summary_lines(plan: Plan, fmt) -> list[str]:
    """Per layer (repeated ones folded): the parameters grouped by layout, then each phase's collectives by kind
    (count and bytes, per layer)."""
    lines = []
    for label, lay in _folded(_layers(plan, fmt)):
        if not lay.params and not any(lay.collectives.values()):
            continue
        lines.append(label)
        by_layout: dict[str, list[str]] = {}
        for name, layout in lay.params:
            by_layout.setdefault(layout, []).append(name)
        if by_layout:
            lines.append("  parameters  " + "; ".join(f"{layout}: {', '.join(names)}"
                                                      for layout, names in by_layout.items()))
        for phase in ("forward", "backward"):
            kinds = lay.collectives.get(phase)
            if kinds:
                lines.append(f"  {phase:<10}  " + ", ".join(f"{kind} x{n} ({_mib(b)})"
                                                           for kind, (n, b) in kinds.items()))
    return lines
