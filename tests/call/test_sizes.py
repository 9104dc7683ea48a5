"""Sizes that change between calls (shardfn/capture/dynamic.py, the engine's programs for every size): once a
second size of a structure is seen, the dims that changed are traced as symbols and one program serves every
later size, results and gradients as eager's; a size the capture's guards reject gets a program of its own."""

import copy
import logging
import os

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.transformers_models import MODELS, megatron

WORLD = 4
# the first length's program; the second's, for every length; two more lengths on it
LENGTHS = (9, 13, 17, 11)


def _gpt2():
    import transformers as tf

    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _captures(model) -> int:
    return sf.engine_of(model).captures


def _steps(model, reference, slice_of, loss_of, grads_of, rank_count: int, lengths=LENGTHS):
    """A step per length: the sharded model's loss and one gradient against eager's on the whole batch."""
    for length in lengths:
        torch.manual_seed(length)
        ids = torch.randint(0, 128, (8, length))
        local = slice_of(ids)
        loss = model(local, labels=local).loss
        loss.backward()
        want = reference(ids, labels=ids).loss
        want.backward()
        for got, expected in zip(loss_of(loss), [want.detach()] * rank_count):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads_of(dict(model.named_parameters())[name].grad), p.grad, rtol=1e-4,
                                       atol=1e-6, msg=lambda m: f"length {length}, {name}: {m}")
        model.zero_grad()
        reference.zero_grad()


def test_tensor_parallel_steps_of_changing_length(caplog):
    spec = MODELS["llama"]
    torch.manual_seed(0)
    reference = spec.make()
    plan = {k: v for i in range(2) for k, v in megatron(spec, WORLD, f"model.layers.{i}.").items()}
    with simulated_world(WORLD), caplog.at_level(logging.INFO, logger="shardfn"):
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), parameter_plan=plan)
        _steps(model, reference, lambda ids: ids, lambda loss: [on_rank(loss, r) for r in range(WORLD)],
               lambda g: on_rank(g.full_tensor(), 0), WORLD, LENGTHS[:3])
        # the first length's capture, and one for every later length
        assert _captures(model) == 2 and len(sf.engine_of(model).programs.for_every_size) == 1
    assert any("traced as symbols" in r.getMessage() for r in caplog.records)


def _branchy(x):
    # fn's Python reads a size: the capture assumes the branch it took
    return x * 2 if x.shape[1] > 12 else x - 1


def test_a_size_the_capture_assumed_otherwise_gets_a_program_of_its_own(caplog):
    with simulated_world(WORLD), caplog.at_level(logging.INFO, logger="shardfn"):
        f = sf.shard(_branchy, in_strategy=((WORLD, 1),))
        for length in (16, 20, 24, 8):
            x = torch.randn(8, length)
            torch.testing.assert_close(on_rank(f(x), 0), _branchy(x))
        engine = sf.engine_of(f)
        assert len(engine.programs.for_every_size) == 1 and engine.captures == 3  # 16; 20 and 24 dynamic; 8 on its own
    assert any("a program for these sizes alone" in r.getMessage() for r in caplog.records)


def test_a_structure_whose_symbolic_capture_fails_keeps_one_program_per_size(monkeypatch, caplog):
    import shardfn.call.planning as planning

    def refuse(gm):  # a symbolic capture that fails (an op without symbolic shapes, say)
        raise RuntimeError("no symbolic shapes here")

    monkeypatch.setattr(planning, "planning_graph", refuse)
    with simulated_world(WORLD), caplog.at_level(logging.WARNING, logger="shardfn"):
        f = sf.shard(lambda x: x.cos(), in_strategy=((WORLD, 1),))
        for length in (4, 6, 8, 6):
            x = torch.randn(8, length)
            torch.testing.assert_close(on_rank(f(x), 0), x.cos())
        # 4; 6 tried as symbols once, then one program per size: 6, 8
        assert sf.engine_of(f).captures == 4 and not sf.engine_of(f).programs.for_every_size
    assert any("tracing dims" in r.getMessage() and "no symbolic shapes here" in r.getMessage()
               for r in caplog.records)


def test_dynamic_false_keeps_one_program_per_size():
    with simulated_world(WORLD):
        f = sf.shard(lambda x: x.sin(), in_strategy=((WORLD, 1),), dynamic=False)
        for length in (4, 6, 8):
            x = torch.randn(8, length)
            torch.testing.assert_close(on_rank(f(x), 0), x.sin())
        assert sf.engine_of(f).captures == 3 and not sf.engine_of(f).programs.for_every_size


def test_explain_says_which_dims_are_dynamic():
    with simulated_world(WORLD):
        f = sf.shard(lambda x, w: (x @ w).relu(), in_strategy=((WORLD, 1), None))
        w = torch.randn(6, 5)
        for rows in (8, 12, 16):
            f(torch.randn(rows, 6), w)
        plan = sf.explain(f, torch.randn(20, 6), w)
    (note,) = [n for n in plan.notes if n.startswith("dynamic:")]
    assert "input 0 dims [0] (planned at [12])" in note and ">= 2" in note


def test_dims_named_up_front_are_dynamic_from_the_first_call():
    def f(x, mask=None):
        return (x.softmax(-1) * mask).sum(1)

    with simulated_world(WORLD):
        g = sf.shard(f, in_strategy={"x": (WORLD, 1)}, dynamic={0: 1, "mask": (1,)})
        for length in (6, 10, 7):
            x, mask = torch.randn(8, length), torch.rand(8, length)
            torch.testing.assert_close(on_rank(g(x, mask=mask), 0), f(x, mask))
        assert len(sf.engine_of(g).programs.for_every_size) == 1 and sf.engine_of(g).captures == 1
        with pytest.raises(ValueError, match=r"dynamic\['mask'\] = \(1,\): mask has 1 dims"):
            g(torch.randn(8, 5), mask=torch.rand(5))


@pytest.mark.parametrize("bad", ["yes", True, {0: -1}, {0: ()}, {1.5: 1}])
def test_a_bad_dynamic_setting_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"dynamic must be None .*, False .* or a dict"):
        sf.shard(lambda x: x, in_strategy=(None,), dynamic=bad)


def _for_every_size(model):
    """The program for every size of the model's one structure, traced on real ranks: why its trace failed
    (None), its graphs, how many sizes' calls they served, and its backward's all-reduces."""
    (compiled,) = sf.engine_of(model).programs.for_every_size.values()
    traced = compiled.traced
    backward = traced.graphs.get("backward")
    reductions = backward and sum("all_reduce" in str(n.target) for n in backward.graph.nodes)
    return traced.for_every_size.failed, sorted(traced.graphs), len(traced.for_every_size._verdicts), reductions


def _data_parallel_body(lengths):
    reference = _gpt2()
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
    rank = dist.get_rank()
    _steps(model, reference, lambda ids: ids[2 * rank: 2 * rank + 2], lambda loss: [loss.detach()],
           lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g, 1, lengths)
    return _captures(model), len(sf.engine_of(model).programs), _for_every_size(model)


def test_data_parallel_steps_of_changing_length_on_real_ranks(gloo4):
    # the first length's program; at the second (13), the program for every length, traced once with the length
    # as a symbol: every later length runs its graphs (no program, capture or trace of its own), as eager; its
    # gradients reduced in one bucket, the position embedding's rows (a length long) among them
    lengths = LENGTHS + (21, 13, 40)
    served = len(set(lengths[1:]))
    assert gloo4.run(_data_parallel_body, lengths) == [(2, 1, (None, ["backward", "forward"], served, 1))] * 4


def _failed_trace_body():
    # where the trace for every size fails, every call of the program for every size runs interpreted, and a
    # size met SHARDFN_TRACE_AFTER times (2 here) is traced on its own
    from shardfn.exec.for_every_size import ForEverySize

    trace = ForEverySize._trace
    ForEverySize._trace = lambda self, args: setattr(self, "failed", "its trace failed (forced)")
    os.environ["SHARDFN_TRACE_AFTER"] = "2"
    try:
        captures, programs, (failed, *_) = _data_parallel_body(LENGTHS[:2] + (17, 13, 13))
    finally:
        ForEverySize._trace = trace
        del os.environ["SHARDFN_TRACE_AFTER"]
    return captures, programs, failed


def test_a_failed_trace_for_every_size_runs_interpreted_then_traces_a_size_met_again(gloo4):
    # the first length's program and 13's, traced at its second call after the failure (the call that made the
    # program for every size, whose trace failed, counts none)
    assert gloo4.run(_failed_trace_body) == [(2, 2, "its trace failed (forced)")] * 4


def _tensor_parallel_body(lengths):
    spec = MODELS["llama"]
    torch.manual_seed(0)
    reference = spec.make()
    plan = {k: v for i in range(2) for k, v in megatron(spec, WORLD, f"model.layers.{i}.").items()}
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), parameter_plan=plan)
    _steps(model, reference, lambda ids: ids, lambda loss: [loss.detach()],
           lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g, 1, lengths)
    return _captures(model), _for_every_size(model)[0]


def test_tensor_parallel_steps_of_changing_length_on_real_ranks(gloo4):
    # a Megatron plan's program for every length, traced once on real ranks, at every length as eager
    assert gloo4.run(_tensor_parallel_body, LENGTHS) == [(2, None)] * 4


def test_a_size_the_trace_assumed_otherwise_runs_interpreted():
    # the trace for every size records what its sizes were assumed to be (here, an even length: a branch on it);
    # a call of another size runs the fallback, and the verdict is kept per sizes
    from functorch.compile import make_boxed_func

    from shardfn.exec.for_every_size import ForEverySize

    def fn(x):
        return [x * 2 if x.shape[1] % 2 == 0 else x * 3]

    fallen = []
    compiler = lambda gm, example_inputs: make_boxed_func(gm.forward)  # noqa: E731
    traced = ForEverySize(fn, {0: (1,)}, dict(fw_compiler=compiler, bw_compiler=compiler),
                          fallback=lambda x: fallen.append(x.shape[1]) or [x * 5])
    for length in (4, 6, 7, 8, 9):
        x = torch.ones(2, length)
        torch.testing.assert_close(traced(x)[0], x * (5 if length % 2 else 2))
    assert traced.failed is None and fallen == [7, 9]
    assert traced.rejects([torch.ones(2, 7)]) and not traced.rejects([torch.ones(2, 10)])


def test_a_size_is_traced_at_its_sixteenth_call_by_default(monkeypatch):
    # a trace costs ~20 interpreted steps: the lengths of one generate() met again in the next are not traced
    from types import SimpleNamespace

    from shardfn.call.programs import Programs
    from shardfn.strategy_search.lru import LRU

    programs, compiled = Programs("f"), SimpleNamespace(met=LRU(8))
    assert [programs.trace_now(compiled, ("a",)) for _ in range(16)] == [False] * 15 + [True]
    monkeypatch.setenv("SHARDFN_TRACE_AFTER", "0")
    assert not any(programs.trace_now(compiled, ("b",)) for _ in range(40))
    monkeypatch.setenv("SHARDFN_TRACE_AFTER", "often")
    with pytest.raises(ValueError, match="SHARDFN_TRACE_AFTER='often'"):
        programs.trace_now(compiled, ("c",))


def test_guards_compiled_to_python_agree_with_sympy():
    # a generation checks the capture's guards at every token: compiled once, each must say what sympy says
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    from shardfn.capture.dynamic import _check_of

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    guards = [sympy.Eq(FloorDiv(s0, 4) * 4, s0), sympy.Ne(PythonMod(s0, 3), 0), sympy.Ge(s0 + s1, 5),
              sympy.Eq(Mod(s0, 2), 0), sympy.And(sympy.Lt(s0, 64), sympy.Gt(s1, 1)), sympy.Eq(sympy.Max(s0, s1), s0)]
    for guard in guards:
        holds = _check_of(guard)
        for a, b in [(8, 3), (9, 1), (2, 2), (63, 5), (64, 2)]:
            assert holds({s0: a, s1: b}) == bool(guard.xreplace({s0: a, s1: b})), (guard, a, b)


class _Views(torch.nn.Module):
    """The views the interpreter runs on pieces (a program for every length, data parallel): the batch split
    merged and unmerged (view), views along whole dims (split, transpose, unsqueeze, expand, slice, select,
    squeeze), t() of a whole weight (its gradient's pending sum passes through the view), a value read by several
    ops, a detached one; an embedding and a gather on pieces."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 12)
        self.w = torch.nn.Parameter(torch.randn(24, 12) * 0.2)
        self.gate = torch.nn.Parameter(torch.randn(12))

    def forward(self, ids):
        h = self.emb(ids)
        b, t, d = h.shape
        a, c = (h.reshape(b * t, d) @ self.w.t()).view(b, t, 24).split(12, dim=-1)
        z = a.transpose(1, 2).unsqueeze(1).expand(b, 2, d, t)[:, :, :, 1:].sum(1).transpose(1, 2)
        h2 = h[:, 1:] + z * self.gate + c[:, 1:] * h[:, :-1]
        logp = torch.log_softmax(h2 @ self.emb.weight.t(), -1)
        picked = torch.gather(logp, -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return -picked.mean() + h2.detach().select(-1, 0).mean() * 0.5


def _view_steps(slice_of, loss_of, grad_of):
    torch.manual_seed(0)
    reference = _Views()
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
    for length in LENGTHS:
        torch.manual_seed(length)
        ids = torch.randint(0, 32, (8, length))
        loss = model(slice_of(ids))
        loss.backward()
        want = reference(ids)
        want.backward()
        torch.testing.assert_close(loss_of(loss), want.detach(), rtol=1e-5, atol=1e-6)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grad_of(model.get_parameter(name).grad), p.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"length {length}, {name}: {m}")
        model.zero_grad()
        reference.zero_grad()
    return _captures(model)


def test_views_on_pieces_match_eager_at_every_length():
    from torch.distributed._local_tensor import local_tensor_mode

    with simulated_world(WORLD):
        def slice_of(ids):
            return local_tensor_mode().rank_map(lambda r: on_rank(ids, r)[2 * r: 2 * r + 2].clone())

        assert _view_steps(slice_of, lambda loss: on_rank(loss, 0), lambda g: on_rank(g.full_tensor(), 0)) == 2


def _views_body():
    rank = dist.get_rank()
    return _view_steps(lambda ids: ids[2 * rank: 2 * rank + 2], lambda loss: loss.detach(),
                       lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g)


def test_views_on_pieces_match_eager_on_real_ranks(gloo4):
    assert gloo4.run(_views_body) == [2] * 4


def test_an_interpreted_new_length_reduces_its_gradients_once():
    # the program for every size, interpreted at a new length, leaves the parameters' gradients pending and
    # reduces them in one bucket as the backward ends (not one all-reduce per parameter); they end as eager's
    from torch.distributed._local_tensor import local_tensor_mode
    from torch.distributed.tensor.debug import CommDebugMode

    with simulated_world(WORLD):
        torch.manual_seed(0)
        reference = _Views()
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
        reduces = []
        for length in LENGTHS:
            torch.manual_seed(length)
            ids = torch.randint(0, 32, (8, length))
            local = local_tensor_mode().rank_map(lambda r: on_rank(ids, r)[2 * r: 2 * r + 2].clone())
            loss = model(local)
            with CommDebugMode() as comm:
                loss.backward()
            reduces.append(sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op)))
            reference(ids).backward()
            for name, p in reference.named_parameters():
                got = model.get_parameter(name).grad
                assert tuple(got.placements) == tuple(model.get_parameter(name).placements), name
                torch.testing.assert_close(on_rank(got.full_tensor(), 0), p.grad, rtol=1e-4, atol=1e-6)
            model.zero_grad()
            reference.zero_grad()
    # the first length's program reduces each of the 3 parameters' gradients as autograd hands it over; the
    # program for every length (from the second length on) one bucket of them
    assert reduces[0] >= 3 and reduces[1:] == [1] * (len(LENGTHS) - 1), reduces


def test_the_synced_once_program_is_the_searchs_accumulating_plan():
    # the program for every size, interpreted with gradients, runs a plan that leaves the parameters' gradients
    # pending: the search's plan of the same graph asked with accumulate=True (as sf.no_sync's calls ask it),
    # the parameters kept where the first plan laid them out; not the first plan with its field replaced
    from torch.distributed._local_tensor import local_tensor_mode

    with simulated_world(WORLD):
        model = sf.shard(_Views(), in_strategy=(None,), dataset_strategy="data_parallel")
        engine = sf.engine_of(model)
        for length in LENGTHS[:3]:
            ids = torch.randint(0, 32, (8, length))
            local = local_tensor_mode().rank_map(lambda r: on_rank(ids, r)[2 * r: 2 * r + 2].clone())
            model(local).backward()
            if length == LENGTHS[1]:
                planned_at = local  # the program for every size is planned at the second length's sizes
        (compiled,) = [c for c in engine.programs.for_every_size.values() if c.synced_once is not None]
        with sf.no_sync(model):  # what the search plans for an accumulating call of that graph
            asked = engine.plan([planned_at], {}, WORLD, "cpu", dynamic=compiled.dynamic).plan
    synced = compiled.synced_once.plan
    assert synced.accumulate and not compiled.plan.accumulate and asked.accumulate
    assert synced.collectives == asked.collectives and dict(synced.nodes) == dict(asked.nodes)
    assert [(p.name, p.planned) for p in synced.inputs] == [(p.name, p.planned) for p in asked.inputs] \
        == [(p.name, p.planned) for p in compiled.plan.inputs]
    # the first plan all-reduces the gradients as autograd hands them over; the accumulating plan none
    assert compiled.plan.count("all_reduce", "backward") > 0 == synced.count("all_reduce", "backward")
