"""Cost model: compute (FLOPs / roofline), communication (alpha-beta ring formulas per mesh dim), memory.

Communication on a mesh dim of ``n`` ranks moving a logical operand of ``B`` bytes (the full operand within
the group, as Plan.collectives reports it), with per-hop latency ``alpha``, inverse bandwidth ``beta`` and a
fixed cost ``c`` per collective issued (so of two plans that move the same bytes, the one with fewer
collectives wins: a reduce_scatter + all_gather pair costs an all_reduce plus one more launch):

=================  ==============================================
all_reduce         c + 2 (n-1) alpha + 2 (n-1)/n B beta
all_gather         c + (n-1) alpha + (n-1)/n B beta      (B = gathered output)
reduce_scatter     c + (n-1) alpha + (n-1)/n B beta      (B = input before scattering)
all_to_all         c + (n-1) alpha + (n-1)/n^2 B beta    (B = input)
=================  ==============================================

(:func:`ring_terms` holds the hops and volumes; ``shardfn.training.calibrate`` solves the same formulas for alpha
and beta.)

Each mesh dim has its own link (:class:`Link`: alpha, beta, launch cost): a profile has one within a node
(``intra_node``: NVLink on an H100 node) and one between nodes (``inter_node``: the network). By default a mesh
dim is intra-node when its ranks and those of every dim inside it fit in one node (the innermost dims whose
product is at most ``DeviceProfile.devices_per_node``, as DTensor's ``MeshTopoInfo`` assumes), else inter-node;
``sf.Layout(..., links=...)`` says otherwise (:func:`mesh_links`). Every collective runs over one mesh dim (a
redistribution is lowered one dim at a time, as DTensor's is), and a dim whose ring crosses nodes is priced
whole at the inter-node link, its slowest (not hierarchically).

A redistribution is lowered per mesh dim (:func:`redistribute_collectives`); its backward is the dual
(:func:`backward_collectives`): the gradient flows from the consumer's placement back to the producer's, and a
gradient that the consumer left as a pending sum (it used a replicated input in work split over that dim) is
reduced on the way (all_reduce to a replicated producer, reduce_scatter to a sharded one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import flop_registry

from .. import _pytree_internals as pytree
from ..capture.functions import FunctionCall
from ..capture.graph import is_view
from .registry import REGISTRY

__all__ = [
    "CPU",
    "H100",
    "load_profile",
    "profile_for",
    "save_profile",
    "CommOp",
    "DeviceProfile",
    "LINKS",
    "Link",
    "backward_collectives",
    "collective_seconds",
    "local_numel",
    "mesh_links",
    "redistribute_collectives",
    "ring_terms",
]

LINKS = ("intra", "inter")  # a mesh dim's link: within one node, or between nodes


@dataclass(frozen=True)
class Link:
    """The alpha-beta constants of the ring a mesh dim's collectives run on."""

    alpha_s: float  # per-hop latency
    beta_s_per_byte: float  # inverse bandwidth per rank (1 / bus bandwidth)
    launch_s: float = 0.0  # fixed cost of issuing one collective (software, kernel launch)
    # measured per collective kind (shardfn.training.calibrate): (kind, alpha_s, beta_s_per_byte), which replace alpha,
    # beta and the launch cost for that kind
    per_kind: tuple[tuple[str, float, float], ...] = ()

    def constants(self, kind: str) -> tuple[float, float, float]:
        """(alpha, beta, launch) of collective ``kind`` on this link."""
        for k, alpha, beta in self.per_kind:
            if k == kind:
                return alpha, beta, 0.0
        return self.alpha_s, self.beta_s_per_byte, self.launch_s


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline and link constants of one device kind. Override by building your own profile
    (``dataclasses.replace``) and saving it for SHARDFN_PROFILE (:func:`save_profile`)."""

    name: str
    flops_per_s: float  # sustained matmul throughput, fp32 (full precision: no TF32)
    mem_bytes_per_s: float  # memory bandwidth, for memory-bound (elementwise) ops
    memory_bytes: float  # per-device memory, the budget of level 2
    intra_node: Link  # between the ranks of one node
    inter_node: Link  # between nodes
    # ranks one node holds: a mesh dim whose ranks, with those of the dims inside it, number at most this many
    # runs within a node (intra_node), others between nodes; 0: every rank in one node
    devices_per_node: int = 0
    half_flops_per_s: float = 0.0  # bf16/fp16 matmul throughput (0: as fp32)
    tf32_flops_per_s: float = 0.0  # fp32 matmuls when TF32 is allowed (0: as fp32)
    op_s: float = 0.0  # the fixed cost of running one op (dispatch), whatever its size and split
    # what shardfn.training.calibrate measured per dim of the mesh it ran on: (mesh dim, its size, its link, kind,
    # alpha_s, beta_s_per_byte); each link's per_kind is the slowest of its dims
    measured_dims: tuple[tuple[int, int, str, str, float, float], ...] = ()
    # True: memory_bytes is the device's own and a plan over it is refused; False (a CPU rank: a share of its
    # host's memory, which other ranks and processes use too): a plan over it is returned with a warning
    memory_is_hard: bool = True

    def __post_init__(self):
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 0:
            raise ValueError(f"DeviceProfile {self.name!r}: devices_per_node must be a non-negative int (the ranks "
                             f"of one node; 0: every rank in one node), got {self.devices_per_node!r}")
        for field in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, field), Link):
                raise TypeError(f"DeviceProfile {self.name!r}: {field} must be a cost_model.Link(alpha_s, "
                                f"beta_s_per_byte, launch_s), got {getattr(self, field)!r}")

    def link(self, name: str) -> Link:
        """The link named ``name``: "intra" (within a node) or "inter" (between nodes)."""
        return self.intra_node if name == "intra" else self.inter_node

    def matmul_flops_per_s(self, dtype: torch.dtype) -> float:
        """Throughput for ops computing in ``dtype``; fp32 uses TF32's when torch allows it on CUDA."""
        if dtype in (torch.bfloat16, torch.float16) and self.half_flops_per_s:
            return self.half_flops_per_s
        if dtype == torch.float32 and self.tf32_flops_per_s and torch.backends.cuda.matmul.allow_tf32:
            return self.tf32_flops_per_s
        return self.flops_per_s


# A CPU rank with gloo over loopback/TCP, and an H100 SXM node (NCCL). Order-of-magnitude constants: they rank
# plans, they do not predict wall time to the percent. H100 matmul rates as measured on one H100 (a GPT block: fp32
# without TF32 ~60 TFLOP/s, bf16 ~800 TFLOP/s), TF32 between.
#
# H100 links (per GPU, one direction), from the hardware's data sheets:
# - within a node, NVLink 4: 18 links x 25 GB/s each way = 450 GB/s per GPU (900 GB/s bidirectional, NVIDIA's
#   H100 SXM figure), through NVSwitch to all 8 GPUs of an HGX/DGX H100 node;
# - between nodes, InfiniBand NDR: one 400 Gb/s ConnectX-7 per GPU (DGX H100) = 50 GB/s per GPU, a ninth of
#   NVLink (DTensor's MeshTopoInfo takes 0.22 of the intra-node bandwidth);
# - latency per ring hop: a few microseconds over NVLink, ~10 us across the network (a switch and the NIC's PCIe
#   each way); DTensor's MeshTopoInfo takes 0.6 us and 2.7 us per hop after a 6.6 us base, which NCCL's
#   measured small-message times (tens of microseconds for 8 GPUs) exceed; a collective's launch ~5 us.
# A CPU world runs on one machine (devices_per_node 0); its network link is 10 Gb Ethernet with TCP's latency.
CPU = DeviceProfile("cpu", 5e10, 2e10, 16e9, intra_node=Link(5e-5, 1 / 2e9, 2e-5),
                    inter_node=Link(1e-4, 1 / 1.25e9, 2e-5), devices_per_node=0, memory_is_hard=False)
H100 = DeviceProfile("h100", 6e13, 3e12, 80e9, intra_node=Link(3e-6, 1 / 4.5e11, 5e-6),
                     inter_node=Link(1e-5, 1 / 5e10, 5e-6), devices_per_node=8, half_flops_per_s=8e14,
                     tf32_flops_per_s=4e14)


def profile_for(device: str) -> DeviceProfile:
    """The cost profile plans for ``device`` use: the one measured on this machine that SHARDFN_PROFILE names
    (``python -m shardfn.calibrate``), else H100 for CUDA and CPU otherwise."""
    path = os.environ.get("SHARDFN_PROFILE")
    if path:
        return load_profile(path)
    return H100 if device == "cuda" else CPU


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(profile), f, indent=1)


def load_profile(path: str) -> DeviceProfile:
    """A profile saved by :func:`save_profile`; a clear error where the file is not one. A profile saved before
    links were per mesh dim (one alpha, beta and launch cost) prices every dim with its one link."""
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    try:
        with open(path) as f:
            data = json.load(f)
        if "intra_node" not in data and "alpha_s" in data:  # one link for every dim
            one = {"alpha_s": data["alpha_s"], "beta_s_per_byte": data["beta_s_per_byte"],
                   "launch_s": data.get("launch_s", 0.0), "per_kind": data.get("per_kind", ())}
            data = {**data, "intra_node": one, "inter_node": one, "devices_per_node": 0}
        data = {k: v for k, v in data.items() if k in fields}
        for link in ("intra_node", "inter_node"):
            entry = dict(data[link])
            entry["per_kind"] = tuple(tuple(k) for k in entry.get("per_kind", ()))
            data[link] = Link(**entry)
        data["measured_dims"] = tuple(tuple(entry) for entry in data.get("measured_dims", ()))
        return DeviceProfile(**data)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"SHARDFN_PROFILE={path!r} is not a readable device profile ({e!r}); make one with "
                         "python -m shardfn.calibrate --out PATH, or unset SHARDFN_PROFILE") from e


def mesh_links(mesh_shape: Sequence[int], profile: DeviceProfile,
               given: Sequence[str | None] | None = None) -> tuple[str, ...]:
    """The link each mesh dim's collectives run over, "intra" or "inter": ``given[d]`` where the caller said
    (``sf.Layout(..., links=...)``), else "intra" where the dim's ranks and those of every dim inside it fit in
    one node (the product of ``mesh_shape[d:]`` is at most ``profile.devices_per_node``; 0: every rank in one
    node), as DTensor's MeshTopoInfo assumes of a row-major mesh over ranks numbered node by node."""
    per_node = profile.devices_per_node
    links = []
    for d in range(len(mesh_shape)):
        said = given[d] if given is not None and d < len(given) else None
        if said is None:
            said = "intra" if not per_node or math.prod(mesh_shape[d:]) <= per_node else "inter"
        links.append(said)
    return tuple(links)


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """(hops, share of the operand each rank moves) of collective ``kind`` on a ring of ``n`` ranks: its seconds
    are ``launch + hops * alpha + share * bytes * beta`` (the one place these formulas live)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    if kind == "all_to_all":
        return n - 1, (n - 1) / (n * n)
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True)
class CommOp:
    """One collective of a redistribution: kind, the mesh dim it runs over, the logical operand bytes."""

    kind: str
    mesh_dim: int
    nbytes: int
    # bytes the collective also copies locally: gathering or scattering a dim other than the first interleaves
    # the ranks' pieces (a chunk and a cat of the whole operand) around a collective that runs on dim 0
    copied: int = 0


def collective_seconds(op: CommOp, mesh_shape: Sequence[int], profile: DeviceProfile,
                       latency_share: float = 1.0, links: Sequence[str] | None = None) -> float:
    """Alpha-beta seconds of ``op`` on a ring over its mesh dim's link. ``latency_share``: the part of the
    collective's fixed costs (its launch, the latency of each hop) this operand bears: less than 1 for a gradient
    reduction fused with others into one collective (strategy_search.buckets). ``links``: each mesh dim's link
    (:func:`mesh_links`; None: the profile's default split)."""
    n = mesh_shape[op.mesh_dim]
    if n <= 1:
        return 0.0
    name = links[op.mesh_dim] if links is not None else mesh_links(mesh_shape, profile)[op.mesh_dim]
    a, b, c = profile.link(name).constants(op.kind)
    a, c = a * latency_share, c * latency_share
    c += 2 * op.copied / profile.mem_bytes_per_s  # read and write
    hops, share = ring_terms(op.kind, n)
    return c + hops * a + share * op.nbytes * b


def local_numel(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """Elements one rank holds of a tensor of global ``shape`` (ceil division, as torch.chunk)."""
    sizes = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard) and sizes:
            d = p.dim % len(sizes)
            sizes[d] = -(-sizes[d] // n)
    return math.prod(sizes)


def redistribute_collectives(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
) -> list[CommOp]:
    """The collectives that turn ``src`` placements into ``dst``, one mesh dim at a time, in DTensor's order
    (its greedy redistribute plan), so that each operand's size is the one DTensor moves: where ``src`` splits on
    some mesh dim, first each mesh dim from the innermost out straight to its target (to Replicate instead where
    a split of the same tensor dim on an outer mesh dim differs: nested splits are undone first), then from the
    outermost in whatever is still off. A gradient pending over "dp" and split over "tp" that goes back to whole
    is gathered over "tp" first, then all-reduced whole. Going to a Shard or Partial from Replicate is local (a
    slice, or zeros on all but one rank) and free.
    """
    cur = list(src)
    ops: list[CommOp] = []

    def move(d: int, t: Placement) -> None:
        s, kind, split = cur[d], None, Shard(0)
        if s.is_partial():
            kind, split = ("reduce_scatter", t) if isinstance(t, Shard) else ("all_reduce", Shard(0))
        elif isinstance(s, Shard):
            kind, split = ("all_to_all", Shard(0)) if isinstance(t, Shard) else ("all_gather", s)
        operand = cur.copy()
        if kind == "all_gather":  # (its operand counted gathered)
            operand[d] = Replicate()
        size = local_numel(shape, operand, mesh_shape) * itemsize
        if kind is not None and mesh_shape[d] > 1:
            ops.append(CommOp(kind, d, size, size if split.dim != 0 else 0))
        cur[d] = t

    if any(isinstance(p, Shard) and mesh_shape[d] > 1 for d, p in enumerate(cur)):
        for d in reversed(range(len(cur))):
            t = dst[d]
            if isinstance(t, Shard) and [i for i in range(d) if cur[i] == Shard(t.dim)] != \
                    [i for i in range(d) if dst[i] == Shard(t.dim)]:
                t = Replicate()  # (a nested split to undo first)
            if cur[d] != t:
                move(d, t)
    for d in range(len(cur)):
        if cur[d] != dst[d]:
            move(d, dst[d])
    return ops


def gradient_placement(src: Sequence[Placement]) -> list[Placement]:
    """Where the gradient of a value laid out as ``src`` must end up: the same, with pending sums replicated."""
    return [Replicate() if p.is_partial() else p for p in src]


def accumulator_placement(src: Sequence[Placement]) -> list[Placement]:
    """A gradient accumulated as a pending sum wherever the value is replicated: readers' pending contributions
    add up for free, and one reduction (:func:`accumulated_collectives`) resolves the total."""
    return [Partial() if p.is_replicate() else p for p in gradient_placement(src)]


def backward_collectives(
    shape: Sequence[int],
    itemsize: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    pending: Sequence[bool],
    mesh_shape: Sequence[int],
    accumulate: bool = False,
) -> list[CommOp]:
    """Collectives of the gradient of an edge: from the consumer side (``dst``) back to the producer (``src``).

    ``pending[d]``: the consumer left this gradient as a pending sum on mesh dim ``d`` (it read the tensor
    replicated there while splitting its work there). A producer that was Partial receives a replicated gradient.
    With ``accumulate`` the contribution only joins the producer's pending accumulator, where the edge moves
    nothing (``src == dst``): the backward of a redistribution (DTensor's) takes the gradient to ``src``'s own
    placements, pending sums resolved there, whole (a weight gathered for its reader is reduced whole, then this
    rank's piece cut).
    """
    grad_at_consumer = [Partial() if pend else p for p, pend in zip(dst, pending)]
    grad_at_consumer = [Replicate() if (p.is_partial() and not pend) else p
                        for p, pend in zip(grad_at_consumer, pending)]
    target = accumulator_placement(src) if accumulate and tuple(src) == tuple(dst) else gradient_placement(src)
    return redistribute_collectives(shape, itemsize, grad_at_consumer, target, mesh_shape)


def accumulated_collectives(shape: Sequence[int], itemsize: int, src: Sequence[Placement],
                            mesh_shape: Sequence[int], summed: Sequence[int] | None = None) -> list[CommOp]:
    """The one reduction that resolves an accumulated gradient (see :func:`accumulator_placement`). ``summed``:
    the mesh dims where some contribution arrives as a pending sum (None: every dim the accumulator may hold
    one). Autograd adds the contributions as DTensors, and a sum of a pending sum and a replicated value is
    pending, of replicated values replicated: the total is pending only where a contribution was."""
    held = accumulator_placement(src)
    if summed is not None:
        held = [p if not p.is_partial() or d in summed else g
                for d, (p, g) in enumerate(zip(held, gradient_placement(src)))]
    return redistribute_collectives(shape, itemsize, held, gradient_placement(src), mesh_shape)


# per op and shapes: identical layers count each op once (a memo the registry owns, emptied by its clear())
_FLOPS = REGISTRY.memo("flops", 16384)


def node_flops(node) -> int:
    """FLOPs of one fx node at its global shapes (torch.utils.flop_counter; 0 for ops it does not count). A custom
    autograd.Function's call counts the ops its forward ran at capture."""
    if isinstance(node.target, FunctionCall):
        return sum(_op_flops(op, args, kwargs, out) for op, args, kwargs, out in node.target.forward_ops)
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.overloadpacket not in flop_registry:
        return 0  # (before the key: most ops are views and elementwise, which it does not count)
    args, kwargs = pytree.tree_map(lambda x: x.meta["val"] if isinstance(x, torch.fx.Node) else x,
                                   (node.args, node.kwargs))
    return _op_flops(node.target, args, kwargs, node.meta.get("val"))


def _op_flops(op, args, kwargs, out) -> int:
    key = (op, repr(pytree.tree_map(lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x),
                                    (args, kwargs))))

    def count() -> int:
        packet = op.overloadpacket
        if packet not in flop_registry:
            return 0
        try:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        except TypeError:
            return int(flop_registry[packet](*args, **kwargs))

    return _FLOPS.get(key, count)


def node_bytes(node) -> int:
    """Bytes an op reads and writes at its global shapes: the memory-bound side of the roofline."""
    total = 0
    for x in pytree.graph_leaves((node.args, node.kwargs)):
        if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
            v = x.meta["val"]
            total += v.numel() * v.element_size()
    for v in pytree.graph_leaves(node.meta.get("val")):
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def compute_seconds(flops: int, nbytes: int, split: int, profile: DeviceProfile,
                    dtype: torch.dtype = torch.float32) -> float:
    """Roofline time of one op computing in ``dtype`` whose work is split ``split`` ways (an array of splits: each
    one's)."""
    roof = max(flops / profile.matmul_flops_per_s(dtype), nbytes / profile.mem_bytes_per_s)
    if isinstance(split, np.ndarray):
        return roof / np.maximum(split, 1) + profile.op_s
    return roof / max(split, 1) + profile.op_s


def is_view_op(node) -> bool:
    """Ops whose result is a view of an input: they hold no memory of their own."""
    return is_view(getattr(node, "target", None))


def view_base(node):
    """The value ``node`` views, through any chain of views (``node`` itself if it is no view)."""
    while node.op == "call_function" and is_view_op(node):
        node = node.args[0]
    return node
