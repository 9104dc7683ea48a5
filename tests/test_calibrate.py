"""shardfn.calibrate on 4 real gloo ranks: every rank gets the same measured profile, and plans made with it
(SHARDFN_PROFILE) price collectives by the measured constants."""

import os

import torch
import torch.distributed as dist


def _calibrate_body(path):
    import shardfn as sf
    from shardfn.calibrate import calibrate
    from shardfn.strategy_search.cost_model import save_profile

    profile = calibrate(repeat=3)
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
    assert profile.op_s > 0 and [k for k, _, _ in profile.per_kind] == ["all_reduce", "all_gather",
                                                                         "reduce_scatter", "all_to_all"]
    assert all(alpha > 0 and beta > 0 for _, alpha, beta in profile.per_kind)
    # the plan's collectives are priced by the measured constants: each kind it runs costs at least that kind's
    # measured latency over 3 hops (which kinds depends on the measured prices: a gather of the output, or moving
    # x and summing partial products)
    alphas = dict((k, a) for k, a, _ in profile.per_kind)
    for _, comm, kinds in results:
        assert kinds and set(kinds) <= set(alphas)
        assert comm >= 3 * sum(alphas[k] for k in kinds) * (1 - 1e-9)
