"""gloo with two collectives in flight at once, torch alone (no shardfn): the pattern of a sharded block's backward
(an in-place gradient all-reduce still running while two all-gathers run and are waited for), then a
reduce-scatter and an all-reduce, step after step. Not a timing: it shows whether gloo keeps up.

    mpirun -n 8 --oversubscribe python bench/gloo_stress.py --steps 6000            # overlapped
    mpirun -n 8 --oversubscribe python bench/gloo_stress.py --steps 6000 --serial   # one collective at a time
    torchrun --nproc-per-node 8 bench/gloo_stress.py --steps 6000

On the 2-core CI machine (torch 2.14.1's gloo, 8 ranks), overlapped, every rank stopped in the last all-reduce of a
step until gloo's timeout ("Timed out waiting ... for send/recv operation to complete") after about 2600 steps;
a longer run of shardfn's own shard_cell sample aborted a rank with "malloc(): unaligned tcache chunk detected".
Serialised, 6000 steps ran clean. shardfn therefore keeps one collective in flight on gloo
(shardfn/exec/passes.py, _one_in_flight).
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--serial", action="store_true", help="wait for each collective before the next starts")
    parser.add_argument("--timeout", type=float, default=60.0, help="gloo's timeout, seconds")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="all-reduces started together before the gathers (overlapped only)")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))
    address = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29512')}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    buckets = [torch.empty(64 + 2048) for _ in range(args.in_flight)]
    start = time.monotonic()
    for step in range(args.steps):
        reduced = []
        for bucket in buckets:
            torch.cat([torch.randn(64), torch.randn(2048)], out=bucket)
            reduced.append(c10d.all_reduce_(bucket, "sum", group))
            if args.serial:
                c10d.wait_tensor(reduced[-1])
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(torch.randn(16, 8), world, group))
        again = c10d.all_gather_into_tensor(gathered @ torch.randn(8, 8), world, group)
        c10d.wait_tensor(again)
        if not args.serial:
            for r in reduced:
                c10d.wait_tensor(r)
        c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.randn(16 * world, 32), "sum", world, group))
        c10d.wait_tensor(c10d.all_reduce_(torch.randn(2112), "sum", group))
        if rank == 0 and step % 500 == 0:
            print(f"step {step}: {time.monotonic() - start:.0f} s", flush=True)
    print(f"rank {rank}: {args.steps} steps {'serial' if args.serial else 'overlapped'} ran clean", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
