"""Models built on meta: planned before any call, given only each rank's pieces, initialised or loaded as the
unsharded model, trained. Simulated ranks for most; four real gloo ranks read their own slices of checkpoints."""

import json
import os

import pytest
import torch
import torch.nn as nn
import transformers as tf
from torch.distributed.tensor import DTensor, Shard

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.models import GPTBlock

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _gpt2_config():
    return tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=101, n_positions=32, **NO_DROPOUT)


def _llama_config():
    return tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=101, max_position_embeddings=32)


def _on_meta(make):
    with torch.device("meta"):
        return make()


def _reference(cls, config):
    """The unsharded transformers model initialised from meta the way transformers does: to_empty, then
    init_weights() (its constructor draws numbers of its own first, which no meta recipe repeats)."""
    torch.manual_seed(0)
    model = _on_meta(lambda: cls(config))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _sharded_on_meta(make, example, **shard_kwargs):
    model = sf.shard(_on_meta(make), in_strategy=(None,), example_inputs=(example,), **shard_kwargs)
    return model


def _each_rank(t, world):
    """Each simulated rank's value of ``t`` (a DTensor: gathered whole)."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return [on_rank(whole, r) for r in range(world)]


def _assert_same_parameters(model, reference, world=4):
    for name, q in reference.named_parameters():
        for value in _each_rank(model.get_parameter(name), world):
            torch.testing.assert_close(value, q.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_planned_before_any_call_then_materialised_like_the_unsharded_model():
    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    with simulated_world(4):
        model = _sharded_on_meta(lambda: GPTBlock(dim=16, heads=4), torch.empty(4, 8, 16, device="meta"), level=1)
        # laid out as planned, nothing allocated: meta pieces, split (level 1: least memory)
        params = dict(model.named_parameters())
        assert all(p.device.type == "meta" for p in params.values())
        assert any(isinstance(pl, Shard) for p in params.values() for pl in p.placements)
        assert params["fc.weight"].to_local().shape[0] < 64
        torch.manual_seed(0)
        sf.materialize(model, "cpu")
        _assert_same_parameters(model, reference)
        # and it computes as the unsharded model does, forward and backward
        x = torch.randn(4, 8, 16)
        out, ref_out = model(x), reference(x)
        torch.testing.assert_close(on_rank(out, 0), ref_out, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        ref_out.sum().backward()
        for name, q in reference.named_parameters():
            for g in _each_rank(model.get_parameter(name).grad, 4):
                torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("cls, config", [(tf.GPT2LMHeadModel, _gpt2_config), (tf.LlamaForCausalLM, _llama_config)],
                         ids=["gpt2", "llama"])
def test_transformers_models_initialise_as_unsharded_tied_weights_and_buffers_included(cls, config):
    reference = _reference(cls, config())
    ids = torch.randint(0, 101, (4, 16))
    with simulated_world(4):
        model = _sharded_on_meta(lambda: cls(config()), torch.empty(4, 16, dtype=torch.long, device="meta"), level=1)
        torch.manual_seed(0)
        sf.materialize(model, "cpu")
        _assert_same_parameters(model, reference)
        for name, b in reference.named_buffers():  # Llama's rotary tables, computed by its own init
            for value in _each_rank(model.get_buffer(name), 4):
                torch.testing.assert_close(value, b)
        if cls is tf.GPT2LMHeadModel:
            assert model.lm_head.weight is model.transformer.wte.weight
        loss = model(ids, labels=ids).loss
        torch.testing.assert_close(on_rank(loss, 0), reference(ids, labels=ids).loss, rtol=1e-5, atol=1e-5)


def test_a_save_pretrained_checkpoint_loads_into_the_pieces(tmp_path):
    torch.manual_seed(3)
    reference = tf.GPT2LMHeadModel(_gpt2_config())
    reference.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 101, (4, 16))
    with simulated_world(4):
        model = _sharded_on_meta(lambda: tf.GPT2LMHeadModel(_gpt2_config()),
                                 torch.empty(4, 16, dtype=torch.long, device="meta"),
                                 parameter_plan={"transformer.h.0.mlp.c_fc.weight": (1, 4)})
        sf.materialize(model, "cpu", init=None)
        sf.load(model, tmp_path)
        _assert_same_parameters(model, reference)
        torch.testing.assert_close(on_rank(model(ids).logits, 2), reference(ids).logits, rtol=1e-5, atol=1e-5)


# --- bad input -----------------------------------------------------------------------------------------------


def test_a_call_before_materialising_names_what_is_meta_and_the_fix():
    with simulated_world(4):
        model = _sharded_on_meta(lambda: GPTBlock(dim=16, heads=4), torch.empty(4, 8, 16, device="meta"))
        with pytest.raises(ValueError, match=r"still on the meta device.*sf\.materialize\(module\)"):
            model(torch.randn(4, 8, 16))


def test_a_checkpoint_of_another_shape_loads_nothing(tmp_path):
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=99, n_positions=32)) \
        .save_pretrained(tmp_path)
    with simulated_world(4):
        model = _sharded_on_meta(lambda: tf.GPT2LMHeadModel(_gpt2_config()),
                                 torch.empty(4, 16, dtype=torch.long, device="meta"))
        torch.manual_seed(0)
        sf.materialize(model, "cpu")
        before = {n: _each_rank(p, 4) for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=r"does not fit the model, nothing was loaded: transformer\.wte\.weight has "
                                             r"shape \(101, 32\) in the model but \(99, 32\) in the checkpoint"):
            sf.load(model, tmp_path)
        for n, p in model.named_parameters():
            assert all(torch.equal(a, b) for a, b in zip(_each_rank(p, 4), before[n])), n


def test_an_index_naming_missing_files_is_a_clear_error(tmp_path):
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(_gpt2_config()).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / gone)
    with simulated_world(4):
        model = _sharded_on_meta(lambda: tf.GPT2LMHeadModel(_gpt2_config()),
                                 torch.empty(4, 16, dtype=torch.long, device="meta"))
        sf.materialize(model, "cpu", init=None)
        with pytest.raises(FileNotFoundError, match=rf"names files that are not in .*{gone}"):
            sf.load(model, tmp_path)


class _Rotary(nn.Module):
    """A buffer computed at construction, which no reset_parameters recomputes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0).cos(), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.table


def test_a_buffer_no_init_computes_is_a_clear_error_and_an_init_function_fixes_it(tmp_path):
    sf.save(_Rotary().state_dict(), tmp_path / "ckpt")
    with simulated_world(2):
        model = _sharded_on_meta(_Rotary, torch.empty(4, 8, device="meta"))
        with pytest.raises(ValueError, match=r"buffer\(s\) table were built on meta.*init=fn"):
            sf.materialize(model, "cpu")

        def init(sub):
            if isinstance(sub, _Rotary):
                sub.table.copy_(torch.arange(8.0).cos())
            elif hasattr(sub, "reset_parameters"):
                sub.reset_parameters()

        model = _sharded_on_meta(_Rotary, torch.empty(4, 8, device="meta"))
        sf.materialize(model, "cpu", init=init)
        for value in _each_rank(model.table, 2):
            torch.testing.assert_close(value, torch.arange(8.0).cos())
        # allocated only, then a checkpoint that cannot hold the non-persistent buffer: said, not used
        model = _sharded_on_meta(_Rotary, torch.empty(4, 8, device="meta"))
        sf.materialize(model, "cpu", init=None)
        with pytest.raises(ValueError, match=r"buffer\(s\) table are not in the checkpoint.*sf\.materialize\(module\)"):
            sf.load(model, tmp_path / "ckpt")


def test_misused_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="example_inputs lays a module's parameters out"):
        sf.shard(torch.mm, in_strategy=(None, None), example_inputs=(torch.empty(2, 2), torch.empty(2, 2)))
    with simulated_world(2):
        with pytest.raises(TypeError, match="example_inputs must be a tuple"):
            sf.shard(_on_meta(lambda: nn.Linear(4, 4)), in_strategy=(None,), example_inputs=3)
        with pytest.raises(TypeError, match="materialize: init must be"):
            sf.materialize(_on_meta(lambda: nn.Linear(4, 4)), "cpu", init="zeros")


# --- real ranks --------------------------------------------------------------------------------------------------


def _real_ranks_body(path, mode):
    """Build on meta, shard (level 1 or Megatron), give each rank its pieces, train two steps: the losses and the
    first gradients against the unsharded model built the ordinary way."""
    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    megatron = {"attn.q.weight": (4, 1), "attn.k.weight": (4, 1), "attn.v.weight": (4, 1),
                "attn.proj.weight": (1, 4), "fc.weight": (4, 1), "out.weight": (1, 4)}
    kwargs = dict(level=1) if mode == "level1" else dict(parameter_plan=megatron)
    model = _sharded_on_meta(lambda: GPTBlock(dim=16, heads=4), torch.empty(4, 8, 16, device="meta"), **kwargs)
    if mode in ("safetensors", "dcp"):
        sf.materialize(model, init=None)
        sf.load(model, path)  # each rank reads its own slices
    else:
        torch.manual_seed(0)
        sf.materialize(model)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for module in (model, reference):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for step in range(2):
            loss = module(x).square().mean()
            loss.backward()
            if step == 0:
                grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                         for n, p in module.named_parameters()}
                if module is model:
                    sharded_grads = grads
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    for name, g in grads.items():
        torch.testing.assert_close(sharded_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert losses[:2] == pytest.approx(losses[2:], rel=1e-5, abs=1e-6)
    pieces = sum(p.to_local().numel() for p in model.parameters())
    return pieces, sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("mode", ["level1", "megatron", "safetensors", "dcp"])
def test_meta_built_models_train_like_the_unsharded_on_real_ranks(gloo4, tmp_path, mode):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = GPTBlock(dim=16, heads=4).state_dict()  # the unsharded model's, written whole by one process
    path = str(tmp_path / "block.safetensors") if mode == "safetensors" else str(tmp_path / "ckpt")
    if mode == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    elif mode == "dcp":
        sf.save(state, path)
    results = gloo4.run(_real_ranks_body, path, mode)
    assert all(pieces < whole for pieces, whole in results)  # no rank holds the whole model
