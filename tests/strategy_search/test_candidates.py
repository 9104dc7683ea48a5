"""Where candidates come from: DTensor's rules through the adapter, own rules, the replicated fallback."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardfn.layout import Axis, MeshSpec, TensorSpec
from shardfn.runtime import planning_mesh
from tests.parity import check_parity


def _mesh(*shape):
    axes = tuple(Axis(s, int(torch.tensor(shape[i + 1 :]).prod())) for i, s in enumerate(shape))
    return planning_mesh(MeshSpec(axes, tuple(f"d{i}" for i in range(len(shape)))), "cpu")


def _node(fn, *args):
    from shardfn.capture import capture

    graph = capture(fn, list(args), {})
    return [n for n in graph.gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)][-1]


def test_matmul_candidates_from_dtensor_rules():
    from shardfn.strategy_search.candidates import node_candidates

    node = _node(torch.mm, torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta"))
    cands = node_candidates(node, _mesh(4), set())
    pairs = {(c.inputs, c.outputs) for c in cands}
    assert (((Shard(0),), (Replicate(),)), ((Shard(0),),)) in pairs  # batch split
    assert (((Shard(1),), (Shard(0),)), ((torch.distributed.tensor.Partial(),),)) in pairs  # contraction split
    assert all(c.rule == "dtensor" for c in cands)
    assert len(node_candidates(node, _mesh(2, 4), set())) > len(cands)  # a 2-D mesh combines per-dim rules


def test_own_rule_for_causal_attention_on_cpu():
    from shardfn.strategy_search.candidates import node_candidates

    q = torch.empty(4, 4, 8, 16, device="meta")
    node = _node(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, q, q)
    cands = node_candidates(node, _mesh(4), set())
    # batch or heads, never the causal sequence (each rank's mask would start at its first row)
    assert {c.inputs[0] for c in cands} == {(Replicate(),), (Shard(0),), (Shard(1),)}
    assert all(c.rule == "local" for c in cands)
    node = _node(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, q, q)
    assert (Shard(2),) in {c.inputs[0] for c in node_candidates(node, _mesh(4), set())}  # query rows


def _gqa(x, wq, wk, wv):
    """Attention of 6 query heads over 2 kv heads (grouped-query), from projections, as models write it."""
    b, t, _ = x.shape
    q = (x @ wq).view(b, t, 6, 4).transpose(1, 2)
    k, v = ((x @ w).view(b, t, 2, 4).transpose(1, 2) for w in (wk, wv))
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(b, t, 24)


def test_head_cut_is_the_largest_part_of_the_inner_dim_the_heads_divide():
    from shardfn.capture import capture
    from shardfn.strategy_search import head_cut

    def spec(*shape):
        return MeshSpec(tuple(Axis(s, int(torch.tensor(shape[i + 1:]).prod())) for i, s in enumerate(shape)),
                        tuple(f"d{i}" for i in range(len(shape))))

    def gm(heads, kv):
        q, k = torch.empty(1, heads, 8, 4, device="meta"), torch.empty(1, kv, 8, 4, device="meta")
        return capture(lambda q, k: F.scaled_dot_product_attention(q, k, k, enable_gqa=True), [q, k], {}).gm

    assert head_cut(gm(6, 2), spec(4)) == 2  # 6 and 2 heads: parts of 2 on a dim of 4
    assert head_cut(gm(28, 4), spec(8, 8)) == 4  # Qwen2-7B's heads on 8 x 8: the inner dim in 2 x 4
    assert head_cut(gm(28, 4), spec(8, 8, 1)) == 4  # (a dim of one is no dim)
    assert head_cut(gm(6, 2), spec(2, 2)) is None  # they divide the inner dim
    batch = TensorSpec(((Axis(4, 1),), (), (), ()))  # a batch given over the inner dim: attention is local there
    assert head_cut(gm(6, 2), spec(4), [batch]) is None
    assert head_cut(gm(6, 2), spec(2, 4), [TensorSpec(((Axis(2, 4),), (), (), ()))]) == 2  # over the outer one
    assert head_cut(gm(7, 7), spec(4)) is None  # no part of 4 divides 7
    assert head_cut(capture(torch.mm, [torch.empty(4, 4, device="meta")] * 2, {}).gm, spec(4)) is None


def test_attention_whose_heads_do_not_divide_splits_them_over_a_part_of_the_dim():
    # 6 and 2 heads on 4 ranks: the mesh becomes 2 x 2, and level 1 (least memory) splits attention by heads over
    # the inner 2 (by query rows over the outer 2), never across a head; the results and gradients are eager's
    def rand(*shape):
        return torch.randn(*shape, requires_grad=True)

    plan = check_parity(_gqa, lambda: (rand(1, 16, 8), rand(8, 24), rand(8, 8), rand(8, 8)), (None,) * 4, world=4,
                        level=1)
    assert plan.mesh.shape == (2, 2)
    (sdpa,) = (n for n in plan.nodes.values() if "scaled_dot_product" in n.op)
    assert sdpa.inputs[0][1] == Shard(1) and sdpa.inputs[1][1] == Shard(1)  # q's and k's heads over the inner dim


class _GQA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(8, n)) for n in (24, 8, 8))

    def forward(self, x):
        return _gqa(x, self.wq, self.wk, self.wv)


@pytest.mark.parametrize("planned_in_shard", [False, True])
def test_a_sharded_modules_parameters_move_to_a_cut_mesh_only_before_any_optimizer(planned_in_shard):
    # shard() lays the parameters out on the call's mesh; an optimizer's states (a checkpoint loaded into them)
    # are made there before the first call: that call keeps the mesh and says what the cut would give, unless
    # example_inputs planned it in shard(). Both train as eager does (AdamW, states made before the first call)
    import copy

    import shardfn as sf
    from shardfn.runtime import simulated_world
    from tests.harness import on_rank

    with simulated_world(4):
        torch.manual_seed(0)
        reference, x = _GQA(), torch.randn(1, 16, 8)
        example = (torch.empty(1, 16, 8, device="meta"),) if planned_in_shard else None
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), level=1, example_inputs=example)
        opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference)]
        for opt in opts:  # the states made now, as a checkpoint's load makes them
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.step()
        for _ in range(2):
            for m, opt in zip((model, reference), opts):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(on_rank(p.full_tensor(), 0), on_rank(q, 0), msg=lambda m: f"{name}: {m}")
        plan = sf.explain(model, x)
    assert plan.mesh.shape == ((2, 2) if planned_in_shard else (4,))
    assert any("example_inputs" in note for note in plan.notes) != planned_in_shard


def test_ops_without_any_rule_run_replicated_with_one_warning():
    def bucket(x, edges):
        return torch.searchsorted(edges, x) * 2

    def make_args():
        return torch.rand(8, 6), torch.linspace(0, 1, 5)

    with pytest.warns(UserWarning, match=r"no sharding rule for aten.searchsorted.Tensor; .*run replicated"):
        plan = check_parity(bucket, make_args, ((4, 1), None), world=4)
    assert "replicated fallback for: aten.searchsorted.Tensor" in plan.notes


def test_random_fills_are_candidates_in_any_layout():
    from shardfn.strategy_search.candidates import node_candidates

    node = _node(lambda x: torch.rand_like(x), torch.empty(8, 6, device="meta"))
    cands = node_candidates(node, _mesh(4), set())
    assert {c.outputs[0] for c in cands} == {(Replicate(),), (Shard(0),), (Shard(1),)}
    assert all(c.rule == "random" for c in cands)


def test_a_core_rule_that_cannot_be_read_is_an_error_naming_the_torch_release(monkeypatch):
    import shardfn as sf
    import shardfn.strategy_search.candidates as candidates
    from shardfn.strategy_search.lru import LRU
    from shardfn.strategy_search.registry import REGISTRY

    monkeypatch.setattr(candidates, "_from_dtensor", lambda node, mesh: None)  # as if DTensor had no rules
    monkeypatch.setattr(REGISTRY, "_memos", {"candidates": LRU(16)})
    release = re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=rf"rules for aten.mm.default in torch {release}.*>=2.11,<2.16"):
        sf.explain(torch.mm, torch.empty(8, 4), torch.empty(4, 6), world_size=4)
