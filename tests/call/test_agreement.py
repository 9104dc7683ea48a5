"""Ranks that disagree on a call get the same clear error on every rank, before any of the call's collectives:
never a hang, never a wrong number (4 real gloo ranks; every case bounded by the pool's time limit)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardfn as sf


@pytest.fixture
def ranks(gloo4):
    """The session's four gloo ranks (tests/conftest.py), under a shorter time limit: a regression that hangs
    fails here instead of holding CI (a timeout ends the ranks; the next test gets fresh ones)."""
    limit, gloo4.timeout_s = gloo4.timeout_s, 120
    yield gloo4
    gloo4.timeout_s = limit


def dense_relu(x, w, b):
    return torch.relu(x @ w + b)


def _odd(value, other, odd_rank=3):
    return value if dist.get_rank() == odd_rank else other


def _outcome(call) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        outcome = ("ok", "")
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        outcome = (type(e).__name__, str(e))
    t = torch.ones(1)
    dist.all_reduce(t)  # nobody is stuck in a collective: the world is still usable
    return (*outcome, time.monotonic() - start) if int(t.item()) == 4 else ("broken world", "", 0.0)


def _args(rank_dtype=torch.float32, rows=8, grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=g, dtype=rank_dtype)
    w = torch.randn(16, 12, generator=g).requires_grad_(grad)
    return x, w, torch.randn(12, generator=g).requires_grad_()


def _different_strategy():
    sf.shard(dense_relu, in_strategy=(_odd((1, 4), (4, 1)), None, None))(*_args())


def _different_requires_grad():
    y = sf.shard(dense_relu, in_strategy=((4, 1), None, None))(*_args(grad=dist.get_rank() != 3))
    y.sum().backward()


def _different_dtype():
    sf.shard(lambda t: t * 2, in_strategy=((4, 1),))(_args(rank_dtype=_odd(torch.float64, torch.float32))[0])


def _data_parallel_slice_of_another_width():
    # slices of other lengths are one uneven batch (shardfn.call.uneven_batch); of other widths, another call
    torch.manual_seed(0)  # the same model on every rank
    m = sf.shard(nn.Linear(16, 12), in_strategy=(None,), dataset_strategy="data_parallel")
    m(torch.randn(2, 16))
    m(torch.randn(_odd(1, 2), _odd(12, 16)))


def _shapes_change_on_one_rank_later():
    f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
    f(*_args())
    f(*_args(rows=_odd(16, 8)))


def _sizes_differ_on_one_rank_with_a_program_for_every_size():
    f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
    f(*_args())
    f(*_args(rows=16))  # the rows traced as a symbol: one program for every row count
    f(*_args(rows=_odd(24, 20)))  # served by that program on every rank, with other sizes on rank 3


def _other_call_order():
    f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
    g = sf.shard(lambda x, w, b: x @ w - b, in_strategy=((4, 1), None, None))
    f(*_args())
    g(*_args())  # both cached: then rank 3 calls them the other way round
    first, second = (g, f) if dist.get_rank() == 3 else (f, g)
    first(*_args())
    second(*_args())


def _structure_differs():
    scale = _odd(3.0, 2.0)
    sf.shard(lambda x: x * scale, in_strategy=((4, 1),))(_args()[0])


def _values_differ():
    x = _args()[0] + _odd(1.0, 0.0)  # a full batch drawn differently on one rank (another seed)
    sf.shard(lambda t: t * 2, in_strategy=((4, 1),))(x)


def _values_differ_later():
    os.environ["SHARDFN_CHECK"] = "values"
    try:
        f = sf.shard(lambda t: t * 2, in_strategy=((4, 1),))
        f(_args()[0])
        f(_args()[0] + _odd(1.0, 0.0))
    finally:
        del os.environ["SHARDFN_CHECK"]


def _model_initialised_apart():
    torch.manual_seed(_odd(1, 0))  # rank 3 builds its model from other random numbers
    model = sf.shard(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), in_strategy=((4, 1),),
                     parameter_plan={"0.weight": (4, 1)})  # a split parameter holds another piece on every rank
    model(_args()[0])


def _a_skipped_call():
    f = sf.shard(dense_relu, in_strategy=((4, 1), None, None))
    f(*_args())
    if dist.get_rank() != 3:  # rank 3 skips one call (it caught an error and moved on)
        f(*_args())
    sf.shard(lambda t: t + 1, in_strategy=((4, 1),))(_args()[0])


CASES = {
    # name: (body, what the message must name)
    "in_strategy differs": (_different_strategy, ["in_strategy", "rank 3: ((1, 4), None, None)",
                                                  "ranks 0,1,2: ((4, 1), None, None)"]),
    "requires_grad differs": (_different_requires_grad, ["tensor inputs", "input 1 (16, 12) float32;"]),
    "dtype differs": (_different_dtype, ["rank 3: input 0 (8, 16) float64", "ranks 0,1,2: input 0 (8, 16) float32"]),
    "data_parallel slice of another width": (_data_parallel_slice_of_another_width,
                                              ["rank 3: input 0 (1, 12)", "only the batch slices' lengths"]),
    "shapes change on one rank later": (_shapes_change_on_one_rank_later, ["rank 3: input 0 (16, 16)"]),
    "sizes differ on one rank, one program for every size": (
        _sizes_differ_on_one_rank_with_a_program_for_every_size, ["rank 3: input 0 (24, 16)"]),
    "another call order": (_other_call_order, ["callable", "<lambda>", "dense_relu"]),
    "traced structure differs": (_structure_differs, ["traced graph"]),
    "input values differ": (_values_differ, ["values of input 0: ranks 0,1,2: digest", "torch.manual_seed"]),
    "input values differ later (SHARDFN_CHECK=values)": (_values_differ_later, ["values of input 0: ranks 0,1,2"]),
    "a model initialised apart": (_model_initialised_apart, ["values of 0.bias: ranks 0,1,2", "values of 2.weight",
                                                             "values of 2.bias", "before building the model"]),
    "a skipped call": (_a_skipped_call, ["callable", "dense_relu", "<lambda>"]),
}


def _run_case(name):
    return _outcome(CASES[name][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_ranks_that_disagree_all_get_the_same_error(ranks, name):
    outcomes = ranks.run(_run_case, name)
    kinds = {kind for kind, _, _ in outcomes}
    assert kinds == {"ValueError"}, outcomes
    messages = {m for _, m, _ in outcomes}
    assert len(messages) == 1, messages  # the same words on every rank
    (message,) = messages
    assert "not making the same call" in message
    for words in CASES[name][1]:
        assert words in message, (words, message)
    assert max(t for _, _, t in outcomes) < 30


def _caught_error_then_go_on():
    # rank 3 alone gives a strategy that cannot divide the world; every rank catches the error and carries on
    try:
        sf.shard(dense_relu, in_strategy=(_odd((3, 1), (4, 1)), None, None))(*_args())
    except ValueError as e:
        first = str(e)
    y = sf.shard(dense_relu, in_strategy=((4, 1), None, None))(*_args())
    return first, float(y.sum())


def test_an_error_on_one_rank_stops_every_rank_and_the_world_goes_on(ranks):
    results = ranks.run(_caught_error_then_go_on)
    assert len({first for first, _ in results}) == 1
    first = results[0][0]
    assert "rank 3: ValueError: in_strategy[0] (for input 0) = (3, 1) splits over 3 devices" in first, first
    assert len({total for _, total in results}) == 1  # the next call runs on every rank, the same


@pytest.mark.parametrize("name", ["data_parallel slice of another width", "in_strategy differs"])
def test_under_mpirun_every_rank_reports_the_error(name):
    from tests.launch import run_mpirun, succeeds

    out = succeeds(run_mpirun, "tests/scripts/disagree.py", 4, name, timeout=120)
    for r in range(4):
        assert f"rank {r}: ValueError after" in out and "not making the same call" in out, out
