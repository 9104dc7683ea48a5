"""The cost model: compute by dtype, alpha-beta collectives, redistributions and their backward duals."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardfn.strategy_search import cost_model as cm


def test_compute_knows_the_dtype():
    flops = 10**12
    fp32 = cm.compute_seconds(flops, 0, 1, cm.H100, torch.float32)
    bf16 = cm.compute_seconds(flops, 0, 1, cm.H100, torch.bfloat16)
    assert fp32 / bf16 == pytest.approx(cm.H100.half_flops_per_s / cm.H100.flops_per_s)
    allowed = torch.backends.cuda.matmul.allow_tf32  # a property of torch's (monkeypatch cannot undo it)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert cm.compute_seconds(flops, 0, 1, cm.H100, torch.float32) == pytest.approx(
            flops / cm.H100.tf32_flops_per_s)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    # a profile without separate rates (the CPU's) costs every dtype alike; split work costs its share
    assert cm.compute_seconds(flops, 0, 4, cm.CPU, torch.bfloat16) == pytest.approx(flops / cm.CPU.flops_per_s / 4)


def test_memory_bound_ops_cost_their_bytes():
    assert cm.compute_seconds(0, 10**9, 2, cm.CPU) == pytest.approx(1e9 / cm.CPU.mem_bytes_per_s / 2)


@pytest.mark.parametrize("kind, hops, volume", [("all_reduce", 2 * 3, 2 * 3 / 4), ("all_gather", 3, 3 / 4),
                                                ("reduce_scatter", 3, 3 / 4), ("all_to_all", 3, 3 / 16)])
def test_alpha_beta_ring_formulas(kind, hops, volume):
    p, nbytes = cm.CPU, 1 << 20
    link = p.intra_node  # the CPU profile's ranks share one machine
    got = cm.collective_seconds(cm.CommOp(kind, 0, nbytes), (4,), p)
    assert got == pytest.approx(link.launch_s + hops * link.alpha_s + volume * nbytes * link.beta_s_per_byte)
    assert cm.ring_terms(kind, 4) == pytest.approx((hops, volume))
    assert cm.collective_seconds(cm.CommOp(kind, 0, nbytes), (1,), p) == 0.0  # a dim of one rank moves nothing


def test_a_fused_reduction_bears_its_share_of_the_latency():
    p, op = cm.CPU, cm.CommOp("all_reduce", 0, 1 << 20)
    whole, quarter = cm.collective_seconds(op, (4,), p), cm.collective_seconds(op, (4,), p, latency_share=0.25)
    assert whole - quarter == pytest.approx(0.75 * (p.intra_node.launch_s + 2 * 3 * p.intra_node.alpha_s))


@pytest.mark.parametrize("src, dst, kinds", [
    ((Shard(0),), (Replicate(),), ["all_gather"]),
    ((Partial(),), (Replicate(),), ["all_reduce"]),
    ((Partial(),), (Shard(1),), ["reduce_scatter"]),
    ((Shard(0),), (Shard(1),), ["all_to_all"]),
    ((Replicate(),), (Shard(0),), []),  # a slice: free
    ((Shard(0), Partial()), (Replicate(), Replicate()), ["all_reduce", "all_gather"]),  # inner dim first
    # a gradient pending over "dp" and split over "tp", back whole: gathered first, then reduced whole (DTensor's)
    ((Partial(), Shard(0)), (Replicate(), Replicate()), ["all_gather", "all_reduce"]),
    ((Partial(), Partial()), (Replicate(), Replicate()), ["all_reduce", "all_reduce"]),
])
def test_redistributions(src, dst, kinds):
    mesh = (4,) * len(src)
    ops = cm.redistribute_collectives((8, 8), 4, src, dst, mesh)
    assert [o.kind for o in ops] == kinds


def test_redistributions_run_in_dtensors_order_with_its_operand_sizes():
    # every pair of 2-D layouts: the cost model's collectives are DTensor's own greedy plan's steps, in its order
    # (each step's operand is what one rank holds before it, gathered for an all-gather)
    import itertools

    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    from shardfn.runtime import simulated_world

    kinds = {("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter", ("S", "R"): "all_gather",
             ("S", "S"): "all_to_all", ("S", "P"): "all_gather"}
    shape, layouts = (8, 8), [Replicate(), Partial(), Shard(0), Shard(1)]
    meta = TensorMeta(torch.Size(shape), (8, 1), torch.float32)
    with simulated_world(4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2))
        for src, dst in itertools.product(itertools.product(layouts, repeat=2), repeat=2):
            steps = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta),
                                                    use_graph_based_transform=False)
            want = [(i.mesh_dim, kinds[(type(a).__name__[0], type(b).__name__[0])])
                    for i in steps for a, b in [i.src_dst_placements] if not a.is_replicate()]
            got = [(o.mesh_dim, o.kind) for o in cm.redistribute_collectives(shape, 4, src, dst, (2, 2))]
            assert got == want, (src, dst)


def test_backward_of_a_replicated_read_in_split_work_reduces_the_gradient():
    # a weight read whole by a batch-split matmul: its gradient is a pending sum, all-reduced on the way back
    ops = cm.backward_collectives((8, 8), 4, (Replicate(),), (Replicate(),), (True,), (4,))
    assert [o.kind for o in ops] == ["all_reduce"]
    # read as the same shard it was produced in: nothing to move back
    assert cm.backward_collectives((8, 8), 4, (Shard(0),), (Shard(0),), (False,), (4,)) == []


def test_a_measured_profile_prices_each_collective_kind_and_each_op(tmp_path, monkeypatch):
    measured = dataclasses.replace(cm.CPU, intra_node=dataclasses.replace(
        cm.CPU.intra_node, per_kind=(("all_gather", 1e-3, 1e-8),)), op_s=1e-5)
    op = cm.CommOp("all_gather", 0, 1 << 20)
    assert cm.collective_seconds(op, (4,), measured) == pytest.approx(3 * 1e-3 + 3 / 4 * (1 << 20) * 1e-8)
    # kinds it did not measure keep the shared constants
    reduce = cm.CommOp("all_reduce", 0, 1 << 20)
    assert cm.collective_seconds(reduce, (4,), measured) == cm.collective_seconds(reduce, (4,), cm.CPU)
    # an op's fixed cost is paid whole, however the op is split
    assert cm.compute_seconds(0, 10**9, 2, measured) == pytest.approx(1e9 / cm.CPU.mem_bytes_per_s / 2 + 1e-5)
    path = str(tmp_path / "profile.json")
    cm.save_profile(measured, path)
    monkeypatch.setenv("SHARDFN_PROFILE", path)
    assert cm.profile_for("cpu") == measured and cm.profile_for("cuda") == measured
    (tmp_path / "bad.json").write_text("{not json")
    monkeypatch.setenv("SHARDFN_PROFILE", str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not a readable device profile.*python -m shardfn.calibrate"):
        cm.profile_for("cpu")


def test_each_mesh_dim_is_priced_on_its_own_link():
    # the H100 profile: 8 GPUs a node; on 8 x 8 the inner dim (8 ranks) is NVLink, the outer crosses nodes
    p, op = cm.H100, cm.CommOp("all_reduce", 0, 64 << 20)
    assert p.devices_per_node == 8
    assert cm.mesh_links((8, 8), p) == ("inter", "intra")
    assert cm.mesh_links((8, 8, 8), p) == ("inter", "inter", "intra")
    assert cm.mesh_links((2, 4), p) == ("intra", "intra")  # 8 ranks: one node
    assert cm.mesh_links((4, 4), p) == ("inter", "intra")  # the outer dim's rings cross 2 nodes: the slower link
    outer, inner = (cm.collective_seconds(cm.CommOp("all_reduce", d, 64 << 20), (8, 8), p) for d in (0, 1))
    hops, share = cm.ring_terms("all_reduce", 8)
    for seconds, link in ((outer, p.inter_node), (inner, p.intra_node)):
        assert seconds == pytest.approx(link.launch_s + hops * link.alpha_s + share * (64 << 20) * link.beta_s_per_byte)
    assert outer > 5 * inner  # InfiniBand's 50 GB/s a GPU against NVLink's 450
    # the caller says otherwise (sf.Layout(..., links=...)): the outer dim within a node, the inner across
    swapped = ("intra", "inter")
    assert cm.mesh_links((8, 8), p, swapped) == swapped
    assert cm.collective_seconds(op, (8, 8), p, links=swapped) == pytest.approx(inner)
    assert cm.mesh_links((8, 8), p, (None, "inter")) == ("inter", "inter")  # None: the default for that dim
    # the CPU profile: every rank on one machine, whatever the mesh
    assert cm.mesh_links((8, 8), cm.CPU) == ("intra", "intra")
    with pytest.raises(ValueError, match="devices_per_node must be a non-negative int"):
        dataclasses.replace(p, devices_per_node=-1)


def test_a_profile_of_one_link_loads_as_before(tmp_path):
    # a profile saved before links were per mesh dim prices every dim with its one (measured) link
    import json

    old = {"name": "cpu-measured", "flops_per_s": 1e10, "mem_bytes_per_s": 1e10, "alpha_s": 1e-4, "launch_s": 0.0,
           "beta_s_per_byte": 1e-9, "memory_bytes": 16e9, "per_kind": [["all_reduce", 2e-4, 2e-9]], "op_s": 1e-6}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    p = cm.load_profile(str(path))
    assert p.intra_node == p.inter_node == cm.Link(1e-4, 1e-9, 0.0, (("all_reduce", 2e-4, 2e-9),))
    assert p.devices_per_node == 0
    new = tmp_path / "new.json"
    cm.save_profile(cm.H100, str(new))
    assert cm.load_profile(str(new)) == cm.H100


def test_layout_links_are_checked_and_reach_the_mesh():
    import shardfn as sf
    from shardfn.layout import Axis, common_mesh, normalize_strategy

    layout = sf.Layout((8, 8), ("dp", "tp"), links=("inter", "intra"))
    assert layout("dp", "None").links == ("inter", "intra")
    for bad in (("inter",), ("inter", "nvlink"), "intra"):
        with pytest.raises(ValueError, match="links must give each of the 2 axes .*'intra'.*'inter'"):
            sf.Layout((8, 8), ("dp", "tp"), links=bad)
    # a user axis split into several mesh dims gives each its link; dims no Layout names keep the default (None)
    spec = normalize_strategy(layout("dp", "tp"), (8, 8), 64, "x")
    mesh = common_mesh([spec], 64, links={Axis(8, 8): "intra", Axis(8, 1): "inter"})
    assert mesh.links == ("intra", "inter")
    assert common_mesh([spec], 64).links is None
    with pytest.raises(ValueError, match="disagree on the link"):
        common_mesh([spec], 64, links={Axis(64, 1): "inter", Axis(8, 1): "intra"})
    # the mesh is cut where a node ends: a tensor split over 64 ranks on 8-rank nodes is split over 8 x 8
    whole = normalize_strategy((64,), (64,), 64, "x")
    assert common_mesh([whole], 64).shape == (64,)
    assert common_mesh([whole], 64, node=8).shape == (8, 8)


def test_a_custom_function_costs_the_flops_of_its_forward():
    from shardfn.capture import capture

    class MatMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g @ b.t(), a.t() @ g

    gm = capture(lambda a, b: MatMul.apply(a, b) + a @ b, (torch.randn(8, 6), torch.randn(6, 4)), {}).gm
    (call,) = [n for n in gm.graph.nodes if str(n.target).endswith("MatMul.apply")]
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert cm.node_flops(call) == cm.node_flops(mm) == 2 * 8 * 6 * 4


def test_checkpointed_activations_are_priced_as_recomputed_not_kept():
    # activation checkpointing: a region's inner values are not kept for backward (less peak memory) and its
    # forward runs once more (more compute); the same plan otherwise
    import shardfn as sf
    from tests.models import CheckpointedStack

    x = torch.randn(8, 16, 16)
    plain, checkpointed = (sf.explain(CheckpointedStack(c), x, world_size=4, in_strategy=(None,), level=2)
                           for c in (False, True))
    assert checkpointed.cost.peak_bytes < 0.8 * plain.cost.peak_bytes
    assert checkpointed.cost.compute_s > plain.cost.compute_s


def _two_matmuls_plan():
    import shardfn as sf

    def f(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    x, w1, w2 = torch.randn(6, 8), torch.randn(8, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    return sf.explain(f, x, w1, w2, world_size=4, in_strategy=((2, 1), (1, 4), (4, 1)))


def test_memory_over_the_forward_and_the_backward_by_hand():
    # per rank, fp32: x (3, 8) 96 B; w1 (8, 1) 32 B; w2 (1, 4) 16 B; mm and relu (3, 2) 24 B each (detach a view);
    # mm_1 a pending sum (3, 4) 48 B. w1 and w2 are read gathered over the mesh's second dim, (8, 2) 64 B and
    # (1, 4) 32 B, gathered in one bucket where the first of them is read (mm): its flat buffer (96) and both
    # copies out of it (96). Kept for backward: what some backward reads, relu's output (relu's own backward and
    # w2's gradient read it) and w2's copy (relu's gradient reads it); mm goes once relu has run (relu's backward
    # reads its output, not its input), w1's copy after mm (no backward reads it: x needs no gradient)
    plan = _two_matmuls_plan()
    assert plan.nodes["mm"].inputs[1] == (Shard(1), Replicate())
    assert plan.nodes["mm_1"].inputs[1] == (Shard(0), Replicate())
    forward = {n.name: n.live_bytes for n in plan.nodes.values()}
    # the arguments are given whole: the caller holds x (192), w1 (96) and w2 (48) beside their pieces
    caller = 192 + 96 + 48
    assert forward == {"input 0": 96 + 192, "input 1": 128 + 288, "input 2": 144 + caller, "mm": 168 + 192 + caller,
                       "relu": 224 + caller, "detach": 200 + caller, "mm_1": 248 + caller}
    backward = [(n.name, n.backward_live_bytes) for n in reversed(plan.nodes.values())
                if n.backward_live_bytes is not None]
    # the output is returned whole (6, 4): 96 B on every rank from the exit on, through the backward (the caller's
    # loss keeps it), and mm_1's pending sum goes at the exit: 144 + relu 24 + w2's copy 32 + 96 = 296. mm_1's
    # backward: the output's gradient arrives as the output left, whole (96, held by the caller's autograd to the
    # end), relu's (24) and
    # w2's (16) are made; then w2's copy goes (32); relu's backward makes mm's gradient (24), then relu's gradient
    # and relu go; mm's makes w1's (32) (360), and the backward's end, its last point, is the larger: mm's
    # gradient gone, w1's and w2's gradients reduce-scattered in one bucket, concatenated (64 + 32) while alive
    end = 296 + caller
    scattered = [c.nbytes for c in plan.collectives if c.kind == "reduce_scatter"]
    assert sorted(scattered) == [32, 64]
    # (detach, autograd's alias of relu's saved output, carries no gradient: no backward point of its own)
    assert backward == [("mm_1", end + 96 + 24 + 16), ("relu", end + 104 + 24),
                        ("mm", end + 104 - 24 + 32 - 24 + 96)]
    assert plan.cost.peak_bytes == end + 104 - 24 + 32 - 24 + 96  # the step's peak


def _gathered_linear_plan(level: int, x_grad: bool):
    import shardfn as sf

    torch.manual_seed(0)
    x = torch.randn(64, 8, requires_grad=x_grad)
    return sf.explain(torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh()), x, world_size=2,
                      in_strategy=((2, 1),), parameter_plan={"0.weight": (2, 1)}, level=level)


def test_gathered_inputs_are_held_while_read():
    # per rank, fp32: the weight (16, 8) split in 2, 256 B, with AdamW's two states 768 (its gradient is made in
    # backward); x (64, 8) split, 1024 B, and the caller's whole x beside it, 2048 B
    held = 1792 + 2048
    both = _gathered_linear_plan(2, False)
    assert both.nodes["mm"].inputs == ((Replicate(),), (Replicate(),))  # both gathered, in one bucket
    line = {n.name: (n.live_bytes, n.backward_live_bytes) for n in both.nodes.values()}
    # mm: the bucket's flat buffer (512 + 2048) and each copy out of it, and mm's (64, 16) 4096; then the buffer
    # goes, and the weight's copy (no backward reads it: x needs no gradient); x's stays for the weight's gradient
    assert line["mm"] == (held + 2 * 2560 + 4096, held + 2048 + 4096 + 4096 + 256)
    # tanh keeps its output; mm goes after it (tanh's backward reads its output). Its backward: tanh's gradient
    # from the caller and mm's; after mm's backward (the weight's gradient made, 256) x's copy goes
    assert line["tanh"] == (held + 2048 + 4096 + 4096, held + 2048 + 4096 + 2 * 4096)
    assert line["t"] == (held, held + 4096 + 256)
    # level 1 (x needing a gradient now): the weight alone is gathered, again in backward (a flat buffer of its
    # 512 B and the copy) for x's gradient (x's own 1024 made there); mm (32, 16) 2048, the output returned
    # whole 4096, and its gradient arriving so
    again = _gathered_linear_plan(1, True)
    assert again.nodes["t"].inputs == ((Replicate(),),) and again.nodes["mm"].outputs == ((Shard(0),),)
    assert again.nodes["mm"].live_bytes == held + 2 * 512 + 2048
    assert again.nodes["mm"].backward_live_bytes == held + 2 * 4096 + 2048 + 256 + 1024 + 2 * 512 == \
        again.cost.peak_bytes


def test_an_activation_read_in_another_layout_is_its_readers_copy():
    # cumprod down the rows reads x @ w whole: x (4096, 256) arrives split by rows, so the plan splits mm and
    # gathers its (4096, 4) result, not x. Exec makes that copy as cumprod runs (no bucket, no flat buffer) and
    # cumprod's backward keeps it, not mm's split value, which goes after its last reader. Per rank, fp32:
    # x 2048 x 256; w 16 x 4 x 4 (an argument needing a gradient: no optimizer states); mm (2048, 4)
    import shardfn as sf

    def f(x, w):
        return torch.cumprod(x @ w, dim=0)

    x, w = torch.randn(4096, 256), torch.randn(256, 4, requires_grad=True)
    plan = sf.explain(f, x, w, world_size=2, in_strategy=((2, 1), (1, 1)), out_strategy=((2, 1),), level=2)
    assert plan.nodes["mm"].outputs == ((Shard(0),),) and plan.nodes["cumprod"].inputs == ((Replicate(),),)
    xb, wb, mm, whole = 2048 * 256 * 4, 256 * 4 * 4, 2048 * 4 * 4, 4096 * 4 * 4
    forward = {n.name: n.live_bytes for n in plan.nodes.values()}
    x_held = xb + 2 * xb  # (x is given whole: the caller holds it beside its piece)
    # cumprod: the copy and its own result; then mm's value goes (its one backward reader keeps the copy)
    assert forward == {"input 0": x_held, "input 1": x_held + wb, "mm": x_held + wb + mm,
                       "cumprod": x_held + wb + mm + 2 * whole, "detach": x_held + wb + 2 * whole}
    # the exit returns the output split (mm's worth); cumprod's value goes there (no backward reads it); its
    # gradient arrives whole, mm's is made: the copy is alive as cumprod's backward runs, gone by mm's, which
    # makes w's gradient
    end = x_held + wb + whole + mm
    assert plan.nodes["cumprod"].backward_live_bytes == end + whole + mm == plan.cost.peak_bytes
    assert plan.nodes["mm"].backward_live_bytes == end + whole + mm - whole + wb
    # a second reader in that layout reads the same copy (the traced program redistributes once): cumsum adds
    # its own result alone
    def g(x, w):
        h = x @ w
        return torch.cumprod(h, dim=0), torch.cumsum(h, dim=0)

    both = sf.explain(g, x, w, world_size=2, in_strategy=((2, 1), (1, 1)), out_strategy=((2, 1), (2, 1)), level=2)
    assert both.nodes["cumsum"].inputs == ((Replicate(),),) and "mm_1" not in both.nodes
    assert both.nodes["cumsum"].live_bytes == x_held + wb + mm + 3 * whole


def test_the_memory_line_runs_through_the_backward_and_its_peak_is_the_plans():
    import shardfn as sf
    from tests.models import CheckpointedStack, GPTBlock

    with torch.device("meta"):
        block = GPTBlock(64, 4)
    x = torch.empty(8, 16, 64, device="meta")
    plan = sf.explain(block, x, world_size=4, in_strategy=(None,), level=2)
    forward = [n.live_bytes for n in plan.nodes.values()]
    backward = [n.backward_live_bytes for n in plan.nodes.values() if n.backward_live_bytes is not None]
    # every op on the way to a parameter's gradient has its backward point (not a detach: autograd's alias of a
    # saved output carries no gradient); no input's placeholder has one
    assert len(backward) == sum(n.op not in ("input", "aten.detach.default") for n in plan.nodes.values())
    assert plan.cost.peak_bytes == max(forward + backward) == max(backward) > max(forward)
    # without gradients there is no backward, and the peak is the forward's
    inference = sf.explain(GPTBlock(64, 4).requires_grad_(False), torch.randn(8, 16, 64), world_size=4,
                           in_strategy=(None,), level=2)
    assert all(n.backward_live_bytes is None for n in inference.nodes.values())
    assert inference.cost.peak_bytes == max(n.live_bytes for n in inference.nodes.values())
    # a checkpointed region comes back in the backward, but one region at a time: less than keeping both
    x = torch.randn(8, 16, 16)
    plain, checkpointed = (sf.explain(CheckpointedStack(c), x, world_size=4, in_strategy=(None,), level=2)
                           for c in (False, True))
    back = [max(n.backward_live_bytes or 0 for n in p.nodes.values()) for p in (plain, checkpointed)]
    assert back[1] < back[0]
    assert checkpointed.cost.peak_bytes == max(back[1], max(n.live_bytes for n in checkpointed.nodes.values()))


def test_the_search_and_the_walk_count_the_outputs_the_caller_holds(monkeypatch):
    # y = x @ w on 4 ranks, x split by rows, w needing a gradient: y (64, 32) fp32, 8192 B whole, 2048 a piece.
    # The caller holds y as it is returned through the backward, and y's gradient arrives so: returned whole,
    # 8192 + 8192 (the exit's copy where y is made split: its own piece then goes); returned split as it is made,
    # the piece itself and its gradient's, 2048 + 2048 (once left out: the piece went at the exit). tanh's output
    # is kept for its backward anyway: returned as made, only its gradient adds. The search's estimate counts
    # them per choice of the output's layout, as the read-out's walk does.
    import shardfn as sf
    from shardfn.strategy_search import search

    seen = []
    real = search.Pricing.terms
    monkeypatch.setattr(search.Pricing, "terms", lambda self, k=(): seen.append(self) or real(self, k))
    x, w = torch.randn(64, 16), torch.randn(16, 32, requires_grad=True)
    plans = {}
    for fn, whole, out in ((torch.matmul, 8192, None), (torch.matmul, 2048, ((4, 1),)),
                           (lambda x, w: torch.tanh(x @ w), 2048, ((4, 1),))):
        seen.clear()
        plans[fn, whole] = sf.explain(fn, x, w, world_size=4, in_strategy=((4, 1), None), out_strategy=out, level=2)
        problem = seen[-1].problem
        pairs = [(u, m) for u, v, m in real(seen[-1]).edge_memory if problem.decisions[v].name == "output"]
        assert len(pairs) == 1
        u, m = pairs[0]
        returned = problem.decisions[-1].candidates[0].inputs[0]
        kept = fn is not torch.matmul
        for k, c in enumerate(problem.decisions[u].candidates):
            own = cm.local_numel((64, 32), c.outputs[0], (4,)) * 4
            copy = 0 if kept and tuple(c.outputs[0]) == tuple(returned) else whole
            assert m[k, 0] == copy + max(own, whole), (c.outputs, returned)
    # the walk, at mm's backward: x's piece (1024) and the caller's whole x (4096), w (2048), y and its gradient
    # as returned; then, made whole (x gathered, 4096, kept for w's gradient) and w's gradient (2048); made split,
    # w's gradient a pending sum (2048) and its all-reduce's result (2048)
    whole, split = plans[torch.matmul, 8192], plans[torch.matmul, 2048]
    assert whole.nodes["mm"].outputs == ((Replicate(),),) and split.nodes["mm"].outputs == ((Shard(0),),)
    assert whole.cost.peak_bytes == whole.nodes["mm"].backward_live_bytes == 7168 + 2 * 8192 + 4096 + 2048
    assert split.cost.peak_bytes == split.nodes["mm"].backward_live_bytes == 7168 + 2 * 2048 + 2 * 2048


def test_the_walk_holds_the_scratch_a_gathers_backward_makes(monkeypatch):
    # a loss's gather from log-probabilities: autograd's backward of gather makes zeros of its input's size and
    # scatter-adds into a new tensor, two of that size where the gradient is one (seen here, eager); the walk
    # holds the second while that backward runs (a Llama's loss over whole logits: bench/plan_peak's peak)
    import shardfn as sf
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardfn.strategy_search.registry import REGISTRY

    made = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.append(out.numel())
            return out

    x, idx = torch.randn(8, 32, requires_grad=True), torch.randint(0, 32, (8, 1))
    logp = torch.log_softmax(x, -1)
    picked = torch.gather(logp, 1, idx)
    with Made():
        torch.autograd.grad(picked, logp, torch.ones_like(picked))
    assert made.count(8 * 32) == 2

    def loss(x, idx):
        return torch.gather(torch.log_softmax(x, -1), 1, idx).sum()

    def at_gather():
        plan = sf.explain(loss, x, idx, world_size=2, in_strategy=((2, 1), (2, 1)), level=2)
        assert plan.nodes["gather"].inputs[0] == (Shard(0),)  # (split as given: each rank 4 rows)
        return plan.nodes["gather"].backward_live_bytes

    with_scratch = at_gather()
    monkeypatch.setitem(REGISTRY._tables, "backward_scratch", {})
    assert with_scratch - at_gather() == 4 * 32 * 4
