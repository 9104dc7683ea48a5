"""Ground truth for sharding rules: every candidate of one op node, checked on real numbers.

For each candidate on each mesh: every tensor input is laid out as the candidate says (Shard: DTensor's own
slices, uneven ones too; Replicate: whole; Partial: split into a sum, unevenly and with offsets of alternating
sign so a non-linear op cannot pass by chance; a pending maximum (minimum) into pieces below (above) the value but
on one rank, which one going round; a pending product into factors), the op runs on each rank's pieces (torch's LocalTensorMode), the
outputs are assembled as their placements say (Shard: concatenated, Partial: reduced, Replicate: every rank's own)
and every rank's result is compared with the whole op. The method is DTensor's own rule validation
(torch/distributed/tensor/_ops/strategy_validation.py), applied to shardfn's candidates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from shardfn.layout import Axis, MeshSpec
from shardfn.runtime import planning_mesh, simulated_world
from shardfn.exec.expert_dispatch import dispatched
from shardfn.exec.pieces import sized_to_piece
from shardfn.strategy_search import candidates as C
from shardfn.strategy_search.registry import REGISTRY

MESHES = ((2,), (3,), (4,), (2, 2))


def planning(*shape: int) -> DeviceMesh:
    axes = tuple(Axis(s, int(torch.tensor(shape[i + 1:]).prod())) for i, s in enumerate(shape))
    return planning_mesh(MeshSpec(axes, tuple(f"d{i}" for i in range(len(shape)))), "cpu")


def op_node(op, args: tuple, kwargs: dict) -> torch.fx.Node:
    """A one-op fx graph node for ``op(*args, **kwargs)`` with fake values, as capture makes them."""
    graph = torch.fx.Graph()
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def placeholder(t):
        n = graph.placeholder(f"t{len(graph.nodes)}")
        n.meta["val"] = mode.from_tensor(t)
        return n

    node_args, node_kwargs = pytree.tree_map_only(torch.Tensor, placeholder, (args, kwargs))
    node = graph.call_function(op, node_args, node_kwargs)
    fake_args, fake_kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (node_args, node_kwargs))
    with mode:
        node.meta["val"] = op(*fake_args, **fake_kwargs)
    return node


def _partial_pieces(local, mesh: DeviceMesh, placements):
    """Per-rank pieces whose sum (maximum, minimum: the placement's reduction) over each Partial mesh dim is the
    (already sliced) piece."""
    from torch.distributed._local_tensor import LocalTensor

    pieces = dict(local._local_tensors) if isinstance(local, LocalTensor) else \
        {r: local.clone() for r in range(mesh.size())}
    coords = {r: [int(c) for c in (mesh.mesh == r).nonzero()[0]] for r in pieces}
    for m, p in enumerate(placements):
        if not p.is_partial():
            continue
        n = mesh.shape[m]
        for r, piece in pieces.items():
            c = coords[r][m]
            sign = torch.ones_like(piece)
            index = torch.tensor(0)  # each element's index sum
            if piece.numel():
                grids = torch.meshgrid(*[torch.arange(s) for s in piece.shape], indexing="ij") if piece.dim() else ()
                index = sum(grids, torch.tensor(0))
                sign = torch.where(index % 2 == 0, 1.0, -1.0).to(piece.dtype)
            kind = getattr(p, "reduce_op", "sum")
            if kind in ("max", "min"):
                # one rank holds the value itself (which one goes round over the elements), the others a value
                # below it (above, for a minimum) by a distinct amount
                holder = index % n == c
                below = (piece.abs() + 1) * (1 + c) * (1 if kind == "max" else -1)
                pieces[r] = torch.where(holder, piece, piece - below)
                continue
            if kind == "product":  # the value twice on one rank, halved on the next, whole on the others
                factor = torch.where(index % n == c, 2.0, torch.where((index + 1) % n == c, 0.5, 1.0))
                pieces[r] = piece * factor.to(piece.dtype)
                continue
            offset = (piece.abs() + 1) * sign
            weight = 0.7 if c == 0 else 0.3 / (n - 1)
            pieces[r] = piece * weight + offset * (c - (n - 1) / 2)
    return LocalTensor(pieces)


def _lay_out(t: torch.Tensor, mesh: DeviceMesh, placements) -> Any:
    whole = tuple(Replicate() if p.is_partial() else p for p in placements)
    local = distribute_tensor(t.clone(), mesh, whole, src_data_rank=None).to_local()
    if any(p.is_partial() for p in placements):
        local = _partial_pieces(local, mesh, placements)
    return local


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_candidate(op, args, kwargs, expected, cand: C.Candidate, mesh: DeviceMesh, rtol=1e-4, atol=1e-4) -> str:
    """'' where ``cand`` gives ``expected`` (the whole op's outputs) on ``mesh``; else what went wrong."""
    world = mesh.size()
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if any(p.is_partial() and not t.is_floating_point() for t, pl in zip(tensors, cand.inputs) for p in pl):
        return ""  # a pending sum of integers is not something a plan holds
    it = iter(cand.inputs)
    # ops that take sizes (views) get the global ones: DTensor's dispatch turns them into each rank's, so those
    # run through it (on inputs in the candidate's layout); every other op runs on the local pieces themselves
    dispatch = cand.rule == "dtensor" and _takes_sizes(op)

    def lay(t):
        pl = next(it)
        local = _lay_out(t, mesh, pl)
        return DTensor.from_local(local, mesh, pl, run_check=False, shape=t.shape, stride=t.stride()) \
            if dispatch else local

    try:
        local_args, local_kwargs = pytree.tree_map_only(torch.Tensor, lay, (args, kwargs))
        at = REGISTRY.size_argument(op)
        if at is not None and cand.rule == "local":  # a sized factory: each rank's piece made as exec makes it
            local_args = sized_to_piece(local_args, at, expected.shape, cand.outputs[0], mesh)
        call = dispatched(op, cand.inputs, mesh) if cand.rule == "dispatch" else op  # (as exec calls it)
        out = _outputs(call(*local_args, **local_kwargs))
    except Exception as e:  # noqa: BLE001 - a candidate the kernel refuses is a wrong candidate
        return f"raised {type(e).__name__}: {str(e)[:200]}"
    if dispatch:
        out = [o.full_tensor() if isinstance(o, DTensor) else o for o in out]
    for i, (o, e, pl) in enumerate(zip(out, _outputs(expected), cand.outputs)):
        if pl is None or not isinstance(e, torch.Tensor):
            continue
        full = o if dispatch else \
            DTensor.from_local(o, mesh, pl, run_check=False, shape=e.shape, stride=e.stride()).full_tensor()
        for r in range(world):
            got = full._local_tensors[r] if hasattr(full, "_local_tensors") else full
            if got.shape != e.shape:
                return f"output {i} rank {r}: shape {tuple(got.shape)}, expected {tuple(e.shape)}"
            if not torch.allclose(got.to(e.dtype), e, rtol=rtol, atol=atol, equal_nan=True):
                diff = (got.double() - e.double()).abs().nan_to_num().max().item() if e.numel() else 0
                return f"output {i} rank {r}: max |diff| {diff:.3g}"
    return ""


def _takes_sizes(op) -> bool:
    return "SymInt[]" in str(op._schema)


def _mask_partial(cand: C.Candidate) -> bool:
    return any(C.is_local_from_replicate(p) for pl in (*cand.inputs, *(o for o in cand.outputs if o)) for p in pl)


def _candidates_on_meshes(node: torch.fx.Node, meshes):
    """(mesh shape, mesh, candidate) for every candidate of ``node`` on each mesh, inside a simulated world of
    that mesh's ranks."""
    for shape in meshes:
        cands = C.node_candidates(node, planning(*shape), set())
        with simulated_world(int(torch.tensor(shape).prod())):
            mesh = DeviceMesh("cpu", torch.arange(int(torch.tensor(shape).prod())).reshape(shape))
            for cand in cands:
                yield shape, mesh, cand


def failures(op, args: tuple, kwargs: dict | None = None, meshes=MESHES, rules=None) -> list[str]:
    """Every candidate shardfn offers for ``op(*args, **kwargs)`` on each mesh that does not give the whole op's
    numbers, as 'mesh inputs -> outputs: what went wrong'. ``rules``: only candidates of these kinds."""
    kwargs = kwargs or {}
    expected = op(*args, **kwargs)
    found = []
    for shape, mesh, cand in _candidates_on_meshes(op_node(op, args, kwargs), meshes):
        # random fills are drawn whole and sliced by exec; embedding's masked sum is made by DTensor's dispatch
        # (checked by the parity tests)
        if cand.rule == "random" or (rules and cand.rule not in rules) or _mask_partial(cand):
            continue
        why = check_candidate(op, args, kwargs, expected, cand, mesh)
        if why:
            found.append(f"{shape} {_fmt(cand.inputs)} -> {_fmt(cand.outputs)}: {why}")
    return found


def _fmt(pls) -> str:
    def one(pl):
        return "-" if pl is None else "(" + ",".join(_short(p) for p in pl) + ")"

    return " ".join(one(pl) for pl in pls)


def _short(p: Placement) -> str:
    return "R" if p.is_replicate() else f"S{p.dim}" if hasattr(p, "dim") else "P"


def backward_failures(op, args: tuple, meshes=MESHES, pending_replicated=False) -> list[str]:
    """:func:`failures` for the backward of ``op`` (differentiable, returning a tensor or a list of them): under each
    candidate, the inputs laid out as it says and the outputs' gradients as its outputs are, autograd through
    ``op`` on each rank's pieces gives pieces of the whole backward's input gradients (laid out as the inputs)."""
    grads = [torch.randn_like(o) for o in _outputs(op(*args))]
    wanted = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def vjp(*tensors):
        ins = [t.detach().requires_grad_() if i in wanted else t for i, t in enumerate(tensors[:len(args)])]
        pairs = [(o, g) for o, g in zip(_outputs(op(*ins)), tensors[len(args):]) if o.requires_grad]
        return list(torch.autograd.grad([o for o, _ in pairs], [ins[i] for i in wanted], [g for _, g in pairs]))

    expected = vjp(*args, *grads)
    found = []
    for shape, mesh, cand in _candidates_on_meshes(op_node(op, args, {}), meshes):
        layouts = tuple(cand.inputs[i] for i in wanted)
        if pending_replicated:  # as exec returns them: a whole input read by ranks working on different pieces
            working = {m for pl in cand.outputs if pl for m, p in enumerate(pl) if not p.is_replicate()}
            layouts = tuple(tuple(Partial() if m in working and p.is_replicate() else p for m, p in enumerate(pl))
                            for pl in layouts)
        backward = C.Candidate(layouts, (*cand.inputs, *cand.outputs), "local")
        why = check_candidate(vjp, (*args, *grads), {}, expected, backward, mesh)
        if why:
            found.append(f"{shape} {_fmt(cand.inputs)} -> {_fmt(cand.outputs)} backward: {why}")
    return found
