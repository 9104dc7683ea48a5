"""Golden plans on simulated worlds (no processes): Alpa's MLP, Megatron's transformer layer, and the three
levels each winning on their own objective."""

import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import shardfn as sf
from tests.models import GPTBlock, NormedMLP


def mlp(x, *weights):
    for i, w in enumerate(weights):
        x = x @ w
        if i < len(weights) - 1:
            x = torch.relu(x)
    return x


def _mlp_args(batch, hidden, layers):
    """Alpa's MLP as a function: weights passed in whole (their gradients go back whole)."""
    x = torch.empty(batch, hidden, device="meta")  # the input needs no gradient
    return [x] + [torch.empty(hidden, hidden, device="meta", requires_grad=True) for _ in range(layers)]


def _mlp_module(hidden, layers):
    """Alpa's MLP as a module: weights are parameters, laid out as planned and kept that way."""
    blocks = []
    for i in range(layers):
        blocks.append(torch.nn.Linear(hidden, hidden, bias=False))
        if i < layers - 1:
            blocks.append(torch.nn.ReLU())
    with torch.device("meta"):
        return torch.nn.Sequential(*blocks).to("meta")


def _weights(plan):
    return [n.outputs[0][0] for n in plan.nodes.values() if n.op == "input" and n.name.endswith("weight")]


@pytest.mark.parametrize("layers", [2, 4, 6])
def test_alpa_mlp_small_batch_plans_megatron_pairs(layers):
    x = torch.empty(32, 8192, device="meta")  # the input needs no gradient
    plan = sf.explain(_mlp_module(8192, layers), x, in_strategy=(None,), world_size=4, level=2, device="cuda")
    assert {c.kind for c in plan.collectives} == {"all_reduce"}, plan
    assert plan.count("all_reduce", "forward") == layers // 2
    assert plan.count("all_reduce", "backward") == layers // 2 - 1
    assert all(c.nbytes == 32 * 8192 * 4 for c in plan.collectives)  # activations, never weights
    # nn.Linear weights are (out, in): column-parallel splits dim 0, row-parallel dim 1
    assert _weights(plan) == [Shard(0), Shard(1)] * (layers // 2)


@pytest.mark.parametrize("level", [0, 2])
def test_alpa_mlp_large_batch_plans_data_parallel(level):
    layers = 4
    x = torch.empty(16384, 512, device="meta")
    plan = sf.explain(_mlp_module(512, layers), x, in_strategy=(None,), out_strategy=((4, 1),), world_size=4,
                      level=level, device="cuda")
    assert plan.count("all_reduce", "backward") == layers, plan  # one per weight gradient
    assert len(plan.collectives) == layers
    assert all(c.nbytes == 512 * 512 * 4 for c in plan.collectives)
    assert all(w.is_replicate() for w in _weights(plan))


def test_gradient_reductions_fused_in_one_bucket_share_one_latency(monkeypatch):
    # data parallel's 4 weight gradients (1 MiB each) fit one 25 MiB bucket, which exec runs as one all-reduce:
    # the estimate counts one collective's latency for the four, not four
    from shardfn.strategy_search import cost_model as cm

    def comm_s():
        x = torch.empty(16384, 512, device="meta")
        return sf.explain(_mlp_module(512, 4), x, in_strategy=(None,), out_strategy=((4, 1),), world_size=4,
                          level=2, device="cuda").cost.comm_s

    fused = comm_s()
    monkeypatch.setenv("SHARDFN_BUCKET_MB", "0")  # fusion off: each gradient its own all-reduce
    op = cm.CommOp("all_reduce", 0, 512 * 512 * 4)
    latency = cm.collective_seconds(op, (4,), cm.H100) - cm.collective_seconds(op, (4,), cm.H100, latency_share=0)
    assert comm_s() - fused == pytest.approx(3 * latency)


def test_whole_weights_passed_to_a_function_pay_for_their_gradients():
    # the same small-batch MLP as a function of whole weights: a sharded weight's gradient must be gathered
    # back whole (8192^2 floats), which costs more than the compute it saves: the plan stays replicated
    args = _mlp_args(32, 8192, 2)
    plan = sf.explain(mlp, *args, in_strategy=(None,) * 3, world_size=4, level=2, device="cuda")
    assert plan.collectives == ()


MEGATRON = {"attn.q.weight": (4, 1), "attn.k.weight": (4, 1), "attn.v.weight": (4, 1), "attn.q.bias": (4,),
            "attn.v.bias": (4,), "attn.proj.weight": (1, 4), "fc.weight": (4, 1), "fc.bias": (4,),
            "out.weight": (1, 4)}


def test_transformer_layer_tensor_parallel_costs_two_all_reduces_each_way():
    with torch.device("meta"):
        block = GPTBlock(4096, 32)
    x = torch.empty(2, 512, 4096, device="meta", requires_grad=True)
    plan = sf.explain(block, x, in_strategy=(None,), parameter_plan=MEGATRON, world_size=4, level=2, device="cuda")
    assert plan.count("all_reduce", "forward") == 2, plan
    assert plan.count("all_reduce", "backward") == 2, plan
    assert len(plan.collectives) == 4


def test_levels_differ_and_each_wins_its_own_objective():
    args = _mlp_args(32, 8192, 4)
    plans = {level: sf.explain(mlp, *args, in_strategy=(None,) * len(args), world_size=4, level=level)
             for level in (0, 1, 2)}
    layouts = {level: tuple(n.outputs for n in p.nodes.values()) for level, p in plans.items()}
    assert len(set(layouts.values())) == 3, "the three objectives disagree here: the plans must differ"
    ratio = {lv: p.cost.ratio for lv, p in plans.items()}
    time = {lv: p.cost.total_s for lv, p in plans.items()}
    peak = {lv: p.cost.peak_bytes for lv, p in plans.items()}
    assert ratio[0] >= max(ratio[1], ratio[2])
    assert peak[1] <= min(peak[0], peak[2])
    assert time[2] <= min(time[0], time[1])
    # strictly, where they disagree (level 1 may find a plan as fast as level 2's with less memory: the fastest
    # plan need not be the leanest one)
    assert ratio[0] > ratio[2] and peak[1] < peak[2]


def _deep_mlp(layers):
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(8192, 8192, bias=False) for _ in range(layers)])


def test_level_2_respects_the_memory_limit():
    # 100 trainable 8192^2 fp32 layers: 27 GB of weights, 107 GB with gradients and AdamW's two states, more
    # than an H100's 80 GB unless sharded; the fastest plan (replicated weights, data parallel) must give way
    x = torch.empty(4096, 8192, device="meta")
    plan = sf.explain(_deep_mlp(100), x, in_strategy=(None,), world_size=4, level=2, device="cuda")
    assert 0 < plan.cost.peak_bytes <= 80e9
    weights = [n.outputs[0] for n in plan.nodes.values() if n.op == "input" and n.name.endswith("weight")]
    assert len(weights) == 100 and all(not w[0].is_replicate() for w in weights)
    # none fits: the error gives the fastest plan's figures and what would (once only "use level=1")
    with pytest.raises(ValueError, match=r"level=2: no plan found fits.*alone are 400\.0 GiB, at least 6 ranks"):
        sf.explain(_deep_mlp(400), x, in_strategy=(None,), world_size=4, level=2, device="cuda")


@pytest.mark.parametrize("level", [0, 1, 2])
def test_no_level_returns_a_plan_over_the_memory_and_the_error_says_what_would_fit(level):
    # 20 trainable 32768^2 layers: 86 GB of weights, 344 GB with gradients and AdamW's states: more than 4 H100s
    # hold whatever the split; every level says so with the figures (once levels 0 and 1 returned such a plan)
    with torch.device("meta"):
        wide = torch.nn.Sequential(*[torch.nn.Linear(32768, 32768, bias=False) for _ in range(20)])
    with pytest.raises(ValueError, match=rf"level={level}: no plan (found )?fits the per-rank memory") as e:
        sf.explain(wide, torch.empty(64, 32768, device="meta"), in_strategy=(None,), world_size=4, level=level,
                   device="cuda")
    if level == 1:  # the least-memory plan: its figures and the ways out
        assert re.search(r"peak is \d+\.\d GiB a rank.*more ranks: the parameters, gradients and optimizer "
                         r"states alone are 320\.0 GiB, at least 5 ranks.*recompute", str(e.value))


def test_a_plan_over_a_cpu_ranks_memory_is_returned_with_a_warning():
    # a CPU rank's memory is a share of its host's (the profile's 16 GB is nominal): the plan comes back, said
    from shardfn.strategy_search.search import PlanMemoryWarning

    with torch.device("meta"):
        wide = torch.nn.Sequential(*[torch.nn.Linear(32768, 32768, bias=False) for _ in range(6)])
    with pytest.warns(PlanMemoryWarning, match=r"level=1: no plan found fits the per-rank memory of the cpu"):
        plan = sf.explain(wide, torch.empty(64, 32768, device="meta"), in_strategy=(None,), world_size=4, level=1)
    assert plan.cost.peak_bytes > 16e9 and any("no plan found fits" in n for n in plan.notes)


def test_outputs_that_alone_overflow_a_cpu_rank_are_said_without_reading_out_plans_that_cannot_fit(monkeypatch):
    # the output returned whole, (524288, 4096) fp32, 8 GiB, and its gradient arriving so: 16 GiB on every rank
    # whatever the layouts, over the CPU profile's nominal 14.9. The search's estimate counts them, so no try
    # fits it and none is read out but the last: the fastest plan, returned with its figures (once, each try
    # read out walked 28 GiB against an estimate at the budget: a Llama-3-8B shape took 5.8 s to say so)
    from shardfn.strategy_search import search
    from shardfn.strategy_search.search import PlanMemoryWarning

    reads = []
    real = search.read_plan
    monkeypatch.setattr(search, "read_plan", lambda *a: reads.append(1) or real(*a))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 4096))
    with pytest.warns(PlanMemoryWarning, match=r"level=2: no plan found fits.*the caller holds 8\.0 GiB of them"):
        plan = sf.explain(model, torch.empty(524288, 4096, device="meta"), in_strategy=((4, 1),), world_size=4,
                          level=2)
    assert len(reads) == 1 and plan.cost.peak_bytes > 16 * 2**30


def test_level_0_keeps_the_memory_limit_where_a_plan_within_it_exists():
    # 25 trainable 16384^2 layers: 107 GB with gradients and AdamW's states replicated (level 0's best ratio),
    # 27 GB split over 4 ranks: level 0 gives the best ratio among the plans that fit
    with torch.device("meta"):
        deep = torch.nn.Sequential(*[torch.nn.Linear(16384, 16384, bias=False) for _ in range(25)])
    plan = sf.explain(deep, torch.empty(1024, 16384, device="meta"), in_strategy=(None,), world_size=4, level=0,
                      device="cuda")
    assert 0 < plan.cost.peak_bytes <= 80e9


def test_the_peak_counts_outputs_as_the_call_returns_them():
    # y = x @ w split by rows on 8 ranks: returned whole, every rank holds all of y's 256 MiB (it once counted
    # only its piece, the same peak as y returned split)
    x, w = torch.empty(8192, 1024, device="meta"), torch.empty(1024, 8192, device="meta")
    peaks = {out: sf.explain(lambda x, w: x @ w, x, w, world_size=8, in_strategy=((8, 1), None), out_strategy=out,
                             level=2, device="cuda").cost.peak_bytes for out in (None, ((8, 1),))}
    y = 8192 * 8192 * 4
    assert peaks[None] - peaks[((8, 1),)] == y  # the whole copy made at the exit, beside the piece


def test_updates_of_buffers_are_written_where_the_buffers_are_held():
    # BatchNorm's running statistics: the copy_ into each buffer is planned in the buffer's own (whole) layout;
    # the arithmetic producing the update stays free to run split
    model = NormedMLP().to("meta")
    plan = sf.explain(model, torch.empty(8, 16, device="meta"), world_size=4, in_strategy=((4, 1),))
    writes = [p for p in plan.nodes.values() if p.op == "aten.copy_.default"]
    assert len(writes) == 3  # running_mean, running_var, num_batches_tracked
    whole = (Replicate(),)
    assert all(p.inputs[0] == whole and p.outputs[0] == whole for p in writes)
    assert any(p.outputs[0] != whole for p in plan.nodes.values() if p.op == "aten.mul.Tensor")


@pytest.mark.parametrize("level", [0, 2])
def test_data_parallel_mode_plans_data_parallelism(level):
    # the batch stays split, every parameter whole, one all-reduce per gradient, nothing else
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 8))
    plan = sf.explain(mlp, torch.empty(4, 16), in_strategy=(None,), dataset_strategy="data_parallel",
                      level=level, world_size=4)
    assert [(c.kind, c.phase) for c in plan.collectives] == [("all_reduce", "backward")] * 6, str(plan)
    assert all(i.planned == (Replicate(),) for i in plan.inputs if i.kind == "param")


def _llama_on_8_x_8(links=None):
    """A small transformers Llama (hidden 1024, 2 layers) on 8 x 8 ("dp", "tp") ranks of H100s, tokens over "dp"."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=2048)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    entry = sf.Layout((8, 8), ("dp", "tp"), links=links)("dp", "None")
    return sf.explain(model, ids, world_size=64, in_strategy={"input_ids": entry, "labels": entry},
                      kwargs=dict(labels=ids, use_cache=False), level=2, device="cuda")


def _within_layers(plan):
    """The forward collectives of activations between two ops of the layers (tensor parallelism's: a layer's
    hidden states, MiBs; not a norm's statistics of a few KiB)."""
    return [c for c in plan.collectives if c.phase == "forward" and c.nbytes >= 2**20 and
            all(n in plan.nodes and plan.nodes[n].module.startswith("model.layers.") for n in c.where.split(" -> "))]


def test_tensor_parallelism_runs_within_a_node():
    # 64 H100s, 8 a node: "tp" (inner) is NVLink, "dp" (outer) InfiniBand. Megatron's activation collectives
    # (per layer: 2 gathers/all-reduces in forward) go over "tp"; with one link for every dim they ran over "dp"
    plan = _llama_on_8_x_8()
    assert plan.mesh.links == ("inter", "intra")
    assert "dp=8 (inter) x tp=8 (intra)" in str(plan)
    tp = _within_layers(plan)
    assert len(tp) >= 2 * 2 and all(c.mesh_dims == (1,) for c in tp), [(c.kind, c.mesh_dims) for c in tp]
    q = next(e for e in plan.inputs if e.name.endswith("layers.0.self_attn.q_proj.weight"))
    assert q.planned[0] == Replicate() and isinstance(q.planned[1], Shard)
    assert sf.Plan.from_json(plan.to_json()).mesh.links == ("inter", "intra")
    # the user says the outer axis is the one within a node: the same collectives go over "dp"
    swapped = _llama_on_8_x_8(("intra", "inter"))
    assert swapped.mesh.links == ("intra", "inter")
    dp = _within_layers(swapped)
    assert len(dp) >= 2 * 2 and all(c.mesh_dims == (0,) for c in dp), [(c.kind, c.mesh_dims) for c in dp]


def test_layouts_that_disagree_on_links_are_refused():
    dp_tp = sf.Layout((2, 2), ("dp", "tp"), links=("inter", "intra"))
    other = sf.Layout((2, 2), ("dp", "tp"), links=("intra", "intra"))
    x = torch.empty(8, 8, device="meta")
    with pytest.raises(ValueError, match="in_strategy: the Layouts given say both 'inter' and 'intra' for axis 'dp'"):
        sf.explain(lambda a, b: a + b, x, x, in_strategy=(dp_tp("dp", "tp"), other("dp", "tp")), world_size=4)
