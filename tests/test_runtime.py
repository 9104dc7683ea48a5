import time

import pytest

from shardfn.runtime import DEFAULT_MASTER_PORT, detect_launch
from tests.harness import free_port
from tests.launch import check, run_mpirun, run_python, run_torchrun


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


def test_plain_python_is_a_world_of_one():
    out = check(run_python("tests/scripts/init_report.py"))
    assert "launcher=none rank=0 world=1 backend=gloo sum=1" in out


def test_torchrun_four_ranks():
    out = check(run_torchrun("tests/scripts/init_report.py", 4))
    for r in range(4):
        assert f"launcher=torchrun rank={r} world=4 backend=gloo sum=4" in out


def test_mpirun_four_ranks():
    out = check(run_mpirun("tests/scripts/init_report.py", 4))
    for r in range(4):
        assert f"launcher=Open MPI rank={r} world=4 backend=gloo sum=4" in out


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
