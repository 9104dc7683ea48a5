"""The compiled path on real gloo ranks (4 processes, started once for the session): parity with
single-process eager, training, checkpoints, and errors raised on every rank instead of hangs."""

import contextlib
import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.models import CheckpointedStack, GPTBlock, NormedMLP


def dense_relu(x, w, b):
    return torch.relu(x @ w + b)


def _parity_body(strategy):
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    w = torch.randn(8, 12, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    f = sf.shard(dense_relu, in_strategy=(strategy, None, None))
    y = f(x, w, b)
    y.square().sum().backward()
    rw, rb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = dense_relu(x, rw, rb)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(w.grad, rw.grad)
    torch.testing.assert_close(b.grad, rb.grad)
    (compiled,) = sf.engine_of(f).programs.values()
    return sorted(compiled.program.graphs)  # the AOT-compiled local graphs


def test_compiled_parity(gloo4):
    for strategy in [(4, 1), (1, 4), (2, 2), None]:
        graphs = gloo4.run(_parity_body, strategy)
        assert graphs[0] == ["backward", "forward"]


def _train_body(plan_name):
    from tests.test_modules import GPT_PLANS, _train

    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    model = sf.shard(copy.deepcopy(reference), **GPT_PLANS[plan_name])
    x = torch.randn(4, 8, 16)
    losses, ref_losses = _train(model, x, 5), _train(reference, x, 5)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=2e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    return float(losses[-1])


def test_gpt_block_training_dp_tp(gloo4):
    losses = gloo4.run(_train_body, "dp_tp")
    assert len(set(losses)) == 1  # every rank saw the same loss


def _rank_ordered_body():
    # each rank's Python runs fn's independent work in its own order (a set of strings iterates by the process's
    # hash seed: transformers' Gemma 3 and ModernBERT): the ranks still capture one graph, agree, and compute
    from tests.capture.test_order import tables

    order = ["global", "local"] if dist.get_rank() % 2 else ["local", "global"]
    torch.manual_seed(0)
    x, w = torch.randn(8, 6), torch.randn(6, 6, requires_grad=True)
    f = sf.shard(lambda a, b: tables(a, b, order), in_strategy=((4, 1), None))
    y = f(x, w)
    y.backward()
    rw = w.detach().clone().requires_grad_()
    ref = tables(x, rw, order)
    ref.backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(w.grad, rw.grad)
    (compiled,) = sf.engine_of(f).programs.values()
    return compiled.captured.gm.code


def test_ranks_whose_python_runs_in_another_order_capture_one_graph(gloo4):
    codes = gloo4.run(_rank_ordered_body)
    assert len(set(codes)) == 1


class _Wrapped(torch.nn.Module):
    """A model with one sharded block between eager parts, as users compile whole models."""

    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = torch.nn.Linear(6, 16), GPTBlock(dim=16, heads=4), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(torch.tanh(self.embed(x)))).mean(1)


def _compiled_around_body():
    # torch.compile around a model holding a sharded block: Dynamo breaks the graph at the sharded call (shardfn's
    # own capture and graphs run it) instead of tracing shardfn's Python
    torch.manual_seed(0)
    reference = _Wrapped()
    model = copy.deepcopy(reference)
    model.block = sf.shard(model.block, in_strategy=(None,), parameter_plan={"fc.weight": (4, 1), "fc.bias": (4,),
                                                                             "out.weight": (1, 4)})
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(2, 8, 6)
        y, ref = compiled(x), reference(x)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        y.square().sum().backward()
        ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_torch_compile_around_a_sharded_block(gloo4):
    gloo4.run(_compiled_around_body)


def _checkpointed_body(checkpointed):
    torch.manual_seed(0)
    reference = CheckpointedStack(checkpointed)
    n = dist.get_world_size()
    megatron = {f"blocks.{i}.{name}": s for i in range(2) for name, s in (("fc.weight", (n, 1)), ("fc.bias", (n,)),
                                                                          ("out.weight", (1, n)))}
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), parameter_plan=megatron)
    x = torch.randn(4, 8, 16)
    y, ref = model(x), reference(x)
    y.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    (compiled,) = sf.engine_of(model).programs.values()
    fw, bw = compiled.program.graphs["forward"], compiled.program.graphs["backward"]
    def an_input(n):  # a graph input (parameters, x), or a view of one: held anyway
        while n.op == "call_function" and getattr(n.target, "is_view", False):
            n = n.args[0]
        return n.op == "placeholder"

    saved = [n for n in next(n for n in fw.graph.nodes if n.op == "output").args[0][1:] if not an_input(n)]
    # attention (dropout 0) computed again in backward as aten's own op, not replayed under a saved generator state
    assert not any(n.target is torch.ops.higher_order.run_with_rng_state for n in bw.graph.nodes)
    assert not any(hasattr(n.target, "replayable_op") for g in (fw, bw) for n in g.graph.nodes)
    collectives = [str(n.target) for n in bw.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional"]
    return sum(n.meta["val"].numel() for n in saved if isinstance(n.meta.get("val"), torch.Tensor)), collectives


def test_activation_checkpointing_is_kept(gloo4):
    # checkpointed blocks: backward computes their activations again, the collectives on them too (the forward
    # saves under half the elements it saved, besides its inputs: the blocks' inputs; each block's backward
    # gathers its sequence-split input again, as Megatron's full recompute does), and every number is eager's
    (plain, plain_collectives), (checkpointed, collectives) = (gloo4.run(_checkpointed_body, c)[0]
                                                               for c in (False, True))
    assert checkpointed < plain / 2, (checkpointed, plain)
    gather = ["_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.wait_tensor.default"]
    assert sorted(collectives) == sorted(plain_collectives + 2 * gather)


def test_activation_checkpointing_is_kept_in_a_world_of_one():
    # a world of one runs the captured graph whole: its regions are computed again in backward there too
    from shardfn.runtime import simulated_world

    with simulated_world(1, local_tensors=False):  # a process group of one: the traced graphs run
        (plain, _), (checkpointed, _) = (_checkpointed_body(c) for c in (False, True))
    assert checkpointed < plain / 2, (checkpointed, plain)


def _shape_mismatch_body(odd_rank, odd_rows):
    x = torch.randn(odd_rows if dist.get_rank() == odd_rank else 8, 4)
    try:
        sf.shard(lambda t: t * 2, in_strategy=((4, 1),))(x)
    except ValueError as e:
        return str(e)
    return "no error"


def test_full_batch_shapes_differing_across_ranks_fail_everywhere(gloo4):
    # rank 0 passes 16 rows; then rank 1 passes 6, which also breaks its strategy (6 rows in 4): the same error
    # on every rank, naming the shapes on each rank (and rank 1's own failure), no hang
    for odd_rank, odd_rows in [(0, 16), (1, 6)]:
        messages = gloo4.run(_shape_mismatch_body, odd_rank, odd_rows)
        assert len(set(messages)) == 1, messages
        assert f"rank {odd_rank}: input 0 ({odd_rows}, 4) float32" in messages[0], messages[0]
        assert "ranks not making the same call" in messages[0] or "not making the same call" in messages[0]


def _bad_strategy_body():
    try:
        sf.shard(dense_relu, in_strategy=((3, 1), None, None))(torch.randn(6, 4), torch.randn(4, 4), torch.randn(4))
    except ValueError as e:
        t = torch.ones(1)
        dist.all_reduce(t)  # the world is still usable: nobody is stuck in a collective
        return f"{e} / {int(t.item())}"


def test_bad_strategy_raises_on_every_rank(gloo4):
    messages = gloo4.run(_bad_strategy_body)
    assert all("does not divide the world size 4" in m and m.endswith("/ 4") for m in messages)


def _checkpoint_body(path):
    import torch.distributed.checkpoint as dcp

    from tests.test_modules import GPT_PLANS

    torch.manual_seed(0)
    model = sf.shard(GPTBlock(), **GPT_PLANS["tp"])
    x = torch.randn(2, 8, 16)
    y = model(x)
    dcp.save(model.state_dict(), checkpoint_id=path)
    torch.manual_seed(1)
    other = sf.shard(GPTBlock(), **GPT_PLANS["tp"])
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    torch.testing.assert_close(other(x), y)
    return all(isinstance(p, DTensor) for p in other.parameters())


def test_distributed_checkpoint_round_trip(gloo4):
    with tempfile.TemporaryDirectory() as d:
        assert gloo4.run(_checkpoint_body, os.path.join(d, "ckpt")) == [True] * 4


def _agreement_body():
    from tests.exec.test_plan_agreement import _mlp_args, executed, mlp, planned

    torch.manual_seed(0)
    args = _mlp_args()
    f = sf.shard(mlp, in_strategy=(None, (1, 4), (4, 1)))
    return planned(sf.explain(f, *args)) == executed(f, args)


def test_compiled_runs_agree_with_plans(gloo4):
    assert gloo4.run(_agreement_body) == [True] * 4


def _transformers_agreement_body():
    from tests.exec.test_plan_agreement import transformers_counts

    plan, run = transformers_counts("llama", "tp", dist.get_world_size(), fused=True)
    return plan == run, plan[1]["all_gather"], plan[1]["reduce_scatter"]


def test_traced_backward_of_a_tensor_parallel_llama_runs_what_it_plans(gloo4):
    # the traced graphs on real ranks run what the plan lists: Megatron's activations moved twice per layer in
    # backward (the bug gathered the weights: 13 all-gathers and 6 reduce-scatters)
    results = gloo4.run(_transformers_agreement_body)
    assert all(agree and gathers == scatters <= 4 for agree, gathers, scatters in results)


def _buckets_body(limit_mb):
    os.environ["SHARDFN_BUCKET_MB"] = str(limit_mb)
    torch.manual_seed(0)
    model = sf.shard(GPTBlock(), in_strategy=(None,), dataset_strategy="data_parallel")
    x = torch.randn(2, 8, 16)
    plan = sf.explain(model, x)
    model(x).sum().backward()
    del os.environ["SHARDFN_BUCKET_MB"]
    (compiled,) = sf.engine_of(model).programs.values()
    backward = compiled.program.graphs["backward"]
    traced = sorted(n.args[0].meta["val"].numel() * 4 for n in backward.graph.nodes
                    if str(n.target).startswith("_c10d_functional.all_reduce"))
    fused: dict = {}
    for c in plan.collectives:
        if c.phase == "backward" and c.kind == "all_reduce":
            fused.setdefault(c.where if c.bucket is None else c.bucket, []).append(c.nbytes)
    return traced, sorted(sum(sizes) for sizes in fused.values()), len({c.bucket for c in plan.collectives} - {None})


def test_explain_lists_the_buckets_the_program_fuses(gloo4):
    # 15 gradients, 13056 bytes: one bucket at 25 MB. At 4 KiB, last parameter first: out.bias alone (out.weight
    # would overflow it), out.weight, fc.bias, fc.weight alone, attn's proj..q.bias fused (3264), q.weight and
    # the norms fused (1280)
    traced, planned, buckets = gloo4.run(_buckets_body, 25)[0]
    assert traced == planned == [13056] and buckets == 1
    traced, planned, buckets = gloo4.run(_buckets_body, 4096 / 2**20)[0]
    assert traced == planned == [64, 256, 1280, 3264, 4096, 4096] and buckets == 2


def _autocast_body(level):
    torch.manual_seed(0)
    reference = GPTBlock(dim=64, heads=4)
    model = sf.shard(copy.deepcopy(reference), in_strategy=((4, 1, 1),), level=level)
    x = torch.randn(8, 32, 64)  # (large enough that the search keeps the batch split, the weights whole)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = sf.explain(model, x)
        loss, ref_loss = model(x).float().square().mean(), reference(x).float().square().mean()
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=1e-3)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=5e-2, atol=5e-3, msg=lambda m: f"{name}: {m}")
    return sorted({c.where.split(" -> ")[0].rstrip("_0123456789") for c in plan.collectives
                   if c.phase == "backward" and c.bucket is not None})


def test_gradients_reduced_in_bf16_under_autocast_are_bucketed_as_planned(gloo4):
    # autocast's bf16 copy of a parameter, read by a data-parallel matmul: its gradient is reduced in bf16 and
    # cast back; the backward graph fused those reductions into a bucket the plan did not list (it followed
    # reshapes to the parameter, not casts), and exec refused the plan at level 2
    for level in (2, 1):
        bucketed = gloo4.run(_autocast_body, level)[0]
        assert "_to_copy" in bucketed, bucketed


def _batch_norm_body(plan_name):
    from tests.test_modules import NORMED_PLANS, _train, assert_same_buffers

    torch.manual_seed(0)
    reference = NormedMLP()
    model = sf.shard(copy.deepcopy(reference), **NORMED_PLANS[plan_name])
    x = torch.randn(8, 16)
    losses, ref_losses = _train(model, x, 3), _train(reference, x, 3)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=2e-5)
    assert_same_buffers(model, reference)
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=2e-5)
    return int(model.bn.num_batches_tracked)


def test_batch_norm_running_statistics_on_real_ranks(gloo4):
    # the compiled path: the traced program writes the buffers' updates back into the module's tensors
    assert gloo4.run(_batch_norm_body, "dp") == [3] * 4


def _strides_body():
    from tests.exec.test_strides import B, D, H, T, heads_scaled

    torch.manual_seed(0)
    x, c = torch.randn(B, T, H * D, requires_grad=True), torch.randn(B, H, T, D, requires_grad=True)
    y = sf.shard(heads_scaled, in_strategy=((1, 4, 1), (1, 4, 1, 1)))(x, c)
    rx, rc = x.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    ref = heads_scaled(rx, rc)
    weights = torch.linspace(-1, 1, ref.numel()).reshape(ref.shape)
    (y * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(c.grad, rc.grad)
    return True


def test_views_after_redistribution_on_real_ranks(gloo4):
    assert gloo4.run(_strides_body) == [True] * 4


def _in_place_body(strategy):
    from tests.test_io import _scale_in_place

    torch.manual_seed(0)
    x, w = torch.randn(8, 4), torch.randn(4, 8)
    ref_x = x.clone()
    ref = _scale_in_place(ref_x, w)
    f = sf.shard(_scale_in_place, in_strategy=(strategy, None))
    y = f(x, w)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x, ref_x)
    y = f(x, w)  # the cached program writes back too
    torch.testing.assert_close(y, _scale_in_place(ref_x, w))
    torch.testing.assert_close(x, ref_x)
    return True


def test_in_place_updates_in_another_layout_are_written_back_on_real_ranks(gloo4):
    for strategy in [(4, 1), None]:
        assert gloo4.run(_in_place_body, strategy) == [True] * 4


def _regather_body():
    from tests.test_modules import _train

    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel", level=1)
    x = torch.randn(4, 8, 16)
    batch = x[dist.get_rank():dist.get_rank() + 1]
    plan = sf.explain(model, batch)
    losses = _train(model, batch, 3)
    # every rank's loss is its slice's mean: the reference trains on the whole batch, whose loss is their mean
    whole = _train(reference, x, 3)
    for loss, ref in zip(losses, whole):
        mean = torch.tensor(float(loss))
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / 4, ref, rtol=1e-5, atol=2e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
    (compiled,) = sf.engine_of(model).programs.values()
    graphs = compiled.program.graphs

    def gathers(name):
        return sum(str(n.target).startswith("_c10d_functional.all_gather") for n in graphs[name].graph.nodes)

    fw_out = next(n for n in graphs["forward"].graph.nodes if n.op == "output").args[0]
    params = {tuple(p.shape) for p in model.parameters() if p.dim() == 2 and p.to_local().shape != p.shape}
    saved_whole = [n.name for n in fw_out[len(compiled.program.out_vals):]
                   if n.op != "placeholder" and tuple(n.meta["val"].shape) in params | {s[::-1] for s in params}]
    def planned(phase):  # one collective per bucket of parameters' gathers, one per gather outside buckets
        found = [c for c in plan.collectives if c.kind == "all_gather" and c.phase == phase]
        return len({c.bucket for c in found if c.bucket is not None}) + sum(c.bucket is None for c in found), \
            len(found)

    return (plan.reshard_after_forward, planned("backward"), gathers("backward"), planned("forward"),
            gathers("forward"), saved_whole)


def test_level_1_gathers_parameters_again_in_backward_and_trains_like_eager(gloo4):
    # FSDP's memory: no whole parameter is saved from forward to backward; backward gathers the ones it reads,
    # and both gather the parameters in buckets (as FSDP2 gathers a block's at once), as the plan says
    for reshard, planned_bw, traced_bw, planned_fw, traced_fw, saved_whole in gloo4.run(_regather_body):
        assert reshard and planned_fw[0] == traced_fw > 0 and 0 < traced_bw == planned_bw[0]
        assert 0 < planned_bw[1] < planned_fw[1] and traced_fw < planned_fw[1]  # fewer gathers than parameters
        assert saved_whole == [], saved_whole


def _gathered_held_at_once(graph) -> int:
    """The most gathered parameters (an all-gather's results, their pieces and copies) that later ops still read
    when a parameters' all-gather starts, over ``graph``'s all-gathers of parameters (of the step's inputs,
    primals_N, or of a bucket of them; an activation's move is not a parameter's): 1 where each starts while only
    the previous one is read, 2 where an op reads parameters of both (a bias at a bucket's end, its weight at the
    next one's start)."""
    c10d = torch.ops._c10d_functional

    def of_parameters(gather):
        a = gather.args[0]
        while a.op == "call_function" and len(a.all_input_nodes) == 1:
            a = a.all_input_nodes[0]
        return a.name.startswith("primals_") or a.target is torch.ops.aten.cat.default

    pos = {n: i for i, n in enumerate(graph.nodes)}
    gathers = [n for n in graph.nodes if n.target is c10d.all_gather_into_tensor.default and of_parameters(n)]
    of = {}  # a gathered result, or a value made from one alone: which gather's
    for n in graph.nodes:
        if n.target is c10d.wait_tensor.default and n.args[0] in gathers:
            of[n] = gathers.index(n.args[0])
        elif n.op == "call_function" and n.all_input_nodes and len({of.get(a) for a in n.all_input_nodes}) == 1 \
                and n.all_input_nodes[0] in of:
            of[n] = of[n.all_input_nodes[0]]
    last = {}
    for n, k in of.items():
        last[k] = max([last.get(k, 0)] + [pos[u] for u in n.users])
    return max((sum(pos[g] < pos[start] < last.get(k, 0) for k, g in enumerate(gathers)) for start in gathers),
               default=0)


def _held_body():
    from tests.models import GPTStack

    before = os.environ.get("SHARDFN_BUCKET_MB")
    os.environ["SHARDFN_BUCKET_MB"] = "0.004"  # a few parameters a bucket: several buckets a block
    try:
        torch.manual_seed(0)
        # (recompute off: a block computed again in backward reads all its parameters there, whose gathers then
        # stay until the block's backward reads them, as FSDP2 with checkpointing unshards the block whole)
        model = sf.shard(GPTStack(2, 16, 4), in_strategy=(None,), dataset_strategy="data_parallel", level=1,
                         recompute=False)
        model(torch.randn(1, 8, 16)).square().sum().backward()
    finally:
        os.environ.pop("SHARDFN_BUCKET_MB") if before is None else os.environ.update(SHARDFN_BUCKET_MB=before)
    (compiled,) = sf.engine_of(model).programs.values()
    graphs = compiled.program.graphs
    gathers = {name: sum(n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
                         for n in graphs[name].graph.nodes) for name in ("forward", "backward")}
    return gathers, {name: _gathered_held_at_once(graphs[name].graph) for name in ("forward", "backward")}


def test_level_1_holds_two_buckets_of_whole_parameters_at_most(gloo4):
    # FSDP's prefetch: each bucket of parameters is gathered once the previous one is waited for and copied out,
    # while that one is read (issue 40: the captured graph's canonical order has every op on parameters alone
    # near its top, and traced there, all the forward's gathers started, and were held, before its first product)
    for gathers, held in gloo4.run(_held_body):
        assert gathers["forward"] > 4 and gathers["backward"] > 4, gathers
        assert held["forward"] <= 2 and held["backward"] <= 2, (held, gathers)


def _two_dim_regather_body():
    # level 1 on a 2 x 2 mesh: parameters split over both dims are gathered one dim after the other, the second
    # gather reading a parameter the first bucket's fusion cut out (exec's bucket fusion once failed there)
    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    mesh = sf.Layout((2, 2), ("dp", "tp"))
    model = sf.shard(copy.deepcopy(reference), in_strategy=(mesh("dp", "None", "None"),), level=1)
    x = torch.randn(4, 8, 16)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(g, r.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return sf.explain(model, x).reshard_after_forward


def test_level_1_on_a_2x2_mesh_gathers_over_both_dims_and_trains_like_eager(gloo4):
    assert all(gloo4.run(_two_dim_regather_body))


def _kept_buckets_body():
    # data-parallel gradients leave the backward graph as views of a bucket kept between calls: gradients
    # accumulated over two calls, kept through zero_grad(set_to_none=False), or held by the caller across a step
    # must stay what eager autograd gives
    torch.manual_seed(0)
    reference = GPTBlock(dim=16, heads=4)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
    whole = [torch.randn(4, 8, 16) for _ in range(4)]  # the reference's batches; each rank is given its row
    rank = dist.get_rank()
    slices = [x[rank:rank + 1] for x in whole]

    def grads(m):
        return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in m.parameters()]

    def same_grads(note):
        for (name, _), g, r in zip(model.named_parameters(), grads(model), grads(reference)):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{note}, {name}: {m}")

    # losses are sums: the ranks' slices' gradients add up to the whole batch's
    for m, xs in ((model, slices), (reference, whole)):  # two calls, one backward: accumulated over both
        (m(xs[0]).square().sum() + m(xs[1]).sin().sum()).backward()
    same_grads("two calls")
    for m, xs in ((model, slices), (reference, whole)):  # gradients zeroed in place, then accumulated into
        for p in m.parameters():
            p.grad.zero_()
        m(xs[2]).square().sum().backward()
        m(xs[3]).square().sum().backward()
    same_grads("zeroed in place, two backward passes")
    held = [p.grad for p in model.parameters()]  # the caller keeps last step's gradients
    values = [g.full_tensor().clone() for g in held]
    for m, xs in ((model, slices), (reference, whole)):
        for p in m.parameters():
            p.grad = None
        m(xs[0]).cos().sum().backward()
    same_grads("set to none")
    for g, v in zip(held, values):
        torch.testing.assert_close(g.full_tensor(), v, rtol=0, atol=0)
    (compiled,) = sf.engine_of(model).programs.values()
    backward = compiled.program.graphs["backward"]
    return sum(getattr(n.target, "__name__", "") == "kept_buffer" for n in backward.graph.nodes)


def test_gradients_in_kept_buckets_accumulate_and_stay_as_eager(gloo4):
    assert gloo4.run(_kept_buckets_body) == [1] * 4


def solve_rows(a, b):
    return torch.linalg.solve(a, b)


def _runtime_error_body():
    torch.manual_seed(0)  # the same b on every rank
    f = sf.shard(solve_rows, in_strategy=(None, (1, 4)))
    a, b = torch.eye(6) * 2, torch.randn(6, 8)
    torch.testing.assert_close(f(a, b), b / 2)
    try:
        f(torch.zeros(6, 6), b)  # the same signature: the traced graph runs, and its check fails on every rank
    except RuntimeError as e:
        return str(e), getattr(e, "__notes__", [])
    raise AssertionError("a singular matrix was solved")


def test_an_error_inside_a_graph_names_the_callable_and_its_call(gloo4):
    import sys

    results = gloo4.run(_runtime_error_body)
    for rank, (message, notes) in enumerate(results):
        assert "singular" in message, message
        if sys.version_info >= (3, 11):
            assert notes == [f"shardfn: rank {rank}: raised in the forward graph of solve_rows, its call 2 here"], \
                notes


def _learned_temperature_body():
    from tests.functions import LearnedTemperature

    torch.manual_seed(0)
    reference = LearnedTemperature()
    model = sf.shard(copy.deepcopy(reference), in_strategy=((4, 1),))
    x = torch.randn(8, 4)
    for _ in range(2):  # the first call traces; the second runs the cached graphs
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
    return [torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5)
            for p, q in zip(model.parameters(), reference.parameters())]


def test_a_whole_parameter_read_on_batch_pieces_gets_every_ranks_gradient_on_real_ranks(gloo4):
    # the traced graphs: the temperature's gradient was each rank's part of the sum (differing per rank)
    assert gloo4.run(_learned_temperature_body) == [[True, True, True]] * 4


def _uneven_body():
    from tests.test_uneven import _args, _train_gpt2, dense_relu

    for strategy in [((4, 1), None, None), ((2, 2), None, None), (None, (1, 4), (4,))]:
        torch.manual_seed(0)
        x, w, b = _args()
        y = sf.shard(dense_relu, in_strategy=strategy)(x, w, b)
        y.square().sum().backward()
        rw, rb = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        dense_relu(x, rw, rb).square().sum().backward()
        torch.testing.assert_close(y, dense_relu(x, rw, rb))
        torch.testing.assert_close(w.grad, rw.grad)
        torch.testing.assert_close(b.grad, rb.grad)
    # GPT-2's own vocabulary, 50257 = 29 x 1733: 12565 rows on three ranks, 12562 on the fourth
    return _train_gpt2(50257, 4, ranks=1, steps=1)


def test_uneven_splits_match_eager(gloo4):
    # splits that do not divide their dim: torch.chunk's pieces, in the traced graphs real ranks run
    assert gloo4.run(_uneven_body) == [12565, 12565, 12565, 12562]


def _no_sync_body():
    from tests.call.test_accumulation import accumulate

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = GPTBlock(16, 4)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), dataset_strategy="data_parallel")
    batches = [torch.randn(8, 4, 16) for _ in range(3)]
    reductions = []
    import shardfn.call.accumulation as accumulation

    real = accumulation.reduce_pending
    accumulation.reduce_pending = lambda params: reductions.append(real(params)) or reductions[-1]
    try:
        accumulate(model, reference, batches, world, lambda t: t[2 * rank: 2 * rank + 2], inside=2)
    finally:
        accumulation.reduce_pending = real
    for name, q in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    (no_sync,) = [c for c in sf.engine_of(model).programs.values() if c.plan.accumulate]
    in_backward = sum("all_reduce" in str(n.target) for n in no_sync.program.graphs["backward"].graph.nodes)
    # and a rank that accumulates while the others sync: told, on every rank, before any collective
    try:
        with sf.no_sync(model) if rank == 1 else contextlib.nullcontext():
            model(batches[0][2 * rank: 2 * rank + 2]).sum().backward()
        told = ""
    except ValueError as e:
        told = str(e)
    return in_backward, reductions, "no sync" in told and "rank 1" in told


def test_accumulation_without_sync_reduces_once(gloo4):
    # micro-steps: no all-reduce in their traced backward; the synced call: one bucket for all 15 gradients
    assert gloo4.run(_no_sync_body) == [(0, [1], True)] * 4


def _mixed_precision_body(how):
    from tests.test_precision import BF16, close, eager_under_the_same_casts

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = GPTBlock(16, 4)
    x = torch.randn(8, 4, 16)
    _, ref_grads = eager_under_the_same_casts(copy.deepcopy(reference), x, BF16)
    model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), mp_policy=BF16, **how)
    dp = how.get("dataset_strategy") == "data_parallel"
    (model(x[2 * rank: 2 * rank + 2] if dp else x).square().mean() / (world if dp else 1)).backward()
    for name, p in model.named_parameters():
        close(p.grad.full_tensor(), ref_grads[name], name)
    (compiled,) = sf.engine_of(model).programs.values()

    def dtypes(nodes, kind):
        return sorted({str(n.args[0].meta["val"].dtype) for n in nodes if kind in str(n.target)})

    backward = compiled.program.graphs["backward"].graph
    n_params = len(list(model.parameters()))
    gradients = next(n for n in backward.nodes if n.op == "output").args[0][:n_params]
    return dtypes(compiled.program.graphs["forward"].graph.nodes, "all_gather"), \
        dtypes(_collectives_before(gradients), "reduce")


def _collectives_before(outputs) -> set:
    """The collectives whose results are these graph outputs, moved only (through waits, views, slices, casts and
    a bucket's splits; no arithmetic)."""
    moves = ("wait_tensor", "view", "reshape", "slice", "split", "getitem", "convert_element_type", "clone",
             "_to_copy", "narrow", "squeeze", "permute", "transpose", "t.default", "copy")
    found, todo, seen = set(), [o for o in outputs if o is not None], set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        name = str(n.target)
        if "_c10d_functional" in name and "wait" not in name:
            found.add(n)
        elif any(m in name for m in moves):
            todo.extend(n.all_input_nodes)
    return found


def test_mixed_precision_gathers_in_bf16_and_reduces_in_fp32(gloo4):
    # the traced graphs: whole parameters' gradients are all-reduced in reduce_dtype (fp32); split ones (level 1)
    # are gathered in bf16 and their gradients reduce-scattered in fp32 (cast before the reduction, as FSDP2 does)
    assert gloo4.run(_mixed_precision_body, dict(dataset_strategy="data_parallel")) == [([], ["torch.float32"])] * 4
    # (recompute off: level 1 would recompute the block, whose gradients then leave through its recomputed ops)
    assert gloo4.run(_mixed_precision_body, dict(level=1, recompute=False)) == \
        [(["torch.bfloat16"], ["torch.float32"])] * 4


def _sharded_optimizer_body(path):
    from tests.training.test_optimizer import train_both

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, reference, ref_opt = train_both(2, world, lambda t: t[2 * rank: 2 * rank + 2], micro=2)
    for name, q in reference.named_parameters():
        # AdamW divides a gradient by its magnitude: a near-zero one summed in another order moves by up to lr
        torch.testing.assert_close(model.get_parameter(name).full_tensor(), q.detach(), rtol=1e-4, atol=1e-4)
    sf.save({"optim": opt.state_dict()}, path)  # each rank writes its pieces of the states
    return [tuple(opt.state[p]["exp_avg"].to_local().shape) for p in opt.pieces][:2]


def test_a_sharded_optimizer_trains_and_its_states_load_into_one_process(gloo4, tmp_path):
    from tests.training.test_optimizer import train_both

    path = str(tmp_path / "ckpt")
    pieces = gloo4.run(_sharded_optimizer_body, path)
    assert pieces[0] == [(4,), (4,)] and pieces[3] == [(4,), (4,)]  # ln weights (16,): a quarter each
    # another world size: one rank (simulated: a real process group left in the test process would leave every
    # later simulated test in it), the states whole, read from the four ranks' pieces
    with simulated_world(1):
        _, opt, _, _ = train_both(2, 1, lambda t: t, steps=1)  # (a step: the states exist, in this layout)
        state = opt.state_dict()
        sf.load({"optim": state}, path)
        opt.load_state_dict(state)
    torch.manual_seed(0)
    ref = GPTBlock(16, 4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        for m in range(2):
            torch.manual_seed(10 * step + m)
            ref(torch.randn(8, 4, 16)).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for piece, q in zip(opt.pieces, ref.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            got = opt.state[piece][name]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, ref_opt.state[q][name], rtol=1e-4, atol=1e-6)


def _megatron_optimizer_body(path):
    from tests.training.test_optimizer import MEGATRON, MEGATRON_STATES, _assert_trained_alike, train_both

    row = dist.get_rank() // 2  # rank r holds batch row r // 2 of the (dp, tp) mesh
    model, opt, reference, _ = train_both(2, 2, lambda t: t[4 * row: 4 * row + 4], **MEGATRON)
    _assert_trained_alike(model, reference, 1)
    sf.save({"optim": opt.state_dict()}, path)  # each rank writes its pieces of the states
    return {n: tuple(opt.state[piece]["exp_avg"].to_local().shape)
            for (n, p), piece in zip(model.named_parameters(), opt.pieces) if n in MEGATRON_STATES}


def test_a_megatron_sharded_optimizer_trains_and_its_states_load_into_one_process(gloo4, tmp_path):
    from tests.training.test_optimizer import MEGATRON_STATES, train_both

    path = str(tmp_path / "ckpt")
    assert gloo4.run(_megatron_optimizer_body, path) == [MEGATRON_STATES] * 4  # column-parallel states split too
    # another world size and layout: one rank, the states whole, read from the four ranks' pieces split over both
    # mesh dims (data x tensor parallel)
    with simulated_world(1):
        _, opt, reference, ref_opt = train_both(2, 1, lambda t: t)  # (the states exist, in this layout)
        state = opt.state_dict()
        sf.load({"optim": state}, path)
        opt.load_state_dict(state)
    for piece, q in zip(opt.pieces, reference.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            got = opt.state[piece][name]
            torch.testing.assert_close(got.full_tensor() if hasattr(got, "full_tensor") else got,
                                       ref_opt.state[q][name], rtol=1e-4, atol=1e-6)
