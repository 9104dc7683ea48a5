"""Mixture-of-experts layers captured in a form that splits over experts exactly.

transformers' experts modules (``grouped_mm``, ``batched_mm`` and ``eager`` implementations, gated, without biases:
Mixtral, Qwen2-MoE, ...) are captured as one call of :class:`MoEExperts` (the tokens, their top-k experts and
weights, the experts' global ids, the two expert weights): it runs transformers' own implementation on the experts a
rank holds, for the (token, slot) pairs routed to them alone (each as a token of one slot, summed back by token:
no compute for the others). Tokens are independent (a token split needs nothing) and split experts give each rank
its experts' share of every token (a pending sum), exactly and dropless. Its backward runs the same forward again
under autograd (one more expert forward a step, for a backward that is transformers' own).

Other experts modules keep their traced ops; there the grouped matmul alone becomes :class:`ExpertMM`:

transformers' default experts implementation (``grouped_mm``) sorts the (token, expert) pairs by expert and
multiplies each expert's rows with its weight: ``transformers::grouped_mm_fallback(x (S, K), w (E, K, N), offs)``
with ``offs`` the cumulative row counts per expert. Its rows per expert are given by offsets into the whole
array, so it cannot run on a rank's experts alone (its offs must have one entry per expert it holds, and the start
of its first expert is the previous rank's last end). While fn is captured, its call becomes :class:`ExpertMM`
on ``bounds`` (E, 2): each expert's [start, end) rows. Split on the expert dim, a rank's weights and bounds are
its experts' alone, and it computes their rows (zeros elsewhere): the ranks' results sum to the whole one, and
their gradients too. The routing (top-k, sort, histc, cumsum) has fixed shapes, so the program runs at any
routing; only the kernel reads the counts, inside the op.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterator

import torch
from torch.utils.flop_counter import register_flop_formula

from ._function_internals import autograd_inside_an_op
from .functions import substitute_function

__all__ = ["ExpertMM", "MoEExperts", "eager_experts_hint", "experts_captured"]


@torch.library.custom_op("shardfn::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Rows [start, end) of ``x`` times ``w[e]`` for each expert e's bounds; rows of no expert zero."""
    out = torch.zeros(x.size(0), w.size(2), device=x.device, dtype=x.dtype)
    for e, (start, end) in enumerate(bounds.tolist()):  # one host read, as transformers' own loop
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
    return out


@expert_mm.register_fake
def _(x, w, bounds):
    return x.new_empty(x.size(0), w.size(2))


@torch.library.custom_op("shardfn::expert_mm_backward", mutates_args=())
def expert_mm_backward(x: torch.Tensor, w: torch.Tensor, bounds: torch.Tensor,
                       grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    for e, (start, end) in enumerate(bounds.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].T, out=grad_x[start:end])
            torch.mm(x[start:end].T, grad[start:end], out=grad_w[e])
    return grad_x, grad_w


@expert_mm_backward.register_fake
def _(x, w, bounds, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _expert_mm_flops(x_shape, w_shape, bounds_shape, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]  # every row is one expert's: one (K x N) product a row


def _expert_mm_backward_flops(x_shape, w_shape, bounds_shape, grad_shape, out_shape=None, **kwargs) -> int:
    return 2 * _expert_mm_flops(x_shape, w_shape, bounds_shape)


register_flop_formula(torch.ops.shardfn.expert_mm)(_expert_mm_flops)
register_flop_formula(torch.ops.shardfn.expert_mm_backward)(_expert_mm_backward_flops)


class ExpertMM(torch.autograd.Function):
    """``expert_mm`` with its gradient; bounds (E, 2) integer rows per expert, no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, bounds)
        return torch.ops.shardfn.expert_mm(x, w, bounds)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, bounds = ctx.saved_tensors
        grad_x, grad_w = torch.ops.shardfn.expert_mm_backward(x, w, bounds, grad.contiguous())
        return grad_x, grad_w, None


def bounds_of(offs: torch.Tensor) -> torch.Tensor:
    """(E, 2) [start, end) rows per expert from the cumulative counts (the ends)."""
    ends = offs.to(torch.int64)
    return torch.stack([torch.cat([ends.new_zeros(1), ends[:-1]]), ends], dim=1)


def _grouped_mm_fallback(x, w, offs, *metadata):
    # the custom op's generated Function is applied with (input, weight, offs, its keyword metadata)
    return ExpertMM.apply(x, w, bounds_of(offs))


substitute_function("GeneratedBackwardFor_transformers_grouped_mm_fallback_default", _grouped_mm_fallback)


def eager_experts_hint(fn) -> str:
    """A hint for a capture that failed on tensor values where fn holds transformers experts run by their 'eager'
    implementation (a loop over the experts hit, found with nonzero); "" otherwise."""
    modules = fn.modules() if isinstance(fn, torch.nn.Module) else ()
    for m in modules:
        config = getattr(m, "config", None)
        weights = [p for name, p in m.named_parameters(recurse=False) if name.endswith("proj") and p.dim() == 3]
        if getattr(config, "_experts_implementation", None) == "eager" and weights:
            return ("\n  Its experts (" + type(m).__name__ + ") run transformers' experts_implementation='eager', a "
                    "loop over the experts each batch routes to (nonzero). Use 'grouped_mm' (transformers' default; "
                    "the experts can then be split over ranks) or 'batched_mm': "
                    "model.set_experts_implementation('grouped_mm'), or experts_implementation='grouped_mm' in the "
                    "model's config or from_pretrained.")
    return ""


# --- whole experts modules ----------------------------------------------------------------------------------

def _local_experts(gate_up, down, act: str, n_local: int):
    """What transformers' experts forwards read of their module, with this rank's experts (sentinels on)."""
    from transformers.activations import ACT2FN  # only reached from a captured transformers model

    ns = types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down, num_experts=n_local, has_gate=True,
                               has_bias=False, has_post_expert_norm=False, is_transposed=False,
                               _is_expert_parallel=True, act_fn=ACT2FN[act])


    def apply_gate(x):  # transformers' _default_apply_gate (the only gate taken: _supported)
        gate, up = x.chunk(2, dim=-1)
        return ns.act_fn(gate) * up

    ns._apply_gate = apply_gate
    return ns


def _run_experts(hidden, index, weights, experts, gate_up, down, act: str, impl: str):
    from transformers.integrations import moe

    n = experts.numel()
    if n == 0:  # a rank holding no expert (an uneven split) contributes nothing
        return hidden.new_zeros(hidden.shape)
    local = index - experts[0]  # experts: this rank's global ids, contiguous
    # the (token, slot) pairs routed to this rank's experts, each run as a token of one slot, summed back by token:
    # another rank's experts cost nothing here (transformers' sentinels would cost batched_mm a product each)
    token, slot = ((local >= 0) & (local < n)).nonzero(as_tuple=True)
    if token.numel() == 0:  # no token routed to them: no contribution
        return hidden.new_zeros(hidden.shape)
    forward = _ORIGINAL.get(impl) or moe.ExpertsInterface._global_mapping[impl]
    pairs = forward(_local_experts(gate_up, down, act, n), hidden[token], local[token, slot].unsqueeze(-1),
                    weights[token, slot].unsqueeze(-1))
    return hidden.new_zeros(hidden.shape).index_add(0, token, pairs)


# transformers' experts forwards by implementation name, as they were before capture; an experts class's own
# ('eager': its loop over the experts hit) by "eager:<module>.<class>"
_ORIGINAL: dict = {}


@torch.library.custom_op("shardfn::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str, impl: str) -> torch.Tensor:
    with torch.no_grad():
        return _run_experts(hidden, index, weights, experts, gate_up, down, act, impl)


@moe_experts.register_fake
def _(hidden, index, weights, experts, gate_up, down, act, impl):
    return torch.empty_like(hidden)


@torch.library.custom_op("shardfn::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str,
                         impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ins = [t.detach().requires_grad_() for t in (hidden, weights, gate_up, down)]
    if experts.numel() == 0:  # no expert here: no contribution, no gradient
        return tuple(torch.zeros_like(t) for t in ins)
    with autograd_inside_an_op(), torch.enable_grad():
        out = _run_experts(ins[0], index, ins[1], experts, ins[2], ins[3], act, impl)
        grads = torch.autograd.grad(out, ins, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, ins))


@moe_experts_backward.register_fake
def _(grad, hidden, index, weights, experts, gate_up, down, act, impl):
    return tuple(torch.empty_like(t) for t in (hidden, weights, gate_up, down))


def _moe_flops(hidden, index, weights, experts, gate_up, down, act=None, impl=None, out_shape=None, **kw) -> int:
    return 2 * index[0] * index[1] * (gate_up[1] * gate_up[2] + down[1] * down[2])  # k experts a token


register_flop_formula(torch.ops.shardfn.moe_experts)(_moe_flops)


class MoEExperts(torch.autograd.Function):
    """``moe_experts`` with its gradient (hidden, routing weights, both expert weights)."""

    @staticmethod
    def forward(ctx, hidden, index, weights, experts, gate_up, down, act: str, impl: str):
        ctx.save_for_backward(hidden, index, weights, experts, gate_up, down)
        ctx.names = (act, impl)
        return torch.ops.shardfn.moe_experts(hidden, index, weights, experts, gate_up, down, act, impl)

    @staticmethod
    def backward(ctx, grad):
        hidden, index, weights, experts, gate_up, down = ctx.saved_tensors
        gh, gw, ggu, gd = torch.ops.shardfn.moe_experts_backward(grad.contiguous(), hidden, index, weights, experts,
                                                                 gate_up, down, *ctx.names)
        return gh, None, gw, None, ggu, gd, None, None


def _supported(module) -> bool:
    from transformers.integrations import moe

    gate_up = getattr(module, "gate_up_proj", None)
    return (getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
            and not getattr(module, "has_post_expert_norm", True) and not getattr(module, "is_transposed", True)
            and getattr(module, "is_concatenated", False) and not getattr(module, "_is_expert_parallel", True)
            and type(module)._apply_gate is moe._default_apply_gate and gate_up is not None and gate_up.dim() == 3
            and isinstance(getattr(module.config, "hidden_act", None), str))


def _own_forward(module):
    """An experts class's own forward ('eager'), which transformers' dispatch wraps (functools.wraps)."""
    own = getattr(type(module).forward, "__wrapped__", None)
    if own is None:
        raise TypeError(f"{type(module).__name__}: transformers' experts dispatch without its own forward; use "
                        "experts_implementation='grouped_mm'")
    return own


def _as_moe_experts(impl: str):
    def forward(module, hidden, index, weights):
        if not _supported(module):
            return (_ORIGINAL.get(impl) or _own_forward(module))(module, hidden, index, weights)
        name = impl
        if impl == "eager":  # the class's own loop, run inside the op (its nonzero reads the routing there)
            name = f"eager:{type(module).__module__}.{type(module).__qualname__}"
            _ORIGINAL[name] = _own_forward(module)
        experts = torch.arange(module.gate_up_proj.size(0), device=hidden.device)
        return MoEExperts.apply(hidden, index, weights, experts, module.gate_up_proj,
                                module.down_proj, module.config.hidden_act, name)

    return forward


@contextlib.contextmanager
def experts_captured() -> Iterator[None]:
    """While fn is captured, transformers' experts (grouped_mm, batched_mm and eager) run as one MoEExperts call
    each: the same implementation, inside an op whose routing the trace does not read."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None:
        yield
        return
    mapping = moe.ExpertsInterface._global_mapping
    saved = {impl: mapping[impl] for impl in ("grouped_mm", "batched_mm") if impl in mapping}
    _ORIGINAL.update(saved)
    try:
        mapping.update({impl: _as_moe_experts(impl) for impl in (*saved, "eager")})
        yield
    finally:
        mapping.pop("eager", None)
        mapping.update(saved)
