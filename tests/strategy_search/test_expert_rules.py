"""Ground truth for the mixture-of-experts rules (shardfn/strategy_search/expert_rules.py): every candidate, laid
out and run on each rank's pieces, gives the whole op's result, and its backward on the pieces the whole op's
gradients, laid out as exec hands them back (a replicated input of a split or pending-sum result: a pending sum)."""

import functools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

pytest.importorskip("transformers")
import transformers.integrations.moe  # noqa: E402,F401 - the experts implementations MoEExperts runs

from shardfn.capture import capture  # noqa: E402
from shardfn.capture.experts import ExpertMM, MoEExperts, bounds_of  # noqa: E402
from shardfn.capture.functions import FunctionCall  # noqa: E402
from shardfn.exec.expert_dispatch import dispatched  # noqa: E402
from shardfn.strategy_search import candidates as C  # noqa: E402
from tests.strategy_search.truth import MESHES, _candidates_on_meshes, check_candidate, failures, op_node  # noqa: E402


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # k distinct experts a token
    return index, torch.rand(T, k, generator=g)


def _moe_case(impl, T=10, H=8, I=4, E=4, k=2, seed=0):  # torch's grouped_mm: rows of 16-byte multiples
    index, weights = _routing(T, E, k, seed)
    args = (torch.randn(T, H), index, weights, torch.arange(E), torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    return (lambda h, i, w, e, gu, d: MoEExperts.apply(h, i, w, e, gu, d, "silu", impl)), args


def _expert_mm_case(S=12, K=5, N=3, E=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.multinomial(torch.ones(E), S, replacement=True, generator=g).bincount(minlength=E)
    counts[0], counts[1] = counts[0] + counts[1], 0  # an expert no token chose
    bounds = bounds_of(torch.cumsum(counts, 0))
    return (lambda x, w, b: ExpertMM.apply(x, w, b)), (torch.randn(S, K), torch.randn(E, K, N), bounds)


def _call_target(fn, args):
    (node,) = [n for n in capture(fn, args, {}).gm.graph.nodes if isinstance(n.target, FunctionCall)]
    return node.target


def _gradient_failures(target, args) -> list[str]:
    """Each candidate's backward on the pieces: the outputs' gradients replicated where the output is pending,
    as the output otherwise; the inputs' gradients as exec returns them."""
    grad = torch.randn_like(target(*args)[0])
    wanted = [i for i, a in enumerate(args) if a.is_floating_point()]

    def vjp(*tensors, call=target):
        ins = [t.detach().requires_grad_() if i in wanted else t for i, t in enumerate(tensors[:-1])]
        out = call(*ins)
        out = out if isinstance(out, torch.Tensor) else out[0]
        return list(torch.autograd.grad(out, [ins[i] for i in wanted], tensors[-1]))

    expected = vjp(*args, grad)
    found = []
    for shape, mesh, cand in _candidates_on_meshes(op_node(target, args, {}), MESHES):
        # (a dispatch candidate runs as exec runs it, its tokens sent to their experts' ranks and back)
        call = dispatched(target, cand.inputs, mesh) if cand.rule == "dispatch" else target
        working = {m for pl in cand.outputs for m, p in enumerate(pl) if not p.is_replicate()}
        grads = tuple(tuple(Partial() if m in working and p.is_replicate() else p for m, p in enumerate(cand.inputs[i]))
                      for i in wanted)
        out_grad = tuple(Replicate() if p.is_partial() else p for p in cand.outputs[0])
        why = check_candidate(functools.partial(vjp, call=call), (*args, grad), {}, expected,
                              C.Candidate(grads, (*cand.inputs, out_grad), "local"), mesh)
        if why:
            found.append(f"{shape} {cand.inputs} -> {cand.outputs}: {why}")
    return found


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("sizes", [dict(), dict(T=7, E=6, k=3, seed=1), dict(E=3, seed=2)], ids=str)
def test_moe_experts_rule(impl, sizes):
    fn, args = _moe_case(impl, **sizes)
    target = _call_target(fn, args)
    assert failures(target, args, {}) == []
    assert _gradient_failures(target, args) == []


def test_moe_experts_rule_offers_the_expert_split():
    from tests.strategy_search.truth import planning

    fn, args = _moe_case("grouped_mm")
    cands = C.node_candidates(op_node(_call_target(fn, args), args, {}), planning(2, 2), set())
    experts = [c for c in cands if c.inputs[4] == (Shard(0), Shard(0)) and c.inputs[0] == (Replicate(), Replicate())]
    assert experts and all(c.outputs[0] == (Partial(), Partial()) for c in experts)
    # tokens and experts split over one mesh dim: each pair dispatched to its expert's rank, the result split as
    # the tokens; over both dims at once it is not offered (one group a call)
    dispatch = [c for c in cands if c.rule == "dispatch"]
    assert {(c.inputs[0], c.inputs[4], c.outputs[0]) for c in dispatch} >= {
        ((Shard(0), Replicate()), (Shard(0), Shard(0)), (Shard(0), Partial())),
        ((Shard(0), Shard(0)), (Shard(0), Replicate()), (Shard(0), Shard(0)))}
    assert not [c for c in cands if c.inputs[0] == c.inputs[4] == (Shard(0), Shard(0))]
    assert any(c.inputs[0] == (Shard(0), Replicate()) and c.inputs[4] == (Replicate(), Shard(0)) for c in cands)


@pytest.mark.parametrize("seed", [0, 1])
def test_expert_mm_rule(seed):
    fn, args = _expert_mm_case(seed=seed)
    target = _call_target(fn, args)
    assert failures(target, args, {}) == []
    assert _gradient_failures(target, args) == []


def test_a_wrong_layout_is_caught():
    # the check can fail: the expert split's result read as whole (not a pending sum) is wrong
    fn, args = _moe_case("grouped_mm")
    target = _call_target(fn, args)
    out = target(*args)
    for _, mesh, cand in _candidates_on_meshes(op_node(target, args, {}), [(2,)]):
        if cand.inputs[4] == (Shard(0),):
            assert check_candidate(target, args, {}, out, cand, mesh) == ""
            whole = C.Candidate(((Replicate(),),), cand.inputs, "local")
            assert check_candidate(target, args, {}, out, whole, mesh) != ""
