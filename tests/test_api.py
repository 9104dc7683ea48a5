"""shard()/explain() argument checks: every bad input is a clear error naming the argument and the fix,
raised before any communication; the program cache."""

import pytest
import torch

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.models import BasicBlock


def dense_relu(x, w, b):
    return torch.relu(x @ w + b)


def _args():
    return torch.randn(8, 4), torch.randn(4, 6), torch.randn(6)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(in_strategy=((4, 1), None)), ValueError, r"in_strategy has 2 entries but .* 3 positional inputs"),
        (dict(in_strategy=((4, 1, 1), None, None)), ValueError, r"in_strategy\[0\].*3 entries but the tensor has 2"),
        (dict(in_strategy=((3, 1), None, None)), ValueError, r"does not divide the world size 4"),
        (dict(in_strategy=(None, None, None), out_strategy=((4, 1), (4, 1))), ValueError,
         r"out_strategy has 2 entries but dense_relu returns 1"),
        (dict(in_strategy=(None, None, None), out_strategy=((4, 1, 1),)), ValueError, r"out_strategy\[0\]"),
    ],
)
def test_bad_call_arguments(kwargs, exc, match):
    with simulated_world(4):
        x, w, b = _args()
        if "(1, 4)" in str(kwargs.get("in_strategy")):
            x = torch.randn(8, 6)  # 6 is not divisible by 4
            w = torch.randn(6, 6)
        with pytest.raises(exc, match=match):
            sf.shard(dense_relu, **kwargs)(x, w, b)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(in_strategy=((4, 1), None, None), level=3), ValueError, r"level must be 0 .*, 1 .* or 2"),
        (dict(in_strategy=((4, 1), None, None), level="fast"), ValueError, r"level must be"),
        (dict(in_strategy=((4, 1), None, None), device="tpu"), ValueError, r"device must be 'cpu', 'cuda' or None"),
        (dict(in_strategy=((4, 1), None, None), dataset_strategy="sharded"), ValueError,
         r"dataset_strategy must be 'full_batch' .* or 'data_parallel'"),
        (dict(in_strategy="dp"), TypeError, r"in_strategy must be a tuple"),
        (dict(in_strategy=(("a", 1), None, None)), TypeError, r"in_strategy\[0\] must be a tuple of ints"),
        (dict(in_strategy=None), TypeError, r"in_strategy is required"),
        (dict(in_strategy=((4, 1), None, None), parameter_plan={"w": (4, 1)}), TypeError,
         r"parameter_plan applies to nn.Module"),
    ],
)
def test_bad_shard_arguments_fail_at_shard_time(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sf.shard(dense_relu, **kwargs)


def test_strategy_for_non_tensor_input():
    def scale(x, k):
        return x * k

    with simulated_world(4):
        with pytest.raises(ValueError, match=r"in_strategy\[1\] is \(4,\) but input 1 is a int"):
            sf.shard(scale, in_strategy=((4, 1), (4,)))(torch.randn(8, 2), 3)


def test_unknown_parameter_name_lists_closest():
    with simulated_world(4):
        with pytest.raises(ValueError, match=r"unknown parameter 'dense2.weigth'.*'dense2.weight'"):
            sf.shard(BasicBlock(), in_strategy=((4, 1),), parameter_plan={"dense2.weigth": (4, 1)})
        with pytest.raises(ValueError, match=r"does not divide the world size 4"):
            sf.shard(BasicBlock(), in_strategy=((4, 1),), parameter_plan={"self.dense2.weight": (3, 1)})


def test_self_prefix_accepted():
    with simulated_world(4):
        block = sf.shard(BasicBlock(), in_strategy=((4, 1),), parameter_plan={"self.dense1.weight": (4, 1)})
        assert block.dense1.weight.placements[-1] == torch.distributed.tensor.Shard(0)


def test_data_parallel_strategy_mismatch():
    with simulated_world(4):
        with pytest.raises(ValueError, match="data_parallel.*use None or \\(4, 1\\)"):
            sf.shard(dense_relu, in_strategy=((1, 4), None, None), dataset_strategy="data_parallel")(*_args())


def test_vmap_around_sharded_callable_is_rejected():
    with simulated_world(4):
        f = sf.shard(lambda x: x * 2, in_strategy=((4,),))
        with pytest.raises(TypeError, match="torch.func transform.*put the transform inside fn"):
            torch.func.vmap(f)(torch.randn(3, 8))


def test_nested_shard_is_rejected():
    with simulated_world(4):
        inner = sf.shard(lambda x: x + 1, in_strategy=((4, 1),))
        outer = sf.shard(lambda x: inner(x) * 2, in_strategy=((4, 1),))
        with pytest.raises(ValueError, match="nested shard calls are not supported"):
            outer(torch.randn(8, 4))


def test_data_dependent_control_flow_names_the_line():
    def branchy(x):
        if x.sum() > 0:  # the line the error must name
            return x
        return -x

    with simulated_world(4):
        with pytest.raises(sf.CaptureError, match=r"test_api.py\", line \d+, in branchy: if x.sum\(\) > 0"):
            sf.shard(branchy, in_strategy=((4, 1),))(torch.randn(8, 4))


def test_repeat_call_reuses_the_program(monkeypatch):
    import shardfn.call.planning as planning

    calls = []
    real = planning.capture
    monkeypatch.setattr(planning, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    with simulated_world(4):
        f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
        x, w, b = _args()
        f(x, w, b)
        f(x * 2, w, b)
        assert len(calls) == 1
        f(torch.randn(16, 4), w, b)  # a new shape: a new program
        assert len(calls) == 2


def _addmm_relu(x, w, b):
    return torch.relu(torch.addmm(b, x, w))  # addmm runs in bfloat16 under CPU autocast


def test_autocast_regions_get_their_own_program():
    with simulated_world(4):
        torch.manual_seed(0)
        f = sf.shard(_addmm_relu, in_strategy=((4, 1), None, None))
        x, w, b = _args()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside, ref_inside = f(x, w, b), _addmm_relu(x, w, b)
        outside = f(x, w, b)  # the same signature outside the region: float32 again
        assert inside.dtype == ref_inside.dtype == torch.bfloat16
        assert outside.dtype == torch.float32
        for r in range(4):
            torch.testing.assert_close(on_rank(outside, r), on_rank(_addmm_relu(x, w, b), r))
            torch.testing.assert_close(on_rank(inside, r), on_rank(ref_inside, r))


def test_explain_world_size_plans_without_processes():
    x = torch.empty(64, 32, device="meta")
    w = torch.empty(32, 32, device="meta")
    b = torch.empty(32, device="meta")
    plan = sf.explain(dense_relu, x, w, b, in_strategy=((8, 1), None, None), world_size=64)
    assert plan.mesh.world_size == 64
    assert "aten.mm.default" in plan.table()
    assert '"mesh"' in plan.to_json()
    assert not torch.distributed.is_initialized()


def test_explain_matches_the_plan_shard_runs():
    with simulated_world(4):
        f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
        x, w, b = _args()
        f(x, w, b)
        (compiled,) = sf.engine_of(f).programs.values()
        assert str(sf.explain(f, x, w, b)) == str(compiled.plan)



def test_explain_of_data_parallel_slices_of_other_lengths_is_the_plan_that_ran():
    # simulated ranks holding batch slices of other lengths (2, 2, 2, 0 rows; a 1-row input all on rank 0) give a
    # per-rank size: explain hashed it into the cache key (TypeError: unhashable SymInt). It plans, and finds the
    # program that ran, for the ranks' global batch, as the call does
    from shardfn.runtime import simulated_map

    def f(x, y):
        return torch.broadcast_tensors(x, y)[0] * y

    full_x, full_y = torch.randn(6, 3), torch.randn(1, 3)
    with simulated_world(4):
        x = simulated_map(full_x, lambda r, v: v[r][2 * r:2 * r + 2] if r < 3 else v[r][:0])
        y = simulated_map(full_y, lambda r, v: v[r] if r == 0 else v[r][:0])
        sharded = sf.shard(f, in_strategy=(None, None), dataset_strategy="data_parallel")
        before = sf.explain(sharded, x, y)
        out = sharded(x, y)
        (compiled,) = sf.engine_of(sharded).programs.values()
        assert str(sf.explain(sharded, x, y)) == str(compiled.plan)
        assert before.table() == compiled.plan.table()
        assert compiled.captured.output_nodes[0].meta["val"].shape == (6, 3)  # the global batch's program
        for r in range(4):
            torch.testing.assert_close(on_rank(out, r), f(full_x, full_y)[2 * r:2 * r + 2])

def test_explain_module_does_not_shard_it():
    block = BasicBlock()
    plan = sf.explain(block, torch.empty(8, 32, device="meta"), in_strategy=((4, 1),), world_size=4)
    assert not isinstance(block.dense1.weight, torch.distributed.tensor.DTensor)
    assert "dense1.weight" in plan.table() and "dense1\n  parameters" in str(plan)


def test_data_parallel_in_a_world_of_one():
    x = torch.randn(4, 3)
    with simulated_world(1, local_tensors=False):
        out = sf.shard(lambda t: t * 2, in_strategy=(None,), dataset_strategy="data_parallel")(x)
    torch.testing.assert_close(out, x * 2)


def test_the_programs_kept_per_callable_are_bounded_and_the_limit_is_said(monkeypatch, recwarn):
    monkeypatch.setenv("SHARDFN_CACHE_SIZE", "2")
    with simulated_world(2):  # (one program per size: without dynamic dims, which would serve them all)
        f = sf.shard(lambda x: x * 2, in_strategy=((2, 1),), dynamic=False)
        for rows in (2, 4, 6, 4):  # the 6-row program pushes out the 2-row one; 4 rows was used again
            f(torch.randn(rows, 3))
        assert [c.captured.inputs[0].shape for c in sf.engine_of(f).programs.values()] == [(6, 3), (4, 3)]
    said = [w for w in recwarn if "more than 2 signatures" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in recwarn]
    monkeypatch.setenv("SHARDFN_CACHE_SIZE", "none")
    with simulated_world(2), pytest.raises(ValueError, match="SHARDFN_CACHE_SIZE='none'"):
        sf.shard(lambda x: x * 2, in_strategy=((2, 1),))(torch.randn(2, 3))
