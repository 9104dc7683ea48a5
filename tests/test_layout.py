import itertools
import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardfn as sf
from shardfn.layout import (
    Axis,
    TensorSpec,
    common_mesh,
    from_placements,
    normalize_strategy,
    to_placements,
)
from shardfn.runtime import device_mesh, simulated_world
from tests.harness import on_rank


def _shard_on(x, mesh_spec, spec):
    mesh = device_mesh(mesh_spec, "cpu")
    return distribute_tensor(x, mesh, to_placements(spec, mesh_spec))


def test_tuple_strategy_4x2_on_8_ranks_hand_computed():
    with simulated_world(8):
        x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
        spec = normalize_strategy((4, 2), x.shape, 8, "in_strategy[0]")
        mesh = common_mesh([spec], 8)
        assert mesh.shape == (4, 2)
        d = _shard_on(x, mesh, spec)
        # device matrix (1, 4, 2): rank 5 = row 2 of 4, column 1 of 2
        assert torch.equal(on_rank(d, 5), x[4:6, 3:6])
        assert torch.equal(on_rank(d, 0), x[0:2, 0:3])
        assert torch.equal(on_rank(d, 7), x[6:8, 3:6])


def test_repeat_axis_is_outermost():
    with simulated_world(8):
        x = torch.arange(4 * 4, dtype=torch.float32).reshape(4, 4)
        spec = normalize_strategy((2, 2), x.shape, 8, "in_strategy[0]")
        mesh = common_mesh([spec], 8)
        assert mesh.shape == (2, 2, 2)
        d = _shard_on(x, mesh, spec)
        # device matrix (2, 2, 2): ranks r and r + 4 hold the same shard
        for r in range(4):
            i0, i1 = r // 2, r % 2
            expect = x[2 * i0 : 2 * i0 + 2, 2 * i1 : 2 * i1 + 2]
            assert torch.equal(on_rank(d, r), expect)
            assert torch.equal(on_rank(d, r + 4), expect)


def _expected_shard(x, spec, rank):
    """Rank's shard by the definition: each axis gives coordinate (rank // stride) % size, outer split first."""
    index = []
    for n, axes in zip(x.shape, spec.dims):
        parts, pos = 1, 0
        for a in axes:
            pos = pos * a.size + (rank // a.stride) % a.size
            parts *= a.size
        index.append(slice(pos * n // parts, (pos + 1) * n // parts))
    return x[tuple(index)]


@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
def test_every_tuple_strategy_matches_definition(world):
    shape = (8, 16)
    with simulated_world(world):
        x = torch.randn(shape)
        splits = [s for s in (1, 2, 4, 8) if world % s == 0]
        for s0, s1 in itertools.product(splits, splits):
            if world % (s0 * s1):
                continue
            spec = normalize_strategy((s0, s1), shape, world, "s")
            mesh = common_mesh([spec], world)
            d = _shard_on(x, mesh, spec)
            for r in {0, min(1, world - 1), world // 2, world - 1}:
                assert torch.equal(on_rank(d, r), _expected_shard(x, spec, r)), (s0, s1, r)


def test_layout_multi_axis_dim_and_none():
    layout = sf.Layout((2, 4), ("dp", "mp"))
    with simulated_world(8):
        x = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
        both = normalize_strategy(layout(("dp", "mp"), "None"), x.shape, 8, "in_strategy[0]")
        assert both.dims == ((Axis(2, 4), Axis(4, 1)), ())
        mesh = common_mesh([both], 8)
        d = _shard_on(x, mesh, both)
        for r in range(8):  # dim 0 split in 8, dp outer: rank r holds rows 2r, 2r+1
            assert torch.equal(on_rank(d, r), x[2 * r : 2 * r + 2])
        dp = normalize_strategy(layout("dp", "mp"), x.shape, 8, "in_strategy[0]")
        mesh = common_mesh([dp], 8)
        assert mesh.shape == (2, 4)
        d = _shard_on(x, mesh, dp)
        assert torch.equal(on_rank(d, 6), x[8:16, 2:3])  # dp coordinate 1, mp coordinate 2
        none = normalize_strategy(layout("None", "mp"), x.shape, 8, "w")
        assert to_placements(none, common_mesh([none, dp], 8)) == (Replicate(), Shard(1))


def test_common_mesh_refines_different_device_matrices():
    a = normalize_strategy((2, 4), (8, 8), 8, "a")
    b = normalize_strategy((4, 2), (8, 8), 8, "b")
    mesh = common_mesh([a, b], 8)
    assert mesh.shape == (2, 2, 2)
    assert to_placements(a, mesh) == (Shard(0), Shard(1), Shard(1))
    assert to_placements(b, mesh) == (Shard(0), Shard(0), Shard(1))


def test_common_mesh_rejects_non_nesting_matrices():
    a = normalize_strategy((3, 4), (12, 12), 12, "a")
    b = normalize_strategy((4, 3), (12, 12), 12, "b")
    with pytest.raises(ValueError, match="cannot share one device mesh"):
        common_mesh([a, b], 12)


def test_common_mesh_cuts_a_dim_in_parts_named_after_its_axis():
    layout = sf.Layout((2, 8), ("dp", "tp"))
    names = {Axis(2, 8): "dp", Axis(8, 1): "tp"}
    dp = normalize_strategy(layout("dp", "None"), (8, 8), 16, "x")
    mesh = common_mesh([dp], 16, names, cuts=(4,))
    assert mesh.shape == (2, 2, 4) and mesh.names == ("dp", "tp.0", "tp.1")
    assert to_placements(normalize_strategy(layout("None", "tp"), (8, 8), 16, "w"), mesh) == (
        Replicate(), Shard(1), Shard(1))
    assert common_mesh([dp], 16, names, cuts=(3, 16, 1)).shape == (2, 8)  # cuts that do not nest, or no part
    assert common_mesh([dp], 16, names, cuts=(4,), node=8).shape == (2, 2, 4)  # with a node of 8


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (2, 2, 2)])
def test_placements_round_trip(mesh_shape):
    mesh_axes = tuple(Axis(s, math.prod(mesh_shape[i + 1 :])) for i, s in enumerate(mesh_shape))
    choices = [Replicate(), Shard(0), Shard(1), Partial()]
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        spec = from_placements(mesh_axes, placements, 2)
        mesh = common_mesh([spec], 8)
        # the coarsest mesh may merge dims; map back through the full-resolution mesh
        full = type(mesh)(mesh_axes, tuple(f"d{i}" for i in range(len(mesh_axes))))
        assert to_placements(spec, full) == placements
        assert from_placements(full.axes, to_placements(spec, full), 2) == spec


def test_redistribute_every_pair_on_2d_mesh_keeps_global_value():
    choices = [Shard(0), Shard(1), Replicate(), Partial()]
    with simulated_world(8):
        mesh = device_mesh(common_mesh([normalize_strategy((2, 4), (8, 8), 8, "x")], 8), "cpu")
        x = torch.randn(8, 8)
        for src in itertools.product(choices, repeat=2):
            # a Partial value: every rank in a partial group holds x / group size; the pieces sum to x
            plain = [Replicate() if p.is_partial() else p for p in src]
            groups = math.prod(mesh.size(i) for i, p in enumerate(src) if p.is_partial())
            local = distribute_tensor(x, mesh, plain).to_local() / groups
            start = DTensor.from_local(local, mesh, src, run_check=False)
            assert tuple(start.placements) == src
            assert torch.allclose(start.full_tensor(), x, atol=1e-6), src
            for dst in itertools.product(choices[:3], repeat=2):
                out = start.redistribute(mesh, dst)
                assert tuple(out.placements) == dst
                assert torch.allclose(out.full_tensor(), x, atol=1e-5), (src, dst)


def test_dtensor_input_spec():
    with simulated_world(8):
        mesh = device_mesh(common_mesh([normalize_strategy((2, 4), (8, 8), 8, "x")], 8), "cpu")
        d = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1), Replicate()])
        from shardfn.layout import spec_of_dtensor

        assert spec_of_dtensor(d, 8, "x") == TensorSpec(((), (Axis(2, 4),)))


# --- bad input: each names the argument and the fix -------------------------------------------------


@pytest.mark.parametrize(
    "strategy, shape, world, exc, match",
    [
        ((2, 2, 1), (4, 4), 8, ValueError, r"in_strategy\[0\].*3 entries.*2 dims"),
        ((4, 4), (8, 8), 8, ValueError, r"16 devices.*does not divide the world size 8"),
        ((2.0, 1), (4, 4), 8, TypeError, r"must be an int split count"),
        ((0, 1), (4, 4), 8, ValueError, r">= 1"),
        ("dp", (4, 4), 8, TypeError, r"must be a tuple of split counts"),
    ],
)
def test_bad_tuple_strategies(strategy, shape, world, exc, match):
    with pytest.raises(exc, match=match):
        normalize_strategy(strategy, shape, world, "in_strategy[0]", "input 0")


def test_splits_that_do_not_divide_a_dim_are_chunked_as_dtensor_does():
    # a split count that divides the world but not the dim: torch.chunk's pieces (the last smaller or empty)
    assert normalize_strategy((3, 1), (4, 4), 12, "in_strategy[0]") == TensorSpec(((Axis(3, 1),), ()))
    layout = sf.Layout((2, 4), ("dp", "mp"))
    assert normalize_strategy(layout("mp", "None"), (6, 4), 8, "in_strategy[0]") == TensorSpec(((Axis(4, 1),), ()))
    # what stays an error: more devices than the world, or a count that does not divide it
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        normalize_strategy((3, 1), (4, 4), 8, "in_strategy[0]")


def test_bad_layouts():
    layout = sf.Layout((2, 4), ("dp", "mp"))
    with pytest.raises(ValueError, match="unknown alias 'tp'"):
        layout("tp", "None")
    with pytest.raises(ValueError, match="used twice"):
        layout("dp", "dp")
    with pytest.raises(ValueError, match="repeated name"):
        sf.Layout((2, 2), ("a", "a"))
    with pytest.raises(ValueError, match="name each of the 2"):
        sf.Layout((2, 4), ("dp",))
    with pytest.raises(TypeError, match="positive ints"):
        sf.Layout((2, "4"), ("dp", "mp"))
    with pytest.raises(ValueError, match="maps 1 dims but the tensor has 2"):
        normalize_strategy(layout("dp"), (4, 4), 8, "in_strategy[0]")
    with pytest.raises(ValueError, match="device-matrix order"):
        normalize_strategy(layout(("mp", "dp"), "None"), (8, 4), 8, "in_strategy[0]")
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        normalize_strategy(layout("dp", "mp"), (8, 8), 4, "in_strategy[0]")
