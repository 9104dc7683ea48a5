"""A cached call with gradients runs the traced forward and backward graphs itself (lower.GraphStep), as
AOTAutograd's runtime would: the backward graph takes its saved tensors in one list it empties, so each is freed
after its last use; a backward that keeps the graph (retain_graph) still has them. A world of one on a real
process group takes this path."""

import copy

import torch
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.models import GPTBlock


def _grads(model):
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def test_backward_twice_with_retain_graph_matches_eager():
    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    x = torch.randn(2, 8, 16)
    with simulated_world(1, local_tensors=False):  # a process group of one: the traced graphs run
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,))
        for m in (model, reference):
            for _ in range(2):  # the first call traces; the second runs the graphs directly
                loss = m(x).square().sum()
                loss.backward(retain_graph=True)
                loss.backward()
    for g, r in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    (compiled,) = sf.engine_of(model).programs.values()
    assert compiled.program._graph_step  # the cached call ran the graphs itself
    # the boxed convention: the graph that runs (its ops called through torch's bindings) empties the list of its
    # inputs as it reads them
    assert "args_list.clear()" in compiled.program.runners["backward"].graph.code
