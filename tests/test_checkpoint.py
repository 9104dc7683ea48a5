"""shardfn.save / shardfn.load: a sharded model and its optimizer saved and loaded exactly (4 real ranks, one
process), and a save that survives a rank killed at every point of it (tests/scripts/checkpoint_kill.py)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import shardfn as sf
from tests.launch import run_ranks
from tests.models import GPTBlock


def _plain_state(seed):
    torch.manual_seed(seed)
    return GPTBlock().state_dict()


def test_save_switches_versions_in_one_process(tmp_path):
    path = tmp_path / "ckpt"
    first, second = _plain_state(0), _plain_state(1)
    sf.save(first, path)
    assert os.path.islink(path) and os.readlink(path) == ".ckpt.1"
    os.makedirs(tmp_path / ".ckpt.7")  # a save that died before its switch
    sf.save(second, path)
    assert os.readlink(path) == ".ckpt.8"
    assert sorted(os.listdir(tmp_path)) == [".ckpt.8", "ckpt"]  # the old version and the dead one removed
    loaded = _plain_state(2)
    sf.load(loaded, path)
    for k in second:
        assert torch.equal(loaded[k], second[k]), k


def test_bad_paths_are_refused_before_writing(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="exists and is not a checkpoint written by shardfn.save.*new path"):
        sf.save(_plain_state(0), tmp_path / "plain")
    with pytest.raises(ValueError, match="does not exist; create it first"):
        sf.save(_plain_state(0), tmp_path / "missing" / "ckpt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        sf.load(_plain_state(0), tmp_path / "none")
    assert sorted(os.listdir(tmp_path)) == ["plain"]


def _round_trip_body(path):
    from tests.test_modules import GPT_PLANS

    def trained(seed):
        torch.manual_seed(seed)
        model = sf.shard(GPTBlock(), **GPT_PLANS["tp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(2, 8, 16)).square().mean().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    model_state, optim_state = get_state_dict(model, opt)
    sf.save({"model": model_state, "optim": optim_state}, path)
    other, other_opt = trained(1)
    model_state, optim_state = get_state_dict(other, other_opt)
    sf.load({"model": model_state, "optim": optim_state}, path)
    set_state_dict(other, other_opt, model_state_dict=model_state, optim_state_dict=optim_state)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert isinstance(q, DTensor) and q.placements == p.placements, name
        assert torch.equal(p.to_local(), q.to_local()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].to_local(), other_opt.state[q][key].to_local()), (name, key)
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def test_sharded_model_and_optimizer_round_trip(gloo4, tmp_path):
    path = str(tmp_path / "ckpt")
    full = gloo4.run(_round_trip_body, path)[0]
    assert dist.is_initialized() is False
    loaded = {"model": _plain_state(3)}
    sf.load(loaded, path)  # a 4-rank checkpoint into one process, whole tensors
    for k, v in full.items():
        assert torch.equal(loaded["model"][k], v), k


# where the second save is cut, and which checkpoint must then be there; and a save not cut, in a process group
# made without shardfn.init (no control group: the save uses the default group)
KILLS = {"writing": "A", "written": "A", "metadata": "A", "switched": "B", "own-group": "B"}


@pytest.mark.parametrize("point", sorted(KILLS))
def test_a_rank_killed_during_a_save_leaves_a_whole_checkpoint(tmp_path, point):
    from tests.harness import free_port

    port = str(free_port())
    envs = [dict(RANK=str(r), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, SHARDFN_TIMEOUT="30")
            for r in range(4)]
    results = run_ranks("tests/scripts/checkpoint_kill.py", envs, point, str(tmp_path), timeout=150)
    assert all(code is not None for code, _, _ in results), [out for _, out, _ in results]  # no rank hangs
    killed = point != "own-group"
    assert any(code != 0 for code, _, _ in results) == killed, [out for _, out, _ in results]
    expected = torch.load(tmp_path / f"{KILLS[point]}.pt")
    loaded = {"model": _plain_state(3)}
    sf.load(loaded, tmp_path / "ckpt")
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), (point, k)
    # the next save clears what the cut one left and switches in cleanly
    sf.save(loaded, tmp_path / "ckpt")
    versions = [e for e in os.listdir(tmp_path) if e.startswith(".ckpt.")]
    assert versions == [os.readlink(tmp_path / "ckpt")], versions
