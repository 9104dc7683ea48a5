"""Tensors anywhere in a call's arguments are inputs of the sharded program, with in_strategy entries by position
or by name, shaped like the arguments that hold them."""

import pytest
import torch
import torch.nn as nn

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.parity import Call, check_module_parity, check_parity


class Block(nn.Module):
    """A layer called the way transformers calls its layers: tensors as keywords and inside a tuple."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None, pair=None, mask=None):
        y = self.lin(x)
        if scale is not None:
            y = y * scale
        if pair is not None:
            y = y * pair[0] + pair[1]
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y


def rand(*shape):
    return torch.randn(*shape, requires_grad=True)


def blend(x, pair, weights):
    return x * pair[0] + pair[1] * weights["w"] - weights["b"]


@pytest.mark.parametrize("name, call", [
    ("keyword", lambda: Call((rand(4, 8),), {"scale": rand(8)})),
    ("tuple positional", lambda: Call((rand(4, 8), None, (rand(8), rand(8))))),
    ("tuple keyword", lambda: Call((rand(4, 8),), {"pair": (rand(8), rand(8))})),
    ("bool mask keyword", lambda: Call((rand(4, 8),), {"mask": torch.rand(4, 8) > 0.5})),
])
def test_module_tensors_as_keywords_and_in_tuples(name, call):
    made = call()
    check_module_parity(Block, lambda: made, (None,) * len(made.args), world=4)


def test_strategies_by_argument_name_for_tensors_in_containers():
    make = lambda: Call((rand(8, 6),), {"pair": (rand(8, 6), rand(8, 6)), "weights": {"w": rand(6), "b": rand(6)}})  # noqa: E731
    plan = check_parity(blend, make, {"x": (4, 1), "pair": ((4, 1), None), "weights": {"w": (2,)}}, world=4)
    given = {i.name: [str(p) for p in i.planned] for i in plan.inputs}
    assert given["input 0"] == given["pair[0]"] == ["S(0)", "S(0)"]  # (4, 1) on the 2 x 2 mesh (2,) needs
    assert sorted(given["weights['w']"]) == ["R", "S(0)"]  # (2,) on 4 ranks: split in 2, 2 copies


def test_positional_tuple_strategy_covers_nested_tensors():
    make = lambda: (rand(8, 6), (rand(8, 6), rand(8, 6)), {"w": rand(6), "b": rand(6)})  # noqa: E731
    check_parity(blend, make, ((4, 1), ((4, 1), (1, 2)), None), world=4)


@pytest.mark.parametrize("in_strategy, exc, match", [
    ({"x": (4, 1), "pairs": None}, ValueError, r"in_strategy names 'pairs', which is not an argument of blend.*"
                                               r"did you mean 'pair'\?"),
    (((4, 1), ((4, 1),), None), ValueError, r"in_strategy\[1\] has 1 entries but input 1 holds 2 items"),
    (((4, 1), (4, 1), None), ValueError, r"in_strategy\[1\] is \(4, 1\) but input 1 is a tuple"),
    (((4, 1), None, {"v": (2,)}), ValueError, r"in_strategy\[2\] names \['v'\] but input 2 has only the keys"),
    (((4, 1), ((4, 1), None), {"w": ((2,), None)}), ValueError, r"in_strategy\[2\]\['w'\] is .* but input 2\['w'\] "
                                                                r"is one tensor"),
    ({"x": ("a",)}, TypeError, r"in_strategy\['x'\] must be a tuple of ints"),
    ({3: (4, 1)}, TypeError, r"in_strategy keys must be argument names"),
])
def test_bad_entries_name_the_argument_and_the_fix(in_strategy, exc, match):
    with simulated_world(4):
        with pytest.raises(exc, match=match):
            sf.shard(blend, in_strategy=in_strategy)(rand(8, 6), (rand(8, 6), rand(8, 6)), {"w": rand(6), "b": rand(6)})


def test_strategies_are_read_once_when_shard_is_called():
    """shard() reads each strategy into a Strategy (its TensorSpec) and tells containers from strategies; a call
    binds what it read. A check that needs neither the tensor nor the world raises at shard(), naming the entry."""
    from shardfn.layout import Axis, Strategy, TensorSpec

    sharded = sf.shard(blend, in_strategy=((4, 1), ((4, 1), None), {"w": (2,)}))
    x, pair, weights = sf.engine_of(sharded).config.in_strategy
    assert isinstance(x, Strategy) and x.spec == TensorSpec(((Axis(4, 1),), ())) and repr(x) == "(4, 1)"
    assert type(pair) is tuple and pair[1] is None and isinstance(pair[0], Strategy)
    assert isinstance(weights["w"], Strategy) and weights["w"].given == (2,)
    with pytest.raises(ValueError, match=r"in_strategy\[1\]\[0\] = \(0, 1\): split counts must be >= 1"):
        sf.shard(blend, in_strategy=((4, 1), ((0, 1), None), None))


def test_keyword_tensors_in_data_parallel_are_batch_slices():
    from torch.distributed._local_tensor import local_tensor_mode

    from tests.harness import on_rank

    world = 4
    with simulated_world(world):
        torch.manual_seed(0)
        block = Block()
        reference_lin = nn.Linear(8, 8)
        reference_lin.load_state_dict(block.lin.state_dict())
        sharded = sf.shard(block, in_strategy=(None,), dataset_strategy="data_parallel")
        whole_x, whole_mask = torch.randn(4 * world, 8), torch.rand(4 * world, 8) > 0.5
        piece = lambda t: local_tensor_mode().rank_map(lambda r: on_rank(t, r)[4 * r: 4 * r + 4].clone())  # noqa
        y = sharded(piece(whole_x), mask=piece(whole_mask))
        ref = reference_lin(whole_x).masked_fill(whole_mask, 0.0)
        for r in range(world):
            torch.testing.assert_close(on_rank(y, r), on_rank(ref, r)[4 * r: 4 * r + 4])


class _Cache:
    """A KV cache as transformers' are: a plain object holding its tensors, and a 0-dim counter (StaticCache's)."""

    def __init__(self, keys, seen):
        self.keys, self.seen = keys, seen


def _append(x, cache):
    cache.keys = torch.cat([cache.keys, x[:, None]], dim=1)  # the cache's update, written back to the caller's
    cache.seen = cache.seen + 1
    return cache.keys.sum(1) * cache.seen


@pytest.mark.parametrize("given", [{}, {"cache": sf.Layout((2, 2), ("dp", "tp"))("dp", "None", "None")}],
                         ids=["the batch's axes", "a layout for the object"])
def test_data_parallel_cache_tensors_are_this_ranks_rows_of_the_batch(given):
    # input_ids split over "dp" only, the cache's tensors (no strategy of their own) over every rank: a cat of 2
    # rows with 1 (generate() on a data x tensor parallel model)
    from shardfn.runtime import simulated_map
    from tests.harness import on_rank

    mesh = sf.Layout((2, 2), ("dp", "tp"))
    with simulated_world(4):
        x, keys = torch.randn(4, 8), torch.randn(4, 3, 8)
        mine = lambda t: simulated_map(t, lambda r, v: v[r][2 * (r // 2): 2 * (r // 2) + 2].clone())  # noqa: E731
        f = sf.shard(_append, in_strategy={"x": mesh("dp", "None"), **given}, dataset_strategy="data_parallel")
        cache, want_cache = _Cache(mine(keys), torch.tensor(3.0)), _Cache(keys, torch.tensor(3.0))
        for _ in range(2):
            y = f(mine(x), cache)
            want = _append(x, want_cache)
            for r in range(4):
                torch.testing.assert_close(on_rank(y, r), on_rank(mine(want), r))
                torch.testing.assert_close(on_rank(cache.keys, r), on_rank(mine(want_cache.keys), r))
                assert float(on_rank(cache.seen, r)) == float(want_cache.seen)
        held = {i.name: [str(p) for p in i.held] for i in sf.explain(f, mine(x), cache).inputs}
        assert held["input 0"] == held["input 1.keys"] == ["S(0)", "R"] and held["input 1.seen"] == ["R", "R"]


def test_a_layout_for_an_object_must_fit_its_tensors():
    with simulated_world(4):
        f = sf.shard(_append, in_strategy={"cache": (4, 1)}, dataset_strategy="data_parallel")
        with pytest.raises(ValueError, match=r"in_strategy\['cache'\] = \(4, 1\) lays out 2-dim tensors but argument "
                                             r"'cache' is a _Cache whose tensors have \[3\] dims"):
            f(torch.randn(1, 8), cache=_Cache(torch.randn(1, 3, 8), torch.tensor(3.0)))
