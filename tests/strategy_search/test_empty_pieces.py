"""Candidates that leave a rank an empty piece are kept only where the op runs on one (strategy_search.empty_pieces):
probed once on real tensors of the empty rank's and of rank 0's local shapes."""

import pytest
import torch
from torch.distributed.tensor import Shard

from shardfn.strategy_search.candidates import node_candidates
from tests.strategy_search.truth import op_node, planning

aten = torch.ops.aten


def _splits(op, args, mesh_shape=(4,)):
    cands = node_candidates(op_node(op, args, {}), planning(*mesh_shape), set())
    return {c.inputs[0] for c in cands}


def test_an_op_that_refuses_an_empty_piece_gets_no_layout_that_leaves_one():
    # 5 rows over 4 ranks: 2, 2, 1, 0. MKL's FFT refuses the empty piece on one rank only
    from shardfn.strategy_search._dtensor_adapter import has_dtensor_rule

    if not has_dtensor_rule(aten._fft_r2c.default):
        pytest.skip("this torch (2.11) has no sharding rule for the FFT: it runs whole, never on an empty piece")
    uneven = _splits(aten._fft_r2c.default, (torch.randn(5, 8), [1], 0, True))
    assert (Shard(0),) not in uneven
    assert (Shard(0),) in _splits(aten._fft_r2c.default, (torch.randn(8, 8), [1], 0, True))  # even: kept


def test_an_op_that_runs_on_an_empty_piece_keeps_its_uneven_splits():
    assert (Shard(0),) in _splits(aten.mul.Tensor, (torch.randn(5, 8), torch.randn(5, 8)))
    # a view's global sizes fail on every rank's piece alike: the probe says nothing, DTensor's rule stands
    assert (Shard(0),) in _splits(aten.view.default, (torch.randn(5, 8), [5, 2, 4]))
