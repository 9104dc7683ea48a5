"""Sub-meshes and sf.reshard: shard calls on some ranks only, tensors moved between meshes, on 4 real gloo ranks.

Every value and gradient is compared with the unsharded tensor laid out by DTensor itself.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import shardfn as sf
from shardfn import runtime
from shardfn.layout import MeshSpec, mesh_axes
from shardfn.call.reshard import region, transfers


def _mesh(ranks, shape, names=("a", "b")):
    runtime.prepare_ranks(tuple(ranks), "cpu")
    return runtime.device_mesh(MeshSpec(mesh_axes(shape), names[: len(shape)]), "cpu",
                               None if runtime.whole_world(tuple(ranks)) else tuple(ranks))


# -- the transfer plan (pure) ------------------------------------------------------------------------------------


def test_transfers_send_each_piece_from_a_rank_holding_it():
    src, dst = torch.tensor([0, 1]), torch.tensor([2, 3])
    gathered, held, moves = transfers((8, 4), src, [Shard(0)], dst, [Shard(0)])
    assert not gathered
    assert moves == [(2, 0, ((0, 0), (4, 4))), (3, 1, ((4, 0), (4, 4)))]
    # rows to columns: no source rank holds a whole column block, so the sources gather first
    gathered, held, moves = transfers((8, 4), src, [Shard(0)], dst, [Shard(1)])
    assert gathered and held[0] == ((0, 0), (8, 4))
    assert [(d, s) for d, s, _ in moves] == [(2, 0), (3, 1)]


def test_transfers_keep_a_piece_on_a_rank_in_both_meshes():
    # ranks 1 and 2 are in both meshes; replicated sources: each keeps its own piece, rank 3 gets one sent
    _, _, moves = transfers((6, 2), torch.tensor([0, 1, 2]), [Replicate()], torch.tensor([1, 2, 3]), [Shard(0)])
    assert [(d, s) for d, s, _ in moves] == [(1, 1), (2, 2), (3, 0)]


def _regions_match_dtensor():
    mesh = _mesh(range(4), (2, 2))
    for shape in [(8, 6), (7, 5), (3, 9), (1, 4)]:
        for placements in [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Shard(0))]:
            local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            assert region(shape, mesh.mesh, dist.get_rank(), placements) == (tuple(offset), tuple(local)), \
                (shape, placements)
    return True


def test_region_is_dtensors_own_chunking(gloo4):
    assert gloo4.run(_regions_match_dtensor) == [True] * 4


# -- sf.reshard across meshes, forward and backward --------------------------------------------------------------

CASES = {  # (source ranks, source mesh shape, placements) -> (target ranks, target mesh shape, tensor map), shape
    "rows to rows": ((0, 1), (2,), [Shard(0)], (2, 3), (2,), ("a", "None"), (12, 6)),
    "rows to columns (gathered)": ((0, 1), (2,), [Shard(0)], (2, 3), (2,), ("None", "a"), (12, 6)),
    "2 x 2 to replicated on 2": ((0, 1, 2, 3), (2, 2), [Shard(0), Shard(1)], (1, 3), (2,), ("None", "None"), (12, 6)),
    "overlapping meshes": ((0, 1, 2), (3,), [Replicate()], (1, 2, 3), (3,), ("a", "None"), (12, 6)),
    "uneven source rows": ((0, 1, 2), (3,), [Shard(0)], (2, 3), (2,), ("None", "a"), (7, 6)),
    "2 x 2 to 1 x 2": ((0, 1, 2, 3), (2, 2), [Shard(0), Replicate()], (2, 3), (1, 2), ("b", "a"), (12, 6)),
}


def _reshard_case(name):
    src_ranks, src_shape, src_placements, dst_ranks, dst_shape, tensor_map, shape = CASES[name]
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape)
    source = distribute_tensor(x, _mesh(src_ranks, src_shape), src_placements, src_data_rank=None)
    source = source.detach().requires_grad_()
    layout = sf.Layout(dst_shape, ("a", "b")[: len(dst_shape)], ranks=dst_ranks)(*tensor_map)
    moved = sf.reshard(source, layout)
    expected = distribute_tensor(x, moved.device_mesh, moved.placements, src_data_rank=None)
    me = dist.get_rank()
    value_ok = me not in dst_ranks or torch.equal(moved.to_local(), expected.to_local())
    moved.backward(distribute_tensor(w, moved.device_mesh, moved.placements, src_data_rank=None))
    grad_ok = me not in src_ranks or torch.equal(
        source.grad.to_local(), distribute_tensor(w, source.device_mesh, src_placements, src_data_rank=None).to_local())
    return value_ok, grad_ok, tuple(moved.shape)


@pytest.mark.parametrize("name", list(CASES))
def test_reshard_across_meshes_moves_values_and_gradients(gloo4, name):
    assert gloo4.run(_reshard_case, name) == [(True, True, CASES[name][-1])] * 4


def _same_mesh_is_redistribute():
    layout = sf.Layout((4,), ("mp",))  # the same ranks as the tensor's mesh (named "a"): relabelled, redistributed
    x = torch.arange(32.0).reshape(4, 8)
    t = distribute_tensor(x, _mesh(range(4), (4,), ("a",)), [Shard(0)], src_data_rank=None)
    moved = sf.reshard(t, layout("None", "mp"))
    return tuple(moved.placements) == (Shard(1),) and torch.equal(moved.full_tensor(), x)


def test_reshard_on_the_same_ranks_redistributes(gloo4):
    assert gloo4.run(_same_mesh_is_redistribute) == [True] * 4


# -- shard calls on sub-meshes, chained by sf.reshard (every rank runs the same program) --------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _two_stage_spmd(explicit):
    torch.manual_seed(0)
    m0, m1 = MLP(), MLP()
    ref0, ref1 = MLP(), MLP()
    ref0.load_state_dict(m0.state_dict())
    ref1.load_state_dict(m1.state_dict())
    x = torch.randn(4, 8)
    L0, L1 = sf.Layout((2,), ("mp",), ranks=(0, 1)), sf.Layout((2,), ("mp",), ranks=(2, 3))
    s0 = sf.shard(m0, in_strategy=(None,), out_strategy=(L0("None", "None"),),
                  parameter_plan={"a.weight": L0("mp", "None"), "b.weight": L0("None", "mp")})
    s1 = sf.shard(m1, in_strategy=(L1("mp", "None"),),
                  parameter_plan={"a.weight": L1("mp", "None"), "b.weight": L1("None", "mp")})
    for _ in range(2):  # a repeat call reuses every program and placeholder
        h = s0(x)
        # explicitly, or by the consuming call itself: an argument from other ranks is moved point-to-point
        arg = sf.reshard(h, L1("mp", "None")) if explicit else h
        z = s1(arg)
        loss = z.square().sum()
        loss.backward()
    transfers = sf.explain(s1, arg).count("send_recv")
    for _ in range(2):
        ref_loss = ref1(ref0(x)).square().sum()
        ref_loss.backward()
    me = dist.get_rank()
    model, ref = (m0, ref0) if me < 2 else (m1, ref1)
    grads_ok = all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5)
                   for p, q in zip(model.parameters(), ref.parameters()))
    loss_ok = me < 2 or torch.allclose(loss, ref_loss, atol=1e-5)
    untouched = all(p.grad is None for p in (m1 if me < 2 else m0).parameters())  # outside: no gradients
    return grads_ok, loss_ok, untouched, transfers


@pytest.mark.parametrize("explicit", [True, False], ids=["sf.reshard", "moved by the call"])
def test_shard_calls_on_sub_meshes_chain_forward_and_backward(gloo4, explicit):
    # explain() of the second call lists the move of its argument from ranks 0, 1 (forward, gradient backward)
    assert gloo4.run(_two_stage_spmd, explicit) == [(True, True, True, 0 if explicit else 2)] * 4


def _sub_mesh_disagreement():
    f = sf.shard(lambda x: x * 2, in_strategy=(sf.Layout((2,), ("a",), ranks=(2, 3))("a"),))
    rows = 4 if dist.get_rank() == 2 else 6  # ranks 2 and 3 disagree; 0 and 1 are outside the call
    try:
        f(torch.ones(rows))
    except ValueError as e:
        return str(e)
    return "ran"


def test_ranks_of_a_sub_mesh_agree_among_themselves(gloo4):
    out = gloo4.run(_sub_mesh_disagreement)
    assert out[:2] == ["ran", "ran"]
    for message in out[2:]:
        assert "not making the same call" in message and "rank 2: " in message and "rank 3: " in message


def _ranks_outside_the_world():
    try:
        sf.shard(lambda x: x * 2, in_strategy=(sf.Layout((2,), ("a",), ranks=(4, 5))("a"),))(torch.ones(4))
    except ValueError as e:
        return str(e)
    return "ran"


def test_ranks_outside_the_world_are_an_error_on_every_rank(gloo4):
    for message in gloo4.run(_ranks_outside_the_world):
        assert "names ranks (4, 5) but the world has 4 ranks" in message


def test_layout_ranks_are_checked():
    with pytest.raises(ValueError, match="holds 4 devices but ranks names 3"):
        sf.Layout((2, 2), ("x", "y"), ranks=(0, 1, 2))
    with pytest.raises(ValueError, match="names a rank twice"):
        sf.Layout((2,), ("x",), ranks=(1, 1))
    with pytest.raises(ValueError, match="must be ascending"):
        sf.Layout((2,), ("x",), ranks=(3, 1))
    with pytest.raises(TypeError, match="non-negative int ranks"):
        sf.Layout((2,), ("x",), ranks=(0, -1))
    a, b = sf.Layout((2,), ("x",), ranks=(0, 1)), sf.Layout((2,), ("x",), ranks=(2, 3))
    with pytest.raises(ValueError, match="name different ranks"):
        sf.shard(lambda x, y: x + y, in_strategy=(a("x"), b("x")))
    with pytest.raises(TypeError, match="must be a DTensor"):
        sf.reshard(torch.ones(2), a("x"))
