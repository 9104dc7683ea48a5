"""A fast slice of bench/opinfo_sweep.py: OpInfo samples sharded on 4 simulated ranks, never wrong numbers."""

import pytest

pytest.importorskip("expecttest")  # torch's OpInfo database imports it

# ops whose rules shardfn leans on or fixed: attention (masks, GQA), views, pads, pools and their backward
# rules, norms, matmuls, reductions, random fills
SLICE = [
    "nn.functional.scaled_dot_product_attention", "nn.functional.pad.circular", "nn.functional.pad.constant",
    "nn.functional.pad.reflect", "nn.functional.avg_pool2d", "nn.functional.adaptive_max_pool2d",
    "nn.functional.hardtanh", "nn.functional.logsigmoid", "nn.functional.layer_norm", "nn.functional.softmax",
    "nn.functional.embedding", "matmul", "bmm", "addmm", "view", "reshape", "transpose", "sum", "var_mean",
    "nn.functional.dropout", "tril", "linalg.inv", "cumsum",
]


def test_fast_slice_is_never_wrong():
    import warnings

    from bench.opinfo_sweep import run_inline
    from shardfn.strategy_search.candidates import ReplicatedFallbackWarning

    with warnings.catch_warnings():  # the sweep counts what runs whole, and may: here only wrong numbers fail
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        results = run_inline(SLICE, modes=("decide", "split4", "split2"))
    wrong = {(m, name): detail for m, per in results.items() for name, (r, detail, *_) in per.items()
             if r == "WRONG"}
    assert wrong == {}
    # 37 in torch 2.11, whose OpInfo database has no bmm.triton_optimized variant (3 cases)
    assert sum(r == "pass" for per in results.values() for r, *_ in per.values()) >= 37


# ops issue 35 found wrong once split as a user keeps tensors: scans over the last dim, quantiles (two gathers from
# one split tensor), circular padding and instance norm (writes inside composite ops), unflatten (zero sizes); in
# dp, linear_cross_entropy (the simulated world's writes into an ordinary tensor) and broadcast_tensors (slices of
# other lengths, which explain() could not key); and ops that ran whole before: reductions to a maximum, minimum or
# product (pending placements the plans now carry), stack of one tensor (DTensor's rule merged its options), a
# program of no ops returning its split input (the sweep counted the gradient's gather at the entry against it)
FORCED_SLICE = ["cumsum", "cumprod", "logcumsumexp", "cumulative_trapezoid", "quantile", "nanquantile",
                "nn.functional.pad.circular", "nn.functional.instance_norm", "unflatten", "gather",
                "nn.functional.linear_cross_entropy", "broadcast_tensors", "amax", "aminmax", "prod", "stack",
                "positive"]


def test_forced_splits_are_never_wrong_and_run_sharded():
    import warnings

    import torch
    from torch.torch_version import TorchVersion

    from bench.opinfo_sweep import FORCED, run_inline
    from shardfn.strategy_search.candidates import ReplicatedFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        results = run_inline(FORCED_SLICE, modes=FORCED)
    wrong = {(m, name): detail for m, per in results.items() for name, (r, detail, *_) in per.items()
             if r == "WRONG"}
    assert wrong == {}
    for name in ("nn.functional.linear_cross_entropy.chunked_none", "broadcast_tensors"):
        if name in results["dp"] or "linear_cross_entropy" not in name:  # torch 2.11 has no chunked variant
            assert results["dp"][name][0] == "pass", results["dp"][name]
    for mode, per in results.items():  # most pass, and most of those ran an op on split pieces (read from the plan)
        passed = [name for name, (r, *_) in per.items() if r == "pass"]
        assert len(passed) >= 8, (mode, per)
        assert sum(per[name][3] for name in passed) >= 5, (mode, per)
        for name in ("amax", "aminmax", "prod", "stack"):  # each cause fixed: they run split in every forced mode
            if (mode, name) == ("last", "prod") and TorchVersion(torch.__version__) < "2.12":
                # torch 2.11's prod backward flattens the split last dim: DTensor raises (clear, on every rank)
                assert per[name][0] != "WRONG", per[name]
                continue
            assert per[name][0] == "pass" and per[name][3], (mode, name, per[name])
    for mode in ("dim0", "last"):  # (dp hands inputs per rank: no gradient gathered at the entry)
        assert results[mode]["positive"][3], results[mode]["positive"]
