"""transformers' experts captured (shardfn/capture/experts.py): grouped_mm and batched_mm as one MoEExperts call a
layer, a program that runs at any routing without capturing again; other experts modules' grouped matmul as
ExpertMM; the eager implementation refused with the implementation that works."""

import copy

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

pytest.importorskip("transformers")

import shardfn as sf  # noqa: E402
from shardfn.capture import CaptureError  # noqa: E402
from shardfn.runtime import simulated_world  # noqa: E402
from shardfn.strategy_search.candidates import ReplicatedFallbackWarning  # noqa: E402
from tests.harness import on_rank  # noqa: E402
from tests.moe_models import batch, expert_plan, make  # noqa: E402

WORLD = 2


def _ops(plan) -> list[str]:
    return [n.op for n in plan.nodes.values()]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_experts_are_one_call_a_layer(impl):
    ids, kwargs = batch(0)
    plan = sf.explain(make("mixtral", impl), ids, world_size=WORLD, in_strategy=(None,), kwargs=kwargs)
    assert _ops(plan).count("MoEExperts.apply") == 2  # two layers
    assert not any("nonzero" in op or "grouped_mm" in op for op in _ops(plan))


def test_eager_experts_outside_the_op_are_refused_naming_the_implementation_that_works():
    # an experts module MoEExperts does not cover (here one said to have biases) keeps its own eager loop, whose
    # nonzero reads the routing as it is traced
    ids, kwargs = batch(0)
    model = make("mixtral", "eager")
    for layer in model.model.layers:
        layer.mlp.experts.has_bias = True
    with pytest.raises(CaptureError, match="nonzero") as e:
        sf.explain(model, ids, world_size=WORLD, in_strategy=(None,), kwargs=kwargs)
    assert "set_experts_implementation('grouped_mm')" in str(e.value) and "MixtralExperts" in str(e.value)


def _run_at_two_routings(model: torch.nn.Module):
    """The sharded model (experts split) and eager at two routings of one shape: outputs and gradients equal,
    fn captured once."""
    reference = copy.deepcopy(model)
    sharded = sf.shard(model, in_strategy=(None,), parameter_plan=expert_plan(WORLD), level=2)
    routes = []
    for step in range(2):
        ids, kwargs = batch(step)
        if step:  # another router: other experts for the same tokens
            with torch.no_grad():
                for m, r in zip(sharded.model.layers, reference.model.layers):
                    w = torch.randn(r.mlp.gate.weight.shape)
                    r.mlp.gate.weight.copy_(w)
                    mine = m.mlp.gate.weight
                    mine.copy_(distribute_tensor(w, mine.device_mesh, mine.placements))
        out, ref = sharded(ids, **kwargs), reference(ids, **kwargs)
        out.loss.backward()
        ref.loss.backward()
        for r in range(WORLD):
            torch.testing.assert_close(on_rank(out.logits, r), on_rank(ref.logits, r), rtol=1e-4, atol=1e-5)
        for (n, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for r in range(WORLD):
                torch.testing.assert_close(on_rank(g, r), on_rank(q.grad, r), rtol=1e-4, atol=1e-5, msg=n)
        sharded.zero_grad()
        reference.zero_grad()
        routes.append(on_rank(ref.router_logits[0].topk(2).indices, 0))
    assert not torch.equal(*routes), "the routing did not change"
    assert sf.engine_of(sharded).captures == 1
    return sf.explain(sharded, *batch(0)[:1], kwargs=batch(0)[1])


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_one_program_runs_at_any_routing(impl):
    with simulated_world(WORLD):
        torch.manual_seed(0)
        plan = _run_at_two_routings(make("mixtral", impl))
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    assert calls and all(n.inputs[4] == (Shard(0),) for n in calls)


def test_other_experts_modules_split_their_grouped_matmul():
    # an experts module MoEExperts does not take (here: one marked as not concatenated) keeps its traced ops, the
    # grouped matmul as ExpertMM (its rule: the experts split too)
    with simulated_world(WORLD), warnings.catch_warnings():
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
            # torch 2.11's DTensor has no rule for aten.index.Tensor (the routing's gather): it runs whole, correct
            warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        torch.manual_seed(0)
        model = make("mixtral", "grouped_mm")
        for layer in model.model.layers:
            layer.mlp.experts.is_concatenated = False
        plan = _run_at_two_routings(model)
    assert "MoEExperts.apply" not in _ops(plan) and _ops(plan).count("ExpertMM.apply") == 4
