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

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import flop_registry

from .. import _pytree_internals as pytree
from ..capture.functions import FunctionCall
from ..capture.graph import is_view
from .lru import LRU

__all__ = [
    "CPU",
    "H100",
    "load_profile",
    "profile_for",
    "save_profile",
    "CommOp",
    "DeviceProfile",
    "backward_collectives",
    "collective_seconds",
    "local_numel",
    "redistribute_collectives",
]


@dataclass(frozen=True)
class DeviceProfile:
    """Roofline and link constants of one device kind. Override by building your own profile."""

    name: str
    flops_per_s: float  # sustained matmul throughput, fp32 (full precision: no TF32)
    mem_bytes_per_s: float  # memory bandwidth, for memory-bound (elementwise) ops
    alpha_s: float  # per-hop collective latency
    launch_s: float  # fixed cost of issuing one collective (software, kernel launch)
    beta_s_per_byte: float  # inverse link bandwidth
    memory_bytes: float  # per-device memory, the budget of level 2
    half_flops_per_s: float = 0.0  # bf16/fp16 matmul throughput (0: as fp32)
    tf32_flops_per_s: float = 0.0  # fp32 matmuls when TF32 is allowed (0: as fp32)
    # measured per collective kind (shardfn.calibrate): (kind, alpha_s, beta_s_per_byte), which replace the
    # shared alpha, beta and launch cost for that kind
    per_kind: tuple[tuple[str, float, float], ...] = ()
    op_s: float = 0.0  # the fixed cost of running one op (dispatch), whatever its size and split

    def matmul_flops_per_s(self, dtype: torch.dtype) -> float:
        """Throughput for ops computing in ``dtype``; fp32 uses TF32's when torch allows it on CUDA."""
        if dtype in (torch.bfloat16, torch.float16) and self.half_flops_per_s:
            return self.half_flops_per_s
        if dtype == torch.float32 and self.tf32_flops_per_s and torch.backends.cuda.matmul.allow_tf32:
            return self.tf32_flops_per_s
        return self.flops_per_s


# A CPU rank with gloo over loopback/TCP, and an H100 SXM with NVLink (NCCL). Order-of-magnitude constants:
# they rank plans, they do not predict wall time to the percent. H100 matmul rates as measured on one H100 (a
# GPT block: fp32 without TF32 ~60 TFLOP/s, bf16 ~800 TFLOP/s), TF32 between.
CPU = DeviceProfile("cpu", 5e10, 2e10, 5e-5, 2e-5, 1 / 2e9, 16e9)
H100 = DeviceProfile("h100", 6e13, 3e12, 1e-5, 5e-6, 1 / 4.5e11, 80e9, half_flops_per_s=8e14,
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
    """A profile saved by :func:`save_profile`; a clear error where the file is not one."""
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    try:
        with open(path) as f:
            data = json.load(f)
        data = {k: v for k, v in data.items() if k in fields}
        data["per_kind"] = tuple(tuple(entry) for entry in data.get("per_kind", ()))
        return DeviceProfile(**data)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"SHARDFN_PROFILE={path!r} is not a readable device profile ({e}); make one with "
                         "python -m shardfn.calibrate --out PATH, or unset SHARDFN_PROFILE") from e


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
                       latency_share: float = 1.0) -> float:
    """Alpha-beta seconds of ``op`` on a ring. ``latency_share``: the part of the collective's fixed costs (its
    launch, the latency of each hop) this operand bears: less than 1 for a gradient reduction fused with others
    into one collective (strategy_search.buckets)."""
    n = mesh_shape[op.mesh_dim]
    if n <= 1:
        return 0.0
    a, b, B, c = profile.alpha_s, profile.beta_s_per_byte, op.nbytes, profile.launch_s
    for kind, alpha, beta in profile.per_kind:
        if kind == op.kind:
            a, b, c = alpha, beta, 0.0
    a, c = a * latency_share, c * latency_share
    c += 2 * op.copied / profile.mem_bytes_per_s  # read and write
    if op.kind == "all_reduce":
        return c + 2 * (n - 1) * a + 2 * (n - 1) / n * B * b
    if op.kind in ("all_gather", "reduce_scatter"):
        return c + (n - 1) * a + (n - 1) / n * B * b
    if op.kind == "all_to_all":
        return c + (n - 1) * a + (n - 1) / (n * n) * B * b
    raise ValueError(f"unknown collective {op.kind!r}")


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
    """The collectives that turn ``src`` placements into ``dst``, one mesh dim at a time.

    Pending sums are resolved first, then gathers, then scatters, so operand sizes are the ones DTensor moves.
    Going to a Shard or Partial from Replicate is local (a slice, or zeros on all but one rank) and free.
    """
    cur = list(src)
    ops: list[CommOp] = []

    def nbytes(placements) -> int:
        return local_numel(shape, placements, mesh_shape) * itemsize

    def step(d: int, new: Placement, kind: str | None, size_from, split: Placement) -> None:
        if kind is not None and mesh_shape[d] > 1:
            ops.append(CommOp(kind, d, size_from, size_from if split.dim != 0 else 0))
        cur[d] = new

    order = sorted(range(len(cur)), key=lambda d: (not cur[d].is_partial(), not isinstance(cur[d], Shard)))
    for d in order:
        s, t = cur[d], dst[d]
        if s == t:
            continue
        if s.is_partial():
            if isinstance(t, Shard):
                step(d, t, "reduce_scatter", nbytes(cur), t)
            else:  # to Replicate
                step(d, Replicate(), "all_reduce", nbytes(cur), Shard(0))
        elif isinstance(s, Shard):
            if isinstance(t, Shard):
                step(d, t, "all_to_all", nbytes(cur), Shard(0))
            else:
                gathered = cur.copy()
                gathered[d] = Replicate()
                step(d, Replicate(), "all_gather", nbytes(gathered), s)
    for d in range(len(cur)):
        if cur[d] != dst[d]:  # Replicate -> Shard / Partial: local
            cur[d] = dst[d]
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
    With ``accumulate`` the contribution only joins the producer's pending accumulator.
    """
    grad_at_consumer = [Partial() if pend else p for p, pend in zip(dst, pending)]
    grad_at_consumer = [Replicate() if (p.is_partial() and not pend) else p
                        for p, pend in zip(grad_at_consumer, pending)]
    target = accumulator_placement(src) if accumulate else gradient_placement(src)
    return redistribute_collectives(shape, itemsize, grad_at_consumer, target, mesh_shape)


def accumulated_collectives(shape: Sequence[int], itemsize: int, src: Sequence[Placement],
                            mesh_shape: Sequence[int]) -> list[CommOp]:
    """The one reduction that resolves an accumulated gradient (see :func:`accumulator_placement`)."""
    return redistribute_collectives(shape, itemsize, accumulator_placement(src), gradient_placement(src),
                                    mesh_shape)


_FLOPS = LRU(16384)  # per op and shapes: identical layers count each op once


def node_flops(node) -> int:
    """FLOPs of one fx node at its global shapes (torch.utils.flop_counter; 0 for ops it does not count). A custom
    autograd.Function's call counts the ops its forward ran at capture."""
    if isinstance(node.target, FunctionCall):
        return sum(_op_flops(op, args, kwargs, out) for op, args, kwargs, out in node.target.forward_ops)
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0
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
    for x in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
            v = x.meta["val"]
            total += v.numel() * v.element_size()
    for v in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def compute_seconds(flops: int, nbytes: int, split: int, profile: DeviceProfile,
                    dtype: torch.dtype = torch.float32) -> float:
    """Roofline time of one op computing in ``dtype`` whose work is split ``split`` ways."""
    return max(flops / profile.matmul_flops_per_s(dtype), nbytes / profile.mem_bytes_per_s) / max(split, 1) \
        + profile.op_s


def is_view_op(node) -> bool:
    """Ops whose result is a view of an input: they hold no memory of their own."""
    return is_view(getattr(node, "target", None))
