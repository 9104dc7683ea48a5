"""Repeated layers traced once (shardfn.capture.repeated): the graph a capture makes with its layers copied is the
one a trace of every layer makes, node for node (ops, arguments, values' shapes, module paths, checkpoint
regions); layers whose ops could differ are traced as they run."""

import os

import pytest
import torch
import torch.fx
import torch.utils._pytree as pytree

from shardfn.capture import capture
from shardfn.capture import repeated
from shardfn.capture.graph import CHECKPOINT_REGION, MODULE_PATH

tf = pytest.importorskip("transformers")

VOCAB = 128


def _captured(model, args, kwargs, every_layer: bool, monkeypatch) -> torch.fx.GraphModule:
    monkeypatch.setenv("SHARDFN_TRACE_EVERY_LAYER", "1" if every_layer else "0")
    call = lambda state, *a, **k: torch.func.functional_call(model, state, a, k)  # noqa: E731
    return capture(model, args, kwargs, dict(model.named_parameters()), dict(model.named_buffers()), call=call,
                   grad=True).gm


def _described(gm: torch.fx.GraphModule) -> list[tuple]:
    """Each node: its op, target, arguments (other nodes by position), value's shape, dtype and strides, module
    path and checkpoint region."""
    at: dict[torch.fx.Node, int] = {}
    rows = []
    for i, node in enumerate(gm.graph.nodes):
        at[node] = i
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        val = node.meta.get("val")
        custom = node.meta.get("custom") or {}
        rows.append((node.op, str(node.target), str(spec),
                     tuple(("node", at[x]) if isinstance(x, torch.fx.Node) else repr(x) for x in leaves),
                     (tuple(val.shape), val.dtype, val.stride()) if isinstance(val, torch.Tensor) else None,
                     custom.get(MODULE_PATH), custom.get(CHECKPOINT_REGION)))
    return rows


def _copies_and_retraces(monkeypatch) -> dict:
    seen = {"copies": 0, "retraces": 0}
    copy_into, inlined = repeated._copy_into, repeated.LayersTracedOnce.inlined

    def counted_copy(*a, **k):
        seen["copies"] += 1
        return copy_into(*a, **k)

    def counted_inlined(self, *a, **k):
        try:
            return inlined(self, *a, **k)
        except repeated.NotCopied:
            seen["retraces"] += 1
            raise

    monkeypatch.setattr(repeated, "_copy_into", counted_copy)
    monkeypatch.setattr(repeated.LayersTracedOnce, "inlined", counted_inlined)
    return seen


def _same_graph(model, args, kwargs, monkeypatch) -> dict:
    every = _described(_captured(model, args, kwargs, True, monkeypatch))
    seen = _copies_and_retraces(monkeypatch)
    once = _described(_captured(model, args, kwargs, False, monkeypatch))
    assert len(once) == len(every)
    for i, (a, b) in enumerate(zip(every, once)):
        assert a == b, f"node {i}: traced {a}, copied {b}"
    return seen


def _decoder(cls, layers=5, **kw):
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, **kw)


def _llama_checkpointed():
    model = tf.LlamaForCausalLM(_decoder(tf.LlamaConfig))
    model.gradient_checkpointing_enable()
    return model.train()


def _moe(name):
    from tests.moe_models import make

    return lambda: make(name, "grouped_mm", layers=5)


MODELS = {
    "llama": lambda: tf.LlamaForCausalLM(_decoder(tf.LlamaConfig)),
    # each layer's ops in a checkpoint region of its own (transformers wraps the layer's forward)
    "llama checkpointed": _llama_checkpointed,
    # sliding and full attention layers interleaved: two kinds of layer, each copied from its own first call
    "gemma3": lambda: tf.Gemma3ForCausalLM(_decoder(
        tf.Gemma3TextConfig, layers=6, head_dim=8, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3)),
    # MLA, a shared expert and the experts as one Function call each (a FunctionCall of its own per copy)
    "deepseek_v3": _moe("deepseek_v3"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_copied_layers_make_the_graph_a_trace_of_every_layer_makes(name, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, 64, (4, 16))
    seen = _same_graph(model, (ids,), {"labels": ids, "use_cache": False}, monkeypatch)
    assert seen["copies"] >= 2 and seen["retraces"] == 0, seen


class _Layer(torch.nn.Module):
    def __init__(self, index: int, scaled_by_index: bool):
        super().__init__()
        self.layer_idx, self.scaled = index, scaled_by_index
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * (self.layer_idx + 1) if self.scaled else y


class _Net(torch.nn.Module):
    def __init__(self, scaled_by_index: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(i, scaled_by_index) for i in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_layers_whose_ops_read_their_index_are_traced_as_they_run(monkeypatch):
    # layer_idx is left out of what makes layers alike (transformers' layers keep it for their cache): the second
    # traced call tells the layers apart, and the capture traces again with these layers run as they are
    seen = _same_graph(_Net(scaled_by_index=True), (torch.randn(2, 8),), {}, monkeypatch)
    assert seen["retraces"] == 1


def _hooked():
    net = _Net()
    for layer in net.layers:
        layer.lin.register_forward_hook(lambda module, args, out: out * 2)
    return net


class _Writes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def _writes():
    net = _Net()
    net.layers = torch.nn.ModuleList(_Writes() for _ in range(4))
    return net


@pytest.mark.parametrize("make", [_hooked, _writes], ids=["a hook inside the layer", "a layer writing its input"])
def test_layers_a_copy_would_miss_something_of_are_traced_as_they_run(make, monkeypatch):
    x = torch.randn(2, 8)
    seen = _same_graph(make(), (x * 1,), {}, monkeypatch)
    assert seen["copies"] == 0


def test_a_kv_cache_argument_leaves_every_layer_traced(monkeypatch):
    # a cache object is written per layer (its update keyed by layer_idx): not a value a copy could pass on
    model = tf.LlamaForCausalLM(_decoder(tf.LlamaConfig, layers=3))
    ids = torch.randint(0, 64, (2, 8))
    seen = _same_graph(model, (ids,), {"use_cache": True}, monkeypatch)
    assert seen["copies"] == 0


class _MakesAConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.0, 2.0] * 4)  # a constant of the graph, made in each call


def test_a_constant_each_layer_makes_is_copied_where_the_two_traced_calls_made_it_alike(monkeypatch):
    net = _Net()
    net.layers = torch.nn.ModuleList(_MakesAConstant() for _ in range(4))
    seen = _same_graph(net, (torch.randn(2, 8),), {}, monkeypatch)
    assert seen["copies"] == 2 and seen["retraces"] == 0
