"""Recompute as a decision of the search (strategy_search/recompute.py): which layers backward computes again,
chosen under the memory, priced as forward computed again, shown on the plan and steerable with recompute=."""

import re

import numpy as np
import pytest
import torch

import shardfn as sf
from tests.models import CheckpointedStack, GPTStack


_LAYERS = 24


def _big_stack():
    # 24 GPT layers of width 1024 at 64 x 2048 tokens on 2 H100s: about 9 GB kept for backward per layer whole,
    # over 80 GB a rank with everything kept; one layer's values at a time (and the layers' inputs) fit
    with torch.device("meta"):
        return GPTStack(_LAYERS, 1024, 16), torch.empty(64, 2048, 1024)


def _explain(model, x, **kwargs):
    return sf.explain(model, x, world_size=2, in_strategy=(None,), device="cuda", **kwargs)


def _last_pricing(monkeypatch, model, x, **kwargs):
    """(the search's last Pricing of ``sf.explain(model, x, in_strategy=(None,), **kwargs)``, its problem, its
    terms)."""
    from shardfn.strategy_search import search

    seen = []
    real = search.Pricing.terms
    monkeypatch.setattr(search.Pricing, "terms", lambda self, k=(): seen.append(self) or real(self, k))
    sf.explain(model, x, in_strategy=(None,), **kwargs)
    return seen[-1], seen[-1].problem, seen[-1].terms()


def test_level_2_recomputes_only_where_memory_binds_and_then_fits():
    model, x = _big_stack()
    with pytest.raises(ValueError, match=r"level=2: no plan.*or let the search recompute layers in backward "
                                         r"\(recompute=None\)"):
        _explain(model, x, level=2, recompute=False)
    plan = _explain(model, x, level=2)
    assert 0 < plan.cost.peak_bytes <= 80e9
    # the first blocks, as few as the memory needs (not all: each computed again costs its forward), chosen
    # by the search, with what each costs
    k = len(plan.recompute)
    assert 0 < k < _LAYERS and [r.region for r in plan.recompute] == [f"blocks.{i}" for i in range(k)]
    every = _explain(model, x, level=2, recompute=True)
    assert len(every.recompute) == _LAYERS and every.cost.peak_bytes < plan.cost.peak_bytes
    assert plan.cost.compute_s < every.cost.compute_s
    assert {r.origin for r in plan.recompute} == {"search"}
    assert all(r.saved_bytes > 0 and r.extra_s > 0 for r in plan.recompute)
    shown = r"blocks\.0" + (rf"-{k - 1} \(x{k}\)" if k > 1 else "")
    kept = r"matmuls,? (attention and reductions|and attention) kept"
    assert re.search(rf"recompute {shown}  \(chosen by the search(, selectively: {kept})?\): "
                     r"[\d.]+ MiB a rank not kept, [\d.]+ ms of forward again( each)?", str(plan)), str(plan)
    # a plan that fits without recompute keeps everything (the fastest)
    with torch.device("meta"):
        small = torch.empty(4, 2048, 1024)
    assert _explain(model, small, level=2).recompute == ()


def test_a_layer_recomputed_selectively_keeps_its_matmuls_and_attention():
    # Megatron's selective recompute: a layer's matmuls' and attention's results kept, the ops between them (norms,
    # gelu, bias adds, the heads' reshapes) computed again: less saved, for far less forward again. The search
    # tries it first (more bytes saved per second), and on the 24-layer stack it fits with it alone: faster than
    # recomputing whole layers (9 of them, 2.395 s estimated, before it was offered)
    model, x = _big_stack()
    plan = _explain(model, x, level=2)
    assert plan.recompute and all(r.selective for r in plan.recompute)
    every, selective = (_explain(model, x, level=2, recompute=r) for r in (True, "selective"))
    assert not any(r.selective for r in every.recompute) and all(r.selective for r in selective.recompute)
    assert len(selective.recompute) == _LAYERS == len(every.recompute)
    # (per layer: half the bytes whole recompute saves, a twentieth of its forward again)
    for part, whole in zip(selective.recompute, every.recompute):
        assert part.region == whole.region and whole.saved_bytes / 3 < part.saved_bytes < whole.saved_bytes
        assert part.extra_s < whole.extra_s / 10
        kept = [n for n in whole.nodes if n not in part.nodes]
        # (a 3-D product's _unsafe_view: no view to autograd, the kept product's own storage, what backward reads)
        assert kept and all(re.match(r"(mm|addmm|bmm|_scaled_dot_product|getitem|_unsafe_view)", n)
                            for n in kept), kept
        assert any(n.startswith("_scaled_dot_product") for n in kept) and any("mm" in n for n in kept)
    assert plan.cost.compute_s < 2.3 < every.cost.compute_s and plan.cost.peak_bytes <= 80e9
    assert "recompute blocks.0-23 (x24)  (recompute='selective')" in str(selective)
    assert re.search(r"recompute blocks\.0-\d+ \(x\d+\)  \(chosen by the search, selectively: matmuls, "
                     r"attention and reductions kept\)", str(plan)), str(plan)
    # a layer asked for whole is recomputed whole (not selectively)
    asked = _explain(model, x, level=2, recompute={"blocks.0": True})
    assert [(r.region, r.selective, r.origin) for r in asked.recompute][0] == ("blocks.0", False, "recompute=")


def test_probes_for_fewer_layers_recomputed_keep_the_fastest_plan(monkeypatch):
    # a probe's solve cut short by the time limit may be slower than the plan recomputing more (DeepSeek-V3's:
    # 8.76 s estimated against 4.57): the fastest plan that fits is returned, and each probe is optional
    import dataclasses

    from shardfn.strategy_search import recompute

    real, probes = recompute._planned, []

    def slower_probes(*args, optional=False, **kwargs):
        plan = real(*args, optional=optional, **kwargs)
        if optional:
            probes.append(plan)
            plan = dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, compute_s=10 * plan.cost.compute_s))
        return plan

    monkeypatch.setattr(recompute, "_planned", slower_probes)
    model, x = _big_stack()
    plan = _explain(model, x, level=2)
    assert probes and all(len(p.recompute) < len(plan.recompute) for p in probes)
    assert plan.cost.total_s < min(10 * p.cost.compute_s for p in probes)


def test_recompute_is_priced_as_forward_computed_again_and_walked_by_the_one_memory_model():
    # every layer recomputed against none, at one layout (data parallel): the compute grows by the forward of the
    # recomputed values (the plan's figure), the peak drops; the peak is the liveness walk's, as for checkpoint
    model, x = GPTStack(3, 16, 4), torch.randn(4, 8, 16)
    kept, again = (sf.explain(model, x, world_size=2, in_strategy=(None,), dataset_strategy="data_parallel",
                              level=2, recompute=r) for r in (False, True))
    assert kept.recompute == () and [r.region for r in again.recompute] == ["blocks.0", "blocks.1", "blocks.2"]
    # a recomputed op at the same layout: forward, backward (twice the forward) and its forward again
    same = [n for n in again.nodes.values() if n.compute_s and n.outputs == kept.nodes[n.name].outputs
            and n.inputs == kept.nodes[n.name].inputs]
    grown = [n for n in same if n.compute_s > kept.nodes[n.name].compute_s]
    assert len(grown) > 30
    assert all(n.compute_s == pytest.approx(kept.nodes[n.name].compute_s * 4 / 3, rel=1e-9) for n in grown)
    assert sum(r.extra_s for r in again.recompute) == pytest.approx(sum(n.compute_s / 4 for n in grown), rel=1e-9)
    assert again.cost.peak_bytes < kept.cost.peak_bytes
    walk = max(max(n.live_bytes or 0, n.backward_live_bytes or 0) for n in again.nodes.values())
    assert again.cost.peak_bytes == walk
    assert sf.Plan.from_json(again.to_json()).to_json() == again.to_json()
    assert sf.Plan.from_json(again.to_json()).recompute == again.recompute
    from shardfn.show.plan_page import render_page

    assert "<th>recompute</th><td>blocks.0-2 (x3)  (recompute=True):" in render_page(again)  # the plan page too


def test_level_1_recomputes_where_it_lowers_the_peak():
    model, x = GPTStack(3, 16, 4), torch.randn(8, 8, 16)
    never = sf.explain(model, x, world_size=2, in_strategy=(None,), level=1, recompute=False)
    chosen = sf.explain(model, x, world_size=2, in_strategy=(None,), level=1)
    assert chosen.recompute and chosen.cost.peak_bytes < never.cost.peak_bytes


def test_level_1_without_time_for_two_tries_tries_every_group_at_once(monkeypatch):
    # (DeepSeek-V3's level 1 had gone on for minutes past the limit: a solve per group, each tens of seconds; then
    # Llama-405B's try without recompute took its time and one with every group came after the limit)
    from shardfn.strategy_search import recompute

    class TwoKinds(torch.nn.Module):  # two groups of layers (identical layers group together)
        def __init__(self):
            super().__init__()
            self.wide = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                                torch.nn.Linear(64, 16)) for _ in range(2))
            self.narrow = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                                                  torch.nn.Linear(32, 16)) for _ in range(2))

        def forward(self, x):
            for layer in [*self.wide, *self.narrow]:
                x = x + layer(x)
            return x

    model, x = TwoKinds(), torch.randn(8, 8, 16)
    solves = []
    real = recompute._planned
    monkeypatch.setattr(recompute, "_planned", lambda *a, **k: solves.append(a[4]) or real(*a, **k))
    monkeypatch.setenv("SHARDFN_SEARCH_TIME_LIMIT", "1e-9")
    late = sf.explain(model, x, world_size=2, in_strategy=(None,), level=1)
    # no time for two tries: every group at once, and that try's plan (not solved again, nor tried without)
    assert len(solves) == 1 and len(solves[0]) > 1
    assert late.recompute


def test_hand_checkpointed_regions_stay_checkpointed_and_are_shown():
    x = torch.randn(8, 16, 16)
    for recompute in (None, False, True):
        plan = sf.explain(CheckpointedStack(True), x, world_size=4, in_strategy=(None,), level=2,
                          recompute=recompute)
        assert [r.origin for r in plan.recompute] == ["checkpoint", "checkpoint"], recompute
        assert "(checkpointed by hand)" in str(plan)
    kept, again = (sf.explain(CheckpointedStack(False), x, world_size=4, in_strategy=(None,), level=2,
                              recompute=r) for r in (False, True))
    by_hand = sf.explain(CheckpointedStack(True), x, world_size=4, in_strategy=(None,), level=2)
    # the search's regions walk as checkpoint's do (the captured regions differ by a few ops: checkpoint's own)
    assert again.cost.peak_bytes < 0.8 * kept.cost.peak_bytes
    assert again.cost.peak_bytes == pytest.approx(by_hand.cost.peak_bytes, rel=0.05)


def test_recompute_argument_is_checked():
    for bad in ("yes", 1, 0.5, ["blocks.0"], {}, {"blocks.0": 1}, {0: True}):
        with pytest.raises(ValueError, match=r"recompute must be None \(the search decides.*False \(never\), "
                                             r"True \(every layer\), 'selective' \(every layer but its matmuls and "
                                             r"attention.*or per module a dict.*got"):
            sf.shard(GPTStack(1, 16, 4), in_strategy=(None,), recompute=bad)
        with pytest.raises(ValueError, match="recompute must be None"):
            sf.explain(GPTStack(1, 16, 4), torch.randn(2, 4, 16), world_size=2, in_strategy=(None,), recompute=bad)


def test_a_function_without_layers_recomputes_nothing():
    w = torch.randn(8, 8, requires_grad=True)
    plan = sf.explain(lambda x, w: torch.tanh(x @ w).sum(), torch.randn(4, 8), w, world_size=2, recompute=True)
    assert plan.recompute == ()


def test_recompute_per_module_requires_forbids_and_leaves_the_rest_to_the_search():
    model, x = _big_stack()
    # the search alone recomputes the first blocks (as few as the memory needs); blocks.0-1 forbidden, blocks.23
    # required: the search recomputes others instead, blocks.23 always, said as the user's
    free = _explain(model, x, level=2)
    chosen = {r.region for r in free.recompute}
    assert {"blocks.0", "blocks.1"} <= chosen and "blocks.23" not in chosen
    steered = _explain(model, x, level=2, recompute={"blocks.0": False, "blocks.1": False, "blocks.23": True})
    got = {r.region: r.origin for r in steered.recompute}
    assert "blocks.0" not in got and "blocks.1" not in got and got["blocks.23"] == "recompute="
    assert {o for r, o in got.items() if r != "blocks.23"} == {"search"} and len(got) > 1
    assert 0 < steered.cost.peak_bytes <= 80e9
    assert re.search(r"recompute blocks\.23  \(asked for in recompute=\)", str(steered)), str(steered)
    # a module above the layers names them all; the last entry naming a layer decides it
    every_but_one = _explain(model, x, level=2, recompute={"blocks": True, "blocks.5": False})
    assert [r.region for r in every_but_one.recompute] == [f"blocks.{i}" for i in range(_LAYERS) if i != 5]
    assert {r.origin for r in every_but_one.recompute} == {"recompute="}
    # nothing recomputed where forbidden everywhere: refused with the figures, as recompute=False is
    with pytest.raises(ValueError, match="level=2: no plan"):
        _explain(model, x, level=2, recompute={"blocks.*": False})
    with pytest.raises(ValueError, match=r"recompute: 'decoder' names no layer .* blocks\.\*"):
        _explain(model, x, level=2, recompute={"decoder": True})


def test_level_1_counts_a_recomputed_value_as_a_share_of_one_region(monkeypatch):
    # backward brings back one region at a time: level 1's memory counts a recomputed value at 1 / (regions) of its
    # bytes, a value kept whole (Llama-405B's exact level-1 plan had kept each layer's input whole over "tp", 43.7e9
    # bytes a rank walked, to split the values of 126 layers never alive together; now 15.6e9)
    from shardfn.strategy_search import cost_model as cm
    from shardfn.strategy_search import pricing as pricing_terms

    _, problem, terms = _last_pricing(monkeypatch, GPTStack(4, 16, 4), torch.randn(8, 8, 16), world_size=2, level=1,
                                      recompute=True)
    assert pricing_terms._recomputed_share(problem) == 0.25 and len(set(problem.regions.values())) == 4
    checked = 0
    for d, memory in zip(problem.decisions, terms.memory):
        val = d.node.meta.get("val") if d.node is not None else None
        if d.node is None or d.node.op != "call_function" or not isinstance(val, torch.Tensor) or not memory.any():
            continue
        full = [cm.local_numel(val.shape, c.outputs[0], problem.mesh_shape) * val.element_size() for c in d.candidates]
        share = 0.25 if d.node in problem.recomputed else 1.0
        assert list(memory) == pytest.approx([share * b for b in full]), d.name
        checked += d.node in problem.recomputed
    assert checked > 20


class _Headed(torch.nn.Module):
    """Four identical blocks reading a value made once, then a head of its own and the loss's mean."""

    def __init__(self, shared: bool = True):
        super().__init__()
        self.stack, self.head, self.shared = GPTStack(4, 16, 4), torch.nn.Linear(16, 1024), shared

    def forward(self, x):
        if self.shared:
            mask = torch.ones(x.shape[-1]).cumsum(0)  # (needs no gradient; each block adds it: none keeps it)
            for block in self.stack.blocks:
                x = block(x + mask)
        else:
            x = self.stack(x)
        return self.head(x).log_softmax(-1).mean()


def test_level_1_counts_the_head_and_values_living_across_layers_whole(monkeypatch):
    # a value made at the head lives at the forward's end, with everything saved for backward, and one every layer
    # reads lives through the forward: level 1 counts them whole though recomputed (not at 1 / regions) or not
    # kept for backward (not at all) (Llama-405B's level 1 had left its logits a pending sum split 16 ways, 8.4e9
    # bytes a rank walked; now 19.8e9 in all against 22.4e9)
    from shardfn.strategy_search import cost_model as cm

    pricing, problem, terms = _last_pricing(monkeypatch, _Headed(), torch.randn(8, 8, 16), world_size=2, level=1,
                                            recompute=True)
    regions = set(problem.regions.values())
    assert {f"stack.blocks.{i}" for i in range(4)} < regions and "head" in regions
    kinds = set()
    for d, memory in zip(problem.decisions, terms.memory):
        val = d.node.meta.get("val") if d.node is not None else None
        if d.node is None or d.node.op != "call_function" or not isinstance(val, torch.Tensor) \
                or cm.is_view_op(d.node):
            continue
        full = [cm.local_numel(val.shape, c.outputs[0], problem.mesh_shape) * val.element_size() for c in d.candidates]
        region = problem.regions.get(d.node, "")
        in_a_block = region.startswith("stack.") and all(problem.regions.get(u) == region for u in d.node.users)
        if d.node in problem.recomputed:
            kind = "recomputed in a block" if in_a_block else "recomputed at the head"
        elif d.node in problem.needs_grad:
            kind = "kept"
        elif not in_a_block and len(d.node.users) == 4:
            kind = "read by every block"
        else:
            continue
        kinds.add(kind)
        share = 1 / len(regions) if kind == "recomputed in a block" else 1.0
        assert list(memory) == pytest.approx([share * b for b in full]), (d.name, kind)
    assert kinds == {"recomputed in a block", "recomputed at the head", "kept", "read by every block"}



def test_level_2_counts_the_head_whole_and_a_blocks_transient_not(monkeypatch):
    # level 2 counts what backward keeps; a value made at the head lives at the forward's end beside all of it
    # (the logits' product, read by the log-softmax and then gone), and one every block reads lives through the
    # forward: both count whole, a block's transient nothing (Llama-405B's plan keeping every value had its
    # logits' product split two ways, 67e9 bytes a rank walked and none of them priced)
    from shardfn.capture.graph import module_path
    from shardfn.strategy_search import cost_model as cm
    from shardfn.strategy_search._summary import layer_of

    pricing, problem, terms = _last_pricing(monkeypatch, _Headed(), torch.randn(8, 8, 16), world_size=2, level=2,
                                            recompute=False)
    kinds = set()
    for d, memory in zip(problem.decisions, terms.memory):
        val = d.node.meta.get("val") if d.node is not None else None
        if d.node is None or d.node.op != "call_function" or not isinstance(val, torch.Tensor) \
                or cm.is_view_op(d.node) or d.node in pricing._saved:
            continue
        full = [cm.local_numel(val.shape, c.outputs[0], problem.mesh_shape) * val.element_size() for c in d.candidates]
        layer = layer_of(module_path(d.node))
        if layer == "head":
            kinds.add("at the head")
        elif len(d.node.users) == 4:
            kinds.add("read by every block")
        elif layer.startswith("stack.blocks.") and d.node in problem.needs_grad \
                and all(layer_of(module_path(u)) == layer for u in d.node.users):
            kinds.add("a block's transient")
            assert not memory.any(), d.name
            continue
        else:
            continue
        assert list(memory) == pytest.approx(full), d.name
    assert kinds == {"at the head", "read by every block", "a block's transient"}

def test_level_1_reads_no_value_at_the_head_in_a_larger_copy():
    # the loss's mean had read its log-probabilities gathered whole, a copy no backward keeps and so none the
    # memory counted: it lived at the forward's end, where the step peaks (491,780 bytes a rank walked; now read
    # split, 368,896)
    torch.manual_seed(0)
    plan = sf.explain(_Headed(shared=False), torch.randn(8, 8, 16), world_size=4, in_strategy=(None,), level=1,
                      recompute=False)
    sums = [n for n in plan.nodes.values() if n.op.startswith("aten.sum") and not n.module]
    assert sums and all(not p.is_replicate() for n in sums for p in n.inputs[0]), [n.inputs for n in sums]
    assert plan.cost.peak_bytes < 400_000


def test_attention_without_dropout_is_recomputed_and_a_random_draw_is_not():
    # SDPA of dropout 0 draws nothing though torch tags it seeded: a recomputed layer computes it again; a draw
    # (dropout's bernoulli, or SDPA's own with dropout_p) would differ computed again, and is kept
    from shardfn.capture.graph import draws_random

    plan = sf.explain(GPTStack(2, 16, 4), torch.randn(4, 8, 16), world_size=2, in_strategy=(None,), level=2,
                      recompute=True)
    names = {n for r in plan.recompute for n in r.nodes}
    attention = [n for n in plan.nodes if "scaled_dot_product" in n]
    assert len(attention) == 2 and set(attention) <= names
    node = torch.fx.Graph().call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                          (None, None, None), {"dropout_p": 0.0})
    assert not draws_random(node)
    node.kwargs = {"dropout_p": 0.1}
    assert draws_random(node)
    node.kwargs = {}  # (its default, 0)
    assert not draws_random(node)
    assert draws_random(torch.fx.Graph().call_function(torch.ops.aten.bernoulli.p, (None, 0.9)))


def _counts_any_other_layout(problem, held, u, d, slot: int, out_idx: int, value) -> int:
    """Asserts that ``held`` (an edge's bytes kept, the value's choices by its reader's) counts a read of ``value``
    in any other layout than its own, whole; returns how many of those reads are as large as the value."""
    from shardfn.strategy_search import cost_model as cm

    val, same_size = value.meta["val"], 0
    for a, src in enumerate(problem.decisions[u].candidates):
        for b, dst in enumerate(d.candidates):
            copy = tuple(src.outputs[out_idx]) != tuple(dst.inputs[slot])
            read = cm.local_numel(val.shape, dst.inputs[slot], problem.mesh_shape) * val.element_size()
            assert held[a, b] == (read if copy else 0), (value.name, src.outputs, dst.inputs[slot])
            same_size += copy and read == cm.local_numel(val.shape, src.outputs[out_idx], problem.mesh_shape) \
                * val.element_size()
    return same_size

def test_level_1_counts_a_recomputed_values_copy_that_attention_keeps(monkeypatch):
    # attention with dropout (a CUDA kernel draws inside it: taken so here) is not recomputed, so its backward
    # keeps the copies it reads of recomputed values whole, an all-to-all's as large as the value too: level 1
    # counts each such copy (Llama-405B's level 1 had read each layer's keys and values through all-to-alls, 4.2e9
    # bytes a rank kept and uncounted, while its attention, of dropout 0, was taken for random)

    from shardfn.strategy_search import recompute

    replayable = recompute.replayable
    monkeypatch.setattr(recompute, "replayable", lambda n: "scaled_dot_product" not in str(n.target) and replayable(n))
    _, problem, terms = _last_pricing(monkeypatch, GPTStack(2, 16, 4), torch.randn(4, 8, 16), world_size=4, level=1,
                                      recompute=True)
    held = {(u, v): m for u, v, m in terms.edge_memory}
    checked = 0
    for v, d in enumerate(problem.decisions):
        if d.node is None or "scaled_dot_product" not in str(d.node.target):
            continue
        assert d.node not in problem.recomputed
        for slot, (u, out_idx, value) in enumerate(d.sources):
            assert value in problem.recomputed
            checked += _counts_any_other_layout(problem, held[(u, v)], u, d, slot, out_idx, value)
    assert checked  # (copies as large as the value among them)



class _EagerAttention(torch.nn.Module):
    """Attention written out (transformers' eager kernel): its scores' softmax read by the second product through
    the views matmul makes of it."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        p = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)
        return x + self.proj((p @ v).transpose(1, 2).reshape(b, t, c))


def test_level_2_counts_a_recomputed_values_copy_a_kept_product_reads_through_a_view(monkeypatch):
    # a layer recomputed selectively keeps its products: the softmax (recomputed) is read by the second product
    # through matmul's expand and view (recomputed too), and where it is read in another layout the product's
    # backward keeps that copy, an all-to-all's as large as the value too. Level 2 counts it: DeepSeek-V3's
    # selectively recomputed layers kept such copies of their scores, 44e9 bytes a rank walked against 5e9
    # priced, and each of its recompute tries solved three times within lower budgets before one fit
    from shardfn.strategy_search import cost_model as cm
    from shardfn.strategy_search.saved import backward_readers

    model = torch.nn.Sequential(*(_EagerAttention() for _ in range(2)))
    _, problem, terms = _last_pricing(monkeypatch, model, torch.randn(4, 8, 16), world_size=4, level=2,
                                      recompute="selective")
    held = {(u, v): m for u, v, m in terms.edge_memory}
    checked, products = 0, set()
    for v, d in enumerate(problem.decisions):
        if d.node is None or not cm.is_view_op(d.node) or d.node not in problem.recomputed:
            continue
        keepers = backward_readers(d.node, problem.needs_grad)
        for slot, (u, out_idx, value) in enumerate(d.sources):
            if value not in problem.recomputed or all(k in problem.recomputed for k in keepers):
                continue
            products |= {str(k.target) for k in keepers}
            checked += _counts_any_other_layout(problem, held[(u, v)], u, d, slot, out_idx, value)
    assert checked  # (copies as large as the value among them)


@pytest.mark.parametrize("level", [1, 2])
def test_a_copy_only_recomputed_backwards_read_counts_at_level_1_only(monkeypatch, level):
    # a reader's copy of an activation (gathered, larger than the value) whose every backward reader is recomputed
    # is made again for them (the walk's read_copies ``again``): nothing of it is kept from forward, and level 2
    # counts none of it (Llama-405B's layers recomputed whole had 16.9e9 bytes a rank counted for the MLP's input
    # read gathered, against none walked: 68.7e9 estimated, 43.5e9 walked); level 1, counting transients too,
    # counts it (without, the 405B's level 1 read its layers' inputs gathered: 37.9e9 bytes a rank, not 14.8e9)
    from shardfn.strategy_search import cost_model as cm
    from shardfn.strategy_search.gathered import _from_inputs
    from shardfn.strategy_search.saved import backward_readers

    _, problem, terms = _last_pricing(monkeypatch, GPTStack(2, 16, 4), torch.randn(4, 8, 16), world_size=4,
                                      level=level, recompute=True)
    _, from_inputs = _from_inputs(problem)
    held = {(u, v) for u, v, _ in terms.edge_memory}
    made_again = []
    for v, d in enumerate(problem.decisions):
        if d.node is None or d.node.op != "call_function":
            continue
        keepers = backward_readers(d.node, problem.needs_grad) if cm.is_view_op(d.node) else [d.node]
        if keepers and all(k in problem.recomputed and k in problem.needs_grad for k in keepers):
            made_again += [(u, v) for u, _, value in d.sources
                           if value not in from_inputs and value in problem.needs_grad]
    counted = [pair for pair in made_again if pair in held]
    assert made_again and (counted if level == 1 else not counted), (len(made_again), len(counted))


class _Scan(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return torch.cumprod(self.fc(x), dim=0)


class _Scans(torch.nn.Module):
    """Two layers of a linear map and a scan down the rows: the plan splits each matmul by rows and its scan by
    columns, so each layer moves its activations by all-to-all."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Scan() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_recomputed_layers_collectives_run_again_and_are_priced_so():
    # exec computes a recomputed region's collectives on activations again before its backward (it keeps only
    # the region's inputs): the plan lists each forward one again in backward, and its communication grows by
    # their seconds; less is kept from forward
    x = torch.randn(4096, 64)
    whole = {f"blocks.{i}.fc.weight": (1, 1) for i in range(2)}
    plain, again = (sf.explain(_Scans(), x, world_size=2, in_strategy=((2, 1),), out_strategy=((2, 1),), level=2,
                               parameter_plan=whole, recompute=r) for r in (False, True))
    assert [r.region for r in again.recompute] == ["blocks.0", "blocks.1"]
    assert {n.name: (n.inputs, n.outputs) for n in again.nodes.values()} == \
        {n.name: (n.inputs, n.outputs) for n in plain.nodes.values()}  # (the same layouts)
    moved = [c for c in again.collectives if c.where.endswith("(recomputed)")]
    assert moved and all(c.phase == "backward" and c.kind == "all_to_all" for c in moved)
    forward = {(c.kind, c.where) for c in again.collectives if c.phase == "forward"}
    assert all((c.kind, c.where.removesuffix(" (recomputed)")) in forward for c in moved)
    assert again.cost.comm_s == pytest.approx(plain.cost.comm_s + sum(c.seconds for c in moved), rel=1e-9)
    assert again.nodes["detach"].live_bytes < plain.nodes["detach"].live_bytes  # (the forward's end)


def test_a_layer_recomputed_selectively_keeps_what_its_collectives_reduced_and_is_priced_so(monkeypatch):
    # Megatron's selective recompute runs no reduction again (exec keeps their results): the plan lists none
    # again in backward, and the walk keeps each recomputed reader's copy (the all-reduced sum the norm reads) from
    # forward to its backward, where recomputed whole it is made again; the layouts the same (Megatron's)
    from shardfn.strategy_search import readout
    from tests.models import ResidualMLPStack, megatron_mlp_plan

    copies = {}  # each plan's last walk's copies
    real = readout.read_copies

    def planned(recompute, level=2):
        monkeypatch.setattr(readout, "read_copies", lambda p, c: copies.update({recompute: (p, real(p, c)[0])})
                            or real(p, c))
        return sf.explain(ResidualMLPStack(), torch.randn(1, 2, 256), world_size=2, in_strategy=(None,),
                          parameter_plan=megatron_mlp_plan(2), level=level, recompute=recompute)

    plain, whole, part = (planned(r) for r in (False, True, "selective"))
    walked = dict(copies)
    assert [(r.selective, r.keeps_reduced) for r in part.recompute] == [(True, True)] * 3
    assert not any(r.selective or r.keeps_reduced for r in whole.recompute)
    # (level 1, the least memory, runs them again: its selective layers keep no reduction)
    least = planned("selective", level=1)
    assert [(r.selective, r.keeps_reduced) for r in least.recompute] == [(True, False)] * 3
    problem, _ = copies["selective"]
    assert problem.recomputed and not any(map(problem.keeps_reduced_for, problem.recomputed))
    layouts = {n.name: (n.inputs, n.outputs) for n in plain.nodes.values()}
    assert {n.name: (n.inputs, n.outputs) for n in part.nodes.values()} == layouts
    again = [c for c in whole.collectives if c.where.endswith("(recomputed)")]
    assert len(again) == 3 and not any(c.where.endswith("(recomputed)") for c in part.collectives)
    assert part.cost.comm_s == pytest.approx(plain.cost.comm_s, rel=1e-9) and plain.cost.comm_s < whole.cost.comm_s
    for recompute, kept in ((True, False), ("selective", True)):
        problem, found = walked[recompute]
        read = [g for g in found if all(r in problem.recomputed for r in g.readers)]
        assert len(read) == 3 and all((bool(g.backward) and not g.again) == kept for g in read), recompute


def test_what_a_reader_recomputed_selectively_keeps_of_a_reduction_is_counted_on_the_value_reduced(monkeypatch):
    # the walk keeps the reduced copy until the reader's backward; pricing counts, on each candidate of the value
    # reduced that leaves a pending sum, the bytes of that sum (no fewer than the copy's); as many as the run
    # that runs the reduction again would count, plus those, and no other term changed
    from shardfn.strategy_search import cost_model as cm
    from shardfn.strategy_search import readout, recompute, search
    from tests.models import ResidualMLPStack, megatron_mlp_plan

    seen, walked = {}, {}
    terms_of, read_copies = search.Pricing.terms, readout.read_copies
    for keeps in (False, True):
        monkeypatch.setattr(recompute, "_keeps_reduced", lambda request, keeps=keeps: keeps)
        monkeypatch.setattr(search.Pricing, "terms", lambda self, k=(), keeps=keeps: seen.update(
            {keeps: (self.problem, terms_of(self, k))}) or seen[keeps][1])
        monkeypatch.setattr(readout, "read_copies", lambda p, c, keeps=keeps: walked.update(
            {keeps: read_copies(p, c)[0]}) or read_copies(p, c))
        sf.explain(ResidualMLPStack(), torch.randn(1, 2, 256), world_size=2, in_strategy=(None,),
                   parameter_plan=megatron_mlp_plan(2), level=2, recompute="selective")
    (rerun, rerun_terms), (problem, terms) = seen[False], seen[True]
    # (two captures of one model: their decisions in one order)
    assert {n.name for n in problem.recomputed} == {n.name for n in rerun.recomputed}
    assert [d.node.name for d in problem.decisions if d.node] == [d.node.name for d in rerun.decisions if d.node]
    assert not any(map(rerun.keeps_reduced_for, rerun.recomputed))
    pending_makers = 0
    for v, d in enumerate(problem.decisions):
        extra = terms.memory[v] - rerun_terms.memory[v]
        assert np.array_equal(terms.compute[v], rerun_terms.compute[v])
        kept = d.node is not None and d.node.op == "call_function" and not cm.is_view_op(d.node) \
            and any(problem.keeps_reduced_for(u) for u in d.node.users)
        val = d.node.meta["val"] if kept else None
        want = [cm.local_numel(val.shape, c.outputs[0], problem.mesh_shape) * val.element_size()
                if kept and any(q.is_partial() for q in c.outputs[0]) else 0.0 for c in d.candidates]
        assert extra.tolist() == want, d.node
        pending_makers += any(want)
    assert pending_makers >= 3  # (each layer's row-parallel product, all-reduced for its residual sum)
    # the walk keeps those copies (one a layer) from forward to the reader's backward where the reduction is kept
    kept_copies = [g for g in walked[True] if g.backward and not g.again
                   and all(r in problem.recomputed for r in g.readers)]
    assert len(kept_copies) == 3 and not [g for g in walked[False] if g.backward and not g.again
                                          and all(r in problem.recomputed for r in g.readers)]


@pytest.mark.parametrize("share", [0.1, 10.0])
def test_a_plan_keeping_every_value_is_not_tried_where_its_least_memory_is_most_of_the_device(monkeypatch, share):
    # with every value split as far as it goes, the plan keeping them all would hold over _KEPT_SHARE of the
    # memory: recompute is tried first (Llama-405B's least is 0.76 of it; its try of keeping every value took the
    # time left and walked 89-134e9 bytes a rank; without it, 19.9 s and a 20.2 s step for 24.9 s and 23.9)
    from shardfn.strategy_search import recompute, search

    seen, solves = [], []  # (each pricing's problem and terms; whether each solve's problem recomputes)
    terms_of, solve = search.Pricing.terms, search.solve_level

    def priced(self, keep_split=()):
        seen.append((self.problem, terms_of(self, keep_split)))
        return seen[-1][1]

    monkeypatch.setattr(search.Pricing, "terms", priced)
    monkeypatch.setattr(search, "solve_level", lambda *a, **k: solves.append(bool(seen[-1][0].recomputed))
                        or solve(*a, **k))
    monkeypatch.setattr(recompute, "_KEPT_SHARE", share)
    with torch.device("meta"):
        model, x = GPTStack(8, 1024, 16), torch.empty(64, 2048, 1024)
    plan = _explain(model, x, level=2)
    assert not seen[0][0].recomputed
    least = sum(float(m.min()) for m in seen[0][1].memory if len(m))
    assert 0.1 * 80e9 < least < 80e9  # (a plan keeping every value could fit, and does)
    if share < 1:  # (every solve recomputes)
        assert solves and all(solves) and plan.recompute
    else:
        assert solves[0] is False and plan.recompute == ()


def test_the_copies_a_layer_recomputed_selectively_keeps_are_those_reductions_alone_make():
    # (exec keeps all-reduces' and reduce-scatters' results there, and runs gathers and all-to-alls again)
    from torch.distributed.tensor import Partial, Replicate, Shard

    from shardfn.strategy_search.gathered import reduced_copies

    made = [(Partial(), Replicate()), (Partial(), Shard(0)), (Shard(0), Replicate()), (Replicate(), Replicate())]
    read = [(Replicate(), Replicate()), (Shard(1), Replicate()), (Replicate(), Shard(0)), (Shard(1), Shard(0))]
    kept = reduced_copies(made, read, (2, 2))
    assert kept.tolist() == [
        [True, True, True, True],  # (a sum reduced, or reduced and scattered; a whole dim sliced locally)
        [False, False, True, True],  # (the pending dim alone reduced; with dim 1 gathered too: again)
        [False, False, False, False],  # (a gather or an all-to-all: again)
        [False, False, False, False],  # (a whole value: each rank slices its piece)
    ]
