"""Small transformers mixtures of experts (Mixtral, Qwen2-MoE, DeepSeek-V3) trained sharded with their experts
split, against the unsharded model: losses, every gradient (router included) and the parameters after AdamW steps
equal."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import tempfile
from typing import Callable

import torch
import transformers as tf
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from tests.harness import on_rank

VOCAB, SEQ, BATCH, LAYERS = 64, 8, 4, 2
# experts' weights large against the tokens, so that splitting the experts is the plan's own choice too
_SMALL = dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=VOCAB, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)


def make(name: str, impl: str = "grouped_mm", experts: int = 4, layers: int = LAYERS) -> torch.nn.Module:
    small = dict(_SMALL, num_hidden_layers=layers)
    if name == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=2048, num_local_experts=experts, experts_implementation=impl,
                               **small)
        return tf.MixtralForCausalLM(cfg)
    if name == "deepseek_v3":  # MLA (its keys made by new_empty), routed experts by group and a shared expert
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=1024, n_routed_experts=experts, n_shared_experts=1,
            first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, head_dim=4, experts_implementation=impl,
            **{k: v for k, v in small.items() if k not in ("output_router_logits", "router_aux_loss_coef")}))
    cfg = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=2048, shared_expert_intermediate_size=64,
                            num_experts=experts, experts_implementation=impl, **small)
    return tf.Qwen2MoeForCausalLM(cfg)


def expert_plan(world: int, layers: int = LAYERS) -> dict:
    """The experts split over every rank (their expert dim), by parameter_plan."""
    return {f"model.layers.{i}.mlp.experts.{w}": (world, 1, 1)
            for i in range(layers) for w in ("gate_up_proj", "down_proj")}


def batch(seed: int) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)  # the same batch on every rank
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return ids, {"labels": ids, "use_cache": False}


def experts_split(plan) -> bool:
    """Whether every experts call of the plan runs with its expert weights split (expert parallel)."""
    calls = [n for n in plan.nodes.values() if n.op == "MoEExperts.apply"]
    return bool(calls) and all(any(isinstance(p, Shard) and p.dim == 0 for p in n.inputs[4]) for n in calls)


def train_and_compare(name: str, impl: str, world: int, rank_slice: Callable | None = None, ranks: int = 1,
                      steps: int = 3, rtol: float = 1e-4, atol: float = 1e-5,
                      experts: int = 4, checked: Callable | None = None,
                      layers: int = LAYERS) -> tuple[list[float], bool]:
    """Train ``name`` (of ``layers`` layers) with its experts split (data parallel where ``rank_slice`` gives this
    rank's rows) and unsharded on the same batches; assert the losses (aux loss included), the aux loss, every
    gradient and, after each AdamW step, every parameter agree. Returns rank 0's losses and whether the plan split
    the experts (and, where given, ``checked(model, tokens)`` holds of it)."""

    def close(a, b, what):
        for r in range(ranks):
            torch.testing.assert_close(on_rank(a, r), on_rank(b, r), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what} (rank {r}): {m}")

    torch.manual_seed(0)
    reference = make(name, impl, experts, layers)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), parameter_plan=expert_plan(world, layers),
                     level=2, dataset_strategy="data_parallel" if rank_slice else "full_batch")
    groups = [[p for p in model.parameters() if isinstance(p, DTensor) == kind] for kind in (True, False)]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-3, foreach=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=True)
    losses = []
    for step in range(steps):
        ids, kwargs = batch(step)
        out = model(rank_slice(ids), labels=rank_slice(ids), use_cache=False) if rank_slice else model(ids, **kwargs)
        ref = reference(ids, **kwargs)
        close(out.loss, ref.loss, f"step {step} loss")
        if ref.aux_loss is not None:  # (DeepSeek-V3 balances its experts by a bias, not a loss)
            close(out.aux_loss, ref.aux_loss, f"step {step} aux loss")
        out.loss.backward()
        ref.loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            close(g, q.grad, f"step {step} {n}.grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(float(on_rank(ref.loss, 0)))
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        # Adam's steps are lr in size whatever the gradient: a gradient's rounding moves a weight by up to lr
        # where it is near zero, hence lr/10 here (a wrong update is off by lr)
        for r in range(ranks):
            torch.testing.assert_close(on_rank(p.full_tensor() if isinstance(p, DTensor) else p, r), on_rank(q, r),
                                       rtol=rtol, atol=1e-4, msg=lambda m: f"{n} after {steps} steps: {m}")
    ids, kwargs = batch(0)
    split = experts_split(sf.explain(model, rank_slice(ids) if rank_slice else ids,
                                     kwargs=dict(labels=rank_slice(ids), use_cache=False) if rank_slice else kwargs))
    if checked is not None:  # what else the plan must do (it is given the model and the call's tokens)
        split = split and checked(model, rank_slice(ids) if rank_slice else ids)
    return losses, split


@contextlib.contextmanager
def bytes_priced_over_latency():
    """Plans priced on links whose collectives cost their bytes alone (no latency, no launch): there sending each
    (token, slot) pair to its expert's rank moves k/n of the gather's bytes and wins at this test's few tokens,
    as it does at real size (Mixtral-8x7B on 8 x 8 H100s: bench/moe_plan.py). Read where a plan is made."""
    from shardfn.strategy_search import cost_model as cm

    quick = cm.Link(0.0, 1 / 2e9, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        cm.save_profile(dataclasses.replace(cm.CPU, intra_node=quick, inter_node=quick), path)
        saved = os.environ.get("SHARDFN_PROFILE")
        os.environ["SHARDFN_PROFILE"] = path
        try:
            yield
        finally:
            os.environ.pop("SHARDFN_PROFILE")
            if saved is not None:
                os.environ["SHARDFN_PROFILE"] = saved
