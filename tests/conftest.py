import pytest
import torch

from tests.harness import RankPool

# Tests that run on the README's torch release only (.ci/run passes `-m "not one_release"` on the others): the suite
# on three releases must stay within CI's time on 2 cores. Each is either about what does not change between torch
# releases (launchers, timeouts, signals, a browser), or one more case of a path that a quicker test runs on every
# release (named after the prefix). Keys are test node ids or their prefixes.
ONE_RELEASE = {
    # launchers, ports, timeouts and killed ranks: the operating system's and Open MPI's behaviour (torchrun's
    # launch runs on every release: tests/test_runtime.py::test_torchrun_four_ranks)
    "tests/test_samples.py": "the samples under mpirun and torchrun",
    "tests/test_docs.py": "the documentation's code blocks",
    "tests/test_harness.py": "the test harness's own restarts",
    "tests/test_runtime.py::test_mpirun_four_ranks": "Open MPI's environment",
    "tests/test_runtime.py::test_missing_ranks": "timeouts",
    "tests/test_runtime.py::test_a_port_another": "timeouts",
    "tests/test_runtime.py::test_a_wrong_port": "timeouts",
    "tests/test_runtime.py::test_an_unreachable": "timeouts",
    "tests/test_runtime.py::test_a_collective_whose_peer_never_comes": "timeouts",
    "tests/call/test_agreement.py::test_under_mpirun": "errors under mpirun (gloo4 ranks: test_ranks_that_disagree_*)",
    "tests/training/test_checkpoint.py::test_a_rank_killed": "a rank killed by a signal during a save",
    "tests/show/test_plan_page.py": "the plan page in Chromium",
    # more models on the same path: llama and gpt2 train on real ranks on every release, and every model on
    # simulated ranks
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[qwen2]": "more models",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[resnet]": "more models",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[bloom]": "more models",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[vit]": "more models",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[bert]": "more models",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[gemma3]": "more models",
    "tests/test_transformers_models.py::test_data_parallel_generate_gives_each_rank_its_rows_on_real_ranks":
        "generate() at a new length each token: test_data_parallel_steps_of_changing_length_on_real_ranks",
    "tests/test_transformers_models.py::test_trains_like_unsharded_on_real_ranks[gpt2]":
        "more models (GPT-2 on real ranks every release: tests/training/test_checkpoint.py)",
    "tests/test_moe_models.py::test_experts_split_train_like_unsharded_on_real_ranks[mixtral": "more models",
    "tests/test_moe_models.py::test_deepseek_v3_trains_like_unsharded_on_real_ranks":
        "more models (DeepSeek-V3 simulated every release, Qwen2-MoE on real ranks)",
    "tests/test_moe_models.py::test_experts_split_train_like_unsharded_on_real_ranks[qwen2_moe-eager]":
        "more experts implementations",
    # the trace for every size: data parallel on real ranks runs on every release
    "tests/call/test_sizes.py::test_tensor_parallel_steps_of_changing_length_on_real_ranks": "a Megatron plan",
    "tests/call/test_sizes.py::test_a_failed_trace_for_every_size": "the fallback's bookkeeping",
    "tests/call/test_sizes.py::test_views_on_pieces_match_eager_on_real_ranks": "views at every length, simulated",
    "tests/test_layout.py::test_every_tuple_strategy_matches_definition[64]": "a larger world of the same check",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "one_release: runs on the README's torch release only (tests/conftest.py)")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in ONE_RELEASE):
            item.add_marker(pytest.mark.one_release)


@pytest.fixture
def all_releases_cases(request) -> bool:
    """False where this run leaves out the one-release tests (``-m "not one_release"``, the other torch releases
    in .ci/run): a test that launches fresh processes (seconds each) then runs fewer cases in the same launches,
    where a test of its own for the other cases would launch again."""
    return "not one_release" not in (request.config.option.markexpr or "")


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
