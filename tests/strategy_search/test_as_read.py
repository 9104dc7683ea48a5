"""A value every rank makes whole (computed from constants alone) is laid out as its readers all read it."""

import torch
from torch.distributed.tensor import Shard

import shardfn as sf
from shardfn.runtime import simulated_world


class _Masked(torch.nn.Module):
    """A mask made from constants alone (every rank computes it whole), read by a matmul of the batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        mask = torch.ones(t, t).tril().expand(b, t, t) * 0.5  # (the product is no view: a value of its own)
        return mask @ self.lin(x)


def _parity(world: int) -> tuple:
    """The mask's node plan, and the largest error of the output and every gradient against eager."""
    from tests.harness import on_rank
    from tests.parity import _loss

    def error(a, b) -> float:  # (relative to the largest of eager's: the gradients are sums over the batch)
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        return max((on_rank(a, r) - b).abs().max().item() for r in range(world)) / b.abs().max().item()

    torch.manual_seed(0)
    model, x = _Masked(), torch.randn(8, 64, 16)
    reference = _Masked()
    reference.load_state_dict(model.state_dict())
    sharded = sf.shard(model, in_strategy=((world, 1, 1),), out_strategy=((world, 1, 1),))
    out, ref = sharded(x), reference(x)
    _loss(out.full_tensor()).backward()
    _loss(ref).backward()
    errors = [error(out, ref)] + [error(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    (mask,) = [n for n in sf.explain(sharded, x).nodes.values() if n.op == "aten.mul.Tensor"]
    return mask, max(errors)


def test_a_constant_its_readers_read_split_is_made_split_with_eagers_numbers():
    # the mask (8 x 64 x 64) was made whole on every rank and sliced by its reader: now the plan makes it in the
    # reader's layout (its piece kept, the whole gone as the op ends), the walk counts its piece, and every number
    # is eager's
    with simulated_world(4):
        mask, error = _parity(4)
    assert mask.outputs == ((Shard(0),),) and mask.run == "whole", mask
    assert error < 1e-5


def test_a_constant_made_split_gives_eagers_numbers_on_real_ranks(gloo4):
    # (the traced per-rank graphs run: the op on whole operands, its result laid out)
    results = gloo4.run(_parity, 4)
    assert all(m.outputs == ((Shard(0),),) and m.run == "whole" and e < 1e-5 for m, e in results), results


def test_the_walk_counts_a_constant_made_split_by_its_piece_once_its_op_ends():
    # the mask's whole bytes (8 x 64 x 64 x 4) while its op runs, its piece after; its views (an expand, a view)
    # laid out alike, so the matmul reads it as made: no copy
    x = torch.randn(8, 64, 16)
    plan = sf.explain(_Masked(), x, world_size=4, in_strategy=((4, 1, 1),), out_strategy=((4, 1, 1),))
    names = list(plan.nodes)
    (mask,) = [n for n in plan.nodes.values() if n.op == "aten.mul.Tensor"]
    after = plan.nodes[names[names.index(mask.name) + 1]]
    assert mask.live_bytes - after.live_bytes == 8 * 64 * 64 * 4
    (bmm,) = [n for n in plan.nodes.values() if n.op == "aten.bmm.default"]
    assert bmm.inputs[0] == (Shard(0),) and all(
        plan.nodes[n].outputs == ((Shard(0),),) for n in names[names.index(mask.name) + 1:names.index(mask.name) + 3])
