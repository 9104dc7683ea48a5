"""str(plan): the plan per layer, repeated layers folded, parameters by layout, collectives by kind; table() every
op (shardfn/strategy_search/_summary.py)."""

import torch

import shardfn as sf
from shardfn.strategy_search._summary import layer_of
from tests.transformers_models import MODELS, batch, megatron

SPEC = MODELS["llama"]


def test_layer_of_a_submodule_path():
    assert layer_of("model.layers.12.self_attn.q_proj") == "model.layers.12"
    assert layer_of("model.embed_tokens") == layer_of("model.embed_tokens.inner") == "model.embed_tokens"
    assert layer_of("lm_head") == "lm_head"
    assert layer_of("") == "(top level)"


def _llama_plan(layers: int, plan_of_layer):
    import transformers as tf

    from tests.transformers_models import _decoder_config

    config = _decoder_config(tf.LlamaConfig)
    config.num_hidden_layers = layers
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    plan = {k: v for i in range(layers) for k, v in plan_of_layer(i).items()}
    (ids,), kwargs = batch(SPEC, seed=0)
    return sf.explain(model, ids, kwargs=kwargs, in_strategy=(None,), parameter_plan=plan, world_size=4)


def test_repeated_layers_fold_into_one_with_their_count():
    plan = _llama_plan(4, lambda i: megatron(SPEC, 4, f"model.layers.{i}."))
    text = str(plan).splitlines()
    assert len(text) < 20 < len(plan.table().splitlines())
    at = text.index("model.layers.0-3 (x4)")
    assert text[at + 1].startswith("  parameters  (S(0)): self_attn.q_proj.weight, self_attn.k_proj.weight")
    assert "(S(1)): self_attn.o_proj.weight, mlp.down_proj.weight" in text[at + 1]
    # the folded line counts one layer's collectives: those of layer 2, read from the whole list
    nodes = {n.name: n for n in plan.nodes.values()}
    in_layer_2 = [c for c in plan.collectives if c.phase == "forward"
                  and layer_of(nodes[c.where.split(" -> ")[0]].module) == "model.layers.2"]
    def counted(kind):
        of_kind = [c for c in in_layer_2 if c.kind == kind]
        return f"{kind} x{len(of_kind)} ({sum(c.nbytes for c in of_kind) / 1024:.1f} KiB)"

    assert in_layer_2 and text[at + 2] == "  forward     " + ", ".join(
        counted(k) for k in dict.fromkeys(c.kind for c in in_layer_2))
    assert "aten.mm.default" in plan.table() and "aten.mm.default" not in str(plan)


def test_a_layer_planned_otherwise_stands_alone():
    plan = _llama_plan(4, lambda i: megatron(SPEC, 4, f"model.layers.{i}.") if i != 2 else {})
    text = str(plan).splitlines()
    assert [line for line in text if line.startswith("model.layers")] == [
        "model.layers.0-1 (x2)", "model.layers.2", "model.layers.3"]
