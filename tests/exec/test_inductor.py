"""SHARDFN_COMPILE=1: the per-rank forward and backward graphs compiled by Inductor (collectives, fused gradient
buckets and all), on 2 real gloo ranks, and in a world of one; results and gradients as eager's.
Compiling costs tens of seconds on this CPU, so one small block covers tensor and data parallelism."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn.exec.lower import use_inductor
from shardfn.runtime import simulated_world
from tests.harness import RankPool
from tests.models import BasicBlock

# BasicBlock: Dense(32->64) - GELU - Dense(64->32); Megatron on 2 ranks, or the batch split 2 ways
PLANS = {
    "tp": dict(in_strategy=(None,), parameter_plan={"dense1.weight": (2, 1), "dense1.bias": (2,),
                                                    "dense2.weight": (1, 2)}),
    "dp": dict(in_strategy=((2, 1),)),
}


def _compiled_body(name):
    import os

    os.environ["SHARDFN_COMPILE"] = "1"
    torch.manual_seed(0)
    reference = BasicBlock()
    model = sf.shard(copy.deepcopy(reference), **PLANS[name])
    for step in range(2):  # the first call compiles, the second runs the compiled code again
        torch.manual_seed(step)
        x = torch.randn(8, 32, requires_grad=True)
        rx = x.detach().clone().requires_grad_()
        y, ref = model(x), reference(rx)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        y.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x.grad, rx.grad, rtol=1e-5, atol=1e-5)
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")
    # the same signature in other strides: Inductor's code assumed the traced ones
    xt = torch.randn(32, 8).t().requires_grad_()
    rxt = xt.detach().clone().requires_grad_()
    y, ref = model(xt), reference(rxt)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xt.grad, rxt.grad, rtol=1e-5, atol=1e-5)
    (compiled,) = sf.engine_of(model).programs.values()
    return sorted(compiled.program.compile_s)


@pytest.fixture(scope="module")
def gloo2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_inductor_compiled_graphs_match_eager(gloo2, name):
    assert gloo2.run(_compiled_body, name) == [["backward", "forward"]] * 2


def test_world_of_one_compiles_the_whole_graph(monkeypatch):
    monkeypatch.setenv("SHARDFN_COMPILE", "1")
    torch.manual_seed(0)
    reference = BasicBlock()
    x = torch.randn(8, 32)
    with simulated_world(1, local_tensors=False):  # a process group of one, tensors as they are
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,))
        torch.testing.assert_close(model(x), reference(x))
        plan = sf.explain(model, x)  # of the signature that ran: the plan that ran, with its compile times
    (compiled,) = sf.engine_of(model).programs.values()
    assert "forward" in compiled.program.compile_s  # Inductor's code ran, not the traced graph
    assert any(n.startswith("Inductor compiled the forward graph in") or
               n.startswith("Inductor loaded the forward graph from its cache in") for n in plan.notes)
    # the plan that ran, with the program's notes: the program keeps them, its plan stays as the search made it
    assert plan.nodes == compiled.plan.nodes and plan.notes[:len(compiled.plan.notes)] == compiled.plan.notes
    assert not any(n.startswith("Inductor") for n in compiled.plan.notes) and compiled.program.notes


def test_an_identical_layer_loads_its_graphs_from_inductors_cache(monkeypatch):
    # two blocks of the same shapes sharded apart trace the same graphs: the second's are not compiled again
    monkeypatch.setenv("SHARDFN_COMPILE", "1")
    x = torch.randn(8, 32, requires_grad=True)
    with simulated_world(1, local_tensors=False):
        notes = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            reference = BasicBlock()
            model = sf.shard(copy.deepcopy(reference), in_strategy=(None,))
            model(x).sum().backward()
            torch.testing.assert_close(model.dense1.weight.grad.full_tensor(),
                                       torch.autograd.grad(reference(x).sum(), reference.dense1.weight)[0])
            notes.append([n for n in sf.explain(model, x).notes if n.startswith("Inductor")])
    assert [n.split(" in ")[0] for n in notes[1]] == ["Inductor loaded the forward graph from its cache",
                                                      "Inductor loaded the backward graph from its cache"], notes


def test_the_setting_is_checked(monkeypatch):
    assert use_inductor("cuda") and not use_inductor("cpu")  # auto
    monkeypatch.setenv("SHARDFN_COMPILE", "1")
    assert use_inductor("cpu")
    monkeypatch.setenv("SHARDFN_COMPILE", "yes")
    with pytest.raises(ValueError, match="SHARDFN_COMPILE must be auto, 0 or 1"):
        use_inductor("cpu")


def test_world_of_one_replays_its_inference_graph(monkeypatch):
    # (on CUDA as a CUDA graph: here a recorder that reads the addresses it was captured on, tests/exec/test_replay)
    from shardfn.exec import replay, traced
    from tests.exec.test_replay import _Recorder

    recorder = _Recorder()
    monkeypatch.setattr(traced, "replayed",
                        lambda run, gm, device, note: replay.replayed(run, gm, "cpu", recorder, note))
    monkeypatch.setenv("SHARDFN_COMPILE", "1")
    torch.manual_seed(0)
    reference = BasicBlock()
    with simulated_world(1, local_tensors=False), torch.no_grad():
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,))
        for step in range(5):
            if step == 3:  # an update in place between calls: read where it lies
                for m in (model, reference):
                    m.dense1.weight.mul_(0.5)
            x = torch.randn(8, 32)
            torch.testing.assert_close(model(x), reference(x))
        notes = sf.explain(model, x).notes  # (the program's, with the plan that ran)
    (graph,) = recorder.graphs
    assert graph.replays == 4
    assert any(n.startswith("the inference graph replays as a CUDA graph: ") for n in notes), notes
