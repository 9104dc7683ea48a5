"""The world shardfn runs in: launcher detection, the process group, device meshes, simulated worlds.

``init()`` reads rank and world size from whichever launcher started the process:

=================  ======================================  ==========================================
launcher           rank / world size                       local rank
=================  ======================================  ==========================================
torchrun           RANK, WORLD_SIZE                        LOCAL_RANK
Open MPI mpirun    OMPI_COMM_WORLD_RANK / _SIZE            OMPI_COMM_WORLD_LOCAL_RANK
MPICH, Intel MPI   PMI_RANK, PMI_SIZE                      MPI_LOCALRANKID, PMI_LOCAL_RANK
Slurm srun         SLURM_PROCID, SLURM_NTASKS              SLURM_LOCALID
=================  ======================================  ==========================================

With none of them, the process is a world of one. The rendezvous is torch's TCP store at MASTER_ADDR:MASTER_PORT,
defaulting to 127.0.0.1:29500 (:data:`DEFAULT_MASTER_PORT`) when the launcher sets neither (mpirun and srun on
one host). On CUDA each rank takes its local GPU; more ranks on a host than GPUs is an error before any
communication.

Settings (environment variables, seconds):

=======================  =======  =============================================================================
SHARDFN_INIT_TIMEOUT     300      the rendezvous: a missing rank, a wrong port or address, a port another program
                                  holds: a RuntimeError saying what was waited for, within this (plus ~1 s)
SHARDFN_TIMEOUT          300      any collective (the process group's and the control group's timeout): a peer
                                  that never comes is an error after this, not gloo's 30 minutes
SHARDFN_EXIT_TIMEOUT     30       at exit, how long a rank waits for the others to finish before it tears the
                                  process group down alone (none waits for a rank that crashed)
=======================  =======  =============================================================================
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _simulation_internals as _simulation
from ._mesh_internals import mesh_without_groups
from . import rendezvous
from .layout import MeshSpec

__all__ = ["DEFAULT_INIT_TIMEOUT_S", "DEFAULT_MASTER_PORT", "DEFAULT_TIMEOUT_S", "Launch", "collective_timeout_s",
           "control_group", "detect_launch", "init", "simulated_world"]


class _PlannedRedistributions(logging.Filter):
    # DTensor warns when a redistribution runs one collective per mesh dim; shardfn's plans choose those
    # collectives on purpose (and list them in explain()), so the warning is only noise for its users.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("While redistributing from")


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_PlannedRedistributions())

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_EXIT_TIMEOUT_S = 30.0

# (launcher, rank var, world var, local-rank vars, ranks-on-this-host vars), in priority order.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
     ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",), ("SLURM_NTASKS_PER_NODE",)),
)


@dataclass(frozen=True)
class Launch:
    """Who started this process: the launcher's name, this rank, the world size and the rank on this host."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None  # ranks on this host, where the launcher says


def detect_launch(environ: dict[str, str] | None = None) -> Launch:
    env = os.environ if environ is None else environ
    for name, rank_var, world_var, local_vars, local_size_vars in _LAUNCHERS:
        if rank_var in env and world_var in env:
            try:
                rank, world = int(env[rank_var]), int(env[world_var])
                local = next((int(env[v]) for v in local_vars if v in env), rank)
            except ValueError as e:
                raise RuntimeError(f"shardfn.init: {name} set a non-integer rank variable: {e}") from None
            if not 0 <= rank < world:
                raise RuntimeError(f"shardfn.init: {name} says rank {rank} of a world of {world}")
            sizes = [env[v] for v in local_size_vars if v in env and env[v].isdigit()]
            return Launch(name, rank, world, local, int(sizes[0]) if sizes else None)
    return Launch("none", 0, 1, 0, 1)


def check_gpus(launch: Launch, gpus: int) -> None:
    """One GPU per rank on a host: NCCL refuses two ranks on one GPU ("Duplicate GPU detected")."""
    ranks_here = launch.local_world_size if launch.local_world_size is not None else launch.local_rank + 1
    if ranks_here > gpus:
        raise ValueError(
            f"shardfn.init: {ranks_here} ranks run on this host but it has {gpus} GPU{'s' if gpus != 1 else ''}; "
            "NCCL needs one GPU per rank. Start at most one rank per GPU on each host, or use gloo on the CPU "
            "(device='cpu')")


def collective_timeout_s() -> float:
    """SHARDFN_TIMEOUT: how long any collective may wait for its peers."""
    return float(os.environ.get("SHARDFN_TIMEOUT", DEFAULT_TIMEOUT_S))


_CONTROL: list = []  # the control group of the current process group, once made
_STORE: list = []  # the rendezvous store, for the exit check-in


def control_group():
    """A gloo group over the whole world, beside the programs' own collectives, for the ranks' agreement on
    each call (CPU-side: no GPU sync); None in a world of one and in a simulated world."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    return _CONTROL[0] if _CONTROL else None


def _default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None (cuda when available), got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu' or None")
    return device


def init(backend: str | None = None, device: str | None = None) -> DeviceMesh:
    """Join (or form) the process group of this launch and return the world's 1-D DeviceMesh. Idempotent."""
    device = resolve_device(device)
    if not dist.is_initialized():
        launch = detect_launch()
        backend = backend or _default_backend(device)
        if device == "cuda":
            check_gpus(launch, torch.cuda.device_count())
            torch.cuda.set_device(launch.local_rank)
        init_s = float(os.environ.get("SHARDFN_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT_S))
        timeout = datetime.timedelta(seconds=collective_timeout_s())
        _CONTROL.clear()
        _STORE.clear()
        if launch.world_size == 1:
            # A world of one needs no rendezvous: an in-process store, no port to collide on.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            host = os.environ.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
            port = os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
            try:
                store = rendezvous.meet(host, int(port), launch.rank, launch.world_size, init_s)
            except Exception as e:  # torch raises DistStoreError / RuntimeError / TimeoutError variously
                raise RuntimeError(
                    f"shardfn.init: rank {launch.rank} of {launch.world_size} ({launch.launcher}) could not "
                    f"rendezvous at {host}:{port} within {init_s:g} s (SHARDFN_INIT_TIMEOUT): check that every "
                    f"rank started and that MASTER_ADDR/MASTER_PORT name a reachable host and a free port. "
                    f"Cause: {type(e).__name__}: {e}"
                ) from e
            dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                    timeout=timeout)
            _STORE.append(store)
            _CONTROL.append(dist.new_group(backend="gloo", timeout=timeout))
        atexit.register(_shutdown)
        sys.excepthook = _note_crash(sys.excepthook)
    elif backend is not None and dist.get_backend() != backend:
        raise ValueError(
            f"shardfn.init(backend={backend!r}): the process group already runs {dist.get_backend()!r}; "
            "call init() with backend=None or the same backend"
        )
    return world_mesh(device)


_CRASHED = False


def _note_crash(previous_hook):
    def hook(*exc_info):
        global _CRASHED
        _CRASHED = True
        if _STORE:
            rendezvous.note_crash(_STORE[0])
        previous_hook(*exc_info)

    return hook


def _shutdown() -> None:
    # Tear the group down before the interpreter does: gloo's threads dying with the process abort some ranks
    # ("terminate called without an active exception"). Every rank first checks out at the store and waits, at
    # most SHARDFN_EXIT_TIMEOUT, for all others, then a barrier drains the transport; when a rank crashed (or
    # this one did) nobody waits for it.
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    _release_groups(_MESHES.values())
    _MESHES.clear()
    _GROUPS.clear()
    _PREPARED.clear()
    _CONTROL.clear()
    if not _CRASHED and dist.get_world_size() > 1 and _STORE:
        exit_s = float(os.environ.get("SHARDFN_EXIT_TIMEOUT", DEFAULT_EXIT_TIMEOUT_S))
        if rendezvous.check_in_at_exit(_STORE[0], dist.get_world_size(), exit_s):
            with contextlib.suppress(Exception):
                dist.barrier()
    _STORE.clear()
    dist.destroy_process_group()


def _release_groups(meshes) -> None:
    # A DeviceMesh keeps its process groups (torch 2.13's `_pg_registry`), and the user's script holds the mesh
    # init() returned: the groups, and gloo's worker threads, would outlive destroy_process_group into the
    # interpreter's finalization, where a worker dropping a finished collective's tensors needs the GIL and aborts
    # the process ("terminate called without an active exception", seen in a world of one). Dropped here, the
    # groups end inside _shutdown, their threads joined while the interpreter still runs; the meshes are dead
    # after destroy_process_group either way.
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def check_ranks(ranks: tuple[int, ...] | None, what: str) -> None:
    """A call's ranks must exist in this world (checked on every rank, before any communication)."""
    world = dist.get_world_size()
    if ranks is not None and max(ranks) >= world:
        raise ValueError(f"{what}: its layout names ranks {ranks!r} but the world has {world} ranks (0..{world - 1});"
                         " name ranks of this world in Layout(..., ranks=...)")


def whole_world(ranks: tuple[int, ...] | None) -> bool:
    return ranks is None or ranks == tuple(range(dist.get_world_size()))


def is_member(ranks: tuple[int, ...] | None) -> bool:
    """Whether this rank runs a call on ``ranks`` (None: every rank)."""
    return ranks is None or not dist.is_initialized() or dist.get_rank() in ranks


_GROUPS: dict[tuple, object] = {}
_PREPARED: set = set()


def prepare_ranks(ranks: tuple[int, ...] | None, device: str) -> None:
    """Make, once, every process group a call on ``ranks`` can use: the group of each device-matrix axis of any
    row-major matrix over them, and the set itself.

    torch makes a group collectively over the whole world (a group made by its members alone is named after how
    many groups each has made, so overlapping ones never meet), so every rank must make the same groups in the
    same order: this runs where every rank passes (shard(), sf.reshard, sf.pipeline), never on a first call that
    only a sub-mesh's ranks make.
    """
    if not dist.is_initialized() or whole_world(ranks) or (id(dist.group.WORLD), ranks) in _PREPARED:
        return
    n = len(ranks)
    for size in (d for d in range(1, n + 1) if n % d == 0 and (d > 1 or n == 1)):
        for stride in (d for d in range(1, n // size + 1) if (n // size) % d == 0):
            for outer in range(n // (size * stride)):
                for inner in range(stride):
                    make_group(tuple(ranks[outer * size * stride + j * stride + inner] for j in range(size)), device)
    _PREPARED.add((id(dist.group.WORLD), ranks))


def make_group(ranks: tuple[int, ...], device: str):
    """A process group over ``ranks`` (made on every rank, in the same order, once per process group).

    On CUDA it holds NCCL for the programs and gloo for CPU-side control messages, so one group per rank set
    serves both.
    """
    key = (id(dist.group.WORLD), tuple(sorted(ranks)))
    if key not in _GROUPS:
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        if dist.get_backend() == "fake":  # a simulated world: its groups are fake too
            backend = None
        _GROUPS[key] = dist.new_group(sorted(ranks), backend=backend,
                                      timeout=datetime.timedelta(seconds=collective_timeout_s()))
    return _GROUPS[key]


def group_of(ranks: tuple[int, ...]):
    """The process group over ``ranks``, made beforehand by :func:`prepare_ranks` or :func:`make_group`."""
    group = _GROUPS.get((id(dist.group.WORLD), tuple(sorted(ranks))))
    if group is None:
        raise RuntimeError(f"shardfn: no process group over ranks {ranks}: shard() of a call on a sub-mesh, "
                           "sf.reshard and sf.pipeline must run on every rank of the world, in the same order")
    return group


def call_control_group(ranks: tuple[int, ...] | None):
    """The group on which the ranks of a call agree on it: the world's control group, or the sub-mesh's group
    (None in a world of one and in a simulated world)."""
    if whole_world(ranks) or control_group() is None:
        return control_group()
    return group_of(ranks)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The torch device this rank's tensors on ``mesh`` live on (the current GPU on CUDA)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def world_mesh(device: str) -> DeviceMesh:
    world = dist.get_world_size()
    return _cached_mesh(device, (world,), ("world",))


_MESHES: dict[tuple, DeviceMesh] = {}


def _cached_mesh(device: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # DeviceMesh construction creates sub-groups (a collective on real worlds): build each shape once per
    # process group, on every rank in the same order.
    key = (id(dist.group.WORLD), device, shape, names)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = DeviceMesh(device, torch.arange(int(torch.tensor(shape).prod())).reshape(shape), mesh_dim_names=names)
        _MESHES[key] = mesh
    return mesh


def device_mesh(spec: MeshSpec, device: str, ranks: tuple[int, ...] | None = None) -> DeviceMesh:
    """The DeviceMesh of a MeshSpec on the current process group (built once, then reused), laid over ``ranks``
    (row-major) or the whole world."""
    if whole_world(ranks):
        return _cached_mesh(device, spec.shape, spec.names)
    key = (id(dist.group.WORLD), device, spec.shape, spec.names, ranks)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _sub_mesh(torch.tensor(ranks).reshape(spec.shape), device, spec.names)
        _MESHES[key] = mesh
    return mesh


def _sub_mesh(ranks: torch.Tensor, device: str, names: tuple[str, ...]) -> DeviceMesh:
    # DeviceMesh(...) over a sub-mesh makes its groups collectively over the whole world, which a first call made
    # by the sub-mesh's ranks only cannot do. Its groups were made beforehand on every rank (prepare_ranks); a
    # member builds the mesh from its own; other ranks get a mesh without groups ("not a member" to DTensor).
    me = dist.get_rank()
    if me not in ranks.flatten().tolist():
        return mesh_without_groups(device, ranks, names)
    coord = [int(c) for c in (ranks == me).nonzero()[0]]
    groups = []
    for d in range(ranks.dim()):
        index = list(coord)
        index[d] = slice(None)
        groups.append(group_of(tuple(ranks[tuple(index)].tolist())))
    if ranks.dim() == 1:
        return DeviceMesh.from_group(groups[0], device, mesh=ranks, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device, mesh=ranks, mesh_dim_names=names)


def planning_mesh(spec: MeshSpec, device: str) -> DeviceMesh:
    """A DeviceMesh for planning only: no process group, no communication; rank 0's view."""
    return mesh_without_groups(device, torch.arange(spec.world_size).reshape(spec.shape), spec.names, rank=0)


@contextlib.contextmanager
def simulated_world(world_size: int, local_tensors: bool = True) -> Iterator[None]:
    """Run ``world_size`` ranks inside this process.

    The fake process group stands in for the world; with ``local_tensors`` every tensor created inside holds one
    value per rank (torch's LocalTensorMode) and collectives compute their true result, so a sharded program's
    numerics can be checked in one process. Without it, collectives are no-ops: enough for planning.
    """
    if dist.is_initialized():
        raise RuntimeError("simulated_world: a process group is already initialised in this process")
    _simulation.init_fake_world(world_size)
    try:
        if local_tensors:
            with _simulation.LocalTensorMode(world_size), _simulation.per_rank_bools_refused(), \
                    _simulation.plain_writes_once(), _simulation.zero_tensors_materialized(), \
                    _simulation.world_ops_run_whole():
                yield
        else:
            yield
    finally:
        _MESHES.clear()
        _GROUPS.clear()
        _PREPARED.clear()
        dist.destroy_process_group()


def is_simulated() -> bool:
    """True inside :func:`simulated_world` with per-rank local tensors."""
    return _simulation.local_tensor_mode() is not None


def simulated_counts(size) -> list[int] | None:
    """In a simulated world, each rank's value of a size that differs between ranks (a tensor made with
    per-rank shapes), in rank order; None for a plain number."""
    local = _simulation.per_rank_ints(size)
    return None if local is None else [int(local[r]) for r in sorted(local)]


def simulated_map(t: torch.Tensor, fn: Callable[[int, dict[int, torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    """In a simulated world, the tensor whose value on rank r is ``fn(r, every rank's value of t)`` (shapes may
    differ between ranks)."""
    values = _simulation.local_values(t) or {r: t for r in range(dist.get_world_size())}
    with outside_simulation():
        pieces = {r: fn(r, values) for r in values}
    return _simulation.local_tensor_mode().rank_map(lambda r: pieces[r])


def outside_simulation():
    """A context where tensors are ordinary again (capture and planning work on fake tensors, not per-rank ones)."""
    return _simulation.not_simulated()
