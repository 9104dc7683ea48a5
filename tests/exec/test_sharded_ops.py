"""Ops that really run split (issue 35): every input split on the op's dim, the output asked for in the same split,
outputs and gradients equal single-device eager, on a simulated world and on real gloo ranks. Each case names the
cause it guards: in-place writes inside composite ops (capture functionalizes them again), DTensor's scan rule
with a negative dim, two masked sums from one split table pending at once, views of zero sizes; and reductions to a
maximum, minimum or product over the split dim, left pending (Partial("max"/"min"/"product")) where they ran
whole."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.parity import _loss


def rand(*shape, grad=True):
    return torch.randn(*shape).requires_grad_(grad)


def _cumsum_last(x):
    return torch.cumsum(x, -1)


def _cumprod_last(x):
    return torch.cumprod(x, -1)


def _logcumsumexp_last(x):
    return torch.logcumsumexp(x, -1)


def _pad_circular(x):
    return F.pad(x, (0, 2, 0, 1), mode="circular")


def _pad_circular_wide(x):
    return F.pad(x, (0, 4, 0, 1), mode="circular")


def _rfft_rows(x):
    return torch.fft.rfft(x, dim=1).abs()


def _two_gathers(x, i, j):
    return torch.stack([torch.gather(x, 0, i), torch.gather(x, 0, j)])


def _median(x):
    return torch.quantile(x, 0.5)


def _nanmedian(x):
    return torch.nanquantile(x, 0.5)


def _unflatten_zero(x):
    return torch.unflatten(x, 1, (2, 0, 0, 0))


def _amax_all(x):
    return torch.amax(x, (0, 1))


def _range_all(x):
    low, high = torch.aminmax(x)
    return high - low


def _exp_of_max(x):
    return torch.amax(x, (0, 1)).exp()  # the pending maximum reduced before exp reads it


def _prod_all(x):
    return x.prod()


def _cdist(x1, x2):
    return torch.cdist(x1, x2, p=1.5)


def _cdist_euclid(x1, x2):
    return torch.cdist(x1, x2)


def _transposed_doubled(x):
    return x.t() * 2


def _bce(x, y):
    return F.binary_cross_entropy(torch.sigmoid(x), y)


def _smooth_l1(x, y):
    return F.smooth_l1_loss(x, y, beta=0.5)


def _multi_margin(x, y):
    return F.multi_margin_loss(x, y)


# name: (fn, make_args, in_strategy, out_strategy, an op that must run split: (op name, its input's dim[, which
# input, else the first]) or None)
CASES = {
    # a composite op's copy_ into slices of its fresh result (written into a temporary before)
    "pad_circular_batch": (_pad_circular, lambda: (rand(8, 4, 5, 6),), ((4, 1, 1, 1),), ((4, 1, 1, 1),), None),
    "pad_circular_last": (_pad_circular_wide, lambda: (rand(4, 4, 5, 8),), ((1, 1, 1, 4),), ((1, 1, 1, 4),), None),
    # a scan over the split last dim named -1 (DTensor's rule ran it on the pieces); split elsewhere it runs split
    "cumsum_last_split": (_cumsum_last, lambda: (rand(4, 8),), ((1, 4),), ((1, 4),), None),
    "cumsum_last_rows_split": (_cumsum_last, lambda: (rand(8, 6),), ((4, 1),), ((4, 1),), ("cumsum", 0)),
    "cumprod_last_split": (_cumprod_last, lambda: (rand(4, 8),), ((1, 4),), ((1, 4),), None),
    "logcumsumexp_last_split": (_logcumsumexp_last, lambda: (rand(4, 8),), ((1, 4),), ((1, 4),), None),
    "cumulative_trapezoid": (torch.cumulative_trapezoid, lambda: (rand(8),), ((4,),), None, None),
    # two masked sums from one split tensor (DTensor shares one mask buffer between them)
    "two_gathers": (_two_gathers, lambda: (rand(8), torch.tensor([1]), torch.tensor([6])), ((4,), None, None), None,
                    None),
    "quantile": (_median, lambda: (rand(8),), ((4,),), None, None),
    "nanquantile": (_nanmedian, lambda: (rand(8),), ((4,),), None, None),
    # 5 rows over 4 ranks leave one none: MKL's FFT refuses an empty piece (on that rank alone), so the plan gives
    # the FFT no empty piece
    "rfft_uneven": (_rfft_rows, lambda: (rand(5, 8),), ((4, 1),), None, None),
    # DTensor's view rule never returns on zero sizes
    "unflatten_zero": (_unflatten_zero, lambda: (rand(4, 0),), ((4, 1),), ((4, 1, 1, 1, 1),), None),
    # a maximum or minimum over the split dim: each rank's piece reduced, the pending maxima (minima) reduced once
    # (gathered first before); the gradient reaches the rows that hold the maximum
    "amax_all": (_amax_all, lambda: (rand(8, 6),), ((4, 1),), None, ("amax", 0)),
    "aminmax_range": (_range_all, lambda: (rand(8, 6),), ((4, 1),), None, ("aminmax", 0)),
    "exp_of_max": (_exp_of_max, lambda: (rand(8, 6),), ((4, 1),), None, ("amax", 0)),
    # a product over the split dim, left pending (Partial("product"))
    "prod_all": (_prod_all, lambda: (rand(8, 3),), ((4, 1),), None, ("prod", 0)),
    # pairwise distances (own rule; none before: gathered): x1's rows, x2's rows (the output's columns) or the
    # batch split, the gradients of the whole operand pending sums
    "cdist_rows": (_cdist, lambda: (rand(8, 5), rand(6, 5)), ((4, 1), None), ((4, 1),), ("_cdist_forward", 0)),
    "cdist_columns": (_cdist, lambda: (rand(6, 5), rand(7, 5)), (None, (4, 1)), ((1, 4),),
                      ("_cdist_forward", 0, 1)),
    # losses of their own kernels, mean-reduced over a split batch (gathered before: the reduction is the kernel's):
    # decomposed as captured into the elementwise (per-sample) loss and a sum, pending over the ranks
    # (sizes where a gather of the batch costs more than the all-reduce of a number on the CPU profile)
    "bce_batch": (_bce, lambda: (rand(64, 4096), torch.rand(64, 4096)), ((4, 1), (4, 1)), None, ("sum", 0)),
    "smooth_l1_batch": (_smooth_l1, lambda: (rand(64, 4096), rand(64, 4096, grad=False)), ((4, 1), (4, 1)), None,
                        ("sum", 0)),
    "multi_margin_batch": (_multi_margin, lambda: (rand(64, 4096), torch.randint(0, 4096, (64,))), ((4, 1), (4,)),
                           None, ("sum", 0)),
    # a transposed piece made contiguous where one rank's piece is empty (6 rows over 4): its strides, read off the
    # piece, differed on that rank (a per-rank size in the simulated world; the whole's strides on real ranks)
    "transpose_uneven": (_transposed_doubled, lambda: (rand(6, 8),), ((4, 1),), ((4, 1),), None),
    "cdist_batch": (_cdist_euclid, lambda: (rand(4, 6, 3), rand(4, 5, 3)), ((4, 1, 1), (4, 1, 1)), ((4, 1, 1),),
                    ("_cdist_forward", 0)),
}


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_split(name, ranks: int = 4):
    """Case ``name`` sharded and eager: outputs (gathered where returned split) and input gradients, rank by rank;
    the op the case names ran on split pieces in the plan. Runs in a simulated world or on real ranks (ranks=1)."""
    fn, make_args, in_strategy, out_strategy, split_op = CASES[name]
    torch.manual_seed(0)
    args = make_args()
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    sharded = sf.shard(fn, in_strategy, out_strategy=out_strategy)
    out = sharded(*args)
    ref = fn(*ref_args)
    if out_strategy is not None:  # returned split, as asked
        assert isinstance(out, DTensor) and isinstance(out.placements[0], Shard)
    whole = _whole(out)
    for r in range(ranks):
        torch.testing.assert_close(on_rank(whole, r), on_rank(ref, r), rtol=1e-5, atol=1e-5)
    if ref.requires_grad and ref.numel():
        _loss(whole).backward()
        _loss(ref).backward()
        for a, e in zip(args, ref_args):
            if a.requires_grad:
                assert a.grad is not None, name
                for r in range(ranks):
                    torch.testing.assert_close(on_rank(a.grad, r), on_rank(e.grad, r), rtol=1e-5, atol=1e-5)
    if split_op is not None:
        op, dim, which = (*split_op, 0)[:3]
        plan = sf.explain(sharded, *args)
        assert any(n.op.startswith(f"aten.{op}") and n.inputs[which] == (Shard(dim),) for n in plan.nodes.values()), \
            plan.table()


def _this_torch(name: str):
    """How this torch release runs case ``name`` where it cannot run it split: a clear error or the replicated
    fallback, said (never a wrong number); a no-op context elsewhere."""
    import contextlib

    from torch.torch_version import TorchVersion

    from shardfn.capture import CaptureError
    from shardfn.strategy_search.candidates import ReplicatedFallbackWarning

    if name in ("quantile", "nanquantile") and TorchVersion(torch.__version__) < "2.12":
        # torch 2.11's quantile reads tensor values (aten.equal) as it is captured
        return pytest.raises(CaptureError, match=r"depends on tensor values \(aten\.equal")
    if name == "rfft_uneven" and TorchVersion(torch.__version__) < "2.12":
        return pytest.warns(ReplicatedFallbackWarning, match="_fft_r2c")  # (torch 2.11: no rule, run whole)
    if name == "multi_margin_batch" and TorchVersion(torch.__version__) < "2.12":
        return pytest.warns(ReplicatedFallbackWarning, match="aten.ne.Tensor")  # (torch 2.11: no rule for ne)
    if name == "aminmax_range" and TorchVersion(torch.__version__) < "2.12":
        # torch 2.11 has no derivative for aminmax: eager's backward raises the same
        return pytest.raises(RuntimeError, match="derivative for aten::aminmax is not implemented")
    return contextlib.nullcontext()


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_parity(name):
    with simulated_world(4), _this_torch(name):
        check_split(name)


def _instance_norm_running_stats(module: bool):
    """InstanceNorm's running statistics updated as in eager (they stayed as they were: the update's copy_ into an
    alias of the buffer ran on split pieces, into a temporary)."""
    torch.manual_seed(0)
    x = torch.randn(8, 8, 6)
    if module:
        ref = torch.nn.InstanceNorm1d(8, track_running_stats=True, momentum=0.5)
        sharded = sf.shard(torch.nn.InstanceNorm1d(8, track_running_stats=True, momentum=0.5), ((4, 1, 1),))
        calls = [(sharded, ref)]
    else:
        stats = [torch.randn(8), torch.rand(8) + 1]
        ref_stats = [s.clone() for s in stats]

        def f(x, rm, rv):
            return F.instance_norm(x, running_mean=rm, running_var=rv, use_input_stats=True, momentum=0.5)

        sf_call = sf.shard(f, ((4, 1, 1), (4,), (4,)))
        calls = [(lambda x: sf_call(x, *stats), lambda x: f(x, *ref_stats))]
    for got_fn, ref_fn in calls:
        for _ in range(2):
            got, want = got_fn(x), ref_fn(x)
            torch.testing.assert_close(_whole(got), want, rtol=1e-5, atol=1e-5)
    if module:
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(_whole(getattr(sharded, name)), getattr(ref, name))
    else:
        for s, e in zip(stats, ref_stats):
            torch.testing.assert_close(s, e)


@pytest.mark.parametrize("module", [False, True], ids=["function", "module"])
def test_instance_norm_updates_running_stats(module):
    with simulated_world(4):
        _instance_norm_running_stats(module)


# one case per cause on real ranks (each traces its program there: a few seconds apiece)
REAL_RANKS = ("pad_circular_batch", "cumsum_last_split", "two_gathers", "quantile", "unflatten_zero", "rfft_uneven",
              "aminmax_range", "prod_all", "cdist_columns", "bce_batch", "transpose_uneven")


def _on_real_ranks():
    import traceback

    failures = {}
    def case(n):
        with _this_torch(n):
            check_split(n, ranks=1)

    for name, run in [*((n, lambda n=n: case(n)) for n in REAL_RANKS),
                      ("instance_norm_function", lambda: _instance_norm_running_stats(False)),
                      ("instance_norm_module", lambda: _instance_norm_running_stats(True)),
                      ("data_parallel_scan", lambda: _data_parallel_over_the_batch(_batch_scan, 6, real=True)),
                      ("data_parallel_flip", lambda: _data_parallel_over_the_batch(_batch_transposed, 6, real=True))]:
        try:
            run()
        except Exception:  # noqa: BLE001 - reported per case
            failures[name] = traceback.format_exc(limit=-3)
    return failures


def test_split_parity_on_real_ranks(gloo4):
    # real ranks trace the program (a data-dependent read there is an error) and run its graphs
    results = gloo4.run(_on_real_ranks)
    assert results == [{}] * 4, next(r for r in results if r)


def test_pad_circular_at_changing_sizes():
    # a program for every size captures with torch's Python functionalization, which leaves the composite op's
    # writes as out-of-place aten.copy (no derivative, no DTensor rule): captured as the value it is
    with simulated_world(4):
        sharded = sf.shard(_pad_circular, ((4, 1, 1, 1),))
        for n in (4, 8, 12):
            x = rand(n, 3, 5, 6)
            ref_x = x.detach().clone().requires_grad_()
            out, ref = sharded(x), _pad_circular(ref_x)
            torch.testing.assert_close(out, ref)
            _loss(out).backward()
            _loss(ref).backward()
            torch.testing.assert_close(x.grad, ref_x.grad)


def test_pending_sum_read_as_pending_maximum():
    # an op whose rule reads a pending maximum, given a pending sum: the sum is reduced first (DTensor's
    # redistribute refuses one pending kind to another), then the op's dispatch takes it from there
    from shardfn.exec.pieces import placed

    with simulated_world(4):
        mesh = sf.init()
        x = torch.arange(8.0)
        pending_sum = distribute_tensor(x, mesh, [Shard(0)]).sum()
        assert pending_sum.placements == (Partial("sum"),)
        got = placed(pending_sum, (Partial("max"),), mesh)
        assert got.placements == (Replicate(),)
        torch.testing.assert_close(got.full_tensor(), x.sum())


def _batch_scan(x):
    return torch.cumsum(x, 0) * 2


def _batch_transposed(x):
    return x.transpose(0, 1).flip(1).transpose(0, 1)


def _data_parallel_over_the_batch(fn, rows: int, real: bool = False):
    """An op over the batch dim of data-parallel slices (a scan of the batch, a flip of it), 6 rows over 4 ranks
    (one holds none): each rank's slice of the outputs and gradients as eager's. ``real``: on real ranks (each
    checks its own slice), else in a simulated world."""
    import torch.distributed as dist

    from shardfn.runtime import simulated_map

    torch.manual_seed(0)
    full = torch.randn(rows, 8)
    ref = full.clone().requires_grad_()
    weights = torch.linspace(-1, 1, rows * 8).reshape(rows, 8)  # the loss's, so each element's gradient differs
    want = fn(ref)
    (want * weights).sum().backward()
    cut = [len(p) for p in full.chunk(4)] + [0] * (4 - len(full.chunk(4)))
    starts = [sum(cut[:r]) for r in range(4)]

    ranks = [dist.get_rank()] if real else range(4)

    def mine(t):  # each rank's slice of the batch
        if real:
            return t[starts[ranks[0]]:starts[ranks[0]] + cut[ranks[0]]]
        return simulated_map(t, lambda r, v: v[r][starts[r]:starts[r] + cut[r]])

    x = mine(full).requires_grad_()
    sharded = sf.shard(fn, (None,), dataset_strategy="data_parallel")
    out = sharded(x)
    (out * mine(weights)).sum().backward()
    for r in ranks:
        rows_r = slice(starts[r], starts[r] + cut[r])
        torch.testing.assert_close(on_rank(out, r), on_rank(want, r)[rows_r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(on_rank(x.grad, r), on_rank(ref.grad, r)[rows_r], rtol=1e-5, atol=1e-5)
    return sharded


@pytest.mark.parametrize("fn", [_batch_scan, _batch_transposed], ids=["scan", "flip"])
@pytest.mark.parametrize("rows", [8, 6])
def test_data_parallel_op_over_the_batch_trains_like_eager(fn, rows):
    with simulated_world(4):
        _data_parallel_over_the_batch(fn, rows)


@pytest.mark.parametrize("fn", [_batch_scan, _batch_transposed], ids=["scan", "flip"])
def test_data_parallel_op_over_the_batch_moves_its_split_where_an_all_to_all_is_one(fn):
    # A split moved between dims is one all_to_all (NCCL's through DTensor, gloo's through exec.split_moves): each
    # rank holds as much as before, so the plan moves the batch's split and back instead of gathering the batch
    x = torch.empty(256, 1024, device="meta", requires_grad=True)  # each rank's slice
    for device in ("cuda", "cpu"):
        kinds = {(c.phase, c.kind) for c in sf.explain(fn, x, world_size=4, dataset_strategy="data_parallel",
                                                       device=device).collectives}
        assert ("forward", "all_to_all") in kinds and ("forward", "all_gather") not in kinds, (device, kinds)


def _split_moves_traced(rows):
    """On real ranks: a data-parallel transpose and a scan of the batch, ``rows`` over 4 ranks, each as eager;
    the collectives of their traced per-rank graphs."""
    found = []
    for fn in (_batch_scan, _batch_transposed):
        (compiled,) = sf.engine_of(_data_parallel_over_the_batch(fn, rows, real=True)).programs.values()
        found.append({str(n.target).split(".")[1] for g in compiled.program.graphs.values() for n in g.graph.nodes
                      if getattr(n.target, "namespace", None) == "_c10d_functional"})
    return found


def test_split_moves_are_all_to_alls_on_gloo(gloo4):
    # DTensor on gloo runs Shard(i) -> Shard(j) as an all_gather of the whole value and a chunk; exec runs the
    # all_to_all the plan priced, forward and backward, even and uneven (6 rows: one rank holds none)
    for rows in (8, 6):
        for kinds in gloo4.run(_split_moves_traced, rows)[0]:
            assert "all_to_all_single" in kinds and "all_gather_into_tensor" not in kinds, (rows, kinds)
