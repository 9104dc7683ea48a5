"""The one registry of what shardfn knows of each op, as DTensor's ShardingPropagator is DTensor's.

:data:`REGISTRY` (a :class:`RuleRegistry`) owns:

- shardfn's own sharding rules and its checks on DTensor's rules, by op (:meth:`RuleRegistry.register_rule`,
  :meth:`RuleRegistry.register_check`; ``candidates.register_rule`` and ``register_check`` are the same
  decorators). The rules are written next to each other in :mod:`.rules` and :mod:`.expert_rules`;
- rules in DTensor's own form (:mod:`.dtensor_rules`, :meth:`RuleRegistry.register_dtensor_rule`): pending until
  the search first builds a problem (:meth:`RuleRegistry.register_in_dtensor`), then put in DTensor's process-wide
  registry for the ops it lacks. Importing shardfn leaves DTensor as it is;
- the candidates found per op, argument shapes and mesh, kept between plans (:meth:`RuleRegistry.candidates`:
  one bounded LRU), and the other memos pricing them asks (:meth:`RuleRegistry.memo`: the empty-piece probes, the
  FLOPs per op and shapes);
  :meth:`RuleRegistry.clear` empties them all;
- the op tables, below the class: which ops DTensor runs on their pieces as they are, which inputs an op only
  adds, what an op's backward reads, which ops every model leans on, which have torch bindings that exec calls
  directly. The search (run_modes, readout, saved, pricing, problem) and exec (direct_calls) ask them through
  the named query methods; none keeps a table of its own.

A rule for a new op is added in one file: ``@register_rule(op)`` in :mod:`.rules` (or ``@register_check(op)``, or
``@REGISTRY.register_dtensor_rule(op)`` in :mod:`.dtensor_rules`). Where the op also belongs in an op table (it
runs on its pieces, it only adds an input), that is one more line, in its table here.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch.distributed.tensor.experimental import register_sharding

from ..capture.functions import FunctionCall
from ._dtensor_adapter import has_dtensor_rule
from .lru import LRU

__all__ = ["REGISTRY", "RuleRegistry", "register_check", "register_rule"]

aten = torch.ops.aten


class RuleRegistry:
    """Own rules and checks by op, DTensor-form rules (pending until first used), the candidates' memo, and the
    op tables, each read through a named method."""

    def __init__(self, cache_size: int = 8192):
        self._rules: dict[Any, Callable] = {}
        self._checks: dict[Any, Callable] = {}
        self._dtensor_pending: list[tuple[tuple, Callable]] = []
        self.registered_in_dtensor: list = []  # the ops put in DTensor's registry so far
        # DTensor's (and the own rules') answers per op, argument shapes and mesh, kept between plans: one shared
        # list per key, so identical layers share candidate lists (and what is priced per list). Other memos of
        # candidates (which ops run on empty pieces) are kept here too, by name (memo)
        self._memos: dict[str, LRU] = {"candidates": LRU(cache_size)}
        self._tables: dict[str, dict] = {}

    # --- own rules and checks ---------------------------------------------------------------------------------

    def register_rule(self, *ops):
        """Register ``fn(node, mesh) -> list[Candidate]`` (None: no rule for this node) as the rule for ``ops``
        (checked before DTensor's). An op may also be a torch.autograd.Function class: the rule of its calls in
        fn (which then run as ``rule="local"`` candidates say: the Function called on each rank's pieces)."""

        def deco(fn):
            for op in ops:
                self._rules[op] = fn
            return fn

        return deco

    def register_check(self, *ops):
        """Register ``fn(node, mesh, candidate) -> bool`` to keep only the DTensor candidates of ``ops`` it accepts
        (where DTensor's rule is wrong for some shapes)."""

        def deco(fn):
            for op in ops:
                self._checks[op] = fn
            return fn

        return deco

    def rule(self, target) -> Callable | None:
        """The own rule of ``target``: one registered for it, or for a Function call, one registered for the
        Function class, else the rule of Function calls."""
        found = self._rules.get(target)
        if found is None and isinstance(target, FunctionCall):
            found = self._rules.get(target.function, self._rules.get(FunctionCall))
        return found

    def check(self, target) -> Callable | None:
        """The check kept on DTensor's candidates of ``target`` (None: none)."""
        return self._checks.get(target)

    def ruled_ops(self) -> set:
        """Every op (or Function class) that has an own rule."""
        return set(self._rules)

    # --- rules in DTensor's form ------------------------------------------------------------------------------

    def register_dtensor_rule(self, *ops):
        """The decorated rule, in DTensor's form (``register_sharding``'s), for those of ``ops`` DTensor has no rule
        for: pending until :meth:`register_in_dtensor`."""

        def deco(fn):
            self._dtensor_pending.append((ops, fn))
            return fn

        return deco

    def dtensor_pending(self) -> int:
        """How many DTensor-form rules wait to be registered."""
        return len(self._dtensor_pending)

    def register_in_dtensor(self) -> None:
        """Put the pending DTensor-form rules in DTensor's registry, once, for the ops it lacks."""
        while self._dtensor_pending:
            ops, fn = self._dtensor_pending.pop(0)
            missing = [op for op in ops if not has_dtensor_rule(op)]
            if missing:
                register_sharding(missing)(fn)
                self.registered_in_dtensor.extend(missing)

    # --- the candidates' memo ---------------------------------------------------------------------------------

    def candidates(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The candidates kept for ``key``, found by ``make()`` the first time (the last 8192 keys used)."""
        return self._memos["candidates"].get(key, make)

    def memo(self, name: str, maxsize: int) -> LRU:
        """The bounded memo ``name`` of what finding and pricing candidates asks many times (made the first
        time)."""
        return self._memos.setdefault(name, LRU(maxsize))

    def clear(self) -> None:
        """Forget the candidates found and every memo (rules and tables stay)."""
        for memo in self._memos.values():
            memo.clear()

    # --- op tables --------------------------------------------------------------------------------------------

    def describe(self, table: str, entries) -> None:
        """Add ``entries`` (ops, or a mapping op -> value) to the op table ``table``."""
        entries = entries if isinstance(entries, dict) else dict.fromkeys(entries, True)
        self._tables.setdefault(table, {}).update(entries)

    def _in(self, table: str, op) -> bool:
        try:
            return op in self._tables.get(table, ())
        except TypeError:  # an unhashable target
            return False

    def random_fills(self) -> frozenset:
        """Random fills that read only their input's shape (drawn whole from the seed and sliced)."""
        return frozenset(self._tables["random_fill"])

    def is_random_fill(self, op) -> bool:
        return self._in("random_fill", op)

    def sized_factories(self) -> frozenset:
        """Factories shaped by a size argument that read their tensor input for its dtype and device only."""
        return frozenset(self._tables["sized_factory"])

    def size_argument(self, op) -> int | None:
        """Where a sized factory takes its size (None: ``op`` is not one): run on a piece, the piece's size."""
        return self._tables["sized_factory"].get(op) if self._in("sized_factory", op) else None

    def runs_on_pieces(self, op) -> bool:
        """A non-pointwise op DTensor's rule runs on its operands' pieces as they are (list arguments: dims)."""
        return self._in("on_pieces", op)

    def sums_on_pieces(self, op) -> bool:
        """A sum that may be left pending by each rank summing its piece."""
        return self._in("sum_on_pieces", op)

    def view_on_pieces(self, op) -> bool:
        """A view DTensor runs on its operand's piece, its size argument the piece's."""
        return self._in("view_on_pieces", op)

    def added_inputs(self, op) -> tuple[int, ...]:
        """The tensor inputs ``op`` only adds: its backward does not read them."""
        return self._tables["added"].get(op, ()) if self._in("added", op) else ()

    def moves_gradient(self, op) -> bool:
        """Linear in each input: its backward reads none (it moves, sums or converts the output's gradient)."""
        return self._in("moves_gradient", op)

    def linear_in_each(self, op) -> bool:
        """Linear in each input alone: its backward reads an input only for another input's gradient."""
        return self._in("linear_in_each", op)

    def reads_output(self, op) -> bool:
        """Its backward reads its own output (all of a tuple's)."""
        return self._in("reads_output", op)

    def backward_scratch(self, op) -> int | None:
        """The tensor input whose size its backward allocates once more than the gradient it makes, for a while
        (gather's: zeros, then an out-of-place scatter_add into them); None for most ops."""
        return self._tables["backward_scratch"].get(op) if self._in("backward_scratch", op) else None

    def reshapes_gradient(self, op) -> bool:
        """Its gradient is its input's, reshaped: a gradient reduced after it is the input's own."""
        return self._in("reshapes_gradient", op)

    def carries_no_gradient(self, op) -> bool:
        """Its result carries no gradient from its tensor inputs (read for shape, dtype and device, or detached)."""
        return self._in("no_gradient", op)

    def kept_selectively(self, op) -> bool:
        """A selective recompute keeps its results (a matmul's, an attention's): by the aten name of ``op``."""
        return isinstance(op, torch._ops.OpOverload) and \
            op._schema.name.split("::")[-1] in self._tables["kept_selectively"]

    def core_ops(self) -> frozenset[str]:
        """The names of the ops every model leans on (replicating one for want of its rule is an error)."""
        return frozenset(str(op) for op in self._tables["core"])

    def binding(self, name: str) -> str | None:
        """Where the Python binding exec calls for aten op packet ``name`` is: "function", "nn", "method"."""
        return self._tables["binding"].get(name)

    def bindings(self) -> dict[str, str]:
        """Every op packet name with a binding exec calls directly, and where it is."""
        return dict(self._tables["binding"])


REGISTRY = RuleRegistry()
# the decorators rules are registered with, next to each other (as torch.distributed.tensor's register_sharding)
register_rule = REGISTRY.register_rule
register_check = REGISTRY.register_check


# --- op tables ----------------------------------------------------------------------------------------------

# Random fills that read only their input's shape. exec draws them whole on every rank from the shared generator
# state and slices, so a seed gives the same numbers whatever the layout (and the same as single-device eager).
# Other seeded random ops (they read values) run replicated.
REGISTRY.describe("random_fill", {
    aten.bernoulli.p, aten.uniform.default, aten.normal_functional.default, aten.rand_like.default,
    aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype, aten.exponential.default,
    aten.random.default, aten.random.to,
})

# factories shaped by a size argument (op -> its position), their tensor input read for its dtype and device only:
# each rank makes its own piece of any layout (rules), the size argument the piece's (exec.pieces.sized_to_piece)
REGISTRY.describe("sized_factory", dict.fromkeys((
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default), 1))

# ops DTensor runs on its operands' pieces as they are, given the placements its strategy asks for (besides the
# pointwise ones; their list arguments are dims or operands, not sizes): exec's interpreter runs them so itself,
# without DTensor's sharding propagation on every call (run_modes). Views apart (view_on_pieces): a view hands the
# pending sum of its gradient on as it is (DTensor's view rules), where a piece's view between to_local and
# from_local would resolve it first
REGISTRY.describe("on_pieces", {
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten._softmax.default, aten._log_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default, aten.clone.default,
    aten._to_copy.default, aten.cat.default, aten.sum.dim_IntList, aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default, aten.embedding.default, aten.gather.default, aten.sum.default,
})
# sums left pending on the pieces: each rank sums its piece, and the gradient (whole) expands onto the piece. Not
# an average's: a piece's mean divides its gradient by the piece's count, not the whole's
REGISTRY.describe("sum_on_pieces", {aten.sum.default, aten.sum.dim_IntList})
# views DTensor runs on its operand's piece, the size argument rewritten to the result's piece: exec runs them so
# itself (its _ViewOfPiece), where the planned placements say DTensor's rule would
REGISTRY.describe("view_on_pieces", {
    aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.detach.default, aten.alias.default,
})

# what an op's backward reads (the derivative formulas' in outline: saved, readout). Inputs an op only adds (a
# bias, either side of a sum): its backward does not read them
REGISTRY.describe("added", {aten.add.Tensor: (0, 1), aten.sub.Tensor: (0, 1), aten.addmm.default: (0,),
                            aten.baddbmm.default: (0,), aten.addbmm.default: (0,)})
# ops linear in each input, their backward reads none (it moves, sums or converts the output's gradient; each
# checked against autograd's saved tensors in tests/strategy_search/test_saved.py). _unsafe_view is no view to
# autograd (a linear layer reshapes its 3-D product with it), its backward reshapes the gradient alone
REGISTRY.describe("moves_gradient", {
    aten.cat.default, aten.stack.default, aten.clone.default, aten._to_copy.default, aten.neg.default,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.expand.default,
    aten.repeat.default, aten.add.Tensor, aten.sub.Tensor, aten.constant_pad_nd.default, aten._unsafe_view.default,
    aten.tril.default, aten.triu.default, aten.cumsum.default, aten.flip.default, aten.roll.default,
})
# ops linear in each input alone: their backward reads an input only for another input's gradient
REGISTRY.describe("linear_in_each", {
    aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Scalar, aten.embedding.default, aten.convolution.default, aten.index_select.default,
    aten.gather.default, aten.where.self, aten.masked_fill.Scalar, aten.nll_loss_forward.default,
})
# ops whose backward reads their own output (all of a tuple's: attention's output and log-sum-exp)
REGISTRY.describe("reads_output", {
    aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default,
    aten.relu.default, aten._softmax.default, aten._log_softmax.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
})
# ops whose backward allocates a scratch of an input's size beside the gradient it makes (op -> that input): the
# read-out's walk holds it while the backward runs (a loss's gather of whole logits: bench/plan_peak's Llama
# measured the logits' size once more there)
REGISTRY.describe("backward_scratch", {aten.gather.default: 0})
# ops whose result carries no gradient from their tensor inputs: a value made by one needs none, and no pending
# gradient of it is priced or reduced (problem)
REGISTRY.describe("no_gradient", {
    aten.new_full.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.detach.default,
})
# ops whose gradient is their input's, reshaped: a gradient reduced after them is the input's own (pricing)
REGISTRY.describe("reshapes_gradient", {aten.t.default, aten.view.default, aten._unsafe_view.default,
                                        aten.transpose.int, aten.permute.default})

# the expensive ops whose results a selective recompute keeps (recompute), by their aten name: the ops between
# them are computed again
REGISTRY.describe("kept_selectively", {
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
})

# ops every model leans on: running one of them replicated because its rule could not be read would make every
# plan silently serial, so that is an error naming the torch release instead (problem)
REGISTRY.describe("core", {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.native_layer_norm.default, aten.embedding.default,
    aten._softmax.default, aten._log_softmax.default, aten.sum.dim_IntList, aten.mean.dim, aten.add.Tensor,
    aten.mul.Tensor, aten.view.default, aten.t.default, aten.transpose.int,
})

# ops exec calls through torch's own Python bindings (exec.direct_calls): op packet name -> where its binding is,
# "function" (torch's variable functions), "nn" (torch._C._nn) or "method" (x.<op>). Only ops whose binding takes
# the schema's arguments as the graph passes them and reaches the very overload the graph names
REGISTRY.describe("binding", {
    **dict.fromkeys((
        # matrix products and attention
        "mm", "bmm", "addmm", "baddbmm", "embedding",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        # elementwise
        "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "sin", "cos",
        "abs", "reciprocal", "maximum", "minimum", "clamp", "erf", "where", "rsub", "relu",
        "le", "lt", "ge", "gt", "eq", "ne", "bitwise_and", "bitwise_or", "bitwise_not", "logical_not",
        # reductions, normalizations, joins
        "mean", "sum", "amax", "_softmax", "_log_softmax", "native_layer_norm", "cat", "stack", "clone",
        # views
        "transpose", "unsqueeze", "squeeze", "t", "permute", "select", "detach",
        # factories
        "scalar_tensor", "arange", "full", "zeros", "ones", "empty",
    ), "function"),
    **dict.fromkeys(("silu", "gelu"), "nn"),
    **dict.fromkeys(("view", "expand", "new_ones", "new_zeros", "new_empty", "new_full"), "method"),
})
