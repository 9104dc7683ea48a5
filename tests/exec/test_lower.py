"""lower(captured, plan, mesh): the plan is the whole hand-off (frozen, read once into the graph's nodes)."""

import dataclasses

import pytest
import torch

import shardfn as sf
from shardfn.exec.lower import lower
from shardfn.runtime import simulated_world


def _two_matmuls(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def _one_matmul(x, w1, w2):
    return x @ w1 + w2.sum()


def _args():
    torch.manual_seed(0)
    return torch.randn(8, 16), torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)


def test_a_plan_lowers_only_onto_the_graph_it_was_made_for():
    with simulated_world(4):
        x, w1, w2 = _args()
        f = sf.shard(_two_matmuls, in_strategy=((4, 1), None, None))
        torch.testing.assert_close(f(x, w1, w2), _two_matmuls(x, w1, w2))
        (ran,) = sf.engine_of(f).programs.values()
        other = sf.engine_of(sf.shard(_one_matmul, in_strategy=((4, 1), None, None)))
        planned = other.plan([x, w1, w2], {}, 4, "cpu")
        program = lower(ran.captured, ran.plan, ran.program.mesh)  # its own plan: resolved to every op
        assert set(program.node_plans) >= {n for n in ran.captured.gm.graph.nodes if n.op == "call_function"}
        with pytest.raises(ValueError, match="made for another graph"):
            lower(ran.captured, planned.plan, ran.program.mesh)


def test_the_plan_is_frozen_and_what_running_finds_is_kept_apart():
    with simulated_world(4):
        x, w1, w2 = _args()
        f = sf.shard(_two_matmuls, in_strategy=((4, 1), None, None))
        for _ in range(3):  # (the first call's time is left out of the measured step)
            f(x, w1, w2).sum().backward()
        plan = sf.explain(f, x, w1, w2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ("changed",)
    with pytest.raises(TypeError):
        plan.nodes["x"] = None
    with pytest.raises(AttributeError):
        plan.collectives.append(None)
    # explain of a signature that ran adds its measured step to a copy: the program's plan stays as made
    (ran,) = sf.engine_of(f).programs.values()
    assert plan.measured_s is not None and ran.plan.measured_s is None and plan.nodes == ran.plan.nodes
