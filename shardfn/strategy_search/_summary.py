"""A plan read per layer: the parameters' layouts and the collectives of each layer of the module, repeated layers
folded into one line with a count. What ``str(plan)`` shows first (and the plan page folds its tree alike);
``plan.table()`` lists every op."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .expert_rules import EXPERT_INPUTS

if TYPE_CHECKING:
    from ..layout import MeshSpec

__all__ = ["collective_module", "experts_lines", "folded_layers", "layer_group", "layer_of", "mesh_text",
           "placements_text", "recompute_lines", "summary_lines"]

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


def layer_group(layer: str) -> str:
    """What identical layers share of their name (:func:`layer_of`'s): all but its last index
    (``model.layers.#``)."""
    return re.sub(r"\.\d+$", ".#", layer)


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


def _layers(plan, fmt) -> list[_Layer]:
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
        count = layer(layer_of(collective_module(plan, c, params))).collectives.setdefault(c.phase, {}) \
            .setdefault(c.kind, [0, 0])
        count[0] += 1
        count[1] += c.nbytes
    return list(layers.values())


def collective_module(plan, c, params: set[str]) -> str:
    """The submodule path a collective is charged to: the parameter's module where it moves a parameter, else
    the module of the op that made the tensor (or of the op reading it, where no op made it)."""
    producer, _, consumer = c.where.partition(" -> ")
    if producer in params:
        return producer.rpartition(".")[0]
    node = plan.nodes.get(producer) or plan.nodes.get(consumer)
    return node.module if node is not None else ""


def _index_free(name: str) -> str:
    return re.sub(r"\.\d+(\.|$)", r".#\1", name)


def _folded(layers: list[_Layer]) -> list[tuple[str, list[_Layer]]]:
    """Runs of consecutive layers that differ only in their index and plan alike, as one: (label, the run)."""
    runs: list[list[_Layer]] = []
    for lay in layers:
        if runs and _index_free(runs[-1][0].name) == _index_free(lay.name) != lay.name \
                and runs[-1][0].signature() == lay.signature():
            runs[-1].append(lay)
            continue
        runs.append([lay])
    labels = []
    for run in runs:
        labels.append((_run_label(run[0].name, run[-1].name, len(run)), run))
    return labels


def folded_layers(plan, fmt) -> list[tuple[str, list[str]]]:
    """Every layer of the plan in order, repeated ones folded: (label, the names of the layers it stands for),
    the label ``model.layers.0-31 (x32)`` for a run of 32 layers planned alike."""
    return [(label, [lay.name for lay in run]) for label, run in _folded(_layers(plan, fmt))]


def summary_lines(plan, fmt) -> list[str]:
    """Per layer (repeated ones folded): the parameters grouped by layout, then each phase's collectives by kind
    (count and bytes, per layer)."""
    lines = []
    for label, (lay, *_) in _folded(_layers(plan, fmt)):
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


def mesh_text(mesh: MeshSpec) -> str:
    """``dp=8 x tp=8``, each dim's link after it where a dim of more than one rank runs between nodes
    (``dp=8 (inter) x tp=8 (intra)``)."""
    links = mesh.links or (None,) * len(mesh.shape)
    across = any(link == "inter" and n > 1 for link, n in zip(links, mesh.shape))
    return " x ".join(f"{n}={s}" + (f" ({link})" if across and link else "")
                      for n, s, link in zip(mesh.names, mesh.shape, links))


def placements_text(p: tuple | None) -> str:
    """A layout as the plan's text writes it: ``(S(0),R)``."""
    if p is None:
        return "-"
    short = []
    for x in p:
        s = str(x)
        s = s.replace("Replicate()", "R").replace("Shard(dim=", "S(").replace("Partial(sum)", "P")
        short.append(s)
    return "(" + ",".join(short) + ")"


def recompute_lines(plan) -> list[str]:
    """The regions backward computes again (repeated layers folded alike), each with the per-rank bytes it does
    not keep and the forward seconds it computes again (per region)."""
    runs: list[list] = []
    for r in plan.recompute:
        if runs and runs[-1][0].origin == r.origin and runs[-1][0].selective == r.selective \
                and _index_free(runs[-1][0].region) == _index_free(r.region) != r.region:
            runs[-1].append(r)
        else:
            runs.append([r])
    lines = []
    for run in runs:
        first, last = run[0].region, run[-1].region
        label = _run_label(first, last, len(run))
        why = {"search": "chosen by the search", "recompute=True": "recompute=True",
               "recompute=selective": "recompute='selective'",
               "recompute=": "asked for in recompute=", "checkpoint": "checkpointed by hand"}.get(run[0].origin,
                                                                                         run[0].origin)
        kept = "matmuls, attention and reductions" if run[0].keeps_reduced else "matmuls and attention"
        how = f", selectively: {kept} kept" if run[0].selective and "selective" not in why else ""
        lines.append(f"recompute {label}  ({why}{how}): {_mib(run[0].saved_bytes)} a rank not kept, "
                     f"{run[0].extra_s * 1e3:.3f} ms of forward again" + (" each" if len(run) > 1 else ""))
    return lines


# the mixture-of-experts ops as a plan names them (a Function's call: "MoEExperts.apply"), with the positions of
# their tokens and expert weights among their inputs
_EXPERT_OPS = {f"{op.__qualname__}.apply": at for op, at in EXPERT_INPUTS.items()}


def _experts_text(node, mesh) -> str:
    """How one experts op runs, per mesh dim of more than one rank: what holds the experts, how the tokens go."""
    tokens_at, weight_at = _EXPERT_OPS[node.op]
    tokens, weight = node.inputs[tokens_at], node.inputs[weight_at]
    parts = []
    for m, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        if size == 1 or weight is None:
            continue
        w = getattr(weight[m], "dim", None) if weight[m].is_shard() else None
        tokens_split = tokens is not None and tokens[m].is_shard()
        if w == 0 and tokens_split:
            parts.append(f"split over {name} (1/{size} of the experts a rank; each token sent to its experts' "
                         f"ranks over {name} and back: all_to_all)")
        elif w == 0:
            parts.append(f"split over {name} (1/{size} of the experts a rank; every token's share from each "
                         f"rank's experts summed over {name})")
        elif w is not None:
            parts.append(f"each expert's weights split over {name} (tensor parallel within the experts)")
        elif tokens_split:
            parts.append(f"whole over {name}, the tokens split over it")
    return "; ".join(parts) or "whole on every rank"


def experts_lines(plan) -> list[str]:
    """Each layer's mixture of experts (repeated layers planned alike folded): which mesh dims hold the experts and
    how the tokens meet them."""
    runs: list[tuple[list[str], str]] = []  # (the layers, the text)
    for n in plan.nodes.values():
        if n.op not in _EXPERT_OPS:
            continue
        layer, text = layer_of(n.module), _experts_text(n, plan.mesh)
        if runs and runs[-1][1] == text and (runs[-1][0][-1] == layer or
                                             _index_free(runs[-1][0][0]) == _index_free(layer) != layer):
            if runs[-1][0][-1] != layer:
                runs[-1][0].append(layer)
        else:
            runs.append(([layer], text))
    return [f"experts {_run_label(layers[0], layers[-1], len(layers))}: {text}" for layers, text in runs]


def _run_label(first: str, last: str, count: int) -> str:
    """``model.layers.0-31 (x32)`` for a run of layers, the name alone for one."""
    return first if count == 1 else f"{first}-{last.rpartition('.')[2]} (x{count})"
