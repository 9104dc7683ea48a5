"""The samples run as users run them (torchrun, mpirun) and every rank reports a match with single-process eager.
Each sample runs under one launcher (both launchers are used; tests/test_runtime.py checks each on its own)."""

import re

import pytest

from tests.launch import run_mpirun, run_torchrun, succeeds

LAUNCHERS = {"mpirun": run_mpirun, "torchrun": run_torchrun}


def ranks_reporting(out: str, pattern: str) -> set[int]:
    """Ranks whose verdict line matches ``pattern`` (with a (\\d+) for the rank). mpirun may interleave lines."""
    return {int(r) for r in re.findall(pattern, out)}


@pytest.mark.parametrize("launcher, n", [("torchrun", 4)])
def test_dense_relu(launcher, n):
    out = succeeds(LAUNCHERS[launcher], "samples/dense_relu.py", n)
    split = re.escape(str((4, 2) if n % 8 == 0 else (n, 1)))
    assert ranks_reporting(out, rf"rank (\d+)/{n}: dense_relu in_strategy=\({split}, None, None\) matches eager") \
        == set(range(n)), out
    assert "shardfn plan" in out  # rank 0's explain()


def test_shard_cell_mpirun_8():
    out = succeeds(run_mpirun, "samples/shard_cell.py", 8)
    assert ranks_reporting(out, r"rank (\d+)/8: shard_cell block1 \(8, 1\) \+ block2 \(1, 8\) trains like eager") \
        == set(range(8)), out
    assert "shardfn plan" in out


@pytest.mark.parametrize("launcher", ["torchrun"])
def test_mlp_parallel_4(launcher):
    out = succeeds(LAUNCHERS[launcher], "samples/mlp_parallel.py", 4)
    for config in ("dp", "tp", "dp2 x tp2"):
        assert ranks_reporting(out, rf"rank (\d+)/4: mlp {config} trains like single process") == set(range(4)), \
            f"{config}:\n{out}"


@pytest.mark.parametrize("launcher, n", [("mpirun", 8)])
def test_pipeline_hybrid(launcher, n):
    out = succeeds(LAUNCHERS[launcher], "samples/pipeline_hybrid.py", n)
    assert ranks_reporting(out, rf"rank (\d+)/{n}: pipeline_hybrid stage \d trains like single process") \
        == set(range(n)), out
    assert "bubble fraction 0.200" in out  # rank 0's explain(): 2 stages, 4 micro-batches, 1F1B


def test_meta_init_check_torchrun_4():
    # the small decoder built on meta, sharded at level 1, given its pieces: first losses and gradients as the
    # unsharded model built the ordinary way (the full size, under a memory budget, is the sample's default run)
    out = succeeds(run_torchrun, "samples/meta_init.py", 4, "--check")
    assert ranks_reporting(out, r"rank (\d+)/4: meta_init trains like the unsharded model built the ordinary way") \
        == set(range(4)), out
