"""transformers' mixtures of experts (Mixtral, Qwen2-MoE) trained with their experts split over the ranks, against
the unsharded model (tests/moe_models.py): losses, the load-balancing loss, every gradient (router included) and
the parameters after AdamW steps equal, on 4 simulated ranks and on 4 real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import local_tensor_mode

pytest.importorskip("transformers")

from shardfn.runtime import simulated_world  # noqa: E402
from tests.harness import on_rank  # noqa: E402
from tests.moe_models import bytes_priced_over_latency, train_and_compare  # noqa: E402

WORLD = 4


def _simulated_slice(t):
    per = t.shape[0] // WORLD
    return local_tensor_mode().rank_map(lambda r: on_rank(t, r)[per * r: per * (r + 1)].clone())


# eager: the experts class's own loop over the experts hit (nonzero), run inside the captured op
@pytest.mark.parametrize("name, impl", [("mixtral", "grouped_mm"), ("qwen2_moe", "batched_mm"), ("mixtral", "eager")])
def test_experts_split_train_like_unsharded_on_simulated_ranks(name, impl):
    with simulated_world(WORLD):
        _, split = train_and_compare(name, impl, WORLD, ranks=WORLD)
    assert split, "the plan did not split the experts"


def test_data_parallel_with_split_expert_storage_trains_like_unsharded():
    # the batch split over the ranks and the experts stored split over the same ranks: the search decides how they
    # meet, and with experts' weights far larger than the tokens it dispatches the tokens to the experts (expert
    # parallelism; data parallelism is kept: the tokens come back split) rather than gathering the weights
    with simulated_world(WORLD):
        _, split = train_and_compare("mixtral", "grouped_mm", WORLD, _simulated_slice, ranks=WORLD, steps=2)
    assert split, "the plan gathered the experts' weights"


def _dispatched(model, ids) -> bool:
    import shardfn as sf

    plan = sf.explain(model, ids, kwargs=dict(labels=ids, use_cache=False))
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    moved = {c.kind for c in plan.collectives if c.where.endswith("(dispatch)")}  # (the group's experts gathered)
    said = [line for line in str(plan).splitlines() if line.startswith("experts ")]
    return bool(calls) and all(n.run == "dispatch" for n in calls) and moved == {"all_gather", "all_to_all"} \
        and all("all_to_all" in line for line in said)


# the batch split over the ranks, the experts stored split over them: each (token, slot) pair sent to the rank
# holding its expert and back (all_to_all), the tokens never gathered; every number as unsharded
@pytest.mark.parametrize("name, impl", [("mixtral", "grouped_mm"), ("qwen2_moe", "batched_mm"),
                                        ("deepseek_v3", "grouped_mm"), ("qwen2_moe", "eager")])
def test_tokens_dispatched_to_their_experts_train_like_unsharded(name, impl):
    with simulated_world(WORLD), bytes_priced_over_latency():
        _, dispatched = train_and_compare(name, impl, WORLD, _simulated_slice, ranks=WORLD, steps=2,
                                          checked=_dispatched)
    assert dispatched, "the plan did not dispatch the tokens to their experts"


def test_data_parallel_generate_with_the_tokens_dispatched_gives_each_rank_its_rows():
    # generate() with its cache, each rank its own row, the experts stored split: every step (the prompt, then one
    # token a row) sends each rank's pairs to their experts' ranks; each rank's tokens and scores as unsharded
    import copy

    import torch

    import shardfn as sf
    from shardfn.runtime import simulated_map
    from tests.moe_models import expert_plan, make

    with simulated_world(WORLD), bytes_priced_over_latency():
        torch.manual_seed(0)
        reference = make("mixtral").eval()
        reference.config.output_router_logits = False
        model = sf.shard(copy.deepcopy(reference), in_strategy={}, parameter_plan=expert_plan(WORLD),
                         dataset_strategy="data_parallel", level=2)
        ids = torch.randint(0, 64, (WORLD, 5))
        kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True)
        mine = lambda t: simulated_map(t, lambda r, v: v[r][r:r + 1].clone())  # noqa: E731
        with torch.no_grad():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            got = model.generate(mine(ids), attention_mask=mine(torch.ones_like(ids)), **kwargs)
            for r in range(WORLD):
                assert torch.equal(on_rank(got.sequences, r), on_rank(want.sequences, r)[r:r + 1])
                for g, w in zip(got.scores, want.scores):
                    torch.testing.assert_close(on_rank(g, r), on_rank(w, r)[r:r + 1], rtol=1e-5, atol=1e-5)
            one = mine(ids[:, :1])
            plan = sf.explain(model, one, kwargs=dict(attention_mask=mine(torch.ones_like(ids[:, :1]))))
        assert [n.run for n in plan.nodes.values() if n.op == "MoEExperts.apply"] == ["dispatch"] * 2


def _new_empty_split(model, ids) -> bool:
    import shardfn as sf

    plan = sf.explain(model, ids, kwargs=dict(labels=ids, use_cache=False))
    made = [n for n in plan.nodes.values() if n.op == "aten.new_empty.default"]
    return bool(made) and all(n.run == "local" and not n.outputs[0][0].is_replicate() for n in made)


def test_deepseek_v3_trains_like_unsharded_with_its_keys_made_split():
    # DeepSeek-V3's attention (MLA) makes its keys with new_empty and writes its two parts into it: each rank
    # makes its own piece (here of its rows of the batch), none the whole; the experts split, the batch data
    # parallel, the shared expert and the grouped router as the search decides. Three layers: the third is
    # captured as a copy of the first (shardfn.capture.repeated), its experts' Function call a call of its own
    with simulated_world(WORLD):
        _, split = train_and_compare("deepseek_v3", "grouped_mm", WORLD, _simulated_slice, ranks=WORLD, steps=2,
                                     checked=_new_empty_split, layers=3)
    assert split


def _loss_and_gradients_alike(model, out, reference, ref) -> None:
    """One backward of each: the losses and every parameter's gradient equal on every rank."""
    from torch.distributed.tensor import DTensor

    out.loss.backward()
    ref.loss.backward()
    for r in range(WORLD):
        torch.testing.assert_close(on_rank(out.loss, r), on_rank(ref.loss, r))
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for r in range(WORLD):
            torch.testing.assert_close(on_rank(g, r), on_rank(q.grad, r), rtol=1e-4, atol=1e-5, msg=n)


def test_experts_over_one_mesh_dim_of_two():
    # a 2 x 2 mesh: the tokens given split over "dp", the experts stored split over "ep": the experts run split over
    # "ep"; loss and every gradient as unsharded
    import copy

    import torch
    from torch.distributed.tensor import Shard

    import shardfn as sf
    from tests.moe_models import LAYERS, batch, make

    mesh = sf.Layout((2, 2), ("dp", "ep"))
    experts = {f"model.layers.{i}.mlp.experts.{w}": mesh("ep", "None", "None")
               for i in range(LAYERS) for w in ("gate_up_proj", "down_proj")}
    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = make("mixtral")
        model = sf.shard(copy.deepcopy(reference), in_strategy={"input_ids": mesh("dp", "None")},
                         parameter_plan=experts, level=2)
        ids, kwargs = batch(0)
        out, ref = model(ids, **kwargs), reference(ids, **kwargs)
        _loss_and_gradients_alike(model, out, reference, ref)
        plan = sf.explain(model, ids, kwargs=kwargs)
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    assert calls and all(n.inputs[4][1] == Shard(0) for n in calls)
    # explain() and the plan page say which mesh dim holds the experts, and how the tokens meet them
    said = [line for line in str(plan).splitlines() if line.startswith("experts ")]
    assert said == [f"experts model.layers.0-{LAYERS - 1} (x{LAYERS}): split over ep (1/2 of the experts a rank; every token's share from each rank's experts summed "
                    "over ep)"], str(plan)
    from shardfn.show.plan_page import render_page

    assert "data-fact='experts'" in render_page(plan)


def test_tokens_dispatched_over_one_mesh_dim_of_two():
    # a 2 x 2 mesh, the batch over both dims, the experts stored split over "ep": each call dispatches the tokens
    # over one dim (its all_to_all on that dim's groups alone); loss and every gradient as unsharded
    import copy

    import shardfn as sf
    from tests.moe_models import LAYERS, batch, make

    mesh = sf.Layout((2, 2), ("dp", "ep"))
    experts = {f"model.layers.{i}.mlp.experts.{w}": mesh("ep", "None", "None")
               for i in range(LAYERS) for w in ("gate_up_proj", "down_proj")}
    with simulated_world(WORLD), bytes_priced_over_latency():
        torch.manual_seed(0)
        reference = make("mixtral")
        model = sf.shard(copy.deepcopy(reference), in_strategy={"input_ids": mesh(("dp", "ep"), "None")},
                         parameter_plan=experts, level=2, dataset_strategy="data_parallel")
        ids, kwargs = batch(0)
        mine = _simulated_slice(ids)  # each rank its row of the batch
        out, ref = model(mine, labels=mine, use_cache=False), reference(ids, **kwargs)
        _loss_and_gradients_alike(model, out, reference, ref)
        plan = sf.explain(model, mine, kwargs=dict(labels=mine, use_cache=False))
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    assert calls and all(n.run == "dispatch" for n in calls), [(n.run, n.inputs[0], n.inputs[4]) for n in calls]
    assert {c.mesh_dims for c in plan.collectives if c.where.endswith("(dispatch)")} in ({(0,)}, {(1,)})


def test_experts_split_unevenly_train_like_unsharded():
    # 6 experts over 4 ranks as DTensor lays them out: 2, 2, 2 and none (that rank contributes nothing)
    with simulated_world(WORLD):
        _, split = train_and_compare("mixtral", "grouped_mm", WORLD, ranks=WORLD, steps=2, experts=6)
    assert split


def test_generate_gives_the_unsharded_tokens():
    import copy

    import torch

    import shardfn as sf
    from tests.moe_models import expert_plan, make

    import warnings

    from shardfn.strategy_search.candidates import ReplicatedFallbackWarning

    with simulated_world(WORLD), warnings.catch_warnings():
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
            # torch 2.11's DTensor has no rule for aten.index.Tensor (a generation's cache update): run whole, correct
            warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        torch.manual_seed(0)
        reference = make("mixtral").eval()
        reference.config.output_router_logits = False  # its aux loss is for training (and refuses a cache's mask)
        model = sf.shard(copy.deepcopy(reference), in_strategy={}, parameter_plan=expert_plan(WORLD), level=2)
        ids = torch.randint(0, 64, (2, 5))
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        got, want = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        for r in range(WORLD):
            assert torch.equal(on_rank(got, r), on_rank(want, r))


def _train_body(name, impl):
    return train_and_compare(name, impl, dist.get_world_size())


def _dispatched_in_traced_graphs(model, ids) -> bool:
    """The plan dispatches, and the per-rank graphs real ranks run call the dispatch forward and backward."""
    import shardfn as sf

    def called(graph, op) -> int:
        return sum(n.target is op for n in graph.graph.nodes)

    programs = [c.program.graphs for c in sf.engine_of(model).programs.values()]
    return _dispatched(model, ids) and bool(programs) and all(
        called(g["forward"], torch.ops.shardfn.moe_dispatch.default) == 2 and
        called(g["backward"], torch.ops.shardfn.moe_dispatch_backward.default) == 2 for g in programs)


def _dispatched_body():
    world, rank = dist.get_world_size(), dist.get_rank()
    with bytes_priced_over_latency():
        return train_and_compare("mixtral", "grouped_mm", world, lambda t: t.chunk(world)[rank], steps=2,
                                 checked=_dispatched_in_traced_graphs)


def _deepseek_body():
    world, rank = dist.get_world_size(), dist.get_rank()
    return train_and_compare("deepseek_v3", "grouped_mm", world, lambda t: t.chunk(world)[rank], steps=2,
                             checked=_new_empty_split, layers=3)


@pytest.mark.parametrize("name, impl", [("mixtral", "grouped_mm"), ("qwen2_moe", "grouped_mm"), ("qwen2_moe", "eager")])
def test_experts_split_train_like_unsharded_on_real_ranks(gloo4, name, impl):
    results = gloo4.run(_train_body, name, impl)
    assert all(r == results[0] for r in results), results
    assert results[0][1], "the plan did not split the experts"


def test_deepseek_v3_trains_like_unsharded_on_real_ranks(gloo4):
    # the traced per-rank graphs make each rank's piece of MLA's keys (new_empty at the piece's size); the third
    # layer captured as a copy of the first (shardfn.capture.repeated), as on simulated ranks
    results = gloo4.run(_deepseek_body)
    assert all(r[1] for r in results), "the plan did not split the experts or made MLA's keys whole"


def test_tokens_dispatched_to_their_experts_on_real_ranks(gloo4):
    # the traced per-rank graphs: the dispatch's all_to_alls on gloo, with this step's counts
    results = gloo4.run(_dispatched_body)
    assert all(r[1] for r in results), "the plan did not dispatch the tokens to their experts"
