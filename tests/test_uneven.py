"""Splits that do not divide their dim: laid out as DTensor lays them (torch.chunk's pieces, the last ones smaller
or empty), forward and backward, against single-device eager, on simulated ranks (real gloo ranks:
tests/exec/test_gloo.py)."""

import copy

import pytest
import torch
import transformers as tf
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from shardfn.runtime import simulated_world
from shardfn.strategy_search import cost_model as cm
from tests import transformers_models as tm
from tests.harness import on_rank
from tests.parity import check_parity


def dense_relu(x, w, b):
    return torch.relu(x @ w + b)


def _args():
    # 6 rows over 4 ranks: pieces of 2, 2, 2, 0; 7 columns: 2, 2, 2, 1; 10 inner: 3, 3, 3, 1
    return torch.randn(6, 10), torch.randn(10, 7, requires_grad=True), torch.randn(7, requires_grad=True)


@pytest.mark.parametrize("strategy", [((4, 1), None, None), ((1, 4), None, None), ((2, 2), None, None),
                                      (None, (1, 4), (4,)), (None, (4, 1), None)])
def test_uneven_input_and_parameter_splits_match_eager(strategy):
    plan = check_parity(dense_relu, _args, strategy, world=4)
    assert plan.collectives  # really split, not run whole


def test_the_search_may_choose_an_uneven_split_and_prices_its_padding():
    args = (torch.empty(8, 64, device="meta"), torch.empty(64, 101, device="meta", requires_grad=True))
    plan = sf.explain(lambda x, w: (x @ w).relu(), *args, in_strategy=(None, None), world_size=4, level=1)
    weight = plan.inputs[1].planned
    assert any(p.is_shard() for p in weight), plan  # 101 columns split anyway: 26 per rank, the last 23
    # a split costs its largest piece (the padding counted): ceil(101 / 4) = 26 columns, as 104 would
    assert cm.local_numel((64, 101), (Shard(1),), (4,)) == cm.local_numel((64, 104), (Shard(1),), (4,)) == 64 * 26


def _gpt2(vocab):
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, n_positions=32,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _megatron_vocab_parallel(world):
    plan = {k: v for i in range(2) for k, v in tm.megatron(tm.MODELS["gpt2"], world, f"transformer.h.{i}.").items()}
    plan["transformer.wte.weight"] = (world, 1)  # the embedding, and the head tied to it, split by vocabulary
    return plan


def _train_gpt2(vocab, world, ranks, steps=3):
    torch.manual_seed(0)
    reference = _gpt2(vocab)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), parameter_plan=_megatron_vocab_parallel(world))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    for step in range(steps):
        torch.manual_seed(step)  # the global generator: the same batch on every rank, simulated ranks included
        ids = torch.randint(0, vocab, (4, 16))
        out, ref = model(ids, labels=ids), reference(ids, labels=ids)
        out.loss.backward()
        ref.loss.backward()
        for r in range(ranks):
            torch.testing.assert_close(on_rank(out.loss, r), ref.loss, rtol=1e-5, atol=1e-5)
            for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(on_rank(g, r), q.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"step {step} {n}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    rows = model.transformer.wte.weight.to_local().shape[0]
    return [int(rows.node._local_ints[r]) for r in range(ranks)] if ranks > 1 else int(rows)


def test_gpt2_trains_with_a_vocabulary_split_unevenly():
    with simulated_world(4):
        rows = _train_gpt2(101, 4, ranks=4, steps=1)
    assert rows == [26, 26, 26, 23]
