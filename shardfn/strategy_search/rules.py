"""shardfn's own sharding rules, next to each other, and its checks on DTensor's rules, each registered by
decorator (``register_rule``, ``register_check``) in the one registry of rules (:mod:`.registry`).

Every rule and check here is proven against ground truth by tests/strategy_search/test_rule_truth.py: inputs laid
out as a candidate says, the op run on each rank's pieces, the pieces assembled and compared with the whole op.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .. import _pytree_internals as pytree
from ..layout import MeshSpec, TensorSpec
from ..capture.functions import FunctionCall
from ..capture.graph import is_seeded
from ._dtensor_adapter import has_dtensor_rule, has_single_dim_rule, local_shapes, valid_placements
from .candidates import Candidate, _from_dtensor, _per_mesh_dim, replicated_candidates, tensor_inputs
from .registry import REGISTRY, register_check, register_rule

aten = torch.ops.aten
R = Replicate()


# --- attention ----------------------------------------------------------------------------------------------
#
# Attention is independent per (batch, head) and, without a causal mask, per query row. q is (B, H, T, E), k and
# v (B, Hkv, S, E) where query head h reads kv head h // (H // Hkv) (grouped-query attention), and the mask
# broadcasts to (B, H, T, S) from the right (2-D (T, S) or 4-D with size-1 dims). Per mesh dim one of:
#   batch: q, k, v split on dim 0; the mask split on its batch dim where it has one of size B, else whole;
#   heads: q, k, v split on dim 1 (into equal parts of both head counts, so each rank's query heads read exactly
#          its kv heads); the mask split on its head dim where it has one of size H, else whole;
#   rows : q split on dim 2 (not causal: a causal mask is aligned to each rank's first row), k and v whole, the
#          mask split on its query dim where it has one of size T.
# Random dropout inside the kernel runs replicated, so a seed gives eager's numbers. The CPU kernel fails (SIGFPE)
# on zero heads or zero query rows: those dims are split only into non-empty equal parts.

def _mask_dim(mask: torch.Tensor | None, q: torch.Tensor, d: int) -> int | None:
    """The mask's dim aligned with q's dim ``d`` where it has q's size there (else the mask is whole there)."""
    if mask is None:
        return None
    md = d - (q.dim() - mask.dim())
    return md if md >= 0 and mask.shape[md] == q.shape[d] and q.shape[d] > 1 else None


def _attention_layout(q, k, mask, d: int) -> tuple[Placement, Placement, Placement | None] | None:
    """(q, k/v, mask) placements for splitting q's dim ``d`` (None: replicated); None where that is not valid."""
    if d is None:
        return R, R, (R if mask is not None else None)
    if d == 2:
        kv = R
    elif k.shape[d] == q.shape[d] or d == 1:
        kv = Shard(d)
    else:
        return None  # batch sizes differ: not an attention this rule knows
    md = _mask_dim(mask, q, d)
    return Shard(d), kv, (None if mask is None else (R if md is None else Shard(md)))


def _attention_ok(q, k, dims: tuple, mesh: DeviceMesh) -> bool:
    """Head and row splits into non-empty equal parts (of both head counts); batch splits any way."""
    for d in (1, 2):
        n = 1
        for m, dd in enumerate(dims):
            if dd == d:
                n *= mesh.shape[m]
        if n > 1 and (q.shape[d] % n or (d == 1 and k.shape[1] % n)):
            return False
    return True


def _attention_dims(causal: bool, dropout_p: float) -> tuple:
    if dropout_p:
        return (None,)
    return (None, 0, 1) if causal else (None, 0, 1, 2)


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    q, k, v = (a.meta["val"] for a in node.args[:3])
    dropout_p = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    mask_node = node.kwargs.get("attn_mask")
    mask = mask_node.meta["val"] if isinstance(mask_node, torch.fx.Node) else None
    valid = {id(t): set(valid_placements(t.shape, mesh)) for t in (q, k, v) + ((mask,) if mask is not None else ())}
    cands = []
    for dims in itertools.product(_attention_dims(causal, dropout_p), repeat=mesh.ndim):
        layouts = [_attention_layout(q, k, mask, d) for d in dims]
        if any(lay is None for lay in layouts) or not _attention_ok(q, k, dims, mesh):
            continue
        pq, pkv = tuple(lay[0] for lay in layouts), tuple(lay[1] for lay in layouts)
        inputs = (pq, pkv, pkv) + ((tuple(lay[2] for lay in layouts),) if mask is not None else ())
        tensors = (q, k, v) + ((mask,) if mask is not None else ())
        if all(p in valid[id(t)] for p, t in zip(inputs, tensors)):
            cands.append(Candidate((pq, pq), inputs, "local"))  # output (B, H, T, E) and logsumexp (B, H, T)
    return cands


# DTensor's rules for the CUDA kernels split q, k, v and the bias alike on the batch or head dim whatever their
# sizes: a bias broadcast over heads or batch would be split on its size-1 dim, GQA kv heads split unevenly, and
# dropout drawn per rank. Its candidates are kept only where they agree with the layouts above.
_CUDA_ATTENTION = {  # op: (index of the bias argument or None, index of dropout_p, index of is_causal)
    aten._scaled_dot_product_flash_attention.default: (None, 3, 4),
    aten._scaled_dot_product_efficient_attention.default: (3, 5, 6),
    aten._scaled_dot_product_cudnn_attention.default: (3, 5, 6),
}


def _arg(node: torch.fx.Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


@register_check(*_CUDA_ATTENTION)
def _cuda_attention_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    bias_i, drop_i, causal_i = _CUDA_ATTENTION[node.target]
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    bias_node = _arg(node, bias_i, "attn_bias", None) if bias_i is not None else None
    mask = bias_node.meta["val"] if isinstance(bias_node, torch.fx.Node) else None
    allowed = _attention_dims(bool(_arg(node, causal_i, "is_causal", False)),
                              _arg(node, drop_i, "dropout_p", 0.0))
    dims = []
    for m, p in enumerate(cand.inputs[0]):
        d = p.dim if isinstance(p, Shard) else (None if p.is_replicate() else -1)
        if d not in allowed or _attention_layout(q, k, mask, d) is None:
            return False
        pq, pkv, pm = _attention_layout(q, k, mask, d)
        want = (pq, pkv, pkv) + ((pm,) if mask is not None else ())
        if tuple(pl[m] for pl in cand.inputs[:len(want)]) != want:
            return False
        dims.append(d)
    return _attention_ok(q, k, tuple(dims), mesh)


ATTENTION_OPS = (aten._scaled_dot_product_flash_attention_for_cpu.default, *_CUDA_ATTENTION)


def head_cut(gm: torch.fx.GraphModule, mesh: MeshSpec, given: Sequence[TensorSpec] = ()) -> int | None:
    """Where to cut ``mesh``'s innermost dim (the fastest link, where tensor parallelism belongs) so that attention
    can split by whole heads over a part of it: where the heads of the program's attention (in equal parts of
    both head counts: their gcd) do not divide that dim, the largest part of it they divide; None where they
    divide it, where no part > 1 does, or where a ``given`` layout (the user's, the parameters') splits over the
    dim (the dim is theirs: a batch split there runs attention locally already, and tensors given on it keep
    the chunks of the mesh they were given on). The cut is a point in rank space
    (:func:`shardfn.layout.common_mesh`): the dim's inner part of that size becomes a mesh dim of its own, over
    which the rule above splits heads, so attention is computed (dim / part) times over, not (dim) times
    (Qwen2-7B's 28 and 4 heads on 8: by 4)."""
    heads = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION_OPS:
            q, k = node.args[0].meta["val"], node.args[1].meta["val"]
            if q.dim() == 4 and isinstance(q.shape[1], int) and isinstance(k.shape[1], int):
                heads = math.gcd(heads, q.shape[1], k.shape[1])
    split = [a for a in mesh.axes if a.size > 1]
    if not heads or not split or heads % split[-1].size == 0:
        return None
    inner = split[-1]
    if any(a.stride < inner.span and inner.stride < a.span for spec in given for a in spec.axes()):
        return None
    part = max(f for f in range(1, inner.size) if inner.size % f == 0 and heads % f == 0)
    return inner.stride * part if part > 1 else None


# --- views --------------------------------------------------------------------------------------------------

_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)


@register_rule(*_RESHAPES)
def _reshape(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate] | None:
    # DTensor's view rule (view_groups, in planning and in its dispatch alike) never returns on a zero size: a view
    # of no elements runs whole on every rank (there is nothing to gather); any other is DTensor's, checked below
    shapes = (node.args[0].meta["val"].shape, node.meta["val"].shape)
    if any(isinstance(n, int) and n == 0 for shape in shapes for n in shape):
        return replicated_candidates(node, mesh)
    try:
        return _from_dtensor(node, mesh)
    except Exception:  # noqa: BLE001 - DTensor's rule fails on these shapes: no rule (as for any op)
        return None


@register_check(*_RESHAPES)
def _view_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # DTensor's view rule maps a split dim to the merged or split dim it becomes, but with uneven or nested shards
    # a rank's piece may not hold the elements of its piece of the result (view (6, 5) -> (2, 3, 5) split (S0, S0)
    # on 2x2: 6 rows go 2, 1, 2, 1 while 2 leading rows go 1, 0, 1, 0): DTensor's dispatch then raises. Keep the
    # candidates where every rank's input and output pieces hold as many elements.
    x, out = node.args[0].meta["val"], node.meta["val"]
    if cand.outputs[0] is None or any(p.is_partial() for p in cand.inputs[0]):
        return True

    def numels(shape, pl):
        return [int(torch.Size(s).numel()) for s in local_shapes(shape, pl, mesh)]

    ways_in, ways_out = _even_ways(x.shape, cand.inputs[0], mesh.shape), _even_ways(out.shape, cand.outputs[0],
                                                                                  mesh.shape)
    if ways_in is not None and ways_out is not None:  # even pieces: every rank holds numel / ways (no rank walk)
        return ways_in == ways_out
    return numels(x.shape, cand.inputs[0]) == numels(out.shape, cand.outputs[0])


def _even_ways(shape, placements, mesh_shape) -> int | None:
    """In how many pieces ``placements`` cut a tensor of ``shape`` where every split dim divides evenly (each
    rank's piece then holds numel / pieces); None where some piece is uneven."""
    ways = [1] * len(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            ways[p.dim] *= n
    if any(size % w for size, w in zip(shape, ways)):
        return None
    return math.prod(ways)


@register_check(aten.squeeze.dims)
def _squeeze_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # a dim squeeze.dims lists is squeezed wherever it has size 1: on a rank whose piece of a split listed dim has
    # one row (2 rows over 2 ranks), the local result loses that dim too. Listed dims stay whole (DTensor's rule,
    # and torch 2.11's own one below, would split them).
    x, dims = node.args[0].meta["val"], node.args[1]
    listed = {d % max(x.dim(), 1) for d in dims}
    return not any(isinstance(p, Shard) and p.dim in listed for p in cand.inputs[0])


_POOLS = [getattr(aten, name).default for name in (
    "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool2d_backward",
    "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
    "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward", "adaptive_max_pool2d_backward",
    "adaptive_max_pool3d_backward")]


@register_check(*_POOLS)
def _pool_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # Pooling kernels refuse an empty non-batch dim (an empty batch they take), and DTensor splits channels
    # unevenly (6 channels on 4 ranks: 2, 2, 2, 0): keep the candidates that leave every rank some of each
    # non-batch dim of every tensor input.
    spatial = 3 if "3d" in node.target.__name__ else 2
    for arg, pl in zip(tensor_inputs(node), cand.inputs):
        shape = arg.meta["val"].shape
        batch = 1 if len(shape) == spatial + 2 else 0  # (N, C, ...) or unbatched (C, ...)
        if any(0 in piece[batch:] for piece in local_shapes(shape, pl, mesh)):
            return False
    return True


@register_check(aten.convolution.default)
def _convolution_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # DTensor's convolution runs its input split on one mesh dim at a time: a dim split over two mesh dims (the
    # batch over both dims of a 2-D mesh) is offered by its rule and refused by its dispatch
    for pl in cand.inputs:
        dims = [p.dim for p in pl if isinstance(p, Shard)]
        if len(dims) != len(set(dims)):
            return False
    return True


def _convolution_by_batch(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    # Each sample is convolved alone: a batched input and the output split by batch, the weight and bias whole, run
    # on the pieces. Only where DTensor has no strategy for convolution (torch 2.11, whose eager rule only its own
    # convolution handler reads, and that handler refuses strides and dilations ResNets use).
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    n_in = len(tensor_inputs(node))
    choices = [((R,), (R,) * n_in)]
    if x.dim() == w.dim():
        choices.append(((Shard(0),), (Shard(0),) + (R,) * (n_in - 1)))
    valid = set(valid_placements(x.shape, mesh))
    return [c for c in _per_mesh_dim(mesh, choices, "local") if c.inputs[0] in valid]


if not has_dtensor_rule(aten.convolution.default):
    register_rule(aten.convolution.default)(_convolution_by_batch)


# --- statistics ---------------------------------------------------------------------------------------------

@register_rule(aten.var_mean.correction)
def _var_mean(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    # Statistics per slice (a batch norm's per-channel mean and variance): local wherever the split dim is not
    # reduced; a reduced dim must be whole (DTensor has no rule for var_mean).
    x = node.args[0].meta["val"]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    reduced = set(range(x.dim())) if dims is None else {d % max(x.dim(), 1) for d in dims}
    keepdim = node.kwargs.get("keepdim", False)
    choices = [((R, R), (R,))]
    for d in range(x.dim()):
        if d not in reduced:
            out = d if keepdim else d - sum(r < d for r in reduced)
            choices.append(((Shard(out), Shard(out)), (Shard(d),)))
    valid = set(valid_placements(x.shape, mesh))
    return [c for c in _per_mesh_dim(mesh, choices, "local") if c.inputs[0] in valid]


SCANS = [aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default]


@register_check(*SCANS)
def _scan_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # a scan carries along its dim, so that dim stays whole. DTensor's scan rule (torch 2.13) compares a negative
    # dim with the split dims unnormalised and lets cumsum(x, -1) run on the pieces of a split last dim: no carry
    x = node.args[0].meta["val"]
    along = node.args[1] % max(x.dim(), 1)
    return not any(isinstance(p, Shard) and p.dim == along for pl in (cand.inputs[0], cand.outputs[0]) for p in pl)


@register_check(aten.stack.default)
def _stack_check(node: torch.fx.Node, mesh: DeviceMesh, cand: Candidate) -> bool:
    # stack inserts a dim at ``dim``: a split dim j of its inputs is the result's j before it and j + 1 from it on.
    # DTensor's stack rule in torch 2.11 maps a negative dim otherwise (stack([x], -1) of x split on its last dim
    # claimed the result split on that same dim: each rank's piece of another shape than the result's)
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    at = dim % (tensors[0].meta["val"].dim() + 1)

    def stacked(p):
        return Shard(p.dim if p.dim < at else p.dim + 1) if isinstance(p, Shard) else p

    return cand.outputs[0] is not None and all(
        out == stacked(pl[m]) for m, out in enumerate(cand.outputs[0]) for pl in cand.inputs)


@register_rule(*SCANS)
def _scan_along(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    # a scan splits over any dim but the one it carries along, each rank scanning its piece. Own, not DTensor's:
    # torch 2.11 has none for logcumsumexp, and 2.13's lets a negative dim through (the check above, kept for
    # any rule)
    x = node.args[0].meta["val"]
    along = node.args[1] % max(x.dim(), 1)
    choices = [((R,), (R,))] + [((Shard(d),), (Shard(d),)) for d in range(x.dim()) if d != along]
    valid = set(valid_placements(x.shape, mesh))
    return [c for c in _per_mesh_dim(mesh, choices, "local") if c.inputs[0] in valid]


_EDGE_PADS = [getattr(aten, f"{kind}_pad{n}d").default for kind in ("reflection", "replication") for n in (1, 2, 3)]


@register_rule(aten.constant_pad_nd.default, *_EDGE_PADS)
def _constant_pad(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    # Padding touches only the padded dims (the last len(pad) // 2): any other dim may be split, each rank padding
    # its piece (a causal LM's loss pads its labels: data parallel keeps them split). DTensor's rule in torch 2.11
    # only replicates; it has none for reflection and replication pads (the batch was gathered for them).
    x, pad = node.args[0].meta["val"], node.args[1]
    padded = {x.dim() - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    choices = [((R,), (R,))] + [((Shard(d),), (Shard(d),)) for d in range(x.dim()) if d not in padded]
    valid = set(valid_placements(x.shape, mesh))
    return [c for c in _per_mesh_dim(mesh, choices, "local") if c.inputs[0] in valid]


# --- pairwise distances -------------------------------------------------------------------------------------
#
# cdist(x1 (B..., P, M), x2 (B..., R, M)) -> (B..., P, R): each distance reads one row of x1 and one of x2. Per
# mesh dim one of:
#   rows   : x1 split on P, x2 whole: the output split on P;
#   columns: x2 split on R, x1 whole: the output split on R;
#   batch  : a batch dim split in both and in the output.
# Only where x1 and x2 hold one batch shape (broadcast batch dims run whole: the backward sums x2's gradient over
# them, which the simulated world cannot do on pieces of per-rank sizes).
# The backward (_cdist_backward(grad, x1, x2, p, cdist) -> the gradient of x1; x2's is the same op with x1 and x2
# swapped and grad, cdist transposed) the same way: rows split grad, x1, cdist and the result on P; columns split
# grad and cdist on R and x2 on R, each rank's gradient of x1 a pending sum over its columns; batch splits all.
# The contracted M stays whole (a p-norm of pieces is not their sum). A piece of fewer rows may take the direct
# kernel where the whole took the matrix-product one (compute_mode None, over 25 rows): the same distances
# within rounding.

CDIST = [aten._cdist_forward.default, aten._cdist_backward.default]


def _cdist_batch_dims(x1, x2) -> list[int]:
    """The batch dims (of x1, x2 and the output alike), split where the two hold one batch shape."""
    return list(range(x1.dim() - 2))


def _valid_local(node: torch.fx.Node, mesh: DeviceMesh, choices: list) -> list[Candidate]:
    """``choices`` per mesh dim (run on the local pieces), those whose inputs' placements fit their shapes."""
    valid = [set(valid_placements(a.meta["val"].shape, mesh)) for a in tensor_inputs(node)]
    return [c for c in _per_mesh_dim(mesh, choices, "local") if all(pl in ok for pl, ok in zip(c.inputs, valid))]


@register_rule(aten._cdist_forward.default)
def _cdist_forward(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    x1, x2 = node.args[0].meta["val"], node.args[1].meta["val"]
    n = x1.dim()
    choices = [((R,), (R, R))]
    if x1.shape[:-2] == x2.shape[:-2]:  # batch dims broadcast: whole
        choices += [((Shard(n - 2),), (Shard(n - 2), R)),  # rows
                    ((Shard(n - 1),), (R, Shard(n - 2)))]  # columns
        choices += [((Shard(d),), (Shard(d), Shard(d))) for d in _cdist_batch_dims(x1, x2)]
    return _valid_local(node, mesh, choices)


@register_rule(aten._cdist_backward.default)
def _cdist_backward(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    grad, x1, x2 = (a.meta["val"] for a in node.args[:3])
    n = grad.dim()
    choices = [((R,), (R, R, R, R))]  # inputs: grad, x1, x2, cdist
    if x1.shape[:-2] == x2.shape[:-2] == grad.shape[:-2]:  # batch dims broadcast: whole
        choices += [((Shard(n - 2),), (Shard(n - 2), Shard(n - 2), R, Shard(n - 2))),  # rows
                    ((Partial(),), (Shard(n - 1), R, Shard(n - 2), Shard(n - 1)))]  # columns: a pending sum
        choices += [((Shard(d),), (Shard(d),) * 4) for d in _cdist_batch_dims(x1, x2)]
    return _valid_local(node, mesh, choices)


# --- random fills -------------------------------------------------------------------------------------------

@register_rule(*REGISTRY.random_fills())
def _random_fill(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    # drawn whole and sliced: any layout, the shape-carrying input in the same layout (no communication)
    n_in = len(tensor_inputs(node))
    return [Candidate((p,), (p,) * n_in, "random") for p in valid_placements(node.meta["val"].shape, mesh)]


# --- concatenation -------------------------------------------------------------------------------------------
#
# DTensor's rule (cat_strategy): each input's layout with the concatenated dim made whole is a layout every input
# and the result take. Offered every layout of every input, that is every layout of the result that leaves the
# dim whole (in the same order). DTensor's function answers for the layout each input has now (eager dispatch),
# so it was asked per combination of the inputs' layouts: 4,096 calls a cat on a 3-D mesh (1 s; rotary
# embeddings cat in every layer's attention). Where DTensor gives it per mesh dim (torch 2.14: pending sums too),
# and for inputs of fewer dims (legacy empty 1-D tensors): DTensor's rule.

@register_rule(aten.cat.default)
def _cat(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate] | None:
    ins = [t.meta["val"] for t in tensor_inputs(node)]
    out = node.meta["val"]
    if has_single_dim_rule(aten.cat.default) or any(t.dim() != out.dim() for t in ins):
        return _from_dtensor(node, mesh)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.dim()
    return [Candidate((p,), (p,) * len(ins), "dtensor") for p in valid_placements(out.shape, mesh)
            if not any(isinstance(q, Shard) and q.dim == dim for q in p)]


# --- factories shaped by a size argument ---------------------------------------------------------------------
#
# new_empty, new_zeros, new_ones and new_full read their tensor input for its dtype and device only, so their
# result may take any layout: each rank makes its own piece, the size argument the piece's (exec runs the op so:
# ``local``). Split evenly only (a piece's size is each rank's). The input is asked in the result's layout where
# its shape takes it (nothing moves where its producer has it), else whole. Made whole instead, a factory of the
# attention's size (transformers' MLA builds its keys with new_empty) would hold the whole on every rank.

def _splits_evenly(shape, placements, mesh: DeviceMesh) -> bool:
    local = list(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            if local[p.dim] % mesh.shape[m]:
                return False
            local[p.dim] //= mesh.shape[m]
    return True


@register_rule(*REGISTRY.sized_factories())
def _sized_factory(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate]:
    (source,) = tensor_inputs(node)
    into = set(valid_placements(source.meta["val"].shape, mesh))
    shape = node.meta["val"].shape
    return [Candidate((p,), (p if p in into else (R,) * mesh.ndim,), "local")
            for p in valid_placements(shape, mesh) if _splits_evenly(shape, p, mesh)]


# --- custom autograd.Functions ------------------------------------------------------------------------------
#
# A Function call is one node that runs the Function itself on the pieces it is given (capture.functions), its
# own backward included. That is right on pieces where the Function is elementwise both ways: every op its
# forward and its backward ran at the captured shapes is pointwise (or a same-shape cast, copy or alias), none
# draws random numbers, and every tensor they touch has one shape or is a 0-dim scalar. Then one split, the same
# for all of its tensors (scalars whole), is right. Any other Function runs whole (no rule: the fallback, named
# in its warning); a rule registered for the Function class itself comes first.

_SAME_SHAPE_OPS = {aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
                   aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                   aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}


def _elementwise_ops(ops: list[tuple] | None, shape: torch.Size) -> bool:
    if ops is None:
        return False
    for op, args, kwargs, out in ops:
        if op not in _SAME_SHAPE_OPS and (torch.Tag.pointwise not in op.tags or is_seeded(op)):
            return False
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.dim() and t.shape != shape for t in tensors):
            return False
    return True


@register_rule(FunctionCall)
def _function_call(node: torch.fx.Node, mesh: DeviceMesh) -> list[Candidate] | None:
    call: FunctionCall = node.target
    ins = [a.meta["val"] for a in tensor_inputs(node)]
    outs = list(node.meta["val"])
    shaped = [t for t in ins + outs if t.dim()]
    if not shaped or any(t.shape != shaped[0].shape for t in shaped):
        return None
    shape = shaped[0].shape
    if not (_elementwise_ops(call.forward_ops, shape) and _elementwise_ops(call.backward_ops, shape)):
        return None
    choices = [tuple(tuple(Shard(d) if t.dim() else R for t in ts) for ts in (outs, ins)) for d in range(len(shape))]
    valid = set(valid_placements(shape, mesh))
    return [c for c in _per_mesh_dim(mesh, [((R,) * len(outs), (R,) * len(ins)), *choices], "local")
            if all(pl in valid for pl, t in zip(c.inputs + c.outputs, ins + outs) if t.dim())]
