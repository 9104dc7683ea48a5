"""Mixed precision policy (mp_policy, torch's MixedPrecisionPolicy): parameters kept in fp32, used and gathered in
param_dtype, gradients reduced in reduce_dtype, outputs in output_dtype; against eager under the same casts.
Real ranks (the traced graphs' collectives and their dtypes): tests/exec/test_gloo.py."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.fsdp import MixedPrecisionPolicy

import shardfn as sf
from shardfn.runtime import simulated_world
from tests.harness import on_rank
from tests.models import GPTBlock

WORLD = 4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


def _slice(t):
    per = t.shape[0] // WORLD
    return local_tensor_mode().rank_map(lambda r: on_rank(t, r)[per * r: per * (r + 1)].clone())


def eager_under_the_same_casts(reference, x, policy):
    """The unsharded model with its parameters cast to param_dtype (autograd through the casts), its input too,
    its output cast to output_dtype; returns the output and each parameter's (fp32) gradient."""
    params = dict(reference.named_parameters())
    used = {n: p.to(policy.param_dtype) for n, p in params.items()}
    out = torch.func.functional_call(reference, used, (x.to(policy.param_dtype),)).to(policy.output_dtype)
    out.square().mean().backward()
    return out, {n: p.grad for n, p in params.items()}


def close(a, b, what):
    # bf16 keeps 8 bits of mantissa: a sum computed in another order differs by its rounding
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-3, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("how", [dict(dataset_strategy="data_parallel"), dict(level=1)], ids=["dp", "level1"])
def test_parameters_used_in_bf16_gradients_reduced_in_fp32(how):
    torch.manual_seed(0)
    reference = GPTBlock(16, 4)
    x = torch.randn(8, 4, 16)
    ref_out, ref_grads = eager_under_the_same_casts(copy.deepcopy(reference), x, BF16)
    with simulated_world(WORLD):
        model = sf.shard(copy.deepcopy(reference), in_strategy=(None,), mp_policy=BF16, **how)
        dp = how.get("dataset_strategy") == "data_parallel"
        out = model(_slice(x) if dp else x)
        assert out.dtype == torch.float32
        (out.square().mean() / (WORLD if dp else 1)).backward()
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # kept, and stepped, in fp32
            close(on_rank(p.grad.full_tensor(), 0), ref_grads[name], name)
        if not dp:
            close(on_rank(out, 0), ref_out, "output")


def test_the_plan_moves_half_the_bytes_and_says_so():
    with torch.device("meta"):
        block = GPTBlock(64, 4)
    x = torch.empty(8, 16, 64, device="meta")
    # (recompute off: it would let level 1 choose another layout, whose gradients are not all reduce-scattered)
    plain = sf.explain(block, x, in_strategy=(None,), level=1, world_size=4, recompute=False)
    mixed = sf.explain(block, x, in_strategy=(None,), level=1, world_size=4, recompute=False, mp_policy=BF16)
    gathered = [sum(c.nbytes for c in p.collectives if c.kind == "all_gather") for p in (plain, mixed)]
    assert gathered[0] > 0 and gathered[1] * 2 == gathered[0], gathered
    # the parameters' gradients (those in buckets) are reduce-scattered in reduce_dtype, fp32: as many bytes
    # (in bf16, half)
    half = sf.explain(block, x, in_strategy=(None,), level=1, world_size=4, recompute=False,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    reduced = [sorted(c.nbytes for c in p.collectives if c.kind == "reduce_scatter" and c.bucket is not None)
               for p in (plain, mixed, half)]
    assert reduced[0] and reduced[1] == reduced[0] and [2 * n for n in reduced[2]] == reduced[0], reduced
    assert any("parameters used in bfloat16, gradients reduced in float32, outputs float32" in n
               for n in mixed.notes)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_cast_parameter_moves_where_it_enters_never_as_its_view(level):
    # exec casts a parameter where it enters and sends its gradient back through reduce_dtype there: a plan that
    # gathered a weight's transpose instead would reduce its gradient in bf16 (level 1 chose so once; the test on
    # gloo ranks, test_mixed_precision_gathers_in_bf16_and_reduces_in_fp32, caught it)
    block, x = GPTBlock(16, 4), torch.randn(8, 4, 16)
    plan = sf.explain(block, x, in_strategy=(None,), level=level, world_size=4, recompute=False, mp_policy=BF16)
    views = {name for name, n in plan.nodes.items() if n.op == "aten.t.default"}
    moved = [c.where for c in plan.collectives if c.where.split(" -> ")[0] in views]
    assert not moved, moved
    if level == 1:  # (the weights are split there: their gradients reduce-scattered where they enter)
        assert sum(c.kind == "reduce_scatter" and c.where.split(" -> ")[0].endswith("weight")
                   for c in plan.collectives) >= 6


def test_a_policy_dtype_that_cannot_be_used_is_a_clear_error():
    with simulated_world(2):
        with pytest.raises(ValueError, match=r"mp_policy.param_dtype is torch.int8"):
            sf.shard(GPTBlock(16, 4), in_strategy=(None,), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
        with pytest.raises(TypeError, match="mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy"):
            sf.shard(GPTBlock(16, 4), in_strategy=(None,), mp_policy="bf16")
        with pytest.raises(TypeError, match="mp_policy applies to a module's parameters"):
            sf.shard(lambda x: x * 2, in_strategy=((2, 1),), mp_policy=BF16)
