"""fn + example inputs -> CapturedGraph, traced with make_fx on fake tensors of the global shapes."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

from ._fake_internals import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                              disable_current_modes, enable_python_dispatcher, get_decompositions)
from ._tracing import checkpoint_regions_marked, looks_like_tracing, module_paths_marked, requires_grad_marks_ignored
from .dynamic import DynamicDims, functionalized, symbolic_input
from .experts import eager_experts_hint, experts_captured
from .functions import functions_as_calls, functions_as_targets
from .order import canonical_order
from .repeated import LayersTracedOnce, NotCopied
from .graph import CaptureError, CapturedGraph, GraphInput, is_in_place
from .structure import split

__all__ = ["argument_name", "capture", "capturing", "check_not_transformed", "split_arguments"]

_STATE = threading.local()

def _var_mean_two_pass(x, dim=None, *, correction=None, keepdim=False):
    """var_mean as sums (mean first, then squared deviations): each sum over a split dim is a pending sum that one
    small all-reduce resolves, so statistics over a split batch (batch norm under data parallelism) need no
    gather, and equal single-device eager's (a two-pass variance, not E[x^2] - E[x]^2)."""
    if x.is_complex():
        return torch._refs.var_mean(x, dim, keepdim=keepdim, correction=correction)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else [d % max(x.dim(), 1) for d in dim]
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean = x.sum(dims, keepdim=True) / n
    deviation = x - mean
    var = (deviation * deviation).sum(dims, keepdim=keepdim) / (n - (1 if correction is None else correction))
    return var, (mean if keepdim else mean.squeeze(dims))


def _mean_as_sum(x, dim=None, keepdim=False, *, dtype=None):
    """mean as a sum over the count: over a split dim a pending sum (one small all-reduce) where DTensor's mean is a
    pending average that shardfn's plans do not carry (its backward loses the scaling), so the input was gathered."""
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else [d % max(x.dim(), 1) for d in dim]
    n = 1
    for d in dims:
        n *= x.shape[d]
    return x.sum(dims, keepdim=keepdim, dtype=dtype) / n


def _var_as_sums(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean_two_pass(x, dim, correction=correction, keepdim=keepdim)[0]


def _std_as_sums(x, dim=None, *, correction=None, keepdim=False):
    return _var_as_sums(x, dim, correction=correction, keepdim=keepdim).sqrt()


def _std_mean_as_sums(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _var_mean_two_pass(x, dim, correction=correction, keepdim=keepdim)
    return var.sqrt(), mean


# Ops decomposed while capturing:
# - batch norms, whose schema does not declare that they update running_mean/var in place: functionalization
#   would keep them as they are, and the update would land in whatever layout the plan gives those buffers (on a
#   copy). Decomposed, the update is an explicit copy_ into the buffer, planned and run like any other write;
# - nll_loss's mean over a batch, and var_mean: as sums, they run on batch slices (a pending sum each) instead of
#   gathering the batch, as data parallelism needs;
# - group norm, whose kernels take the batch size as an argument (the global one in the graph, wrong for a
#   rank's slice in backward): as views and statistics, it needs no such number;
# - mean, var, std (and the mean of mse_loss, smooth_l1_loss, soft_margin_loss, binary_cross_entropy and the
#   margin losses, each an elementwise or per-sample loss then its reduction): as sums, they run on split pieces
#   (a pending sum each) instead of gathering their input.
_DECOMPOSITIONS = {
    **get_decompositions([
        torch.ops.aten.native_batch_norm, torch.ops.aten.cudnn_batch_norm, torch.ops.aten.miopen_batch_norm,
        torch.ops.aten._native_batch_norm_legit, torch.ops.aten._native_batch_norm_legit_functional,
        torch.ops.aten._native_batch_norm_legit_no_training, torch.ops.aten._batch_norm_with_update,
        torch.ops.aten._batch_norm_with_update_functional, torch.ops.aten._batch_norm_no_update,
        torch.ops.aten.nll_loss_forward, torch.ops.aten.nll_loss2d_forward, torch.ops.aten.native_group_norm,
        torch.ops.aten.mse_loss, torch.ops.aten.smooth_l1_loss, torch.ops.aten.soft_margin_loss,
        torch.ops.aten.binary_cross_entropy, torch.ops.aten.multi_margin_loss,
        torch.ops.aten.multilabel_margin_loss_forward]),
    torch.ops.aten.var_mean.correction: _var_mean_two_pass,
    torch.ops.aten.mean.dim: _mean_as_sum,
    torch.ops.aten.mean.default: lambda x, *, dtype=None: _mean_as_sum(x, dtype=dtype),
    torch.ops.aten.var.correction: _var_as_sums,
    torch.ops.aten.std.correction: _std_as_sums,
    torch.ops.aten.std_mean.correction: _std_mean_as_sums,
}


def capturing() -> bool:
    """True while some shard call is tracing its fn (a shard call inside it is then a nested misuse)."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _capture_scope():
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def check_not_transformed(tensors: Sequence[torch.Tensor], what: Callable[[], str]) -> None:
    """Reject tensors wrapped by torch.func transforms (vmap/grad around a sharded callable). ``what()`` names
    the callable (asked for only when there is an error)."""
    for t in tensors:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise TypeError(
                f"{what()} was called inside a torch.func transform (vmap, grad, jacrev, ...) applied around it. "
                "Sharded callables cannot be transformed from outside; put the transform inside fn instead: "
                "sf.shard(lambda x: torch.func.vmap(f)(x), ...)"
            )


def _user_frame(tb) -> str:
    """The innermost traceback frame outside torch and shardfn: the user's line that failed to trace."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(os.path.dirname(__file__))
    found = None
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith((torch_dir, here)) and "functorch" not in frame.filename:
            found = frame
    if found is None:
        return "<unknown location>"
    return f'File "{found.filename}", line {found.lineno}, in {found.name}: {found.line}'


def argument_name(path: str) -> str:
    """A tensor's path in (args, kwargs) as errors and plans show it: ``input 0``, ``input 2[1]``, ``scale``,
    ``pair[0]``, ``past_key_values.layers[0].keys``."""
    m = re.match(r"\[0\]\[(\d+)\](.*)", path, re.S)
    if m:
        return f"input {m.group(1)}{m.group(2)}"
    m = re.match(r"\[1\]\[(.+?)\](.*)", path, re.S)
    return f"{m.group(1).strip(chr(39))}{m.group(2)}" if m else path


def split_arguments(args: Sequence[Any], kwargs: dict[str, Any], names: bool = False, where=lambda: "fn"):
    """The tensors in a call's (args, kwargs), their names (when asked for) and the Structure of the call."""
    tensors, paths, structure = split((tuple(args), dict(kwargs)), where, path="" if names else None,
                                      display=argument_name)
    return tensors, [argument_name(p) for p in paths] if names else [], structure


def capture(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: dict[str, torch.Tensor] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
    call: Callable[..., Any] | None = None,
    device: str = "cpu",
    grad: bool | None = None,
    dynamic: dict[int, tuple[int, ...]] | None = None,
) -> CapturedGraph:
    """Trace ``fn(*args, **kwargs)`` into an aten graph on fake tensors of the global shapes.

    Every tensor reachable in ``args`` and ``kwargs`` (through pytree containers and the attributes of plain
    objects) is an input of the graph; only its shape, dtype and requires_grad are read (it may be real, fake or
    meta). Other values are constants of the trace. fn runs on copies of argument objects: what it changes in them
    becomes extra graph outputs and a new state written back after each call. For a module, ``params``/``buffers``
    are its state and ``call(state, *args, **kwargs)`` runs it with that state substituted; they become the first
    placeholders, then the argument tensors in order. ``grad``: whether the call records gradients (default: the
    current grad mode), which some ops' kernel choice depends on. ``dynamic``: {argument tensor number: dims}
    traced as symbols (capture.dynamic), so the graph serves other sizes of those dims.
    """
    grad = torch.is_grad_enabled() if grad is None else grad
    what = lambda: getattr(fn, "__qualname__", type(fn).__name__)  # noqa: E731
    params, buffers = params or {}, buffers or {}
    inputs, arg_structure = _graph_inputs(params, buffers, args, kwargs, what, device)
    traced: dict[str, Any] = {}
    flat_fn = _flat_function(fn, call, list(params) + list(buffers), arg_structure, traced, what)
    symbols = DynamicDims(ShapeEnv()) if dynamic else None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=symbols.shape_env if symbols else None)
    fakes = _fake_inputs(inputs, fake_mode, symbols, dynamic or {}, device)
    try:
        gm, function_calls = _traced(fn, flat_fn, fakes, fake_mode, grad, bool(dynamic), what)
    except NotCopied as e:  # layers whose ops depend on which layer runs them: traced as they run
        gm, function_calls = _traced(fn, flat_fn, fakes, fake_mode, grad, bool(dynamic), what, e.signatures)
    _check_constants(gm, fake_mode, what)
    _check_no_communication(gm, what)
    _out_of_place_metadata_ops(gm)
    _drop_skipped_cat_operands(gm)
    # identical ops on the same inputs (q, k and v each viewing the same normalised activations) become one node,
    # so the search sees one value with several readers; random ops are never merged
    gm = CSEPass(banned_ops=get_CSE_banned_ops())(gm).graph_module
    functions_as_targets(gm, function_calls, fake_mode)  # after CSE: two calls of a Function stay two
    # every rank holds this graph in one order, whatever order fn's Python ran independent work in on this rank
    gm = canonical_order(gm)
    return CapturedGraph(gm, inputs, arg_structure, traced["outputs"], traced["n_outputs"], traced["states"],
                         dynamic=symbols)


def _graph_inputs(params, buffers, args, kwargs, what, device):
    """The graph's inputs in placeholder order (parameters, buffers, then the argument tensors) and the arguments'
    structure. A 0-dim argument tensor on the CPU of a program on another device stays there (``on_cpu``): eager
    code that moves it (StaticCache's counter: ``.to(device)`` at its first update) then traces a copy, which the
    caller's object gets back, as in eager, instead of an update written into the CPU tensor each call (a CPU
    scalar's value that a CUDA graph could not replay)."""
    inputs: list[GraphInput] = []
    for kind, state in (("param", params), ("buffer", buffers)):
        for i, (name, t) in enumerate(state.items()):
            inputs.append(GraphInput(kind, name, i, tuple(t.shape), t.dtype, bool(t.requires_grad)))
    arg_tensors, names, arg_structure = split_arguments(args, kwargs, names=True, where=what)
    off_cpu = torch.device(device).type != "cpu"
    for j, (a, name) in enumerate(zip(arg_tensors, names)):
        # (one that needs a gradient is taken to the device as before: its gradient is made there)
        on_cpu = off_cpu and a.dim() == 0 and a.device.type == "cpu" and not a.requires_grad
        inputs.append(GraphInput("input", name, j, tuple(a.shape), a.dtype, bool(a.requires_grad), on_cpu))
    return inputs, arg_structure


def _flat_function(fn, call, state_names, arg_structure, traced, what):
    """fn over flat tensors (the state, then the arguments' tensors) returning flat tensors: its outputs, then the
    new state of argument objects it changed. What the outputs and changes look like lands in ``traced``."""
    n_state = len(state_names)

    def flat_fn(*flat):
        state = dict(zip(state_names, flat[:n_state]))
        fakes = list(flat[n_state:])
        (a, k), copies = arg_structure.rebuild_with_objects(fakes)
        kept = {id(t): j for j, t in enumerate(fakes)}
        numbers = {id(c): n for n, c in enumerate(copies)}
        before = [split(c, what, kept=kept, copies=numbers)[2].key(lambda i: i) for c in copies]
        out = call(state, *a, **k) if call is not None else fn(*a, **k)
        tensors, _, traced["outputs"] = split(out, what, copies=numbers)
        traced["n_outputs"], traced["states"] = len(tensors), []
        for n, c in enumerate(copies):  # argument objects fn changed: their new state, written back per call
            new, _, after = split(c, what, kept=kept, copies=numbers)
            if after.key(lambda i: i) != before[n] or new:
                traced["states"].append((n, len(tensors), after))
                tensors = tensors + new
        return tensors

    return flat_fn


def _fake_inputs(inputs, fake_mode, symbols, dynamic, device):
    """A fake tensor per graph input; the dims ``dynamic`` names are symbols."""
    fakes = []
    for position, gi in enumerate(inputs):
        # inputs require grad as the call's do: ops choose their kernel by it (SDPA takes its math path for a
        # mask that needs a gradient, the CPU flash kernel otherwise)
        grads = gi.requires_grad and (gi.dtype.is_floating_point or gi.dtype.is_complex)
        dims = dynamic.get(gi.index, ()) if gi.kind == "input" else ()
        if dims:
            fakes.append(symbolic_input(fake_mode, symbols, position, gi.shape, dims, dtype=gi.dtype,
                                        device=device).requires_grad_(grads))
            continue
        with fake_mode:
            fakes.append(torch.empty(gi.shape, dtype=gi.dtype, device="cpu" if gi.on_cpu else device)
                         .requires_grad_(grads))
    return fakes


def _traced(fn, flat_fn, fakes, fake_mode, grad, dynamic, what, traced_as_they_run=frozenset()):
    """make_fx of the functionalized flat function (real tensors fn reads that are not its inputs, a closure's
    mask, become constants of the graph); a value-dependent trace is a CaptureError saying what to change. A
    module's repeated layers are traced once and copied (capture.repeated), but those ``traced_as_they_run``."""
    every_layer = dynamic or os.environ.get("SHARDFN_TRACE_EVERY_LAYER", "0") == "1"
    layers = LayersTracedOnce(None if every_layer else _module_of(fn), capturing, traced_as_they_run)
    try:
        # a simulated world's mode leaves the tensors of Python functionalization to their own dispatch, which
        # refuses: off the stack while a dynamic capture traces
        with disable_current_modes() if dynamic else contextlib.nullcontext(), \
                _capture_scope(), torch.set_grad_enabled(grad), fake_mode, looks_like_tracing(), \
                requires_grad_marks_ignored(capturing), checkpoint_regions_marked(capturing), \
                module_paths_marked(_module_of(fn), capturing), \
                functions_as_calls() as function_calls, experts_captured(), layers.patched(), \
                enable_python_dispatcher() if dynamic else contextlib.nullcontext():
            # functionalized: in-place ops become out-of-place, so every node is a pure function of its inputs
            functional = functionalized(flat_fn) if dynamic else torch.func.functionalize(flat_fn)
            gm = make_fx(functional, decomposition_table=_DECOMPOSITIONS, tracing_mode="real")(*fakes)
            gm = layers.inlined(gm, function_calls)
            if _writes_into_views(gm):
                gm = _functionalized_again(gm, fakes, functionalized if dynamic else torch.func.functionalize)
            _copies_as_values(gm)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise CaptureError(
            f"shardfn could not trace {what()}: its control flow or output shape depends "
            f"on tensor values ({e}).\n  at {_user_frame(sys.exc_info()[2])}\n"
            "Make the branch depend on shapes or Python values, use torch.where/torch.cond, or compute it "
            "outside the sharded function." + eager_experts_hint(_module_of(fn))
        ) from None
    except Exception as e:
        if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__:
            raise CaptureError(
                f"shardfn could not trace {what()}: it depends on tensor values.\n"
                f"  at {_user_frame(sys.exc_info()[2])}" + eager_experts_hint(_module_of(fn))
            ) from e
        raise
    return gm, function_calls


def _writes_into_views(gm: torch.fx.GraphModule) -> bool:
    """Whether a decomposition left a write into anything but an input: decompositions run below
    functionalization, so a composite op's ``copy_`` into a slice of its fresh result (circular padding) or into an
    alias of a buffer (instance norm's running statistics) stays in the graph as it is."""
    return any(n.op == "call_function" and is_in_place(n.target) and n.args and isinstance(n.args[0], torch.fx.Node)
               and n.args[0].op != "placeholder" for n in gm.graph.nodes)


def _functionalized_again(gm: torch.fx.GraphModule, fakes: list, functionalize: Callable) -> torch.fx.GraphModule:
    """The graph traced once more under functionalization (no decompositions now): writes into views become
    scatters into their base and writes reaching an input become one ``copy_`` into that input at the end, so every
    write lands where it must whatever layout the plan gives its destination. Nodes keep their annotations
    (module paths, checkpoint regions)."""
    def run(*args):
        return torch.fx.Interpreter(gm).run(*args)

    with torch.fx.traceback.preserve_node_meta():
        return make_fx(functionalize(run), tracing_mode="real")(*fakes)


def _copies_as_values(gm: torch.fx.GraphModule) -> None:
    """Functionalization's out-of-place ``aten.copy(dest, src)`` (autograd has no derivative for it, DTensor no
    rule) as what it is: src in dest's dtype, broadcast to dest's shape, a tensor of its own."""
    aten = torch.ops.aten
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        changed = True
        dest, src = node.args[0].meta["val"], node.args[1].meta["val"]
        with gm.graph.inserting_before(node):
            value = node.args[1]
            if src.dtype != dest.dtype:
                value = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": dest.dtype})
                value.meta["val"] = src = src.to(dest.dtype)
            if src.shape != dest.shape:
                value = gm.graph.call_function(aten.expand.default, (value, list(dest.shape)))
                value.meta["val"] = src.expand(dest.shape)
            value = gm.graph.call_function(aten.clone.default, (value,))
        value.meta = dict(node.meta)
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
    if changed:  # (a big model's graph takes a while to compile into code)
        gm.recompile()


def _out_of_place_metadata_ops(gm: torch.fx.GraphModule) -> None:
    """Functionalization keeps in-place ops that change only a tensor's view (``squeeze_`` of F.linear on a 1-D
    input, ``unsqueeze_`` in group norm); on a laid-out tensor they would change its local view alone. Each
    becomes its out-of-place twin (``squeeze``), and later readers of the tensor read the twin's result, which is
    what the in-place op had made of the tensor."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
            continue
        name = target._schema.name.split("::")[-1]
        packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
        twin = getattr(packet, target._overloadname, None) if packet is not None else None
        if twin is None or not twin.is_view or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        if src.op == "placeholder":
            continue
        for later in [u for u in src.users if order[u] > order[node]]:
            later.replace_input_with(src, node)
        node.target = twin
        changed = True
    if changed:  # a big model's graph takes a while to compile into code
        gm.recompile()


def _drop_skipped_cat_operands(gm: torch.fx.GraphModule) -> None:
    """cat skips a 1-D empty operand beside higher-rank ones (a cache starts from one): dropped from the graph,
    it cannot force the others into its layout (a whole batch gathered for nothing)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        parts = node.args[0]
        vals = [p.meta.get("val") if isinstance(p, torch.fx.Node) else None for p in parts]
        keep = [p for p, v in zip(parts, vals) if not (isinstance(v, torch.Tensor) and v.dim() == 1
                                                      and v.numel() == 0)]
        if keep and len(keep) < len(parts) and all(isinstance(v, torch.Tensor) for v in vals):
            node.args = (keep, *node.args[1:])
            changed = True
            for dropped in set(parts) - set(keep):
                if not dropped.users and dropped.op != "placeholder":  # (not random: DCE could drop draws)
                    gm.graph.erase_node(dropped)
    if changed:
        gm.recompile()


def _module_of(fn: Callable) -> torch.nn.Module | None:
    """The module ``fn`` is (or whose bound forward it is): its submodules' paths mark the ops they compute."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


_COMMUNICATION = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _check_no_communication(gm: torch.fx.GraphModule, what: Callable[[], str]) -> None:
    """fn's own torch.distributed calls (a barrier in a forward hook, an all_reduce of a statistic) would run
    inside the program, beside the collectives the plan places, on tensors the plan has split: refused."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target.namespace in _COMMUNICATION:
            raise CaptureError(
                f"{what()} communicates itself ({target._schema.name}, e.g. a torch.distributed call in fn or in "
                "a module's forward hook): shardfn places every collective the plan needs, and fn runs on every "
                "rank as one program over global tensors. Call it outside the sharded call (before or after it), "
                "or remove it.")


def _check_constants(gm: torch.fx.GraphModule, fake_mode: FakeTensorMode, what: Callable[[], str]) -> None:
    """Tensors the graph holds as constants (made inside fn, or read from outside it) get a fake value like every
    other node; one that requires grad would lose its gradient, so it must be passed as an input."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if value.requires_grad:
            raise CaptureError(
                f"{what()} reads a tensor of shape {tuple(value.shape)} that requires grad but is not one of its "
                "inputs (a global, a closure variable, or an attribute of a non-pytree argument): its gradient "
                "would be lost. Pass it as an argument (or, for a module, make it a parameter).")
        if "val" not in node.meta:
            node.meta["val"] = fake_mode.from_tensor(value)
