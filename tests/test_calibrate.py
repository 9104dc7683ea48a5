"""shardfn.training.calibrate on 4 real gloo ranks: every rank gets the same measured profile, measured per dim of
a 2 x 2 mesh, and plans made with it (SHARDFN_PROFILE) price collectives by the measured constants."""

import os

import torch
import torch.distributed as dist

from shardfn.strategy_search.cost_model import CPU


def _calibrate_body(path):
    import shardfn as sf
    from shardfn.training.calibrate import calibrate
    from shardfn.strategy_search.cost_model import save_profile

    profile = calibrate(repeat=3, mesh=(2, 2))
    if dist.get_rank() == 0:
        save_profile(profile, path)
    dist.barrier()
    os.environ["SHARDFN_PROFILE"] = path
    try:
        plan = sf.explain(lambda x, w: x @ w, torch.randn(64, 32), torch.randn(32, 16),
                          in_strategy=((4, 1), (1, 1)), out_strategy=None)
    finally:
        del os.environ["SHARDFN_PROFILE"]
    return profile, plan.cost.comm_s, sorted({c.kind for c in plan.collectives})


def test_every_rank_plans_with_the_same_measured_profile(gloo4, tmp_path):
    results = gloo4.run(_calibrate_body, str(tmp_path / "profile.json"))
    profiles = [p for p, _, _ in results]
    assert all(p == profiles[0] for p in profiles)
    profile = profiles[0]
    assert profile.name == "cpu-measured" and profile.flops_per_s > 0 and profile.mem_bytes_per_s > 0
    measured = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    # every dim measured (each of its 2 groups at once); on one machine both are intra-node, and the intra-node
    # link takes the slower dim's figures; the network keeps the built-in CPU profile's
    assert [(d, n, link, k) for d, n, link, k, _, _ in profile.measured_dims] == \
        [(d, 2, "intra", k) for d in (0, 1) for k in measured]
    assert profile.devices_per_node == 0 and profile.inter_node == CPU.inter_node
    per_kind = profile.intra_node.per_kind
    assert profile.op_s > 0 and [k for k, _, _ in per_kind] == measured
    assert all(alpha > 0 and beta > 0 for _, alpha, beta in per_kind)
    for kind, alpha, beta in per_kind:
        dims = [(a, b) for _, _, _, k, a, b in profile.measured_dims if k == kind]
        assert (alpha, beta) == (max(a for a, _ in dims), max(b for _, b in dims))
    # the plan's collectives are priced by the measured constants: each kind it runs costs at least that kind's
    # measured latency over 3 hops (which kinds depends on the measured prices: a gather of the output, or moving
    # x and summing partial products)
    alphas = dict((k, a) for k, a, _ in per_kind)
    for _, comm, kinds in results:
        assert kinds and set(kinds) <= set(alphas)
        assert comm >= 3 * sum(alphas[k] for k in kinds) * (1 - 1e-9)
