"""Models from transformers as users call them (small configs, random weights), and how the tests shard them.

Each model is trained a few AdamW steps sharded and unsharded on the same batches; the losses and every
parameter's gradient must agree. Ways of sharding (``MODES``):

* ``dp``: the whole model with dataset_strategy="data_parallel" (each rank passes its slice of the batch);
* ``tp``: the whole model with a Megatron parameter_plan on every layer (column-parallel in, row-parallel out);
* ``search``: the whole model, every layout left to the search at level 2;
* ``layer``: one layer sharded in place inside the model (Megatron plan), called by the model's own forward.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import transformers as tf
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn.strategy_search._dtensor_adapter import has_dtensor_rule
from shardfn.strategy_search.candidates import ReplicatedFallbackWarning
from tests.harness import on_rank

MODES = ("dp", "tp", "search", "layer")
VOCAB, SEQ, BATCH = 128, 16, 8


def _decoder_config(cls, **kw):
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, **kw)


def _encoder_config(cls, **kw):
    return cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)


@dataclass(frozen=True)
class Spec:
    make: Callable[[], torch.nn.Module]
    inputs: str  # "tokens" (labels = the tokens), "classes" (tokens, one label each), "images"
    layers: str  # the attribute path of the layer list
    column: tuple[str, ...] = ()  # names (within a layer) of weights split by output rows
    row: tuple[str, ...] = ()  # names (within a layer) of weights split by input columns; Conv1D: the reverse
    conv1d: bool = False  # GPT-2's Conv1D weights are (in, out)


_LLAMA_COLUMN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight")
_LLAMA_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_BERT_COLUMN = ("attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
                "intermediate.dense.weight")
_BERT_ROW = ("attention.output.dense.weight", "output.dense.weight")

MODELS = {
    "llama": Spec(lambda: tf.LlamaForCausalLM(_decoder_config(tf.LlamaConfig)), "tokens", "model.layers",
                  _LLAMA_COLUMN, _LLAMA_ROW),
    "qwen2": Spec(lambda: tf.Qwen2ForCausalLM(_decoder_config(tf.Qwen2Config)), "tokens", "model.layers",
                  _LLAMA_COLUMN + ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                  _LLAMA_ROW),
    # Gemma 3 interleaves sliding-window and global attention, each with its own rotary tables, which it computes
    # in the order of a Python set of strings: another order in each process a launcher starts
    "gemma3": Spec(lambda: tf.Gemma3ForCausalLM(_decoder_config(
        tf.Gemma3TextConfig, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
        "tokens", "model.layers", _LLAMA_COLUMN, _LLAMA_ROW),
    # GPT-2's Conv1D weights are (in, out): the column split is on dim 1, the row split on dim 0
    "gpt2": Spec(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                          n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                          attn_pdrop=0.0)),
                 "tokens", "transformer.h", ("attn.c_proj.weight", "mlp.c_proj.weight"),
                 ("attn.c_attn.weight", "mlp.c_fc.weight"), conv1d=True),
    # Bloom's MLP activation is a custom autograd.Function (in training), its attention an ALiBi bias
    "bloom": Spec(lambda: tf.BloomForCausalLM(tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                             hidden_dropout=0.0, attention_dropout=0.0)),
                  "tokens", "transformer.h",
                  ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                   "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias"),
                  ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")),
    "bert": Spec(lambda: tf.BertForSequenceClassification(_encoder_config(
        tf.BertConfig, vocab_size=VOCAB, max_position_embeddings=64, num_labels=3)), "classes",
        "bert.encoder.layer", _BERT_COLUMN, _BERT_ROW),
    "vit": Spec(lambda: tf.ViTForImageClassification(_encoder_config(
        tf.ViTConfig, image_size=16, patch_size=4, num_labels=5)), "images", "vit.layers",
        ("attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight", "mlp.fc1.weight"),
        ("attention.o_proj.weight", "mlp.fc2.weight")),
    "resnet": Spec(lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)), "images", "resnet.encoder.stages"),
}


def batch(spec: Spec, seed: int, n: int = BATCH) -> tuple[tuple, dict]:
    torch.manual_seed(seed)  # the global generator: the same batch on every rank, simulated ranks included
    if spec.inputs == "tokens":
        ids = torch.randint(0, VOCAB, (n, SEQ))
        return (ids,), {"labels": ids}
    if spec.inputs == "classes":
        return (torch.randint(0, VOCAB, (n, SEQ)),), {"labels": torch.randint(0, 3, (n,))}
    return (torch.randn(n, 3, 16, 16),), {"labels": torch.randint(0, 5, (n,))}


def _get(obj, path: str):
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def megatron(spec: Spec, world: int, prefix: str = "") -> dict:
    """A Megatron parameter_plan for one layer's names (prefixed)."""
    plan = {prefix + n: (world, 1) for n in spec.column}
    plan.update({prefix + n: (1, world) for n in spec.row})
    if spec.conv1d:  # (in, out)
        plan = {prefix + n: (world, 1) for n in spec.row} | {prefix + n: (1, world) for n in spec.column}
    for n in list(plan):
        if n.endswith(".bias"):
            plan[n] = (world,)
    return plan


def shard(model: torch.nn.Module, spec: Spec, mode: str, world: int) -> torch.nn.Module:
    layers = _get(model, spec.layers)
    if mode == "dp":
        return sf.shard(model, in_strategy=(None,), dataset_strategy="data_parallel")
    if mode == "tp":
        plan = {k: v for i in range(len(layers)) for k, v in megatron(spec, world, f"{spec.layers}.{i}.").items()}
        return sf.shard(model, in_strategy=(None,), parameter_plan=plan)
    if mode == "search":
        return sf.shard(model, in_strategy=(None,), level=2)
    # the layer as the model calls it: hidden states, then keyword arguments (masks, positions, the cache)
    layers[0] = sf.shard(layers[0], in_strategy={}, parameter_plan=megatron(spec, world))
    return model


def train_and_compare(name: str, mode: str, world: int, rank_slice: Callable, ranks: int = 1, steps: int = 3,
                      rtol: float = 1e-4, atol: float = 1e-5, prepare: Callable | None = None) -> list[float]:
    """Train ``name`` sharded as ``mode`` and unsharded on the same batches; assert losses and gradients agree
    at every step. ``rank_slice(t)`` gives this rank's dim-0 slice (data_parallel inputs); ``ranks``: how many
    ranks' values each tensor holds (a simulated world's); ``prepare(model)``: done to the model first (both
    copies). Returns the losses (rank 0's)."""

    def close(a, b, what):
        for r in range(ranks):
            torch.testing.assert_close(on_rank(a, r), on_rank(b, r), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what} (rank {r}): {m}")

    spec = MODELS[name]
    torch.manual_seed(0)
    reference = spec.make()
    if prepare is not None:
        prepare(reference)
    model = shard(copy.deepcopy(reference), spec, mode, world)
    # torch's foreach kernels take no mix of DTensor and plain parameters in one group: one group per kind
    groups = [[p for p in model.parameters() if isinstance(p, DTensor) == kind] for kind in (True, False)]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-3, foreach=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=True)
    losses = []
    for step in range(steps):
        args, kwargs = batch(spec, seed=step)
        if mode == "dp":
            out = model(*map(rank_slice, args), **{k: rank_slice(v) for k, v in kwargs.items()})
        else:
            out = model(*args, **kwargs)
        ref = reference(*args, **kwargs)
        close(out.loss, ref.loss, f"step {step} loss")
        out.loss.backward()
        ref.loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if q.grad is None:
                assert p.grad is None, f"step {step}: {n} got a gradient eager does not"
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            close(g, q.grad, f"step {step} {n}.grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(float(on_rank(ref.loss, 0)))
    return losses


# -- generate() ------------------------------------------------------------------------------------------------

NEW_TOKENS = 5


def _generate(model: torch.nn.Module, ids: torch.Tensor, cache: str) -> torch.Tensor:
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    return model.generate(ids, **kwargs)


def generate_and_compare(way: str, cache: str, world: int) -> list[int]:
    """Greedy generate() with a Llama sharded by a Megatron plan, ``way`` "whole" (the model) or "layers" (each
    layer), and ``cache`` "static" or "dynamic", against the unsharded model's tokens. Returns how many captures
    each sharded callable made (one per signature, one for every size of a structure whose sizes changed)."""
    spec = MODELS["llama"]
    torch.manual_seed(0)
    reference = spec.make().eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    want = _generate(reference, ids, cache)
    model = copy.deepcopy(reference)
    layers = _get(model, spec.layers)
    if way == "whole":  # generate() calls the model with keyword arguments only
        plan = {k: v for i in range(len(layers)) for k, v in megatron(spec, world, f"{spec.layers}.{i}.").items()}
        model = sf.shard(model, in_strategy={}, parameter_plan=plan)
        engines = [sf.engine_of(model)]
    else:
        for i in range(len(layers)):
            layers[i] = sf.shard(layers[i], in_strategy={}, parameter_plan=megatron(spec, world))
        engines = [sf.engine_of(layer) for layer in layers]
    with warnings.catch_warnings():
        if not has_dtensor_rule(torch.ops.aten.index.Tensor):  # torch 2.11's DTensor: the logits' pick runs whole
            warnings.filterwarnings("ignore", ".*aten.index.Tensor", ReplicatedFallbackWarning)
        got = _generate(model, ids, cache)
    assert got.shape[1] == ids.shape[1] + NEW_TOKENS and torch.equal(got, want), (got, want)
    return [engine.captures for engine in engines]


def megatron_layout(spec: Spec, layout: sf.Layout, prefix: str = "") -> dict:
    """megatron()'s plan on a (dp, tp) layout: each split dim over "tp", the weights whole over "dp"."""
    return {name: layout(*("tp" if n > 1 else "None" for n in s)) for name, s in megatron(spec, 2, prefix).items()}


def generate_rows_and_compare(tp: int, cache: str, world: int, mine: Callable, ranks: int = 1,
                              new_tokens: int = 3) -> None:
    """Greedy generate() with a Llama sharded as it trains data parallel: dataset_strategy="data_parallel" over
    every rank (``tp`` 1) or a (dp, tp) mesh with a Megatron plan (``tp`` 2; input_ids laid out over "dp", and
    a StaticCache's tensors too); ``cache`` "dynamic" or "static".
    ``mine(t)`` gives this rank's rows of a batch of 2 rows per dp slice (the tp ranks of a slice alike); ``ranks``:
    how many ranks' values each tensor holds (a simulated world's). Its tokens and scores must be the unsharded
    model's for those rows, on every rank."""
    spec = MODELS["llama"]
    torch.manual_seed(0)
    reference = spec.make().eval()
    ids = torch.randint(0, VOCAB, (2 * (world // tp), 5))
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    model = copy.deepcopy(reference)
    if tp == 1:
        model = sf.shard(model, in_strategy={}, dataset_strategy="data_parallel")
    else:
        layout = sf.Layout((world // tp, tp), ("dp", "tp"))
        plan = {k: v for i in range(len(_get(model, spec.layers)))
                for k, v in megatron_layout(spec, layout, f"{spec.layers}.{i}.").items()}
        given = {"input_ids": layout("dp", "None")}
        if cache == "static":  # (the DynamicCache's tensors take the batch's axes by default; this one is told)
            given["past_key_values"] = layout("dp", "None", "None", "None")
        model = sf.shard(model, in_strategy=given, dataset_strategy="data_parallel", parameter_plan=plan)
    with torch.no_grad(), warnings.catch_warnings():
        if not has_dtensor_rule(torch.ops.aten.index.Tensor):
            warnings.filterwarnings("ignore", ".*aten.index.Tensor", ReplicatedFallbackWarning)
        got = model.generate(mine(ids), attention_mask=mine(torch.ones_like(ids)), **kwargs)
    assert len(got.scores) == len(want.scores) == new_tokens
    for r in range(ranks):
        assert torch.equal(on_rank(got.sequences, r), on_rank(mine(want.sequences), r)), (r, got.sequences)
        for step, (g, w) in enumerate(zip(got.scores, want.scores)):
            torch.testing.assert_close(on_rank(g, r), on_rank(mine(w), r), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {r}, token {step}'s scores: {m}")
