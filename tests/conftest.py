import pytest
import torch

from tests.harness import RankPool

# What .ci/run also runs on the other torch releases (`-m every_release`): the tests of what reads torch's
# internals that change between releases (DTensor's rules and placements, make_fx and functionalization, the
# flop counter, Inductor, torch.distributed.checkpoint), each path once. The rest (more models and more cases on
# a path named here, launchers and timeouts, the harness, a browser) runs on the README's release only: the suite
# on three releases must stay within CI's time on 2 cores. A key is a file, a test (with all its parameters) or,
# ending in "*", a prefix of test ids; the real-rank tests of a file named whole run on the README's release only.
EVERY_RELEASE = {
    # DTensor's rules, checked by running them (every own rule and those shardfn leans on), and the flop counter
    "tests/strategy_search/test_rule_truth.py::test_attention*": "DTensor's attention rules",
    "tests/strategy_search/test_rule_truth.py::test_dtensor*": "DTensor's own rules",
    "tests/strategy_search/test_rule_truth.py::test_rules_registered_in_dtensor_form":
        "shardfn's rules in DTensor's form",
    "tests/strategy_search/test_rule_truth.py::test_rules_on_random_shapes[0]": "every rule, one draw",
    "tests/strategy_search/test_rule_truth.py::test_cdist_rule": "an own rule",
    "tests/strategy_search/test_dtensor_rules.py": "DTensor's registry",
    "tests/strategy_search/test_dtensor_adapter.py": "DTensor's full-mesh expansion seen",
    "tests/strategy_search/test_expansion.py": "DTensor's full-mesh expansion, on placements alone",
    "tests/strategy_search/test_expert_rules.py": "the experts' rules",
    "tests/strategy_search/test_cost_model.py": "the flop counter",
    "tests/strategy_search/test_candidates.py": "candidates from DTensor's strategies",
    # make_fx, functionalization, dynamic shapes
    "tests/capture/test_trace.py": "the capture",
    "tests/capture/test_functions.py": "the capture",
    "tests/capture/test_structure.py": "the capture",
    "tests/capture/test_order.py": "the capture",
    "tests/capture/test_repeated.py": "the capture (repeated layers copied)",
    "tests/capture/test_experts.py::test_one_program_runs_at_any_routing[grouped_mm]": "routing as data",
    "tests/call/test_sizes.py::test_tensor_parallel_steps_of_changing_length": "symbolic sizes (simulated)",
    "tests/call/test_arguments.py": "the call's arguments",
    "tests/call/test_accumulation.py": "no_sync",
    # the program: every op family on simulated and on real ranks (the traced per-rank graphs), torch's OpInfos
    "tests/exec/test_ops_parity.py": "every op family",
    "tests/exec/test_ops_parity.py::test_op_parity_on_real_ranks": "every op family in traced per-rank graphs",
    "tests/exec/test_sharded_ops.py::test_split_parity": "forced splits (simulated)",
    "tests/exec/test_opinfo_sweep.py::test_forced_splits_are_never_wrong_and_run_sharded": "torch's OpInfo samples",
    "tests/exec/test_lower.py": "lowering (simulated: real ranks run op parity)",
    "tests/exec/test_inductor.py::test_inductor_compiled_graphs_match_eager[tp]": "Inductor",
    "tests/exec/test_strides.py": "strides",
    "tests/exec/test_plan_agreement.py::test_transformers_models_run_what_they_plan[llama*": "a plan as run",
    # a model trained, sharded state saved and resumed, optimizers
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[llama]": "a model, real ranks",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_simulated_ranks[llama*": "a model",
    "tests/test_transformers_models.py::test_data_parallel_generate_gives_each_rank_its_rows_on_simulated_ranks":
        "generate() and its caches (torch 2.11's StaticCache fallback)",
    "tests/test_moe_models.py::test_experts_split_train_like_unsharded_on_simulated_ranks[mixtral-grouped_mm]":
        "experts split",
    "tests/test_moe_models.py::test_tokens_dispatched_to_their_experts_train_like_unsharded[mixtral-grouped_mm]":
        "tokens dispatched (an op LocalTensorMode runs for all ranks at once)",
    "tests/training/test_checkpoint.py::test_a_resume_is_the_uninterrupted_run_for_every_way_of_training":
        "torch.distributed.checkpoint (fewer ways)",
    "tests/training/test_optimizer.py::test_torch_*": "torch's optimizers and checkpoint APIs on pieces",
    "tests/training/test_meta_init.py::test_transformers_models_initialise_as_unsharded_tied_weights_and_buffers_"
    "included[llama]": "meta init",
    # torchrun, a world of one
    "tests/test_runtime.py::test_torchrun_four_ranks": "torchrun",
    "tests/test_runtime.py::test_a_world_of_one_runs_traced_graphs_as_eager": "a world of one",
    "tests/test_api.py": "the public API",
    "tests/test_precision.py": "mixed precision",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "every_release: runs on every torch release .ci/run tests (tests/conftest.py)")


def every_release(item) -> bool:
    """Whether ``item`` is named in EVERY_RELEASE (a real-rank test only by its own id)."""
    nodeid = item.nodeid
    if nodeid in EVERY_RELEASE or nodeid.split("[")[0] in EVERY_RELEASE:
        return True
    broadly = nodeid.split("::")[0] in EVERY_RELEASE or \
        any(key.endswith("*") and nodeid.startswith(key[:-1]) for key in EVERY_RELEASE)
    return broadly and not _on_real_ranks(item)


def _on_real_ranks(item) -> bool:
    return any(name.startswith("gloo") for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(items):
    for item in items:
        if every_release(item):
            item.add_marker(pytest.mark.every_release)


@pytest.fixture
def all_releases_cases(request) -> bool:
    """False where this run takes the every-release tests alone (``-m every_release``, the other torch releases in
    .ci/run): a test that launches fresh processes (seconds each) then runs fewer cases in the same launches,
    where a test of its own for the other cases would launch again."""
    return "every_release" not in (request.config.option.markexpr or "")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_real_world_left_behind(request):
    """A test that starts a real process group in the test process (a world of one: sf.shard outside a simulated
    world) leaves it for every later test, whose simulated worlds then fail: said at that test, and cleaned up."""
    yield
    import torch.distributed as dist

    from shardfn.runtime import is_simulated

    if dist.is_initialized() and not is_simulated() and dist.get_backend() != "fake":
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a real process group in the test process; run its body in "
                    "simulated_world(n) or in the rank pool")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks a test whose setup or call failed (for :func:`gloo4`'s fresh ranks after a failure)."""
    report = (yield).get_result()
    if report.failed:
        item.shardfn_failed = True


@pytest.fixture(scope="session")
def _gloo4_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture
def gloo4(_gloo4_pool, request):
    """Four real gloo ranks, started once for the whole session (a start of four ranks costs about 14 s of the
    suite's 2 cores; every module that used its own paid it again). A test that failed leaves nothing behind:
    its ranks are ended, and the next test's body runs on fresh ones (RankPool restarts a pool whose ranks are
    gone), as a pool per module did for the next module."""
    yield _gloo4_pool
    if getattr(request.node, "shardfn_failed", False):
        _gloo4_pool.close()


def pytest_terminal_summary(terminalreporter):
    """How many bodies ran again after a rank died by a signal (never after a timeout): said on every run."""
    from tests.launch import RERUNS

    terminalreporter.write_line(f"shardfn harness: {len(RERUNS)} rerun(s) after a rank died by a signal")
    for line in RERUNS:
        terminalreporter.write_line(f"  rerun: {line}")
