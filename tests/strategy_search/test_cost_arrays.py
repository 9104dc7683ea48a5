import itertools
import random

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial

from shardfn.strategy_search import cost_arrays as ca
from shardfn.strategy_search import cost_model as cm
from shardfn.strategy_search._dtensor_adapter import strided_shard
from shardfn.strategy_search.pricing import _BucketShare


def _layouts(ndim, mesh_ndim, masked=False):
    # embedding's masked pending sum: a kind of its own, never equal to a plain one
    per_dim = [Replicate(), Partial()] + [Shard(d) for d in range(ndim)] + \
        ([_MaskPartial(offset_shape=(16, 1), offset_dim=0)] if masked else [])
    return list(itertools.product(per_dim, repeat=mesh_ndim))


@pytest.mark.parametrize("shape, mesh_shape, profile", [
    ((6, 5), (2, 3), cm.CPU), ((64, 4096, 8192), (8, 8, 8), cm.H100), ((7, 1, 3), (2, 1, 4), cm.H100),
    ((), (4,), cm.CPU), ((3, 16), (4, 2), cm.H100), ((64, 4096, 16384), (8, 8, 2, 8), cm.H100)])
def test_every_pair_priced_as_the_scalar_walk_prices_it(shape, mesh_shape, profile):
    # bit for bit: pricing's edge matrices must not move a plan
    links = cm.mesh_links(mesh_shape, profile)
    layouts = _layouts(len(shape), len(mesh_shape), masked=len(mesh_shape) == 2)
    rng = random.Random(0)
    srcs = layouts if len(layouts) ** 2 <= 20000 else rng.sample(layouts, 140)
    dsts = layouts if len(layouts) ** 2 <= 20000 else rng.sample(layouts, 140)
    share = _BucketShare(2**20, 5)
    keep = (0,)
    partials = {}
    got, gathers = ca.pair_seconds(shape, 4, [ca.codes(s, partials) for s in srcs],
                                   [ca.codes(t, partials) for t in dsts], mesh_shape, profile, links, share.many, keep)
    for i, s in enumerate(srcs):
        for j, t in enumerate(dsts):
            ops = cm.redistribute_collectives(shape, 4, s, t, mesh_shape)
            want = sum(cm.collective_seconds(op, mesh_shape, profile, share(op), links) for op in ops)
            assert got[i, j] == want, (s, t, ops)
            assert gathers[i, j] == any(o.kind == "all_gather" and o.mesh_dim in keep for o in ops)


def test_an_edge_is_the_forward_and_its_backward_dual():
    shape, mesh_shape, profile = (8, 6, 4), (2, 2, 2), cm.H100
    links = cm.mesh_links(mesh_shape, profile)
    layouts = _layouts(3, 3, masked=True)
    src_keys = [(s, acc) for s in layouts[::3] for acc in (False, True)]
    pend = [tuple(p) for p in itertools.product((False, True), repeat=3)]
    dst_keys = [(t, pd) for t in layouts[::4] for pd in pend[::3]]
    share = _BucketShare(2**10, 3)
    got = ca.edge_seconds(shape, 4, 2, src_keys, dst_keys, mesh_shape, profile, links, True, share.many)
    for i, (s, acc) in enumerate(src_keys):
        for j, (t, pd) in enumerate(dst_keys):
            fwd = cm.redistribute_collectives(shape, 4, s, t, mesh_shape)
            bwd = cm.backward_collectives(shape, 2, s, t, pd, mesh_shape, acc)
            want = sum(cm.collective_seconds(op, mesh_shape, profile, links=links) for op in fwd) + sum(
                cm.collective_seconds(op, mesh_shape, profile, share(op), links) for op in bwd)
            assert got[i, j] == want


def test_layouts_without_a_code_are_left_to_the_scalar_walk():
    strided = strided_shard(0, 2)
    assert ca.codes((Shard(1), strided), {}) is None
    assert ca.edge_seconds((4,), 4, 4, [((strided,), False)], [((Replicate(),), (False,))], (2,), cm.CPU,
                           ("intra",), False) is None


def test_a_memo_gives_each_pair_as_computed_alone():
    # pricing keeps one memo for a whole plan: calls that overlap, differ in shape, share or kept dims, or meet a
    # code first in a later call (the tables grow) must each get the figures a call without it gets
    mesh_shape, profile = (2, 2, 2), cm.H100
    links = cm.mesh_links(mesh_shape, profile)
    rng = random.Random(1)
    memo = ca.PairMemo()
    share = _BucketShare(2**12, 4)
    for call in range(12):
        shape = ((8, 6, 4), (16, 6))[call % 2]
        layouts = _layouts(len(shape), 3, masked=True)
        partials = {}
        srcs = [ca.codes(s, partials) for s in rng.sample(layouts, min(20 + 15 * call, len(layouts)))]
        dsts = [ca.codes(t, partials) for t in rng.sample(layouts, 30)]
        srcs += srcs[:3]  # (repeated codes)
        kwargs = dict(share=share.many if call % 3 else None, gathers_on=(0,) if call % 4 == 1 else ())
        alone = ca.pair_seconds(shape, 4, srcs, dsts, mesh_shape, profile, links, **kwargs)
        memoized = ca.pair_seconds(shape, 4, srcs, dsts, mesh_shape, profile, links, memo=memo, **kwargs)
        for a, b in zip(alone, memoized):
            assert a.shape == b.shape and (a == b).all()
    keys = [(s, acc) for s in _layouts(3, 3)[::5] for acc in (False, True)]
    dst_keys = [(t, pd) for t in _layouts(3, 3)[::7] for pd in ((False,) * 3, (True, False, True))]
    for _ in range(2):  # (the second time from the memo)
        got = ca.edge_seconds((8, 6, 4), 4, 2, keys, dst_keys, mesh_shape, profile, links, True, share.many, memo)
        want = ca.edge_seconds((8, 6, 4), 4, 2, keys, dst_keys, mesh_shape, profile, links, True, share.many)
        assert (got == want).all()
