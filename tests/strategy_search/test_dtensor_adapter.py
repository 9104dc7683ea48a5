"""The adapter of DTensor's rules: a whole-mesh rule that enumerates every placement itself (DTensor's full-mesh
expansion of its single-dim rules: gather, scatter; or a strategy per layout of its first input: slice_scatter)
is asked once per node, not once per combination of its inputs' layouts, and gives every strategy that gave."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardfn.strategy_search import _dtensor_adapter as adapter
from shardfn.strategy_search._dtensor_adapter import _propagator
from tests.strategy_search.truth import planning

aten = torch.ops.aten

CASES = {  # (op, its arguments, the mesh where the rule gives fewer strategies than its input has layouts)
    # the router's top-k weights read back by expert (DeepSeek-V3): on its 16 x 2 x 8 mesh, 6,912 strategies asked
    # one combination of layouts at a time
    "gather": (aten.gather.default, lambda: (torch.empty(32, 12), 1, torch.empty(32, 4, dtype=torch.long)),
               (2, 2, 2)),
    "scatter": (aten.scatter.src, lambda: (torch.empty(32, 12), 1, torch.empty(32, 4, dtype=torch.long),
                                           torch.empty(32, 4)), (2, 2)),
    # MLA's keys written in two parts (DeepSeek-V3): a strategy per layout of the input, the source following it
    "slice_scatter": (aten.slice_scatter.default, lambda: (torch.empty(8, 16, 4, 12), torch.empty(8, 16, 4, 4), 3,
                                                           8), (2, 2, 2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_that_enumerates_every_placement_is_asked_once(name, monkeypatch):
    op, make, shape = CASES[name]
    with FakeTensorMode():
        args = make()
    mesh = planning(*shape)
    asked = []
    per_combination = adapter._per_combination
    monkeypatch.setattr(adapter, "_per_combination", lambda *a: asked.append(1) or per_combination(*a))
    once = adapter.dtensor_strategies(op, args, {}, mesh)
    assert not asked
    # as before: once per combination
    monkeypatch.setattr(adapter, "_enumerated", lambda op, strategy: False)
    monkeypatch.setattr(adapter, "_FOLLOW_THE_FIRST_INPUT", frozenset())
    every = adapter.dtensor_strategies(op, args, {}, mesh)
    # (asked per combination, slice_scatter on 2 x 2 x 2 stopped at 4,096 of its 125 x 125 combinations, missing
    # strategies; from torch 2.14 these three are single-dim rules, expanded over the mesh: never asked so)
    assert bool(asked) == (op in _propagator().op_strategy_funcs)
    assert set(every) <= set(once) and len(set(once)) == len(once)


def test_local_shapes_are_dtensors_own_rank_by_rank():
    # asked per coordinate of the mesh dims that split each dim, not per rank: the same shapes as DTensor's own
    # slicing walked over every rank (uneven, nested, negative dims, empty dims, pending sums)
    import itertools
    import random

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rng = random.Random(0)
    meshes = {shape: planning(*shape) for shape in [(2,), (3,), (2, 2), (2, 3), (3, 2, 2), (2, 1, 2, 2)]}
    for _ in range(300):
        mesh_shape = rng.choice(sorted(meshes))
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 6, 7, 8, 13]) for _ in range(rng.randint(0, 3)))
        options = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))] + ([Shard(-1)] if shape else [])
        placements = tuple(rng.choice(options) for _ in mesh_shape)
        walked = [tuple(_compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements,
                                                               skip_offset=True)[0])
                  for coord in itertools.product(*[range(n) for n in mesh_shape])]
        assert adapter.local_shapes(shape, placements, meshes[mesh_shape]) == walked, (shape, placements)


def test_valid_placements_are_those_dtensor_can_lay_out():
    # decided on the numbers (once per shape and mesh shape): the same as DTensor's is_tensor_shardable asked
    # about each combination, sizes smaller than the mesh dims included
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._ops.utils import is_tensor_shardable

    for mesh_shape in [(2,), (3,), (2, 2), (2, 3), (3, 2, 2), (2, 1, 2, 2)]:
        mesh = planning(*mesh_shape)
        for shape in [(), (1,), (2,), (5,), (6, 1), (3, 4), (4, 2, 13), (2, 0, 3), (12, 7)]:
            meta = TensorMeta(shape=torch.Size(shape), stride=(), dtype=torch.float32)
            per_dim = [Replicate()] + [Shard(d) for d in range(len(shape))]
            want = [c for c in itertools.product(per_dim, repeat=len(mesh_shape))
                    if is_tensor_shardable(meta.shape, DTensorSpec(mesh, c, tensor_meta=meta))]
            assert adapter.valid_placements(shape, mesh) == want, (shape, mesh_shape)
            assert adapter.valid_placements(torch.Size(shape), mesh) == want
