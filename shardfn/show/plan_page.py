"""The plan page: a Plan as one self-contained HTML file (inline CSS and script, nothing fetched when it is viewed).

``str(plan)`` reads per layer and ``plan.table()`` per op; the page puts them together where a person can click:
the module tree (repeated layers folded into one with their count, each module open down to its ops), every
parameter, input, output and activation drawn as the device mesh with each rank's piece (offset and shape,
DTensor's chunking: uneven and empty pieces marked) and where its layout came from, the collectives with the cost
model's seconds (filtered by phase), and the costs: compute and communication per layer, memory over the forward
and the backward (one line, the backward's start marked), the measured step next to the estimate where the plan
carries one (``sf.explain`` of a signature that ran: shardfn.call.step_times).
Only the first of each run of folded layers is written out in full, so a 32-layer model's page stays small.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..call.reshard import region
from ..strategy_search._summary import (collective_module, experts_lines, folded_layers, layer_of, mesh_text,
                                        placements_text, recompute_lines)
from ..strategy_search.plan import set_page_writer
from ..strategy_search.policy import level_policy

__all__ = ["render_page", "write_page"]

_ORIGINS = {"in_strategy": "given by the caller (in_strategy)", "dtensor": "the DTensor argument's own layout",
            "data_parallel": "data_parallel (the batch split, parameters whole)",
            "parameter_plan": "given by the caller (parameter_plan)",
            "laid out": "as an earlier call laid the parameter out", "buffer": "a buffer: kept whole",
            "search": "chosen by the search", "": "not recorded in this plan"}
_TOP = "(top level)"
_MEMORY_POINTS = 400  # the memory line's resolution: a long program is drawn as the peaks of this many spans


def write_page(plan, path: str) -> str:
    """Write ``plan``'s page to ``path`` (UTF-8) and return the path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_page(plan))
    return str(path)


set_page_writer(write_page)  # (Plan.to_html draws its page with it: the plan's stage does not import this one)


def render_page(plan) -> str:
    """The page's HTML text."""
    page = _Page(plan)
    tree = _tree(page)  # first: it writes out the activations the other sections link to
    body = "\n".join([page.header(), _costs(page), tree, page.tensors_table(), page.collectives()])
    data = {"mesh": {"shape": list(plan.mesh.shape), "names": list(plan.mesh.names)}, "tensors": page.tensors,
            "first": page.first_shown}
    # "</" would end the script element early: JSON allows "<\/" for the same text
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (_TEMPLATE.replace("%TITLE%", html.escape(page.title))
            .replace("%BODY%", body).replace("%DATA%", payload))


# -- text ---------------------------------------------------------------------------------------------------------

def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.3g} µs"


def _op(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


# -- the pieces ---------------------------------------------------------------------------------------------------

def _drawable(placements) -> bool:
    # DTensor's plain chunking; a strided shard's pieces interleave and a placement read back as text is unknown
    return all(type(p) in (Shard, Replicate) or isinstance(p, Partial) for p in placements)


def _pieces(shape: tuple[int, ...], placements, mesh_shape: tuple[int, ...]) -> list[list]:
    """Each rank's piece, ranks row-major over the mesh (as shardfn lays its meshes over the call's ranks):
    [rank, mesh coordinate, offset, shape]."""
    ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    placements = [Shard(p.dim % len(shape)) if type(p) is Shard else p for p in placements]
    return [[rank, list(coord), *map(list, region(tuple(shape), ranks, rank, placements))]
            for rank, coord in enumerate(itertools.product(*map(range, mesh_shape)))]


def _tensor(name: str, shape, placements, origin: str, mesh_shape, folded: str | None = None) -> dict:
    record = {"name": name, "folded": folded, "shape": None if shape is None else list(shape),
              "placements": placements_text(placements), "origin": origin,
              "partial": placements is not None and any(isinstance(p, Partial) for p in placements)}
    if shape is None or placements is None:
        record["why"] = "no shape recorded for this value"
    elif not _drawable(placements):
        record["why"] = f"pieces of {placements_text(placements)} are not drawn (not DTensor's plain chunking)"
    else:
        record["pieces"] = _pieces(tuple(shape), placements, tuple(mesh_shape))
    return record


# -- the module tree ----------------------------------------------------------------------------------------------

@dataclass
class _Module:
    label: str
    count: int = 1  # layers this entry stands for (folded)
    children: dict[str, _Module] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)  # its own ops and parameters, as table rows
    ops: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    # a folded entry's ops, compute and communication seconds over all its layers (its children show the first)
    folded_totals: tuple[int, float, float] | None = None

    def child(self, label: str) -> _Module:
        return self.children.setdefault(label, _Module(label))

    def totals(self) -> tuple[int, float, float]:
        """Ops, compute and communication seconds of it and its submodules."""
        if self.folded_totals is not None:
            return self.folded_totals
        ops, compute, comm = self.ops, self.compute_s, self.comm_s
        for c in self.children.values():
            o, a, b = c.totals()
            ops, compute, comm = ops + o, compute + a, comm + b
        return ops, compute, comm


def _holds_folded(m: _Module) -> bool:
    return m.count > 1 or any(_holds_folded(c) for c in m.children.values())


class _Page:
    def __init__(self, plan):
        self.plan = plan
        self.mesh_shape = tuple(plan.mesh.shape)
        self.layers = folded_layers(plan, placements_text)
        # each layer's display: the folded label for the first of a run, None for the others (not written out)
        self.shown: dict[str, tuple[str, int] | None] = {}
        for label, members in self.layers:
            self.shown[members[0]] = (label, len(members))
            self.shown.update(dict.fromkeys(members[1:]))
        self.params = {i.name for i in plan.inputs if i.kind == "param"}
        self.tensors: dict[str, dict] = {}
        self.first_shown: str | None = None
        mesh = mesh_text(plan.mesh)
        self.title = f"shardfn plan: mesh [{mesh}], level {plan.level}"
        self._input_ids: dict[str, str] = {}  # input name -> its tensor's id
        self.by_name: dict[str, str] = {}  # a written-out tensor's name (as collectives name it) -> its id
        for k, i in enumerate(plan.inputs):
            if self._visible(self._module_of_input(i)):
                tid = f"i{k}"
                self.tensors[tid] = _tensor(i.name, i.shape, i.planned, _ORIGINS.get(i.origin, i.origin),
                                            self.mesh_shape, self._folded_as(self._module_of_input(i)))
                if i.kind == "input":  # a parameter is laid out as planned before the call: held as planned
                    self.tensors[tid]["held"] = placements_text(i.held)
                self._input_ids[i.name] = tid
                self.by_name[i.name] = tid
                if self.first_shown is None and any(not isinstance(p, Replicate) for p in i.planned):
                    self.first_shown = tid
        for k, p in enumerate(plan.outputs):
            shape = plan.output_shapes[k] if k < len(plan.output_shapes) else None
            origin = "given by the caller (out_strategy), returned as a DTensor" if plan.returns_dtensor[k] else \
                "returned whole (the default)" if p is None or all(isinstance(x, Replicate) for x in p) else \
                "data_parallel: each rank returns its batch slice"
            self.tensors[f"o{k}"] = _tensor(f"output {k}", shape, p, origin, self.mesh_shape)
        if self.first_shown is None and self.tensors:
            self.first_shown = next(iter(self.tensors))

    # which layers and names are written out

    def _module_of_input(self, i) -> str:
        return i.name.rpartition(".")[0] if i.kind in ("param", "buffer") else ""

    def _visible(self, module: str) -> bool:
        return self.shown.get(layer_of(module), ("", 1)) is not None

    def _path(self, module: str) -> list[str]:
        """The tree path of a module: its layer's folded label in place of the layer's own name."""
        layer = layer_of(module)
        if layer == _TOP:
            return [_TOP]
        label, count = self.shown.get(layer) or (layer, 1)
        if count == 1:
            return module.split(".")
        parent = layer.rpartition(".")[0]  # "model.layers" of "model.layers.0", labelled "model.layers.0-3 (x4)"
        head = (parent.split(".") if parent else []) + [label[len(parent) + 1:] if parent else label]
        return head + (module[len(layer) + 1:].split(".") if module != layer else [])

    def _folded_as(self, module: str) -> str | None:
        """The folded label a module's tensors stand for each layer of (``model.layers.0-31 (x32)``), if any."""
        shown = self.shown.get(layer_of(module))
        return shown[0] if shown and shown[1] > 1 else None

    # sections

    def header(self) -> str:
        plan, cost = self.plan, self.plan.cost
        facts = [("mesh", mesh_text(plan.mesh)
                  + f" ({math.prod(plan.mesh.shape)} ranks)"),
                 ("level", f"{plan.level}: {level_policy(plan.level).said}"),
                 ("objective", f"ratio {cost.ratio:.3g} (compute saved {_seconds(cost.saved_s)} per "
                               f"{_seconds(cost.comm_s)} of communication)" if plan.level == 0 else
                  f"peak {_bytes(cost.peak_bytes)} per rank" if plan.level == 1 else
                  f"step {_seconds(cost.total_s)}"),
                 ("search", "optimal" if plan.optimal else f"best found, within {plan.gap:.2%} of the best bound"),
                 ("estimated step", f"{_seconds(cost.total_s)} = compute {_seconds(cost.compute_s)} + "
                                    f"communication {_seconds(cost.comm_s)}"),
                 ("measured step", (_seconds(plan.measured_s) + (f": {plan.measured}" if plan.measured else ""))
                  if plan.measured_s is not None else
                  "not recorded (sf.explain(sharded, *args) of a call that ran a few steps records one)"),
                 ("peak memory", f"{_bytes(cost.peak_bytes)} per rank"),
                 ("program", f"{len(plan.nodes)} ops, {len(plan.collectives)} collectives"
                             + (", parameters gathered again in backward" if plan.reshard_after_forward else ""))]
        # the regions backward computes again, folded as str(plan) folds them
        facts += [("recompute", line.removeprefix("recompute ")) for line in recompute_lines(plan)]
        facts += [("experts", line.removeprefix("experts ")) for line in experts_lines(plan)]
        rows = "".join(f"<tr data-fact='{_esc(k)}'><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in facts)
        notes = "".join(f"<li>{_esc(n)}</li>" for n in plan.notes)
        return (f"<h1>{_esc(self.title)}</h1><table class='facts' id='facts'>{rows}</table>"
                + (f"<ul class='notes'>{notes}</ul>" if notes else ""))

    def _per_layer(self) -> list[tuple[str, float, float]]:
        """(label, compute seconds, communication seconds) of one layer of each folded run."""
        compute: dict[str, float] = {}
        for n in self.plan.nodes.values():
            compute[layer_of(n.module)] = compute.get(layer_of(n.module), 0.0) + (n.compute_s or 0.0)
        comm: dict[str, float] = {}
        for c in self.plan.collectives:
            layer = layer_of(collective_module(self.plan, c, self.params))
            comm[layer] = comm.get(layer, 0.0) + (c.seconds or 0.0)
        return [(label, compute.get(members[0], 0.0), comm.get(members[0], 0.0)) for label, members in self.layers]

    def tensors_table(self) -> str:
        rows = []
        for k, i in enumerate(self.plan.inputs):
            tid = self._input_ids.get(i.name)
            if tid is None:
                continue
            t = self.tensors[tid]
            folded = f" <small>(each of {_esc(t['folded'])})</small>" if t["folded"] else ""
            rows.append(f"<tr><td>{_esc(i.kind)}</td><td><a class='t' data-t='{tid}'>{_esc(t['name'])}</a>{folded}</td>"
                        f"<td>{_esc(tuple(i.shape))}</td><td>{_esc(placements_text(i.held))}</td>"
                        f"<td>{_esc(placements_text(i.planned))}</td><td>{_esc(t['origin'])}</td></tr>")
        for k, p in enumerate(self.plan.outputs):
            t = self.tensors[f"o{k}"]
            shape = "-" if t["shape"] is None else str(tuple(t["shape"]))
            rows.append(f"<tr><td>output</td><td><a class='t' data-t='o{k}'>{_esc(t['name'])}</a></td>"
                        f"<td>{_esc(shape)}</td><td>-</td><td>{_esc(placements_text(p))}</td>"
                        f"<td>{_esc(t['origin'])}</td></tr>")
        return ("<section id='tensors'><h2>Parameters, inputs and outputs</h2><table class='list'><tr><th>kind</th>"
                "<th>name</th><th>shape</th><th>held</th><th>planned</th><th>layout from</th></tr>"
                + "".join(rows) + "</table></section>")

    def collectives(self) -> str:
        names = self.plan.mesh.names
        label_of = {m: label for label, members in self.layers for m in members}
        rows = []
        for k, c in enumerate(self.plan.collectives):
            module = collective_module(self.plan, c, self.params)
            layer = label_of.get(layer_of(module), layer_of(module))
            dims = ", ".join(names[d] if 0 <= d < len(names) else str(d) for d in c.mesh_dims) or "-"
            # "mm_3 -> view", "input 1 (entry)", "w (summed)": the tensor moved, linked where it is written out
            producer = c.where.partition(" -> ")[0].split(" (")[0]
            tid = self.by_name.get(producer)
            where = (f"<a class='t' data-t='{tid}'>{_esc(producer)}</a>{_esc(c.where[len(producer):])}" if tid else
                     _esc(c.where))
            rows.append(f"<tr data-phase='{_esc(c.phase)}'><td class='num'>{k}</td><td>{_esc(c.phase)}</td>"
                        f"<td>{_esc(c.kind)}</td><td>{_esc(dims)}</td><td class='num'>{_esc(_bytes(c.nbytes))}</td>"
                        f"<td class='num'>{_esc(_seconds(c.seconds))}</td>"
                        f"<td>{'-' if c.bucket is None else c.bucket}</td><td>{where}</td>"
                        f"<td>{_esc(layer)}</td></tr>")
        count = {p: sum(c.phase == p for c in self.plan.collectives) for p in ("forward", "backward")}
        buttons = "".join(
            f"<label><input type='radio' name='phase' value='{p}'{' checked' if p == 'all' else ''}> {p} "
            f"({len(self.plan.collectives) if p == 'all' else count[p]})</label>"
            for p in ("all", "forward", "backward"))
        table = ("<table class='list' id='collective-list'><tr><th>#</th><th>phase</th><th>kind</th><th>mesh dims</th>"
                 "<th>bytes</th><th>estimated</th><th>bucket</th><th>tensor</th><th>layer</th></tr>"
                 + "".join(rows) + "</table>") if rows else "<p>no collectives</p>"
        return (f"<section id='collectives'><h2>Collectives</h2><div class='filter' id='phase-filter'>{buttons}"
                f" <span id='shown-count'>{len(rows)} shown</span></div>{table}</section>")


def _costs(page) -> str:
    rows = [r for r in page._per_layer() if r[1] or r[2]]
    top = max([max(a, b) for _, a, b in rows], default=0.0) or 1.0
    bars = "".join(
        f"<div class='layer' data-layer='{_esc(label)}'><span class='lname'>{_esc(label)}</span>"
        f"<span class='bars'><span class='bar compute' style='width:{100 * a / top:.1f}%'></span>"
        f"<span class='bar comm' style='width:{100 * b / top:.1f}%'></span></span>"
        f"<span class='nums'>{_esc(_seconds(a))} | {_esc(_seconds(b))}</span></div>" for label, a, b in rows)
    note = "" if any(n.compute_s is not None for n in page.plan.nodes.values()) else \
        "<p class='hint'>this plan records no per-op compute seconds</p>"
    return ("<section id='costs'><h2>Cost per layer <small>(one layer of a folded run; "
            "<span class='key compute'></span> compute, <span class='key comm'></span> communication)</small>"
            f"</h2>{note}<div class='layers'>{bars}</div>{_memory(page)}</section>")


def _memory(page) -> str:
    nodes = page.plan.nodes.values()
    forward = [n.live_bytes for n in nodes if n.live_bytes is not None]
    # the backward runs the ops in reverse: each op's point as its backward runs
    backward = [n.backward_live_bytes for n in reversed(list(nodes)) if n.backward_live_bytes is not None]
    peak = page.plan.cost.peak_bytes
    if not forward:
        return f"<h3>Memory per rank</h3><p id='memory'>peak {_esc(_bytes(peak))} (no timeline recorded)</p>"
    live = forward + backward
    step = max(1, -(-len(live) // _MEMORY_POINTS))
    # each phase drawn as the peaks of its own spans, so the boundary between them stays where it is
    points = [max(part[i:i + step]) for part in (forward, backward) for i in range(0, len(part), step)]
    boundary = -(-len(forward) // step)  # the first backward point
    top = max(max(points), peak, 1)
    w, h = 600, 80

    def x(k: int) -> float:
        return w * k / max(len(points) - 1, 1)

    xy = " ".join(f"{x(k):.1f},{h - h * v / top:.1f}" for k, v in enumerate(points))
    if backward:  # a grey line where the backward begins (between the last forward point and the first backward)
        at = (x(boundary - 1) + x(boundary)) / 2
        marker = (f"<line x1='{at:.1f}' x2='{at:.1f}' y1='0' y2='{h + 2}' class='boundary' "
                  f"data-point='{boundary}'/>")
        title = (f"Memory per rank over the forward and backward <small>(peak {_esc(_bytes(peak))}; "
                 f"{len(forward)} ops forward, then {len(backward)} backward in reverse; the grey line: where "
                 "the backward begins)</small>")
    else:
        marker, title = "", (f"Memory per rank over the forward <small>(peak {_esc(_bytes(peak))}; "
                             f"{len(forward)} ops)</small>")
    return (f"<h3 id='memory-title'>{title}</h3>"
            f"<svg id='memory' viewBox='0 0 {w} {h + 2}' preserveAspectRatio='none' class='memory' "
            f"data-points='{len(points)}' data-forward-points='{boundary}'>"
            f"<line x1='0' x2='{w}' y1='{h - h * peak / top:.1f}' y2='{h - h * peak / top:.1f}' class='peak'/>"
            f"{marker}<polyline points='{xy}'/></svg>")


def _tree(page) -> str:
    root = _Module("")
    charged: dict[str, float] = {}
    for c in page.plan.collectives:
        module = collective_module(page.plan, c, page.params)
        charged[module] = charged.get(module, 0.0) + (c.seconds or 0.0)
    inputs = {i.name: i for i in page.plan.inputs}
    for k, n in enumerate(page.plan.nodes.values()):
        module = n.module
        if n.op == "input":
            if n.name not in page._input_ids:
                continue  # a parameter of a folded layer other than the first
            module = page._module_of_input(inputs[n.name])
        elif not page._visible(module):
            continue
        where = root
        for part in page._path(module):
            where = where.child(part)
        if n.op == "input":
            tid = page._input_ids[n.name]
            where.rows.append(_row(page, tid, n, [tid]))
            continue
        ids = []
        for j, out in enumerate(n.outputs):
            tid = f"n{k}.{j}"
            shape = n.shapes[j] if j < len(n.shapes) else None
            page.tensors[tid] = _tensor(n.name + ("" if len(n.outputs) == 1 else f" [{j}]"), shape, out,
                                        f"chosen by the search (rule {n.rule})", page.mesh_shape,
                                        page._folded_as(module))
            ids.append(tid)
        if ids:
            page.by_name[n.name] = ids[0]
        where.rows.append(_row(page, ids[0] if ids else "", n, ids))
        where.ops += 1
        where.compute_s += n.compute_s or 0.0
    for module, seconds in charged.items():  # collectives of the shown layers, charged where they are made
        if page._visible(module):
            where = root
            for part in page._path(module):
                where = where.child(part)
            where.comm_s += seconds
    by_layer: dict[str, list[float]] = {}  # every layer's ops, compute and communication, shown or not
    for n in page.plan.nodes.values():
        if n.op != "input":
            counts = by_layer.setdefault(layer_of(n.module), [0, 0.0, 0.0])
            counts[0], counts[1] = counts[0] + 1, counts[1] + (n.compute_s or 0.0)
    for module, seconds in charged.items():
        by_layer.setdefault(layer_of(module), [0, 0.0, 0.0])[2] += seconds
    for label, members in page.layers:  # a folded entry: its count, and its totals over all its layers
        if len(members) > 1:
            where = root
            for part in page._path(members[0]):
                where = where.child(part)
            where.count = len(members)
            sums = [by_layer.get(m, [0, 0.0, 0.0]) for m in members]
            where.folded_totals = (int(sum(s[0] for s in sums)), sum(s[1] for s in sums), sum(s[2] for s in sums))
    body = "".join(_module(page, m, 0) for m in root.children.values())
    return (f"<section id='tree'><h2>Module tree <small>(click a tensor to see its pieces)</small></h2>"
            f"{body}</section>")


def _row(page, tid: str, n, ids: list[str]) -> str:
    outs = ", ".join(f"<a class='t' data-t='{t}'>{_esc(placements_text(o))}</a>" for t, o in zip(ids, n.outputs))
    shapes = ", ".join("-" if s is None else str(tuple(s)) for s in n.shapes) or "-"
    name = f"<a class='t' data-t='{tid}'>{_esc(n.name)}</a>" if tid else _esc(n.name)
    return (f"<tr><td>{name}</td><td>{_esc(_op(n.op))}</td><td>{_esc(n.rule)}</td>"
            f"<td>{_esc(', '.join(placements_text(p) for p in n.inputs) or '-')}</td><td>{outs}</td>"
            f"<td>{_esc(shapes)}</td><td class='num'>{_esc(_seconds(n.compute_s))}</td></tr>")


def _module(page, m: _Module, depth: int) -> str:
    ops, compute, comm = m.totals()
    rows = ""
    if m.rows:
        rows = ("<table class='ops'><tr><th>node</th><th>op</th><th>rule</th><th>inputs</th><th>outputs</th>"
                "<th>shape</th><th>compute</th></tr>" + "".join(m.rows) + "</table>")
    kids = "".join(_module(page, c, depth + 1) for c in m.children.values())
    if m.count > 1:
        rows = f"<p class='hint'>the first of its layers, op by op; the others are planned alike</p>{rows}"
    # open: the top, and the way down to a folded layer (the tree's point); the rest a click away
    is_open = " open" if depth == 0 or _holds_folded(m) else ""
    return (f"<details class='module'{is_open} data-module='{_esc(m.label)}' data-count='{m.count}'><summary>"
            f"<span class='mname'>{_esc(m.label)}</span>"
            f"<span class='msum'>{f'{m.count} layers: ' if m.count > 1 else ''}{ops} ops, compute "
            f"{_esc(_seconds(compute))}, communication {_esc(_seconds(comm))}</span></summary>{rows}{kids}"
            "</details>")


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>%TITLE%</title>
<style>
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
main{display:grid;grid-template-columns:minmax(0,1fr) 430px;gap:16px;padding:12px 16px}
h1{font-size:18px;margin:4px 0 8px}h2{font-size:15px;margin:18px 0 6px}h3{font-size:13px;margin:10px 0 4px}
small{font-weight:normal;color:#5b6472}
table{border-collapse:collapse}th,td{padding:2px 8px;text-align:left;vertical-align:top}
table.facts th{color:#5b6472;font-weight:600;padding-left:0}
table.list,table.ops{background:#fff;border:1px solid #dde1e7;width:100%}
table.list th,table.ops th{background:#eef1f5;font-weight:600}
table.list tr+tr td,table.ops tr+tr td{border-top:1px solid #eef1f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
a.t{color:#1459b8;cursor:pointer;text-decoration:underline dotted}a.t.sel{background:#ffe9a8}
.notes{color:#7a4b00;margin:6px 0;padding-left:18px}
.layer{display:grid;grid-template-columns:240px 1fr 170px;gap:8px;align-items:center;margin:1px 0}
.lname{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}.nums{color:#5b6472;font-variant-numeric:tabular-nums}
.bars{display:flex;flex-direction:column;gap:1px}.bar{display:block;height:7px;min-width:1px;border-radius:2px}
.compute{background:#3b7dd8}.comm{background:#e8833a}.key{display:inline-block;width:10px;height:10px}
svg.memory{width:100%;height:90px;background:#fff;border:1px solid #dde1e7}
svg.memory polyline{fill:none;stroke:#6a4bc4;stroke-width:1.5;vector-effect:non-scaling-stroke}
svg.memory .peak{stroke:#c0392b;stroke-dasharray:4 3;vector-effect:non-scaling-stroke}
svg.memory .boundary{stroke:#9aa5b5;vector-effect:non-scaling-stroke}
details.module{margin-left:14px;border-left:1px solid #dde1e7;padding-left:6px}
details.module>summary{cursor:pointer;padding:1px 0}.mname{font-weight:600}
.msum{color:#5b6472;margin-left:10px}table.ops{margin:3px 0 6px;width:auto}
.hint{color:#5b6472;font-size:12px;margin:2px 0}.filter label{margin-right:12px;cursor:pointer}#shown-count{color:#5b6472}
aside{position:sticky;top:8px;align-self:start;background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px}
#layout h2{margin-top:0;word-break:break-all}.meta{color:#5b6472;margin:2px 0}
.mesh{display:grid;gap:6px;margin:8px 0}.meshlabel{color:#5b6472;font-size:11px;margin-top:6px}
.rank{border:1px solid #9aa5b5;border-radius:5px;padding:4px 6px;background:#f3f7fd;font-size:12px}
.rank b{display:block}.rank .coord{color:#5b6472;font-size:11px}
.rank.uneven{background:#fff4dc;border-color:#d49a2a}.rank.empty{background:#eee;border-style:dashed;color:#888}
.mini{position:relative;height:26px;background:#e4e8ee;margin-top:3px;border-radius:2px;overflow:hidden}
.mini span{position:absolute;background:#3b7dd8}.rank.uneven .mini span{background:#d49a2a}
.legend span{display:inline-block;margin-right:10px}.legend i{display:inline-block;width:10px;height:10px;
border:1px solid #9aa5b5;margin-right:3px;vertical-align:-1px}
</style></head><body><main><div id="page">%BODY%</div>
<aside><div id="layout"><p>Click a tensor's name or layout to see its pieces on the mesh.</p></div></aside></main>
<script type="application/json" id="plan-data">%DATA%</script>
<script>
(function () {
"use strict";
var data = JSON.parse(document.getElementById("plan-data").textContent), mesh = data.mesh;
function esc(s) {
  return String(s).replace(/[&<>"']/g, function (c) { return "&#" + c.charCodeAt(0) + ";"; });
}
function tup(a) { return "(" + a.join(", ") + (a.length == 1 ? "," : "") + ")"; }
function numel(a) { return a.reduce(function (x, y) { return x * y; }, 1); }
function meshText(coord) {
  return mesh.names.map(function (n, i) { return n + "=" + (coord ? coord[i] : mesh.shape[i]); });
}
// the two tensor dims a piece is drawn along (rows, then columns): the split ones, else the first and the last
function drawDims(t) {
  var d = [], n = t.shape.length;
  t.placements.replace(/S\((\d+)\)/g, function (m, k) { if (d.indexOf(+k) < 0) d.push(+k); });
  [0, n - 1].forEach(function (k) { if (k >= 0 && d.indexOf(k) < 0) d.push(k); });
  return d.slice(0, 2).sort(function (a, b) { return a - b; });
}
function bar(t, off, shape, dims) {  // where the piece lies in the whole tensor
  var S = t.shape, r = dims[0], c = dims.length > 1 ? dims[1] : r, two = dims.length > 1;
  var pct = function (a, n) { return (100 * a / n).toFixed(2) + "%"; };
  return "<div class='mini'><span style='left:" + pct(off[c], S[c]) + ";width:" + pct(shape[c], S[c]) +
    ";top:" + (two ? pct(off[r], S[r]) : "0") + ";height:" + (two ? pct(shape[r], S[r]) : "100%") +
    "'></span></div>";
}
function cell(t, piece, largest, dims) {
  var rank = piece[0], coord = piece[1], off = piece[2], shape = piece[3];
  var empty = numel(shape) == 0, uneven = !empty && numel(shape) < largest;
  return "<div class='rank" + (empty ? " empty" : uneven ? " uneven" : "") + "' data-rank='" + rank + "'>" +
    "<b>rank " + rank + "</b><span class='coord'>" + esc(meshText(coord).join(" ")) + "</span>" +
    "<div class='shape'>" + (empty ? "empty " : "") + tup(shape) + "</div>" +
    "<div class='offset'>at " + tup(off) + "</div>" +
    (t.shape.length && !empty ? bar(t, off, shape, dims) : "") + "</div>";
}
// ranks row-major: one grid per coordinate of the mesh dims before the last two
function grid(t) {
  var sh = mesh.shape, cols = sh[sh.length - 1], per = sh.length > 1 ? sh[sh.length - 2] * cols : cols;
  var largest = Math.max.apply(null, t.pieces.map(function (p) { return numel(p[3]); }));
  var dims = drawDims(t), out = "";
  for (var g = 0; g < t.pieces.length; g += per) {
    var block = t.pieces.slice(g, g + per);
    if (sh.length > 2) out += "<div class='meshlabel'>" + esc(meshText(block[0][1]).slice(0, -2).join(" ")) + "</div>";
    out += "<div class='mesh' style='grid-template-columns:repeat(" + cols + ",1fr)'>" +
      block.map(function (p) { return cell(t, p, largest, dims); }).join("") + "</div>";
  }
  var axes = (sh.length > 1 ? "rows " + mesh.names[sh.length - 2] + ", columns " + mesh.names[sh.length - 1]
                            : "ranks along " + mesh.names[0]) + " (the call's ranks, row-major)";
  var along = dims.length > 1 ? "tensor dims " + dims[0] + " (down) and " + dims[1] + " (across)"
                              : "tensor dim " + dims[0];
  return "<div class='meta'>mesh " + esc(axes) + "; each bar: the piece within the tensor, " + along + "</div>" +
    out + "<div class='legend'><span><i style='background:#f3f7fd'></i>full piece</span>" +
    "<span><i style='background:#fff4dc'></i>uneven (shorter)</span><span><i style='background:#eee'></i>empty" +
    "</span></div>";
}
function select(id) {
  var t = data.tensors[id];
  if (!t) return;
  document.querySelectorAll("a.t.sel").forEach(function (a) { a.classList.remove("sel"); });
  document.querySelectorAll("a.t[data-t='" + id + "']").forEach(function (a) { a.classList.add("sel"); });
  var h = "<h2 id='layout-name'>" + esc(t.name) + "</h2><div class='meta'>shape " +
    (t.shape ? esc(tup(t.shape)) : "unknown") + ", placements <b id='layout-placements'>" + esc(t.placements) +
    "</b> on mesh " + esc(meshText().join(" x ")) + "</div>" +
    (t.folded ? "<div class='meta'>the same in each of " + esc(t.folded) + "</div>" : "") +
    (t.held ? "<div class='meta'>held by the caller as " + esc(t.held) + "</div>" : "") +
    "<div class='meta' id='layout-origin'>layout from: " + esc(t.origin) + "</div>" +
    (t.partial ? "<div class='meta'>P: each rank holds a partial sum of the whole value</div>" : "");
  h += t.pieces ? grid(t) : "<p class='meta'>" + esc(t.why) + "</p>";
  var box = document.getElementById("layout");
  box.innerHTML = h;
  box.setAttribute("data-shown", id);
}
function filter(phase) {
  var shown = 0;
  document.querySelectorAll("#collective-list tr[data-phase]").forEach(function (row) {
    row.hidden = phase != "all" && row.getAttribute("data-phase") != phase;
    if (!row.hidden) shown++;
  });
  document.getElementById("shown-count").textContent = shown + " shown";
  document.querySelectorAll("#phase-filter input").forEach(function (i) {
    i.checked = i.defaultChecked = i.value == phase;  // the attribute too: a saved page keeps the choice
  });
}
document.addEventListener("click", function (e) {
  var a = e.target.closest("a.t");
  if (a) { e.preventDefault(); select(a.getAttribute("data-t")); }
});
document.querySelectorAll("#phase-filter input").forEach(function (i) {
  i.addEventListener("change", function () { filter(i.value); });
});
// the address may name a tensor and a phase: page.html#t=i3&phase=backward
function fromHash() {
  var q = {};
  location.hash.slice(1).split("&").forEach(function (kv) {
    var p = kv.split("=");
    if (p[0]) q[p[0]] = decodeURIComponent(p[1] || "");
  });
  if (q.phase) filter(q.phase);
  select(q.t && data.tensors[q.t] ? q.t : data.first);
}
window.addEventListener("hashchange", fromHash);
fromHash();
})();
</script></body></html>
"""
