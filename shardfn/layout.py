"""Strategies <-> device mesh + DTensor placements: the one conversion shardfn uses everywhere.

A *strategy* says how one tensor lies on the world's ranks. Users write it two ways (MindSpore's):

* a tuple of split counts, one per tensor dim. On a world of W ranks, ``(s0, s1, ...)`` means the device
  matrix ``(repeat, s0, s1, ...)`` in row-major rank order, ``repeat = W / prod(s)`` outermost, the tensor
  replicated along ``repeat``. ``(4, 2)`` on 8 ranks splits dim 0 in 4 and dim 1 in 2.
* a :class:`TensorLayout`, made by calling a :class:`Layout`: ``Layout((2, 4), ("dp", "mp"))("dp", "None")``.

Both normalise to a :class:`TensorSpec`: for each tensor dim, the device-matrix *axes* that split it, outer
split first. An axis is named by ``(size, stride)`` in row-major rank space: rank ``r`` sits at coordinate
``(r // stride) % size`` on it. All tensors of one shard call live on one DeviceMesh, the common refinement of
every axis they use (:func:`common_mesh`); a TensorSpec then becomes DTensor placements on that mesh
(:func:`to_placements`) and back (:func:`from_placements`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "Axis",
    "Layout",
    "MeshSpec",
    "Strategy",
    "TensorLayout",
    "TensorSpec",
    "common_mesh",
    "from_placements",
    "normalize_strategy",
    "spec_of_dtensor",
    "to_placements",
]


@dataclass(frozen=True, order=True)
class Axis:
    """One device-matrix axis: ``size`` ranks, consecutive coordinates ``stride`` ranks apart."""

    size: int
    stride: int

    @property
    def span(self) -> int:
        return self.size * self.stride


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor lies on the world: split axes per dim (outer first) and pending-sum axes."""

    dims: tuple[tuple[Axis, ...], ...]
    partial: tuple[Axis, ...] = ()

    def axes(self) -> tuple[Axis, ...]:
        return tuple(a for d in self.dims for a in d) + self.partial

    @classmethod
    def replicated(cls, ndim: int) -> "TensorSpec":
        return cls(((),) * ndim)


@dataclass(frozen=True)
class MeshSpec:
    """A row-major device mesh over the whole world: axes outer first, with their names, and the link each
    runs over where the user said (``Layout(..., links=...)``: "intra" within a node, "inter" between nodes;
    None: the device profile's default). A plan's mesh has every dim's link resolved."""

    axes: tuple[Axis, ...]
    names: tuple[str, ...]
    links: tuple[str | None, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)


class Layout:
    """MindSpore's Layout: a device matrix with a name per axis, called to lay out one tensor.

    ``Layout((2, 4), ("dp", "mp"))`` is 8 ranks as a 2 x 4 matrix in row-major order. Calling it maps each tensor
    dim to an axis name, ``"None"`` (not split), or a tuple of names (split over several axes, outer first):
    ``layout("dp", "mp")``, ``layout("dp", "None")``, ``layout(("dp", "mp"), "None")``.

    ``ranks`` names the global ranks of the matrix, row-major (Paddle's ProcessMesh): ``Layout((2, 2), ("dp",
    "mp"), ranks=(4, 5, 6, 7))``. A shard call whose layouts name ranks runs on those ranks only (a sub-mesh);
    without ``ranks`` the matrix lies over the ranks its call runs on.

    ``links`` says which link each axis's collectives run over, one entry per axis: ``"intra"`` (within a node:
    NVLink on an H100 node) or ``"inter"`` (between nodes: the network): ``Layout((8, 8), ("dp", "tp"),
    links=("inter", "intra"))``. Without it the device profile decides: the innermost axes whose ranks fit in
    one node (``DeviceProfile.devices_per_node``, 8 on CUDA) are intra-node, the rest inter-node.
    """

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str], ranks: Sequence[int] | None = None,
                 links: Sequence[str] | None = None):
        if not isinstance(device_matrix, (tuple, list)) or not device_matrix:
            raise TypeError(f"Layout: device_matrix must be a non-empty tuple of ints, got {device_matrix!r}")
        for size in device_matrix:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise TypeError(f"Layout: device_matrix entries must be positive ints, got {device_matrix!r}")
        if not isinstance(alias_name, (tuple, list)) or len(alias_name) != len(device_matrix):
            raise ValueError(
                f"Layout: alias_name must name each of the {len(device_matrix)} device_matrix axes, "
                f"got {alias_name!r}"
            )
        for name in alias_name:
            if not isinstance(name, str) or not name or name == "None":
                raise ValueError(f"Layout: alias names must be non-empty strings other than 'None', got {name!r}")
        if len(set(alias_name)) != len(alias_name):
            raise ValueError(f"Layout: alias_name has a repeated name: {tuple(alias_name)!r}")
        self.device_matrix = tuple(device_matrix)
        self.alias_name = tuple(alias_name)
        self.ranks = None if ranks is None else _check_ranks(ranks, self.device_matrix)
        self.links = None if links is None else _check_links(links, self.alias_name)

    def __call__(self, *tensor_map: str | tuple[str, ...]) -> "TensorLayout":
        used: set[str] = set()
        dims = []
        for entry in tensor_map:
            names = entry if isinstance(entry, tuple) else (entry,)
            names = tuple(n for n in names if n != "None")
            for name in names:
                if name not in self.alias_name:
                    raise ValueError(
                        f"Layout{self.alias_name!r}: unknown alias {name!r} in {tensor_map!r}; "
                        f"use one of {self.alias_name!r} or 'None'"
                    )
                if name in used:
                    raise ValueError(
                        f"Layout{self.alias_name!r}: alias {name!r} is used twice in {tensor_map!r}; "
                        "each device axis can split a tensor at most once"
                    )
                used.add(name)
            dims.append(names)
        return TensorLayout(self.device_matrix, self.alias_name, tuple(dims), self.ranks, self.links)

    def __repr__(self) -> str:
        ranks = "" if self.ranks is None else f", ranks={self.ranks!r}"
        links = "" if self.links is None else f", links={self.links!r}"
        return f"Layout({self.device_matrix!r}, {self.alias_name!r}{ranks}{links})"


LINK_NAMES = ("intra", "inter")


def _check_links(links: Sequence[str], alias_name: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(links, (tuple, list)) or len(links) != len(alias_name) or \
            any(link not in LINK_NAMES for link in links):
        raise ValueError(f"Layout: links must give each of the {len(alias_name)} axes {alias_name!r} its link, "
                         f"'intra' (within a node: NVLink) or 'inter' (between nodes: the network), e.g. "
                         f"links={tuple(['inter'] * (len(alias_name) - 1) + ['intra'])!r}; got {links!r}")
    return tuple(links)


def _check_ranks(ranks: Sequence[int], device_matrix: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(ranks, (tuple, list, range)) or \
            any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise TypeError(f"Layout: ranks must be a tuple of non-negative int ranks, got {ranks!r}")
    ranks = tuple(ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"Layout: ranks {ranks!r} names a rank twice; name each rank of the matrix once")
    if list(ranks) != sorted(ranks):  # torch orders a process group's ranks ascending: coordinates must agree
        raise ValueError(f"Layout: ranks {ranks!r} must be ascending (row-major order over the matrix): use "
                         f"{tuple(sorted(ranks))!r}")
    if len(ranks) != math.prod(device_matrix):
        raise ValueError(f"Layout: device_matrix {device_matrix!r} holds {math.prod(device_matrix)} devices but "
                         f"ranks names {len(ranks)}; name one rank per device, row-major")
    return ranks


@dataclass(frozen=True)
class TensorLayout:
    """One tensor's layout on a :class:`Layout`'s device matrix: the axis names splitting each dim."""

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]
    tensor_map: tuple[tuple[str, ...], ...]
    ranks: tuple[int, ...] | None = None  # the global ranks of the matrix, row-major; None: the call's ranks
    links: tuple[str, ...] | None = None  # per axis, "intra" or "inter" (Layout's links); None: the profile's

    def axis(self, name: str) -> Axis:
        i = self.alias_name.index(name)
        return Axis(self.device_matrix[i], math.prod(self.device_matrix[i + 1 :]))

    def __repr__(self) -> str:
        entries = ", ".join(repr(d[0]) if len(d) == 1 else (repr(d) if d else "'None'") for d in self.tensor_map)
        ranks = "" if self.ranks is None else f", ranks={self.ranks!r}"
        links = "" if self.links is None else f", links={self.links!r}"
        return f"Layout({self.device_matrix!r}, {self.alias_name!r}{ranks}{links})({entries})"


def _where(arg: str, tensor: str) -> str:
    return f"{arg} (for {tensor})" if tensor else arg


@dataclass(frozen=True)
class Strategy:
    """One user strategy, read once (``ShardConfig.make``): as given (what errors quote; its repr) and the
    TensorSpec it names, which needs neither the tensor nor the world. :func:`normalize_strategy` checks it
    against those (the tensor's dims, the world size) without reading it again."""

    given: tuple | list | TensorLayout
    spec: TensorSpec

    @classmethod
    def of(cls, strategy: "tuple | list | TensorLayout | Strategy", arg: str) -> "Strategy":
        """``strategy`` read: its own checks (ints >= 1; a layout's axes in device-matrix order), ``arg`` naming
        it in their errors."""
        return strategy if isinstance(strategy, Strategy) else cls(strategy, _spec(strategy, arg))

    @property
    def layout(self) -> TensorLayout | None:
        """The sf.Layout tensor layout given, or None for a tuple of split counts."""
        return self.given if isinstance(self.given, TensorLayout) else None

    def __repr__(self) -> str:
        return repr(self.given)


def normalize_strategy(
    strategy: tuple | TensorLayout | Strategy, shape: Sequence[int] | None, world_size: int, arg: str,
    tensor: str = ""
) -> TensorSpec:
    """Check one user strategy against its tensor's global shape and the world; return its TensorSpec.

    ``arg`` names the argument (``"in_strategy[0]"``) and ``tensor`` the tensor, so every error says where and
    what to change. Pure local checks: safe to run on every rank before any communication. With ``shape`` None
    (not known yet) only the checks that do not need it run. A :class:`Strategy` (read already) is only checked.
    """
    where = _where(arg, tensor)
    strategy = Strategy.of(strategy, where)
    given = strategy.given
    n = len(given.tensor_map) if isinstance(given, TensorLayout) else len(given)
    shape = (0,) * n if shape is None else tuple(shape)  # 0 is divisible by every split count
    if isinstance(given, TensorLayout):
        _check_layout(given, shape, world_size, where)
        return strategy.spec
    if len(given) != len(shape):
        raise ValueError(
            f"{where} = {tuple(given)!r} has {len(given)} entries but the tensor has {len(shape)} dims "
            f"(shape {shape}); give one split count per dim, e.g. {(1,) * len(shape)!r}"
        )
    total = math.prod(given)
    if world_size % total:
        raise ValueError(
            f"{where} = {tuple(given)!r} splits over {total} devices, which does not divide the world size "
            f"{world_size}; choose split counts whose product divides {world_size}"
        )
    return strategy.spec  # a split that does not divide its dim makes torch.chunk's pieces


def _spec(strategy: tuple | list | TensorLayout, where: str) -> TensorSpec:
    """The TensorSpec a strategy names (its checks that need neither the tensor nor the world)."""
    if isinstance(strategy, TensorLayout):
        return _layout_spec(strategy, where)
    if not isinstance(strategy, (tuple, list)):
        raise TypeError(
            f"{where} must be a tuple of split counts (one int per tensor dim), an sf.Layout(...)(...) or None; "
            f"got {type(strategy).__name__} {strategy!r}"
        )
    for s in strategy:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{where} = {tuple(strategy)!r}: every entry must be an int split count, got {s!r}")
        if s < 1:
            raise ValueError(f"{where} = {tuple(strategy)!r}: split counts must be >= 1, got {s}")
    dims = []
    for d, split in enumerate(strategy):
        stride = math.prod(strategy[d + 1 :])
        dims.append((Axis(split, stride),) if split > 1 else ())
    return TensorSpec(tuple(dims))


def _check_layout(layout: TensorLayout, shape: tuple[int, ...], world_size: int, where: str) -> None:
    total = math.prod(layout.device_matrix)
    if world_size % total:
        raise ValueError(
            f"{where}: device_matrix {layout.device_matrix!r} holds {total} devices, which does not divide the "
            f"world size {world_size}; use a device matrix whose product divides {world_size}"
        )
    if len(layout.tensor_map) != len(shape):
        raise ValueError(
            f"{where} = {layout!r} maps {len(layout.tensor_map)} dims but the tensor has {len(shape)} dims "
            f"(shape {shape}); give one alias (or 'None') per dim"
        )


def _layout_spec(layout: TensorLayout, where: str) -> TensorSpec:
    dims = []
    for d, names in enumerate(layout.tensor_map):
        axes = tuple(layout.axis(n) for n in names if layout.axis(n).size > 1)
        if any(a.stride < b.stride for a, b in zip(axes, axes[1:])):
            ordered = tuple(sorted(names, key=layout.alias_name.index))
            raise ValueError(
                f"{where} = {layout!r}: dim {d} is split over {names!r} with an inner device axis outermost; "
                f"list the axes in device-matrix order: {ordered!r}"
            )
        dims.append(axes)
    return TensorSpec(tuple(dims))


def spec_of_dtensor(dt: DTensor, world_size: int, where: str, ranks: Sequence[int] | None = None) -> TensorSpec:
    """The TensorSpec of a DTensor input, whose mesh must cover the call's ranks (``ranks``, by default the whole
    world) in row-major order."""
    mesh = dt.device_mesh
    expected = list(range(world_size)) if ranks is None else list(ranks)
    if mesh.mesh.flatten().tolist() != expected:
        over = f"all {world_size} ranks" if ranks is None else f"the call's ranks {expected}"
        raise ValueError(
            f"{where}: a DTensor on mesh {mesh} is not laid over {over} in row-major order; build its DeviceMesh "
            f"from torch.tensor({expected}).reshape(...), or sf.reshard it onto the call's layout first"
        )
    axes = mesh_axes(tuple(mesh.shape))
    return from_placements(axes, tuple(dt.placements), dt.ndim, where)


def mesh_axes(shape: tuple[int, ...]) -> tuple[Axis, ...]:
    return tuple(Axis(size, math.prod(shape[i + 1 :])) for i, size in enumerate(shape))


def common_mesh(specs: Sequence[TensorSpec], world_size: int, names: dict[Axis, str] | None = None,
                links: dict[Axis, str] | None = None, node: int = 0, cuts: Sequence[int] = ()) -> MeshSpec:
    """The coarsest row-major mesh over the world on which every spec's axes are unions of mesh dims.

    Every axis cuts rank space at its stride and at stride * size; those cuts must form a divisibility chain
    (1 | c1 | c2 | ... | world) for one mesh to serve all. ``names`` names a mesh dim after the user's alias when
    a user axis maps onto exactly one mesh dim. ``links`` ({user axis: "intra"/"inter"}, from Layouts' links):
    every mesh dim within a user axis runs over that axis's link, and each such axis is a mesh dim (or several).
    ``node``: the ranks of one node (the device profile's devices_per_node; 0: one node); the mesh is cut there
    too where that nests with the other cuts, so that no mesh dim mixes ranks within a node with ranks across
    nodes (else work could not be split within a node alone). ``cuts``: more places to cut rank space (each
    where it nests with the others: a part of a dim the program can split work over, such as attention's
    heads); a user axis cut in parts names them ``name.0`` (outer), ``name.1``, ...
    """
    extra, cuts = cuts, {1, world_size}
    for spec in specs:
        for axis in spec.axes():
            cuts.update((axis.stride, axis.span))
    for axis in links or {}:
        cuts.update((axis.stride, axis.span))
    chain = sorted(cuts)
    for lo, hi in zip(chain, chain[1:]):
        if hi % lo:
            raise ValueError(
                f"the strategies given cannot share one device mesh of {world_size} ranks: device-matrix axes cut "
                f"rank space at {lo} and {hi}, and {lo} does not divide {hi}; use split counts whose device "
                "matrices nest (e.g. all powers of two)"
            )
    if 1 < node < world_size and all(c % node == 0 or node % c == 0 for c in cuts):
        chain = sorted(cuts | {node})
    for cut in extra:
        if 1 < cut < world_size and all(c % cut == 0 or cut % c == 0 for c in chain):
            chain = sorted(set(chain) | {cut})
    axes = tuple(Axis(hi // lo, lo) for lo, hi in reversed(list(zip(chain, chain[1:]))))
    if not axes:
        axes = (Axis(1, 1),)
    labels = _mesh_labels(axes, names or {})
    return MeshSpec(axes, labels, _mesh_links(axes, links) if links else None)


def _mesh_labels(axes: tuple[Axis, ...], names: dict[Axis, str]) -> tuple[str, ...]:
    """Each mesh dim's name: the user's axis it is, or ``name.k`` for the k-th part (outer first) of the user's axis
    it lies within; ``d{i}`` where neither (all ``d{i}`` where two would share a name)."""
    labels = []
    for i, a in enumerate(axes):
        within = [(n, u) for u, n in names.items() if u.stride <= a.stride and a.span <= u.span and u.size > 1]
        if a in names:
            labels.append(names[a])
        elif len(within) == 1:
            n, u = within[0]
            labels.append(f"{n}.{sum(1 for b in axes[:i] if u.stride <= b.stride and b.span <= u.span)}")
        else:
            labels.append(f"d{i}")
    return tuple(labels) if len(set(labels)) == len(labels) else tuple(f"d{i}" for i in range(len(axes)))


def _mesh_links(axes: tuple[Axis, ...], links: dict[Axis, str]) -> tuple[str | None, ...]:
    """Each mesh dim's link: that of the user axis it lies within (None where no user axis with a link holds it)."""
    out = []
    for m in axes:
        said = {a: link for a, link in links.items() if a.stride <= m.stride and m.span <= a.span}
        if len(set(said.values())) > 1:
            raise ValueError(f"the Layouts given disagree on the link of the ranks {m.stride} apart: "
                             f"{', '.join(f'an axis of {a.size} ranks says {link!r}' for a, link in said.items())}; "
                             "give every Layout of one call the same links")
        out.append(next(iter(said.values()), None))
    return tuple(out)


def _mesh_dims_of(axis: Axis, mesh: MeshSpec) -> list[int]:
    dims = [k for k, m in enumerate(mesh.axes) if axis.stride <= m.stride < axis.span and m.size > 1]
    if math.prod(mesh.axes[k].size for k in dims) != axis.size:
        raise ValueError(f"axis {axis} is not a union of the dims of mesh {mesh.shape}")
    return dims


def to_placements(spec: TensorSpec, mesh: MeshSpec) -> tuple[Placement, ...]:
    """DTensor placements of ``spec`` on ``mesh`` (a refinement of every axis the spec uses)."""
    placements: list[Placement] = [Replicate()] * len(mesh.axes)
    for d, axes in enumerate(spec.dims):
        for axis in axes:
            for k in _mesh_dims_of(axis, mesh):
                placements[k] = Shard(d)
    for axis in spec.partial:
        for k in _mesh_dims_of(axis, mesh):
            placements[k] = Partial()
    return tuple(placements)


def from_placements(
    axes: tuple[Axis, ...], placements: tuple[Placement, ...], ndim: int, where: str = "placements"
) -> TensorSpec:
    """The TensorSpec of DTensor placements on a row-major mesh with these axes (mesh dims outer first)."""
    dims: list[list[Axis]] = [[] for _ in range(ndim)]
    partial = []
    for axis, p in zip(axes, placements):
        if type(p) is Shard:
            dims[p.dim % ndim].append(axis)
        elif p.is_partial():
            if getattr(p, "reduce_op", "sum") != "sum":
                raise ValueError(f"{where}: only Partial('sum') is supported, got {p}")
            partial.append(axis)
        elif not p.is_replicate():
            raise ValueError(f"{where}: placement {p} is not supported; use Shard, Replicate or Partial")
    return TensorSpec(tuple(tuple(d) for d in dims), tuple(partial))

