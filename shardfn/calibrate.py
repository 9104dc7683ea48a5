"""Measure the cost model's constants on this machine: ``python -m shardfn.calibrate --out profile.json``.

Run it as the training runs (the same launcher and rank count: ``torchrun --nproc-per-node 4 -m
shardfn.calibrate --out p.json``), then plan with the result: ``SHARDFN_PROFILE=p.json``. Measured, with every
rank working at once (so ranks sharing a machine see each other's load, as in training):

- matmul throughput per dtype (fp32; TF32 and bf16 on CUDA), from square matmuls;
- memory bandwidth, from copying a large tensor, and the fixed cost of one op (adding to a 1-element tensor);
- per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, run as the programs run them:
  functional collectives, the ranks starting together), latency and inverse bandwidth, from a 4 KiB and a 4 MiB
  operand: the cost model's alpha-beta formula solved for both (the whole latency counted per hop, none as a
  fixed launch cost). In a world of one these stay the built-in profile's.

Each figure is the lower quartile of repeated timings (noise on a shared machine only adds time).

The slowest rank's times are used by all, so every rank plans with the same profile (ranks that plan
differently are stopped by the agreement check).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import runtime
from .strategy_search.cost_model import CPU, H100, DeviceProfile, save_profile

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


# (hops, share of the operand each rank moves) of each collective on n ranks, as cost_model's formulas count them
_RING = {"all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
         "all_gather": lambda n: (n - 1, (n - 1) / n),
         "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
         "all_to_all": lambda n: (n - 1, (n - 1) / (n * n))}


def _collectives(world: int, device: str, repeat: int) -> tuple[tuple[str, float, float], ...]:
    """(kind, alpha, beta) of each collective as the programs run them (functional collectives, the ranks
    starting together), solved from a 4 KiB and a 4 MiB operand."""
    from . import _functional_collectives as funcol

    group = dist.group.WORLD
    run = {"all_reduce": lambda x: funcol.all_reduce(x, "sum", group),
           "all_gather": lambda x: funcol.all_gather_tensor(x[: x.numel() // world], 0, group),
           "reduce_scatter": lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group),
           "all_to_all": lambda x: funcol.all_to_all_single(x, None, None, group)}
    sizes = (4 * 2**10, 4 * 2**20)
    timed = []
    for kind, op in run.items():
        for nbytes in sizes:
            x = torch.ones(nbytes // 4 // world * world, device=device)

            def once():
                dist.barrier()  # every rank starts it together
                return _timed(lambda: funcol.wait_tensor(op(x)), device)

            once()
            timed.append(_typical([once() for _ in range(2 * repeat)]))
    timed = _slowest(timed, device)
    out = []
    for k, kind in enumerate(run):
        small, big = timed[2 * k], timed[2 * k + 1]
        hops, share = _RING[kind](world)
        out.append((kind, small / hops, max(big - small, 1e-9) / (share * (sizes[1] - sizes[0]))))
    return tuple(out)


def calibrate(device: str | None = None, repeat: int = 10) -> DeviceProfile:
    """A DeviceProfile measured on this machine by every rank of the world (a collective: call it on all)."""
    device = runtime.resolve_device(device)
    world = runtime.init(device=device).size()
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
    alpha, launch, beta, per_kind = base.alpha_s, base.launch_s, base.beta_s_per_byte, ()
    if world > 1:
        per_kind = _collectives(world, device, repeat)
        alpha, beta = next((a, b) for kind, a, b in per_kind if kind == "all_reduce")
        launch = 0.0
    memory = base.memory_bytes
    if device == "cuda":
        memory = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return dataclasses.replace(base, name=f"{base.name}-measured", flops_per_s=fp32, mem_bytes_per_s=bandwidth,
                               alpha_s=alpha, launch_s=launch, beta_s_per_byte=beta, memory_bytes=memory,
                               half_flops_per_s=half, tf32_flops_per_s=tf32, per_kind=per_kind, op_s=op_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the profile (JSON)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = parser.parse_args(argv)
    profile = calibrate(args.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        save_profile(profile, args.out)
        print(f"wrote {os.path.abspath(args.out)}: {profile}", flush=True)


if __name__ == "__main__":
    main()
