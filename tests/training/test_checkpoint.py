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
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        sf.load(_plain_state(0), tmp_path / "none")
    assert sorted(os.listdir(tmp_path)) == ["plain"]


def test_a_save_into_folders_that_do_not_exist_creates_them(tmp_path):
    sf.save(_plain_state(0), tmp_path / "runs" / "a" / "ckpt")  # as dcp.save does
    loaded = _plain_state(1)
    sf.load(loaded, tmp_path / "runs" / "a" / "ckpt")
    assert all(torch.equal(v, _plain_state(0)[k]) for k, v in loaded.items())


def _trained_block():
    torch.manual_seed(0)
    model = GPTBlock()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8, 16)).square().mean().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_that_does_not_fit_is_named_and_nothing_is_loaded(tmp_path):
    model, opt = _trained_block()
    sf.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt")
    torch.manual_seed(1)
    fresh = GPTBlock()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    # the module alone: its names are under "model." in the checkpoint
    with pytest.raises(ValueError, match=r"under the prefix 'model\.'; load with sf\.load\(\{'model': "
                                         r"model\.state_dict\(\)\}, path\)"):
        sf.load(fresh, tmp_path / "ckpt")
    # one level too deep: the checkpoint's names have no "model.model."
    with pytest.raises(ValueError, match=r"without the prefix 'model\.'"):
        sf.load({"model": {"model": fresh.state_dict()}}, tmp_path / "ckpt")
    # a torch optimizer that has not stepped has no states to load the saved ones into
    with pytest.raises(ValueError, match=r"checkpoint's tensors are not in the target \(optim\.state\.0\.step.*"
                                         r"get_state_dict\(model, optimizer\)"):
        sf.load({"model": fresh.state_dict(), "optim": torch.optim.AdamW(fresh.parameters()).state_dict()},
                tmp_path / "ckpt")
    # another shape
    with pytest.raises(ValueError, match=r"model\.ln1\.weight has shape \(32,\) in the target but \(16,\)"):
        sf.load({"model": GPTBlock(32, 4).state_dict()}, tmp_path / "ckpt")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing written
    sf.load({"model": fresh.state_dict()}, tmp_path / "ckpt")  # the model alone, beside the optimizer's states
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


WAYS = ["data_parallel", "level1", "megatron_dp", "zero1", "zero2_no_sync", "mixed_precision", "pipeline"]
OTHER_WORLD = ["data_parallel", "megatron_dp", "zero2_no_sync", "mixed_precision"]
# where the one-release tests are left out (the other torch releases): the ways whose states differ most between
# releases (level 1's DTensor parameters, the sharded optimizer's stages, torch's dcp.async_save), in the same
# three launches
WAYS_EVERY_RELEASE = (["level1", "zero1", "zero2_no_sync"], ["zero2_no_sync"])


def _resumed(results) -> dict[str, dict[str, float]]:
    for code, out, _ in results:
        assert code == 0, out[-6000:]
    lines = [line.split() for line in results[0][1].splitlines() if line.startswith("RESUMED ")]
    gaps = {w[1]: {k: float(v) for k, v in (x.split("=") for x in w[4:])} for w in lines}
    assert all(set(g) == {"loss", "params", "states", "lr"} for g in gaps.values()), gaps
    return gaps


def test_a_resume_is_the_uninterrupted_run_for_every_way_of_training(tmp_path, all_releases_cases):
    """tests/scripts/resume.py: each way trained, saved and trained on; then fresh processes load the checkpoint
    and train the same steps: on the same 4 ranks every loss, parameter, optimizer state and the LR equal the
    uninterrupted run's bit for bit; on 2 ranks within summation order (bf16 compute: its rounding, which AdamW's
    normalised step carries into the parameters)."""
    from tests.harness import free_port

    ways, other_world = (WAYS, OTHER_WORLD) if all_releases_cases else WAYS_EVERY_RELEASE

    def launch(world, phase, ways):
        port = str(free_port())
        envs = [dict(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     SHARDFN_TIMEOUT="60") for r in range(world)]
        return run_ranks("tests/scripts/resume.py", envs, phase, str(tmp_path), ",".join(ways), timeout=400)

    _resumed(launch(4, "run", ways))
    same = _resumed(launch(4, "resume", ways))
    assert sorted(same) == sorted(ways)
    assert all(v == 0.0 for gaps in same.values() for v in gaps.values()), same
    other = _resumed(launch(2, "resume", other_world))
    assert sorted(other) == sorted(other_world)
    for way, gaps in other.items():
        bf16 = way == "mixed_precision"
        assert gaps["loss"] <= (1e-3 if bf16 else 1e-5) and gaps["lr"] == 0, (way, gaps)
        assert gaps["params"] <= (2e-2 if bf16 else 1e-4) and gaps["states"] <= (1e-3 if bf16 else 1e-6), (way, gaps)


def _leaving_body(folder):
    """A model trained sharded (Megatron x data parallel) written as an ordinary transformers model: the full state
    dict on rank 0 (torch.distributed.checkpoint's get_model_state_dict), save_pretrained there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.scripts.resume import MegatronDP

    way = MegatronDP()
    way.step(0)
    full = get_model_state_dict(way.models[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        way.models[0].save_pretrained(folder, state_dict=dict(full))  # (it empties the dict it is given)
    sf.save(way.models[0].state_dict(), os.path.join(folder, "sharded"))
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(5))
    logits = way.models[0](ids[way.rows()]).logits.detach()  # the sharded model's, for this rank's rows
    return ids, way.rows(), logits, (full if dist.get_rank() == 0 else None)


def test_leaving_shardfn_a_trained_model_is_an_ordinary_transformers_model(gloo4, tmp_path):
    import transformers

    from tests.scripts.resume import gpt2

    ids, rows, sharded_logits, full = gloo4.run(_leaving_body, str(tmp_path))[0]
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()  # what save_pretrained wrote
    plain = gpt2().eval()
    plain.load_state_dict(full)
    torch.testing.assert_close(back(ids).logits, plain(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(back(ids[rows]).logits, sharded_logits, rtol=1e-5, atol=1e-5)
    # and the sharded checkpoint (4 ranks' pieces) read whole into an ordinary model in one process
    offline = gpt2().eval()
    sf.load(offline, tmp_path / "sharded")
    torch.testing.assert_close(offline(ids).logits, plain(ids).logits, rtol=0, atol=0)
    # the way back in: save_pretrained's folder into a sharded model (tests/test_transformers_models.py)


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
