"""Capture: fn is traced the way library code expects tracing to look, and every tensor it reads is accounted
for (an input, a constant of the graph, or an error naming it)."""

import contextlib

import pytest
import torch

import shardfn as sf
from shardfn.capture import capture
from tests.parity import check_parity


def test_library_code_sees_that_it_is_traced():
    # transformers (and torch.utils.checkpoint) skip value-dependent shortcuts when torch.compiler says so
    seen = []

    def packed(position_ids):
        seen.append(torch.compiler.is_compiling())
        if not torch.compiler.is_compiling() and bool((position_ids[:, -1] == 0).all()):  # value-dependent
            return position_ids
        return position_ids * 2

    check_parity(packed, lambda: (torch.arange(16).unsqueeze(0).expand(4, 16).contiguous(),), ((4, 1),))
    assert seen[0] is True  # the capture (the eager reference call sees False)
    assert False in seen and not torch.compiler.is_compiling()  # restored after it


MASK = torch.rand(8, 6) > 0.5


def test_a_tensor_read_from_outside_fn_is_a_constant_of_the_graph():
    plan = check_parity(lambda x: x.masked_fill(MASK, 0.0) * 2, lambda: (torch.randn(8, 6, requires_grad=True),),
                        ((4, 1),))
    assert any(n.rule == "constant" for n in plan.nodes.values())


def test_a_tensor_made_inside_fn_is_a_constant_too():
    # indexing with a list makes a tensor inside the trace (a graph constant); torch 2.11's DTensor has no rule for
    # the indexing itself (it runs whole there)
    from shardfn.strategy_search._dtensor_adapter import has_dtensor_rule
    from shardfn.strategy_search.candidates import ReplicatedFallbackWarning

    whole = not has_dtensor_rule(torch.ops.aten.index.Tensor)
    with pytest.warns(ReplicatedFallbackWarning, match="aten.index.Tensor") if whole else contextlib.nullcontext():
        check_parity(lambda x: x[[0, 2, 5]] * x[:, [1, 3]].sum(), lambda: (torch.randn(8, 6, requires_grad=True),),
                     (None,))


def test_a_tensor_from_outside_that_requires_grad_is_refused():
    w = torch.randn(6, 6, requires_grad=True)
    with pytest.raises(sf.CaptureError, match=r"reads a tensor of shape \(6, 6\) that requires grad but is not one "
                                              r"of its inputs.*Pass it as an argument"):
        capture(lambda x: x @ w, [torch.empty(8, 6, device="meta")], {})


@pytest.mark.parametrize("where", ["fn", "hook"])
def test_fn_that_communicates_itself_is_refused(where):
    import torch.distributed as dist

    from shardfn.runtime import simulated_world

    def fn(x):
        y = x * 2
        dist.all_reduce(y)
        return y

    with simulated_world(2):
        if where == "hook":  # a barrier in a forward pre-hook (a benchmark timing each call) runs in the capture
            model = torch.nn.Linear(6, 6)
            model.register_forward_pre_hook(lambda *_: dist.barrier())
            sharded = sf.shard(model, in_strategy=((2, 1),))
        else:
            sharded = sf.shard(fn, in_strategy=((2, 1),))
        with pytest.raises(sf.CaptureError, match=r"communicates itself \(c10d::.*Call it outside the sharded call"):
            sharded(torch.randn(4, 6))


def test_tensors_in_keyword_arguments_and_containers_are_inputs():
    graph = capture(lambda x, pair=None, scale=None: x * pair[0] + pair[1] * scale,
                    [torch.empty(4, 3, device="meta")],
                    {"pair": (torch.empty(3, device="meta"), torch.empty(4, 3, device="meta")),
                     "scale": torch.empty(1, device="meta")})
    assert [gi.name for gi in graph.inputs] == ["input 0", "pair[0]", "pair[1]", "scale"]
    assert [gi.shape for gi in graph.inputs] == [(4, 3), (3,), (4, 3), (1,)]


def test_an_activation_marked_as_requiring_grad_is_traced_as_it_is():
    # transformers' gradient checkpointing marks the embeddings' output requires_grad_() (refused inside a
    # functionalized trace); the traced program differentiates what needs it anyway
    def marked(x, w):
        h = x @ w
        h.requires_grad_()
        return torch.sin(h)

    check_parity(marked, lambda: (torch.randn(8, 6), torch.randn(6, 4, requires_grad=True)), ((4, 1), None))
    assert "requires_grad_" not in torch.Tensor.__dict__  # torch's own again after the capture


def test_activation_checkpoint_regions_are_marked():
    # each torch.utils.checkpoint region's ops carry its number (non-reentrant and reentrant alike), for the
    # programs to compute them again in backward; ops outside carry none
    from torch.utils.checkpoint import checkpoint

    from shardfn.capture.graph import checkpoint_region

    def block(x, w):
        return torch.tanh(torch.tanh(x @ w) @ w)

    def fn(x, w):
        y = checkpoint(block, x, w, use_reentrant=False)
        y = checkpoint(block, y, w, use_reentrant=True)
        return block(y, w).sum()

    gm = capture(fn, (torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)), {}).gm
    regions = [checkpoint_region(n) for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default]
    assert sorted(regions, key=str) == [1, 1, 2, 2, None, None]
    assert all(getattr(torch.utils.checkpoint, name).__module__ == "torch.utils.checkpoint" for name in
               ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
               if hasattr(torch.utils.checkpoint, name))  # torch's own again after the capture


def test_writes_of_decompositions_land_in_inputs_only():
    # decompositions run below functionalization: circular padding's copy_ into slices of its fresh result and
    # instance norm's copy_ into an alias of its running statistics stayed in the graph, and a plan that laid the
    # destination out otherwise wrote into a temporary. Captured again under functionalization, every write left is
    # one copy_ into an input (the running statistics), and the graph's annotations are kept
    import torch.nn.functional as F

    from shardfn.capture.graph import is_in_place

    def pad(x):
        return F.pad(x, (0, 2, 0, 1), mode="circular")

    def inorm(x, rm, rv):
        return F.instance_norm(x, running_mean=rm, running_var=rv, use_input_stats=True, momentum=0.5)

    for fn, args, written in [(pad, [torch.randn(2, 3, 5, 5, requires_grad=True)], {}),
                              (inorm, [torch.randn(4, 8, 6), torch.randn(8), torch.rand(8)], {1, 2})]:
        captured = capture(fn, args, {})
        writes = [n for n in captured.gm.graph.nodes if n.op == "call_function" and is_in_place(n.target)]
        assert all(n.args[0].op == "placeholder" for n in writes), captured.gm.code
        assert set(captured.writes) == set(written)
        assert torch.ops.aten.copy.default not in {n.target for n in captured.gm.graph.nodes}


def test_a_cpu_scalar_in_an_object_is_traced_on_the_cpu_so_moving_it_to_the_device_is_a_copy():
    """StaticCache's counter is made on the CPU and moved to the keys' device at the first update; traced as a
    device tensor its ``.to(device)`` vanished, every call wrote into the CPU tensor, and a CUDA graph could not
    replay the decoding step (its input a CPU scalar). Traced where it lies, the caller gets the moved copy."""

    class Counter:
        def __init__(self):
            self.seen = torch.tensor(0)
            self.ready = False

    def step(x, counter):
        if not counter.ready:
            counter.seen, counter.ready = counter.seen.to(x.device), True
        counter.seen.add_(1)
        return x + counter.seen

    captured = capture(step, (torch.empty(4, device="meta"), Counter()), {}, device="cuda")
    placeholders = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert [v.device.type for v in placeholders] == ["cuda", "cpu"]
    assert [gi.on_cpu for gi in captured.inputs] == [False, True]
    moved = [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    assert len(moved) == 1 and moved[0].meta["val"].device.type == "cuda"
    (_, first_new, state), = captured.states  # the new counter is an output, not the CPU input kept
    outputs = next(n for n in captured.gm.graph.nodes if n.op == "output").args[0]
    assert outputs[first_new].meta["val"].device.type == "cuda"
    # a 0-dim input already on the program's device, or a program on the CPU, or one needing a gradient (made on
    # the device) is traced on the program's device
    assert not any(gi.on_cpu for gi in capture(step, (torch.empty(4), Counter()), {}).inputs)
    from shardfn.capture.trace import _graph_inputs

    learnt, _ = _graph_inputs({}, {}, (torch.empty(4), torch.tensor(2.0, requires_grad=True)), {}, lambda: "fn", "cuda")
    assert not any(gi.on_cpu for gi in learnt)
