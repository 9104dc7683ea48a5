"""show(): a tensor's layout in the terminal, as a grid of which ranks hold which block (JAX's
visualize_array_sharding, DTensor's visualize_sharding), and each rank's piece: offset and shape, uneven ones too.

A package so that ``python -m shardfn.show plan.json`` (``__main__``) runs without importing itself twice: it
writes a saved plan's page (shardfn.show.plan_page)."""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import DTensor

from ..strategy_search._dtensor_adapter import local_pieces
from .plan_page import write_page  # (importing it registers Plan.to_html's page writer: the search imports no show)

__all__ = ["show", "write_page"]


def show(tensor: torch.Tensor, file=None) -> str:
    """Print the layout of ``tensor`` (to ``file``, default stdout) and return the text: a DTensor's mesh and
    placements, a grid of its blocks for 1-D and 2-D tensors naming the ranks that hold each, and every rank's
    piece (offset, shape; uneven and empty pieces as DTensor cuts them). A plain tensor is whole on every rank."""
    text = layout_text(tensor)
    print(text, file=file)
    return text


def layout_text(tensor: torch.Tensor) -> str:
    shape = tuple(tensor.shape)
    dtype = str(tensor.dtype).replace("torch.", "")
    if not isinstance(tensor, DTensor):
        return f"tensor {shape} {dtype}: a plain tensor, whole wherever it is"
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    ranks = mesh.mesh.flatten().tolist()
    pieces = local_pieces(shape, placements, mesh)  # per rank (mesh order): (offset, shape)
    lines = [f"DTensor {shape} {dtype} on mesh {' x '.join(f'{n}={s}' for n, s in zip(names, mesh.shape))}, "
             f"placements {_short(placements)}"]
    if 1 <= len(shape) <= 2 and all(n > 0 for n in shape):
        lines += _grid(shape, ranks, pieces)
    lines.append(f"{'rank':>6}  {'mesh coordinate':<16} {'offset':<16} shape")
    coords = itertools.product(*[range(n) for n in mesh.shape])
    for rank, coord, (offset, local) in zip(ranks, coords, pieces):
        empty = "  (empty)" if math.prod(local) == 0 else ""
        lines.append(f"{rank:>6}  {str(coord):<16} {str(offset):<16} {local}{empty}")
    return "\n".join(lines)


def _short(placements) -> str:
    def one(p):
        return "R" if p.is_replicate() else f"S({p.dim})" if hasattr(p, "dim") else "P"

    return "(" + ", ".join(one(p) for p in placements) + ")"


def _grid(shape, ranks, pieces) -> list[str]:
    """Blocks of a 1-D or 2-D tensor (cut where any piece starts or ends) and the ranks holding each."""
    shape2 = shape if len(shape) == 2 else (1, shape[0])
    boxes = [((o[0], o[0] + s[0]), (o[1], o[1] + s[1])) if len(shape) == 2 else ((0, 1), (o[0], o[0] + s[0]))
             for o, s in pieces]
    cuts = [sorted({0, shape2[d]} | {b[d][i] for b in boxes for i in (0, 1)}) for d in (0, 1)]
    spans = [list(zip(c, c[1:])) for c in cuts]
    cells = [[",".join(str(r) for r, b in zip(ranks, boxes) if b[0][0] <= lo0 < b[0][1] and b[1][0] <= lo1 < b[1][1]
                       and b[0][0] < b[0][1] and b[1][0] < b[1][1]) for lo1, _ in spans[1]] for lo0, _ in spans[0]]
    width = max(8, max(len(c) for row in cells for c in row) + 2)
    header = " " * 12 + "".join(f"{f'{a}:{b}':^{width}}" for a, b in spans[1])
    lines = ["blocks (rows x columns) and the ranks holding each:" if len(shape) == 2 else
             "blocks and the ranks holding each:", header]
    for (a, b), row in zip(spans[0], cells):
        label = f"{a}:{b}" if len(shape) == 2 else ""
        lines.append(f"{label:>10}  " + "".join(f"{'[' + c + ']':^{width}}" for c in row))
    return lines
