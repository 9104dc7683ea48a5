"""The search's one place that touches DTensor's private APIs: its sharding-rule registries.

DTensor registers, per aten op, either a single-mesh-dim rule (expanded over the mesh), a whole-mesh strategy
function, or a decomposition it propagates through. :func:`dtensor_strategies` asks them, in the propagator's own
order (``ShardingPropagator.propagate_op_sharding_non_cached``), for every valid (inputs -> outputs) placement
combination of one node, given fake tensors of the global shapes. Every tensor input is offered every
Replicate/Shard placement valid for its shape, as meta-pytorch/autoparallel does, so rules that follow their
input (views, reductions, softmax) emit one strategy per input placement.

Nothing here runs an op on data; nothing outside this module imports torch.distributed.tensor._* .
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import sys
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _get_num_tensor_inputs,
    _insert_single_dim_replication_strategy,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, is_tensor_shardable
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from .. import _pytree_internals as pytree
from .._mesh_internals import mesh_without_groups
from ._expansion import expand_placements, shardable

__all__ = ["dtensor_strategies", "has_dtensor_rule", "has_single_dim_rule", "is_local_from_replicate", "local_shapes",
           "strided_shard", "valid_placements"]

Placements = tuple[Placement, ...]
# (output placements: one tuple, or one per output with None for non-tensor outputs; input placements)
Strategy = tuple[Any, tuple[Placements, ...]]

_MAX_COMBOS = 4096

# What changed between the torch releases shardfn supports (>=2.11): torch 2.11's replication-row helper takes no
# output metadata (later ones mark masked-off outputs None with it), and its full-mesh expansion has no
# allow_uneven_sharding (2.11 expands uneven shards as it does even ones).
_REPLICATION_TAKES_OUT_META = "output_tensor_meta" in inspect.signature(
    _insert_single_dim_replication_strategy).parameters
_EXPANSION_TAKES_UNEVEN = "allow_uneven_sharding" in inspect.signature(expand_to_full_mesh_op_strategy).parameters


def strided_shard(dim: int, split_factor: int) -> Placement:
    """DTensor's strided shard placement (private: a split of a split, as FSDP over TP lays a tensor out)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def has_single_dim_rule(op) -> bool:
    """Whether DTensor gives its rule for ``op`` per mesh dim (expanded over the mesh), not as a function of the
    inputs' current layouts (cat: from torch 2.14)."""
    return op in _propagator().op_single_dim_strategy_funcs


def has_dtensor_rule(op) -> bool:
    """Whether DTensor has a sharding strategy of its own for ``op`` (an eager-only propagation rule is none)."""
    sp = _propagator()
    return op in sp.op_strategy_funcs or op in sp.op_single_dim_strategy_funcs


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype)


def valid_placements(shape: torch.Size | tuple[int, ...], mesh: DeviceMesh) -> list[Placements]:
    """Every Replicate/Shard(d) combination over the mesh dims that DTensor can lay this shape out as (its
    is_tensor_shardable; sizes known as numbers by the same test on the numbers, once per shape and mesh shape:
    asking DTensor per combination took 1.5 s of Llama-405B's candidates on its 4-D mesh)."""
    if all(type(d) is int for d in shape):
        return list(_valid_placements(tuple(shape), tuple(mesh.shape)))
    meta = TensorMeta(shape=torch.Size(shape), stride=(), dtype=torch.float32)
    return [combo for combo in _combinations(len(shape), mesh.ndim)
            if is_tensor_shardable(meta.shape, DTensorSpec(mesh, combo, tensor_meta=meta))]


def _combinations(ndim: int, mesh_ndim: int):
    per_dim: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    return itertools.product(per_dim, repeat=mesh_ndim)


@functools.lru_cache(maxsize=1024)
def _valid_placements(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Placements, ...]:
    return tuple(combo for combo in _combinations(len(shape), len(mesh_shape))
                 if shardable(shape, combo, mesh_shape))


def local_shapes(shape, placements: Placements, mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Each rank's local shape (mesh order) of a tensor of ``shape`` laid out as ``placements``: DTensor's own
    slicing, uneven and nested shards included. A dim's size on a rank depends only on its coordinates on the
    mesh dims that split that dim: DTensor is asked once per coordinate of those (a 1,024-rank mesh whose dims
    split a value's dims 64 and 8 ways: 72 questions, not 1,024)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh_shape = tuple(mesh.shape)
    if any(type(p) not in (Shard, Replicate) and not p.is_partial() for p in placements):  # (strided: walk)
        return [tuple(_compute_local_shape_and_global_offset(tuple(shape), mesh_shape, list(coord), placements,
                                                             skip_offset=True)[0])
                for coord in itertools.product(*[range(n) for n in mesh_shape])]
    sizes = []  # per tensor dim: its size on every rank, as an array of the mesh's shape
    for d, size in enumerate(shape):
        splits = [i for i, p in enumerate(placements) if type(p) is Shard and p.dim % len(shape) == d]
        if not splits:
            sizes.append(np.full(mesh_shape, int(size)))
            continue
        if int(size) % math.prod(mesh_shape[i] for i in splits) == 0:  # (even: every piece alike)
            sizes.append(np.full(mesh_shape, int(size) // math.prod(mesh_shape[i] for i in splits)))
            continue
        alone = tuple(p if i in splits else Replicate() for i, p in enumerate(placements))
        sizes.append(np.broadcast_to(_split_sizes(tuple(int(n) for n in shape), d, alone, mesh_shape), mesh_shape))
    flat = [a.reshape(-1).tolist() for a in sizes]
    return [tuple(dims) for dims in zip(*flat)] if flat else [()] * math.prod(mesh_shape)


@functools.lru_cache(maxsize=4096)
def _split_sizes(shape: tuple, d: int, alone: Placements, mesh_shape: tuple[int, ...]) -> np.ndarray:
    """Dim ``d``'s size on each coordinate of the mesh dims ``alone`` splits it on (1 on the others), DTensor's
    slicing (each shape, dim and split asked once: an op's candidates ask again and again)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    on = np.zeros([n if type(p) is Shard else 1 for p, n in zip(alone, mesh_shape)], dtype=np.int64)
    for coord in itertools.product(*[range(n) if type(p) is Shard else (0,) for p, n in zip(alone, mesh_shape)]):
        on[coord] = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), list(alone),
                                                          skip_offset=True)[0][d]
    on.flags.writeable = False  # (shared by every caller)
    return on


def local_pieces(shape, placements: Placements, mesh: DeviceMesh) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each rank's piece (mesh order) of a tensor of ``shape`` laid out as ``placements``: (offset, shape), as
    DTensor slices it (uneven and nested shards included; an empty piece's offset is where it would start)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    out = []
    for coord in itertools.product(*[range(n) for n in mesh.shape]):
        local, offset = _compute_local_shape_and_global_offset(tuple(shape), tuple(mesh.shape), list(coord),
                                                               placements)
        out.append((tuple(int(o) for o in offset), tuple(int(n) for n in local)))
    return out


def is_local_from_replicate(p: Placement) -> bool:
    """Placements DTensor reaches from Replicate without communication inside an op (embedding's mask)."""
    return type(p).__name__ == "_MaskPartial"


def _schemas(op, args, kwargs, mesh, first_only: bool = False):
    """(the op's schema with each tensor input's strategy of every valid layout, the schema of its whole
    inputs, each input's layouts). ``first_only``: each strategy holds the first layout alone (a single-dim rule
    not in place reads no more: :func:`_single_dim`; a spec per layout of a 4-D mesh took 2 s of Llama-405B's
    candidates)."""
    options: list[list[Placements]] = []

    def to_strategy(x):
        if isinstance(x, torch.Tensor):
            opts = valid_placements(x.shape, mesh)
            options.append(opts)
            return OpStrategy([OpSpec(DTensorSpec(mesh, p, tensor_meta=_meta(x)))
                               for p in (opts[:1] if first_only else opts)])
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
            kids = [to_strategy(t) for t in x]
            return TupleStrategy(tuple(kids) if isinstance(x, tuple) else kids)
        if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
            return [to_strategy(t) if t is not None else None for t in x]
        return x

    s_args = tuple(to_strategy(a) for a in args)
    s_kwargs = {k: to_strategy(v) for k, v in kwargs.items()}
    replicate = (Replicate(),) * mesh.ndim
    p_args, p_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: DTensorSpec(mesh, replicate, tensor_meta=_meta(t)), (tuple(args), dict(kwargs))
    )
    sp = _propagator()
    info = sp.op_to_schema_info.get(op) or sp.op_to_schema_info_for_single_dim_strategy.get(op)
    if info is None and any(isinstance(a, (TupleStrategy, list)) for a in s_args):
        info = RuntimeSchemaInfo(needs_pytree=True)  # so args_strategy flattens tensor lists
    return OpSchema(op, s_args, s_kwargs, schema_info=info), OpSchema(op, p_args, p_kwargs, schema_info=info), options


def _input_strategies(schema: OpSchema) -> list[OpStrategy]:
    return list(schema.args_strategy) + list(schema.kwargs_strategy)


def _with_single_options(schema: OpSchema, chosen) -> OpSchema:
    """``schema`` with each input OpStrategy replaced by a one-option strategy, in flat input order."""
    it = iter(chosen)
    swap = lambda x: OpStrategy([next(it)]) if isinstance(x, OpStrategy) else x  # noqa: E731
    a, k = pytree.tree_map_only(OpStrategy, swap, (schema.args_schema, schema.kwargs_schema))
    return OpSchema(schema.op, a, k, schema_info=schema.schema_info)


def _single_dim(op, schema: OpSchema, out_meta, mesh, options) -> OpStrategy | list[Strategy]:
    # Mirrors _expand_single_dim_strategy_to_mesh, which asserts one option per input; we offer many. The
    # expansion on placements alone where it covers the rules (_expansion), else DTensor's.
    info = _propagator().op_single_dim_strategy_funcs[op]
    rules = info.func(op, schema.args_meta, schema.kwargs_meta)
    n_in = _get_num_tensor_inputs(schema)
    if rules:
        n_out = len(rules[0]) - n_in
    else:
        n_out = 0 if out_meta is None else (1 if isinstance(out_meta, TensorMeta) else len(out_meta))
    rules = (_insert_single_dim_replication_strategy(list(rules), n_out, n_in, out_meta)
             if _REPLICATION_TAKES_OUT_META else _insert_single_dim_replication_strategy(list(rules), n_out, n_in))
    shard_kinds = {Shard(0)} | {p for opts in options for combo in opts for p in combo if isinstance(p, Shard)}
    rules = _fill_single_dim_strategy_placeholders(shard_kinds, rules)
    inplace = op._schema.name.endswith("_")
    uneven = {"allow_uneven_sharding": info.allow_uneven_sharding} if _EXPANSION_TAKES_UNEVEN else {}
    if not inplace and not schema.is_out_variant_op():
        inputs = _input_strategies(schema)
        found = expand_placements(rules, tuple(mesh.shape), n_out, [tuple(s.shape) for s in inputs],
                                  [s.strategies[0].output_spec.placements for s in inputs],
                                  bool(uneven.get("allow_uneven_sharding")))
        if found is not None:
            return found

    def expand(s: OpSchema) -> OpStrategy:
        return expand_to_full_mesh_op_strategy(
            mesh, s, rules, output_tensor_meta=out_meta, input_index=n_out, inplace_op=inplace,
            allow_unbacked_sharding=info.allow_unbacked_sharding, **uneven,
        )

    if not inplace:
        # the expansion enumerates every rule combination whatever the inputs hold; given one option per input
        # it skips costing each strategy against every option (costs shardfn's search does not use)
        return expand(_with_single_options(schema, [o.strategies[0] for o in _input_strategies(schema)]))
    # in-place rules keep only strategies whose self placement equals self's first option: expand per option
    specs: list[OpSpec] = []
    for self_opt in _input_strategies(schema)[0].strategies:
        sub = OpSchema(op, (OpStrategy([self_opt]),) + schema.args_schema[1:], schema.kwargs_schema,
                       schema_info=schema.schema_info)
        try:
            specs.extend(expand(sub).strategies)
        except RuntimeError:  # this self placement needs a placement change: not an in-place strategy
            continue
    return OpStrategy(specs)


def _per_combination(fn, schema: OpSchema) -> OpStrategy:
    # Some strategy functions are written for eager dispatch (one current placement per input: cat, stack,
    # nll_loss): call them once per combination of single input placements.
    specs: list[OpSpec] = []
    for n, chosen in enumerate(itertools.product(*[s.strategies for s in _input_strategies(schema)])):
        if n >= _MAX_COMBOS:
            break
        try:
            specs.extend(fn(_with_single_options(schema, chosen)).strategies)
        except Exception:  # noqa: BLE001 - an invalid combination, skip it
            continue
    return OpStrategy(specs)


def _decomposition_tracer(op, device_type: str):
    """(schema, one placement per input) -> the output placement(s) DTensor's decomposition tracing finds, on a
    mesh of one (every rank computes the same rules)."""
    sp = _propagator()
    ds = getattr(sp, "decomp_strategy", None)
    if ds is not None:  # torch >= 2.12: one DecompShardingStrategy per propagator
        ds.ensure_schema_info(op)
        fake_mesh = ds._get_fake_mesh(device_type)
        return lambda schema, combo: ds._propagate_through_decomp(schema, combo, fake_mesh)
    # torch 2.11: static methods taking the propagator
    DecompShardingStrategy.ensure_schema_info(op, sp)
    fake_mesh = mesh_without_groups(device_type, [0], rank=0)
    return lambda schema, combo: DecompShardingStrategy._propagate_through_decomp(schema, combo, fake_mesh, sp)


def _decomposition(op, schema: OpSchema, spec_schema: OpSchema, out_meta, mesh) -> OpStrategy | None:
    # DecompShardingStrategy only tries placements already on the inputs: try each single-dim combination.
    trace = _decomposition_tracer(op, mesh.device_type)
    flat, _ = pytree.tree_flatten(list(spec_schema.args_schema) + list(spec_schema.kwargs_schema.values()))
    per_leaf = [
        [Replicate()] + [Shard(d) for d in range(leaf.ndim)] if isinstance(leaf, DTensorSpec) else [None]
        for leaf in flat
    ]
    rules = []
    for combo in itertools.product(*per_leaf):
        try:
            out = trace(spec_schema, combo)
        except NotImplementedError:
            return None  # an op inside the decomposition has no rule
        except Exception:  # noqa: BLE001 - this combination needs redistribution: not a strategy
            continue
        rules.append((list(out) if isinstance(out, tuple) else [out]) + [c for c in combo if c is not None])
    if not rules:
        return None
    n_in = sum(isinstance(leaf, DTensorSpec) for leaf in flat)
    return expand_to_full_mesh_op_strategy(
        mesh, schema, rules, output_tensor_meta=out_meta, input_index=len(rules[0]) - n_in
    )


def _listed(strategy, n_inputs: int) -> list[Strategy]:
    """(output placements, input placements) of each of DTensor's strategies (inputs unnamed: as the output)."""
    pairs = []
    for child in strategy.children if isinstance(strategy, TupleStrategy) else [strategy]:
        for s in child.strategies:
            out = _placements(s.output_specs)
            pairs.append((out, tuple(tuple(x.placements) for x in s.input_specs) if s.input_specs is not None
                          else (out,) * n_inputs))
    return pairs


def _placements(spec):
    if spec is None:
        return None
    if isinstance(spec, DTensorSpec):
        return tuple(spec.placements)
    return tuple(_placements(s) for s in spec)


def _unpriced(src_strategy, dst_spec) -> list[float]:
    return [0.0] * len(src_strategy.strategies)


@contextlib.contextmanager
def _replaced_in_dtensor_ops(name: str, make: Any):
    """DTensor's ops helper ``name`` replaced by ``make(torch's own)`` while active, in every module of its rules
    that holds it."""
    from torch.distributed.tensor._ops import utils

    real = getattr(utils, name)
    replacement = make(real)
    holders = [m for key, m in list(sys.modules.items()) if key.startswith("torch.distributed.tensor._ops")
               and getattr(m, name, None) is real]
    for m in holders:
        setattr(m, name, replacement)
    try:
        yield
    finally:
        for m in holders:
            setattr(m, name, real)


def _redistributions_unpriced():
    """DTensor's strategy functions price each strategy's redistribution from every input option (for its eager
    dispatch's choice); the search prices its own, and offers every option: on a 3-D mesh that pricing was most of
    the rules' time (a view: 216 x 216 placements). Skipped while the search asks."""
    return _replaced_in_dtensor_ops("generate_redistribute_costs", lambda real: _unpriced)


_EXPANDED: list[OpStrategy] = []  # the full-mesh expansions made while a whole-mesh rule runs (_expansions_seen)


@contextlib.contextmanager
def _expansions_seen():
    """While active, each OpStrategy DTensor's full-mesh expansion returns is kept in ``_EXPANDED``: a whole-mesh
    rule that returns one enumerated every placement of its single-dim rules itself (gather, scatter), whatever
    its inputs hold, so it is not asked again per combination of their layouts."""

    def kept(real):
        def expansion(*args, **kwargs):
            out = real(*args, **kwargs)
            _EXPANDED.append(out)
            return out

        return expansion

    try:
        with _replaced_in_dtensor_ops("expand_to_full_mesh_op_strategy", kept):
            yield
    finally:
        _EXPANDED.clear()


# whole-mesh rules that give each layout of their first input a strategy of its own (the other inputs told to
# follow it), dropping the layouts they cannot take: all their strategies at once, though fewer than the layouts
_FOLLOW_THE_FIRST_INPUT = frozenset({"gen_slice_scatter_strategy"})


def _enumerated(op, strategy) -> bool:
    """Whether a whole-mesh rule's result is one full-mesh expansion: every placement of its single-dim rules,
    whatever its inputs hold (an in-place op's keeps only those of self's first layout)."""
    return not op._schema.name.endswith("_") and any(strategy is e for e in _EXPANDED)


def dtensor_strategies(op: torch._ops.OpOverload, args: tuple, kwargs: dict, mesh: DeviceMesh) -> list[Strategy] | None:
    """Every (output placements, input placements) DTensor allows for ``op`` on ``mesh``; None: no rule.

    ``args``/``kwargs`` hold fake tensors of the global shapes where the node has tensors. Input placements are
    listed for the flat tensor inputs (args then kwargs, lists flattened) in order.
    """
    with _redistributions_unpriced(), _expansions_seen():
        return _strategies(op, args, kwargs, mesh)


def _strategies(op, args: tuple, kwargs: dict, mesh: DeviceMesh) -> list[Strategy] | None:
    sp = _propagator()
    if not (op in sp.op_single_dim_strategy_funcs or op in sp.op_strategy_funcs
            or DecompShardingStrategy.has_decomp(op)):
        return None
    schema, spec_schema, options = _schemas(op, args, kwargs or {}, mesh,
                                            first_only=op in sp.op_single_dim_strategy_funcs
                                            and not op._schema.name.endswith("_"))
    out_meta = sp._propagate_tensor_meta_non_cached(spec_schema)
    if op in sp.op_single_dim_strategy_funcs:
        strategy = _single_dim(op, schema, out_meta, mesh, options)
    elif op in sp.op_strategy_funcs:
        fn = sp.op_strategy_funcs[op]
        # (a list of one tensor too: stack's rule merges the placements its list's options offer into one)
        listed = any(isinstance(a, TupleStrategy) for a in schema.args_schema)
        try:
            strategy = fn(schema)
            collapsed = isinstance(strategy, OpStrategy) and (len(options) > 1 or listed) and \
                len(strategy.strategies) < len(options[0]) and not _enumerated(op, strategy) \
                and fn.__name__ not in _FOLLOW_THE_FIRST_INPUT
        except Exception:  # noqa: BLE001 - an eager-only rule that indexes per input
            strategy, collapsed = None, True
        if collapsed:
            strategy = _per_combination(fn, schema)
    else:
        strategy = _decomposition(op, schema, spec_schema, out_meta, mesh)
        if strategy is None:
            return None
    pairs = strategy if isinstance(strategy, list) else _listed(strategy, len(options))
    # torch 2.11's norm rules give one spec for all of an op's outputs (mean and rstd laid out as the output)
    shared = isinstance(out_meta, (list, tuple)) and not isinstance(out_meta, TensorMeta)
    found: dict = {}
    for out, ins in pairs:
        if shared and out and isinstance(out[0], Placement):
            out = tuple(None if m is None else out for m in out_meta)
        found.setdefault((out, ins), None)
    return list(found)
