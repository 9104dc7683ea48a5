import re
import time

import pytest

from shardfn.runtime import DEFAULT_MASTER_PORT, detect_launch
from tests.harness import free_port, on_rank
from tests.launch import run_mpirun, run_python, run_ranks, run_torchrun, succeeds


@pytest.mark.parametrize(
    "env, launcher, rank, world, local",
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, "torchrun", 3, 4, 1),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
         "Open MPI", 2, 8, 2),
        ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1"}, "MPICH/Intel MPI", 5, 6, 1),
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}, "Slurm", 7, 16, 3),
        ({}, "none", 0, 1, 0),
        # torchrun wins over an outer Slurm allocation
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "torchrun", 1, 2, 1),
    ],
)
def test_detect_launch(env, launcher, rank, world, local):
    launch = detect_launch(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (launcher, rank, world, local)


def test_detect_launch_rejects_bad_values():
    with pytest.raises(RuntimeError, match="rank 4 of a world of 4"):
        detect_launch({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(RuntimeError, match="non-integer"):
        detect_launch({"PMI_RANK": "x", "PMI_SIZE": "2"})


def test_default_port_is_documented():
    import shardfn.runtime as rt

    assert str(DEFAULT_MASTER_PORT) in rt.__doc__


def _threads_end_in_shutdown(out: str, ranks: int) -> None:
    # gloo's worker threads end inside shardfn's shutdown although the script still holds its mesh: left to the
    # interpreter's finalization they can abort the process (exit -6, once in CI)
    ends = re.findall(r"threads at exit: (\d+) \(before init: (\d+)\)", out)
    assert len(ends) == ranks, out
    assert all(int(at_exit) <= int(before) for at_exit, before in ends), re.findall(r"threads at exit: .*", out)


def test_plain_python_is_a_world_of_one():
    out = succeeds(run_python, "tests/scripts/init_report.py")
    assert "launcher=none rank=0 world=1 backend=gloo sum=1" in out
    _threads_end_in_shutdown(out, 1)


def test_a_world_of_one_runs_traced_graphs_as_eager():
    # constants of the graph (a tensor fn reads from outside) are inputs of the traced step there, too
    assert "match" in succeeds(run_python, "tests/scripts/world_of_one.py")


def test_torchrun_four_ranks():
    out = succeeds(run_torchrun, "tests/scripts/init_report.py", 4)
    for r in range(4):
        assert f"launcher=torchrun rank={r} world=4 backend=gloo sum=4" in out
    _threads_end_in_shutdown(out, 4)


def test_mpirun_four_ranks():
    out = succeeds(run_mpirun, "tests/scripts/init_report.py", 4)
    for r in range(4):
        assert f"launcher=Open MPI rank={r} world=4 backend=gloo sum=4" in out
    _threads_end_in_shutdown(out, 4)


def test_missing_ranks_fail_within_the_timeout():
    port = str(free_port())
    start = time.monotonic()
    # rank 1 of 2 with nobody at the rendezvous address
    res = run_python("tests/scripts/init_report.py",
                     env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": port, "SHARDFN_INIT_TIMEOUT": "3"})
    elapsed = time.monotonic() - start
    assert res.returncode != 0
    assert "could not rendezvous at 127.0.0.1:" + port in res.stderr
    assert "SHARDFN_INIT_TIMEOUT" in res.stderr
    assert elapsed < 60


def _world_of_two(port, **extra):
    return [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "SHARDFN_INIT_TIMEOUT": "4", **extra} for r in range(2)]


def _assert_rendezvous_error(result, host_port, bound=30):
    code, out, seconds = result
    assert code not in (0, None), out
    assert f"could not rendezvous at {host_port} within 4 s (SHARDFN_INIT_TIMEOUT)" in out, out
    assert "MASTER_ADDR/MASTER_PORT name a reachable host and a free port" in out
    assert seconds < bound


@pytest.mark.parametrize("peer", ["silent", "closing"])
def test_a_port_another_program_holds_fails_within_the_timeout(peer):
    # rank 0 cannot serve the store there; rank 1 meets a peer that is no store (torch's client would wait)
    import socket
    import threading

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    kept = []

    def serve():
        while True:
            try:
                conn, _ = holder.accept()
            except OSError:
                return
            conn.close() if peer == "closing" else kept.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        for result in run_ranks("tests/scripts/runtime_faults.py", _world_of_two(port), "init", timeout=60):
            _assert_rendezvous_error(result, f"127.0.0.1:{port}")
    finally:
        holder.close()


def test_a_wrong_port_on_one_rank_fails_both_within_the_timeout():
    envs = _world_of_two(free_port())
    # (two draws of a free port can give the same one: then both ranks met, as CI once saw)
    envs[1]["MASTER_PORT"] = next(p for p in iter(lambda: str(free_port()), None) if p != envs[0]["MASTER_PORT"])
    results = run_ranks("tests/scripts/runtime_faults.py", envs, "init", timeout=60)
    for r, result in enumerate(results):
        _assert_rendezvous_error(result, f"127.0.0.1:{envs[r]['MASTER_PORT']}")


def test_an_unreachable_address_fails_within_the_timeout():
    envs = _world_of_two(free_port(), MASTER_ADDR="10.255.255.1")
    (result,) = run_ranks("tests/scripts/runtime_faults.py", envs[1:], "init", timeout=60)
    _assert_rendezvous_error(result, f"10.255.255.1:{envs[1]['MASTER_PORT']}")


def test_a_collective_whose_peer_never_comes_fails_within_shardfn_timeout():
    results = run_ranks("tests/scripts/runtime_faults.py", _world_of_two(free_port(), SHARDFN_TIMEOUT="3"), "skip",
                        timeout=90)
    out = results[0][1]
    assert "rank 0: collective failed after" in out, out
    seconds = float(out.split("collective failed after ")[1].split(" s")[0])
    assert 2.5 < seconds < 15, out
    assert all(code is not None for code, _, _ in results)  # nobody hangs at exit either


def test_a_crashed_rank_ends_every_rank_and_nobody_waits_at_exit():
    results = run_ranks("tests/scripts/runtime_faults.py", _world_of_two(free_port(), SHARDFN_TIMEOUT="10"),
                        "crash", timeout=90)
    assert results[1][0] not in (0, None) and "a fault on rank 1" in results[1][1]
    assert results[0][0] is not None and "collective failed" in results[0][1], results[0][1]
    assert max(seconds for _, _, seconds in results) < 40


def test_a_rank_that_ends_early_does_not_hang_the_other():
    results = run_ranks("tests/scripts/runtime_faults.py", _world_of_two(free_port()), "early", timeout=90)
    assert [code for code, _, _ in results] == [0, 0], results
    assert all("done" in out for _, out, _ in results)


def test_the_control_group_is_a_gloo_group_over_the_world():
    results = run_ranks("tests/scripts/runtime_faults.py", _world_of_two(free_port()), "control", timeout=90)
    assert all(code == 0 and "control group sum 2" in out for code, out, _ in results), results


@pytest.mark.parametrize("env, gpus, ok", [
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 1, False),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, True),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 4, False),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}, 2, False),  # no local size: the local rank
    ({}, 1, True),
])
def test_more_ranks_on_a_host_than_gpus_is_an_error_before_any_communication(env, gpus, ok):
    from shardfn.runtime import check_gpus

    launch = detect_launch(env)
    if ok:
        check_gpus(launch, gpus)
        return
    with pytest.raises(ValueError, match=rf"ranks run on this host but it has {gpus} GPU.*one GPU per rank.*"
                                         r"device='cpu'"):
        check_gpus(launch, gpus)


def test_a_simulated_world_refuses_a_bool_its_ranks_answer_differently():
    # LocalTensorMode read ranks' differing bools as one truthy value (a SymInt), so DTensor's mask-buffer check
    # passed there and failed on real ranks; a bool all ranks agree on is read as it is
    import torch

    from shardfn._simulation_internals import PerRankBoolError
    from shardfn.runtime import simulated_world, simulated_map

    with simulated_world(4):
        x = simulated_map(torch.zeros(3), lambda r, values: values[r] + (r % 2))
        assert torch.equal(x, x)
        with pytest.raises(PerRankBoolError, match="answers differently"):
            torch.equal(x, torch.zeros(3))
    assert torch.equal(torch.zeros(3), torch.zeros(3))  # ordinary tensors again outside


def test_a_simulated_world_writes_into_an_ordinary_tensor_once_per_value_not_once_per_rank():
    # LocalTensorMode ran an op once per rank on the same ordinary tensor: plain.mul_(per_rank) multiplied it 4
    # times, so eager's gradient of linear_cross_entropy's chunked custom op (whose backward scales an ordinary
    # buffer in place by a per-rank grad_output) was wrong in a simulated world only, and the OpInfo sweep's
    # data-parallel reference with it
    import torch
    import torch.nn.functional as F

    from shardfn._simulation_internals import PerRankWriteError
    from shardfn.runtime import simulated_map, simulated_world

    def loss_grads(x, w, t, g):
        x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
        (F.linear_cross_entropy(x, w, t, reduction="none", options=opts) * g).sum().backward()
        return x.grad, w.grad

    chunked = hasattr(torch.nn, "LinearCrossEntropyOptions")  # torch 2.11 has no chunked linear_cross_entropy
    x, w, t = torch.randn(8, 12), torch.randn(4, 12), torch.randint(0, 4, (8,))
    want = loss_grads(x, w, t, torch.linspace(-1, 1, 8)) if chunked else ()
    plain = torch.full((3,), 2.0)
    with simulated_world(4):
        got = loss_grads(x, w, t, torch.linspace(-1, 1, 8)) if chunked else ()  # made here: per rank, alike
        for g, e in zip(got, want):
            for r in range(4):
                torch.testing.assert_close(on_rank(g, r), e, rtol=1e-5, atol=1e-5)
        plain.mul_(torch.full((3,), 3.0))
        assert type(plain) is torch.Tensor and plain.tolist() == [6.0] * 3
        differing = simulated_map(torch.ones(3), lambda r, values: values[r] * r)
        with pytest.raises(PerRankWriteError, match="differing values into an ordinary tensor"):
            plain.add_(differing)


def test_a_simulated_world_accumulates_a_gradient_into_an_efficient_zero_tensor():
    # sgn's gradient of a real input is an efficient zero tensor (no storage); under LocalTensorMode each rank held
    # one inside a per-rank tensor that did not say so, and accumulating a second gradient into it killed the
    # process (a segmentation fault: the OpInfo sweep's worker, at sgn, in every mode). In a process of its own
    import subprocess
    import sys

    code = """if True:
        import torch
        from shardfn.runtime import simulated_world
        x = torch.randn(8, requires_grad=True)
        with simulated_world(4):
            for _ in range(2):
                (torch.sgn(x) * torch.linspace(-1, 1, 8)).sum().backward()
            assert all(not bool(g.any()) for g in x.grad._local_tensors.values()) and len(x.grad._local_tensors) == 4
        print("ok")
    """
    from tests.launch import ROOT

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])
