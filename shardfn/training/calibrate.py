"""Measure the cost model's constants on this machine: ``python -m shardfn.calibrate --out profile.json``.

Run it as the training runs (the same launcher and rank count: ``torchrun --nproc-per-node 4 -m
shardfn.calibrate --out p.json``), then plan with the result: ``SHARDFN_PROFILE=p.json``. Measured, with every
rank working at once (so ranks sharing a machine see each other's load, as in training):

- matmul throughput per dtype (fp32; TF32 and bf16 on CUDA), from square matmuls;
- memory bandwidth, from copying a large tensor, and the fixed cost of one op (adding to a 1-element tensor);
- per mesh dim (``--mesh 8x8``: the mesh you train on; by default one dim of every rank) and per collective
  kind (all_reduce, all_gather, reduce_scatter, all_to_all, run as the programs run them: functional
  collectives over that dim's groups, every group at once, the ranks starting together), latency and inverse
  bandwidth, from a 4 KiB and a 4 MiB operand: the cost model's alpha-beta formula (``cost_model.ring_terms``)
  solved for both (the whole latency counted per hop, none as a fixed launch cost). Each dim is intra-node or
  inter-node as plans will take it (``cost_model.mesh_links``); each link's figures are the slowest of its
  dims, and a link no dim measured (the network, on one machine) keeps the built-in profile's. In a world of
  one they all stay the built-in profile's;
- the ranks of one node: on CUDA the GPUs a node has (and at least the ranks sharing this host); on the CPU 0
  (every rank one machine) where all ranks share one host, else the ranks a host runs.

Each figure is the lower quartile of repeated timings (noise on a shared machine only adds time).

The slowest rank's times are used by all, so every rank plans with the same profile (ranks that plan
differently are stopped by the agreement check).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import runtime
from ..layout import MeshSpec, mesh_axes
from ..strategy_search.cost_model import CPU, H100, DeviceProfile, Link, mesh_links, ring_terms, save_profile

__all__ = ["calibrate"]


def _timed(fn: Callable[[], object], device: str) -> float:
    """The seconds of one ``fn()``, its GPU work included."""
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _typical(seconds: list[float]) -> float:
    """The lower quartile of repeated timings: a busy machine only ever adds time (a rank descheduled while its
    peer waits), in spells that moved the median of ten collectives fourfold between two calibrations here."""
    return statistics.quantiles(seconds, n=4)[0]


def _seconds(fn: Callable[[], object], device: str, repeat: int) -> float:
    """The typical seconds of ``fn`` (after one warm-up run)."""
    _timed(fn, device)
    return _typical([_timed(fn, device) for _ in range(repeat)])


def _matmul_flops(dtype: torch.dtype, device: str, n: int, repeat: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _seconds(lambda: a @ b, device, repeat)


def _memory_bandwidth(device: str, nbytes: int, repeat: int) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), device, repeat)  # read and write


def _slowest(values: list[float], device: str) -> list[float]:
    """Each value's maximum over the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _collectives(group, n: int, device: str, repeat: int) -> tuple[tuple[str, float, float], ...]:
    """(kind, alpha, beta) of each collective over ``group`` (``n`` ranks; every rank of the world runs its own
    group's at once) as the programs run them (functional collectives, the ranks starting together), solved
    from a 4 KiB and a 4 MiB operand."""
    from .. import _functional_collectives as funcol

    run = {"all_reduce": lambda x: funcol.all_reduce(x, "sum", group),
           "all_gather": lambda x: funcol.all_gather_tensor(x[: x.numel() // n], 0, group),
           "reduce_scatter": lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group),
           "all_to_all": lambda x: funcol.all_to_all_single(x, None, None, group)}
    sizes = (4 * 2**10, 4 * 2**20)
    timed = []
    for kind, op in run.items():
        for nbytes in sizes:
            x = torch.ones(nbytes // 4 // n * n, device=device)

            def once():
                dist.barrier()  # every rank starts it together
                return _timed(lambda: funcol.wait_tensor(op(x)), device)

            once()
            timed.append(_typical([once() for _ in range(2 * repeat)]))
    timed = _slowest(timed, device)
    out = []
    for k, kind in enumerate(run):
        small, big = timed[2 * k], timed[2 * k + 1]
        hops, share = ring_terms(kind, n)
        out.append((kind, small / hops, max(big - small, 1e-9) / (share * (sizes[1] - sizes[0]))))
    return tuple(out)


def _devices_per_node(device: str, world: int) -> int:
    """The ranks of one node: the most ranks sharing a host (on CUDA at least the GPUs a node has); 0 on the
    CPU where every rank shares this host."""
    per_host = world
    if world > 1:
        hosts: list = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        per_host = max(hosts.count(h) for h in set(hosts))
    if device == "cuda":
        return max(per_host, torch.cuda.device_count())
    return 0 if per_host == world else per_host


def _links(base: DeviceProfile, mesh: tuple[int, ...], per_node: int, device: str, repeat: int):
    """(intra-node link, inter-node link, measured_dims): each mesh dim's collectives measured over its groups;
    a link's figures the slowest of its dims (alpha and beta each), a link no dim measured the base's."""
    devmesh = None
    if any(n > 1 for n in mesh):
        devmesh = runtime.device_mesh(MeshSpec(mesh_axes(mesh), tuple(f"d{i}" for i in range(len(mesh)))), device)
    links = mesh_links(mesh, dataclasses.replace(base, devices_per_node=per_node))
    measured, by_link = [], {"intra": {}, "inter": {}}
    for d, n in enumerate(mesh):
        if n <= 1:
            continue
        for kind, alpha, beta in _collectives(devmesh.get_group(d), n, device, repeat):
            measured.append((d, n, links[d], kind, alpha, beta))
            a, b = by_link[links[d]].get(kind, (0.0, 0.0))
            by_link[links[d]][kind] = (max(a, alpha), max(b, beta))
    out = []
    for name, built_in in (("intra", base.intra_node), ("inter", base.inter_node)):
        kinds = by_link[name]
        if not kinds:
            out.append(built_in)
            continue
        alpha, beta = kinds.get("all_reduce", next(iter(kinds.values())))
        out.append(Link(alpha, beta, 0.0, tuple((k, a, b) for k, (a, b) in kinds.items())))
    return out[0], out[1], tuple(measured)


def calibrate(device: str | None = None, repeat: int = 10, mesh: tuple[int, ...] | None = None) -> DeviceProfile:
    """A DeviceProfile measured on this machine by every rank of the world (a collective: call it on all).
    ``mesh``: the mesh dims to measure collectives over, outer first (their product the world; None: one dim of
    every rank)."""
    device = runtime.resolve_device(device)
    world = runtime.init(device=device).size()
    mesh = (world,) if mesh is None else tuple(mesh)
    if not mesh or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in mesh) \
            or math.prod(mesh) != world:
        raise ValueError(f"calibrate: mesh must be positive mesh dim sizes whose product is the world's {world} "
                         f"ranks (e.g. mesh=(8, 8) or --mesh 8x8 on 64 ranks; None for one dim of every rank), "
                         f"got {mesh!r}")
    base = H100 if device == "cuda" else CPU
    n = 2048 if device == "cuda" else 512
    fp32 = _matmul_flops(torch.float32, device, n, repeat)
    half = tf32 = 0.0
    if device == "cuda":
        half = _matmul_flops(torch.bfloat16, device, n * 2, repeat)
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            tf32 = _matmul_flops(torch.float32, device, n * 2, repeat)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
    bandwidth = _memory_bandwidth(device, 64 * 2**20, repeat)
    # throughputs as the slowest rank's (the max of their inverses), latencies likewise
    inverse = _slowest([1 / fp32, 1 / bandwidth] + ([1 / half, 1 / tf32] if device == "cuda" else []), device)
    fp32, bandwidth = 1 / inverse[0], 1 / inverse[1]
    if device == "cuda":
        half, tf32 = 1 / inverse[2], 1 / inverse[3]
    one = torch.ones(1, device=device)
    op_s = _slowest([_seconds(lambda: one + 1, device, repeat * 10)], device)[0]  # an op's fixed cost
    per_node = _devices_per_node(device, world)
    intra, inter, dims = _links(base, mesh, per_node, device, repeat)
    memory = base.memory_bytes
    if device == "cuda":
        memory = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return dataclasses.replace(base, name=f"{base.name}-measured", flops_per_s=fp32, mem_bytes_per_s=bandwidth,
                               memory_bytes=memory, intra_node=intra, inter_node=inter, devices_per_node=per_node,
                               half_flops_per_s=half, tf32_flops_per_s=tf32, op_s=op_s, measured_dims=dims)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the profile (JSON)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--mesh", default=None,
                        help="the mesh dims to measure collectives over, outer first, e.g. 8x8 (default: one dim)")
    args = parser.parse_args(argv)
    mesh = None
    if args.mesh:
        try:
            mesh = tuple(int(n) for n in args.mesh.lower().split("x"))
        except ValueError:
            parser.error(f"--mesh {args.mesh!r}: give mesh dim sizes joined by x, e.g. --mesh 8x8")
    profile = calibrate(args.device, mesh=mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        save_profile(profile, args.out)
        print(f"wrote {os.path.abspath(args.out)}: {profile}", flush=True)


if __name__ == "__main__":
    main()
