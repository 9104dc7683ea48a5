"""Runs agree with plans: the collectives a sharded call executes, counted, are the ones explain() lists."""

from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.models import GPTBlock
from tests.parity import check_parity

_KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast"}


def _comm_counter() -> CommDebugMode:
    """CommDebugMode, also counting the in-place all-reduce the compiled graphs use on buffers nothing else reads
    (CommDebugMode lists only the out-of-place functional collectives)."""
    mode = CommDebugMode()
    mode.comm_registry.add(torch.ops._c10d_functional.all_reduce_)
    return mode


def executed(fn, args, kwargs=None, loss=lambda out: out.sum()):
    """(forward, backward) Counters of the collectives one (cached) call and its backward run."""
    kwargs = kwargs or {}
    fn(*args, **kwargs)  # the first call captures and compiles; count a repeat call
    with _comm_counter() as fwd_mode:
        out = fn(*args, **kwargs)
    with _comm_counter() as bwd_mode:
        loss(out).backward()

    def kinds(mode):
        # the programs run functional collectives; c10d's own all-reduce before a call is the ranks' agreement on
        # the call (on the control group), not part of the plan
        return Counter({_KINDS[str(op).split(".")[-1]]: n for op, n in mode.get_comm_counts().items()
                        if n and op is not torch.ops.c10d.allreduce_})

    return kinds(fwd_mode), kinds(bwd_mode)


def planned(plan, fused: bool = False):
    """(forward, backward) Counters of the plan's collectives; ``fused``: a bucket's gradient reductions counted
    as the one all-reduce a traced program on real ranks runs for them (a simulated world runs each)."""
    def kinds(phase):
        found = [c for c in plan.collectives if c.phase == phase]
        buckets = {c.bucket for c in found if c.bucket is not None} if fused else set()
        return Counter(c.kind for c in found if not (fused and c.bucket is not None)) + \
            Counter(all_reduce=len(buckets))

    return kinds("forward"), kinds("backward")


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


MEGATRON = {"attn.q.weight": (4, 1), "attn.k.weight": (4, 1), "attn.v.weight": (4, 1), "attn.q.bias": (4,),
            "attn.v.bias": (4,), "attn.proj.weight": (1, 4), "fc.weight": (4, 1), "fc.bias": (4,),
            "out.weight": (1, 4)}


def _mlp_args():
    return (torch.randn(8, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True),
            torch.randn(64, 32, requires_grad=True))


def test_megatron_mlp():
    with simulated_world(4):
        args = _mlp_args()
        f = sf.shard(mlp, in_strategy=(None, (1, 4), (4, 1)))
        plan = sf.explain(f, *args)
        assert planned(plan) == executed(f, args)
        assert planned(plan)[0] == Counter(all_reduce=1)


def test_data_parallel_mlp():
    with simulated_world(4):
        args = _mlp_args()
        f = sf.shard(mlp, in_strategy=((4, 1), (1, 1), (1, 1)), out_strategy=((4, 1),))
        plan = sf.explain(f, *args)
        assert planned(plan) == executed(f, args)
        assert planned(plan)[1]["all_reduce"] == 2  # one per weight gradient


def tied(ids, w):
    return torch.nn.functional.embedding(ids, w) @ w.t()  # a tied embedding: looked up, and read as the head


def _tied_args():
    return torch.randint(0, 16, (8, 5)), torch.randn(16, 8, requires_grad=True)


def test_tied_weight_gradient_is_reduced_once():
    # the weight's two readers each leave a pending gradient sum (the batch is split); the head reads it through
    # a transpose, which hands its sum on, so the weight adds both and reduces once
    plan = check_parity(tied, _tied_args, ((4, 1), (1, 1)))
    assert planned(plan)[1] == Counter(all_reduce=1)
    with simulated_world(4):
        f = sf.shard(tied, in_strategy=((4, 1), (1, 1)))
        assert planned(sf.explain(f, *_tied_args())) == executed(f, _tied_args())


def test_tensor_parallel_transformer_block():
    with simulated_world(4):
        block = sf.shard(GPTBlock(16, 4), in_strategy=(None,), parameter_plan=MEGATRON)
        x = torch.randn(2, 8, 16, requires_grad=True)
        plan = sf.explain(block, x)
        assert planned(plan) == executed(block, (x,))
        assert planned(plan) == (Counter(all_reduce=2), Counter(all_reduce=2))


def transformers_counts(name: str, mode: str, world: int, fused: bool = False) -> tuple:
    """(planned, executed) collectives of one training call of transformers model ``name`` sharded as ``mode``
    (tests.transformers_models.MODES); ``fused``: on real ranks, which fuse gradient buckets."""
    from tests.transformers_models import MODELS, batch, shard

    spec = MODELS[name]
    torch.manual_seed(0)
    model = shard(spec.make(), spec, mode, world)
    args, kwargs = batch(spec, seed=0)
    if mode == "dp":  # this rank's slice of the batch (any rows: only the collectives are counted)
        args, kwargs = tuple(a[:2] for a in args), {k: v[:2] for k, v in kwargs.items()}
    plan = sf.explain(model, *args, kwargs=kwargs)
    return planned(plan, fused), executed(model, args, kwargs, loss=lambda out: out.loss)


@pytest.mark.parametrize("name, mode", [(n, m) for n in ("llama", "gpt2", "bert", "resnet")
                                        for m in ("dp", "tp", "search")])
def test_transformers_models_run_what_they_plan(name, mode):
    # backward too: left to DTensor, a pending gradient sum travelled on into the ops that made the value, which
    # then gathered their weights and ran whole on every rank (Llama under Megatron: 13 all-gathers and 6
    # reduce-scatters a step where Megatron needs 2 all-reduces per layer)
    with simulated_world(4):
        plan, run = transformers_counts(name, mode, 4)
    assert plan == run
    if (name, mode) == ("llama", "tp"):
        # Megatron's backward moves the activations twice per layer (2 all-reduces, or with sequence-parallel
        # norms an all-gather and a reduce-scatter each); the bug ran 13 all-gathers and 6 reduce-scatters
        assert plan[1]["all_gather"] == plan[1]["reduce_scatter"] <= 4 and plan[1]["all_reduce"] >= 4
    if (name, mode) == ("gpt2", "dp"):
        # one per parameter gradient: the tied embedding's two readers (the lookup, and the head through a
        # transpose) sum their pending gradients and reduce once
        from tests.transformers_models import MODELS

        assert plan[1] == Counter(all_reduce=len(list(MODELS[name].make().parameters())))
