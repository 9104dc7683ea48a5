"""Plan -> ParallelProgram: the per-rank program that runs the captured graph as planned.

The program is a function of plain local tensors (:meth:`ParallelProgram.local_step`): it wraps each input as a
DTensor in the layout the caller holds it in and lays it out as planned, interprets the captured graph over
DTensors (before each node every tensor input is redistributed to the placement the plan chose for it, the
node runs through DTensor's dispatch or, for shardfn's own and fallback rules, on local shards, and its result
is put in the planned placement: exec.interpret), and returns the local tensors of the results. On a real process
group that function is traced once by AOTAutograd into per-rank local forward and backward aten graphs with
functional collectives (``program.graphs``, exec.traced), so a call runs two flat graphs, not Python per op. Inside
a simulated world (LocalTensorMode) it runs eagerly under autograd. With SHARDFN_COMPILE (on CUDA by default)
Inductor compiles those graphs, collectives included.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import Shard

from .._simulation_internals import local_tensor_mode
from ..capture.graph import CapturedGraph, checkpoint_region
from ..strategy_search.plan import Plan
from ._dtensor_internals import layout_of, local_as, local_of
from ._graph_internals import in_region, keep_linalg_error_checks, release_saved
from .direct_calls import direct_calls
from .interpret import Interpreter
from .pieces import as_dtensor, from_local, gradient_placements, redistribute, redistributed, settled
from .precision import Casts
from .run import LocalsOf, global_stride
from .traced import direct_graphs, traced_program, use_inductor

__all__ = ["ParallelProgram", "lower", "use_inductor"]

aten = torch.ops.aten
_log = logging.getLogger("shardfn")
_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class ParallelProgram:
    """Callable on the graph inputs as the caller holds them (DTensor parameters, whole tensors, batch slices,
    DTensors, in the order of ``plan.inputs``); returns the flat tensor outputs: DTensors where
    ``plan.returns_dtensor`` says so, else plain local tensors (a whole value, or this rank's batch slice)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: DeviceMesh, traced: bool, symbolic: bool = False):
        self.captured, self.plan, self.mesh, self.name = captured, plan, mesh, plan.name
        # traced once for every size of the dynamic dims (exec.for_every_size), not at one call's sizes
        self.symbolic = traced and symbolic
        # a mixed precision policy (config.Precision; the graph was captured in its param_dtype): exec.precision
        self.precision, self.casts = plan.precision, Casts(plan.precision)
        # gradients left pending (plan.pending: accumulation without sync, a stage-2 sharded optimizer's): a
        # parameter's gradient is not reduced over the mesh dims where the parameter is whole; it leaves pending
        # there (Partial), summed locally by autograd until someone reduces it once. Each parameter's gradient
        # placements, as traced (None: its own).
        self.entries, self.as_dtensor = plan.inputs, plan.returns_dtensor
        self.n_params = sum(e.kind == "param" for e in self.entries)
        self.grad_placements: list[tuple | None] = [None] * self.n_params
        self._any_pending = plan.accumulate or bool(plan.pending_grads)
        self.notes: list[str] = []  # what running it found (Inductor's compile times): explain() shows them
        self.graphs: dict[str, torch.fx.GraphModule] = {}  # the traced per-rank graphs, after the passes
        self.gated = False  # whether its forward graphs wait for a call's agreement themselves (exec.gate)
        self.runners: dict[str, Callable] = {}  # what runs each: the graph itself, or Inductor's code of it
        self.compile_s: dict[str, float] = {}  # seconds Inductor took for each (and a note of it: self.notes)
        self.out_vals = [n.meta["val"] for n in captured.output_nodes]
        # a program for every size of some dims (capture.dynamic): the symbols' values of the running call, from
        # which every value's shape at this call's sizes follows
        self.dynamic = captured.dynamic
        self.bindings: dict = {}
        # (a world of one runs the graph on whole tensors: only DTensor outputs need their sizes)
        self._reads_sizes = self.dynamic is not None and (mesh.size() > 1 or any(self.as_dtensor))
        # the graph's constant tensors (made inside fn, or read from outside it): extra inputs of the traced
        # program, read from their objects at every call
        self.constants = [getattr(captured.gm, n.target) for n in captured.gm.graph.nodes
                          if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)]
        self._written_elsewhere = [k for k in captured.writes if self.entries[k].held != self.entries[k].planned]
        # activation checkpointing: backward computes these regions again (recompute_checkpointed): the user's and
        # those the plan recomputes, each op's region numbered in program order
        self._regions = _regions(captured, plan)
        self._checkpointed = bool(self._regions)
        # the regions recomputed selectively keep what their collectives reduced (no reduction again)
        selective = {name for r in plan.recompute if r.keeps_reduced for name in r.nodes}
        self._keeping_reduced = frozenset(k for node, k in self._regions.items() if node.name in selective)
        self.interpreter = Interpreter(captured, plan, mesh, self.casts, self._regions, self._at_sizes)
        self.node_plans = self.interpreter.node_plans  # each op's decisions
        step = self.whole_step if mesh.size() == 1 else self.local_step  # (one rank: nothing to lay out)
        # a world of one runs the captured graph itself: untraced, with its ops called through torch's bindings
        self._whole_graph = captured.gm if traced or mesh.size() > 1 else direct_calls(captured.gm)
        if traced:  # traced into forward/backward graphs; whether a call can run them directly: after the first
            self._run, self._graph_step = traced_program(self, step), False if self.symbolic else None
        else:
            self._run, self._graph_step = (self.whole_step if mesh.size() == 1 else self.interpreted), False
        # (traced for every size: its trace, whose ``failed`` says why calls run interpreted, if they do)
        self.for_every_size = self._run if self.symbolic else None
        self._locals: list[torch.Tensor] = []
        self.layouts: list = []  # the parameters' layouts as their local tensors were read (parameter_locals)
        self._locals_of: list[DTensor] = []

    def local_step(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """The whole call on this rank's local tensors (then the graph's constants): entry, program, exit."""
        inputs = []
        for i, (x, e) in enumerate(zip(locals_, self.entries)):
            pending = e.kind == "param" and self.plan.pending(e.name)
            record = self.grad_placements if pending else None
            d = _Enter.apply(x, self.mesh, e.held, self._global_shape(i, e), record, i)
            if e.kind != "param" or not self.casts.casts(d, e.kind):
                d = self.casts.used(d, e.kind)
            # entering in another layout: the gradient's pending sums reduced in the planned one, as priced
            inputs.append(d if e.held == e.planned else settled(redistribute(d, e.planned)))
        outs = [self.casts.returned(_Exit.apply(o))
                for o in self.interpreter.run(inputs, list(locals_[len(self.entries):]))]
        for k in self._written_elsewhere:  # updated in place in another layout than the caller's: written back
            locals_[k].copy_(redistribute(inputs[k], self.entries[k].held).to_local())
        return outs

    def whole_step(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """A world of one: the captured graph on the whole tensors, as fn ran at capture (traced into forward and
        backward graphs on a process group, eager in a simulated world). The graph holds torch.autocast's casts
        already; they are not applied twice."""
        n = len(self.entries)
        used = locals_[:n] if self.precision is None else [self.casts.used(x, e.kind)
                                                             for x, e in zip(locals_, self.entries)]
        constants = locals_[n:]
        with contextlib.ExitStack() as stack:
            for device in _AUTOCAST_DEVICES:
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            # an interpreter hands each node's annotations (its region) to the trace, and reads the graph's
            # constant tensors from the step's inputs (traced, they are its inputs, not tensors of the graph)
            if self._checkpointed or constants:
                outs = _ConstantsAsInputs(self.captured.gm, constants, self._regions).run(*used)
            else:
                outs = self._whole_graph.forward(*used)
        return outs if self.precision is None else [self.casts.returned(o) for o in outs]

    # --- sizes that change (capture.dynamic) ------------------------------------------------------------

    def _at_sizes(self, val: Any) -> Any:
        """A node's value as at this call's sizes."""
        return val if self.dynamic is None else self.dynamic.concrete(val, self.bindings)

    def _global_shape(self, i: int, e) -> torch.Size:
        """Input ``i``'s global shape in this call."""
        if self.dynamic is None or i not in self.dynamic.dims:
            return torch.Size(e.shape)
        symbolic = self.captured.placeholders[i].meta["val"].shape
        return torch.Size(self.dynamic.size(s, self.bindings) for s in symbolic)

    def global_shapes(self, args) -> dict[int, tuple[int, ...]]:
        """The global shapes of the inputs with dynamic dims, from the call's arguments (a DTensor's own; a
        plain tensor's held split undone)."""
        shapes = {}
        for i in self.dynamic.dims:
            x, e = args[i], self.entries[i]
            if isinstance(x, DTensor):
                shapes[i] = tuple(x.shape)
                continue
            shape = list(x.shape)
            for m, p in enumerate(e.held):
                if isinstance(p, Shard):
                    shape[p.dim] *= self.mesh.shape[m]
            shapes[i] = tuple(shape)
        return shapes

    def dynamic_rejects(self, args) -> str | None:
        """Why this program does not serve a call with these argument tensors (the graph's inputs after the
        parameters and buffers), or None."""
        n_state = len(self.entries) - len(args)
        bindings = self.dynamic.bindings(self.global_shapes([None] * n_state + list(args)))
        return self.dynamic.rejects(bindings)

    def traced(self, for_every_size: bool) -> ParallelProgram:
        """This program for every size traced into local graphs: once, its dynamic dims as symbols
        (exec.for_every_size; a call whose sizes that trace's guards reject runs interpreted), or at the sizes of
        its first call (real ranks trace a size met again where the former failed: shardfn.call.sizes)."""
        return ParallelProgram(self.captured, self.plan, self.mesh, traced=True, symbolic=for_every_size)

    def interpreted(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """The program interpreted over DTensors (simulated worlds). With gradients, its backward runs inside
        this program too (:class:`_Backward`), where DTensor may take plain tensors as replicated."""
        if torch.is_grad_enabled() and any(x.requires_grad for x in locals_):
            return list(_Backward.apply(self.local_step, *locals_))
        return self.local_step(*locals_)

    def parameter_locals(self, params) -> list[torch.Tensor]:
        """The parameters' local tensors, kept between calls: a parameter updated in place (optimizer steps,
        load_state_dict) keeps its local tensor; a parameter replaced by a new object is read again."""
        cached = self._locals
        if len(cached) != len(params) or any(c is not p for c, p in zip(self._locals_of, params)):
            with torch.no_grad():
                cached[:] = [p.to_local() for p in params]
            self.layouts = [layout_of(p) for p in params]  # a new list: backward passes hold the old one
            self._locals_of[:] = list(params)
        return cached

    def parameter_grads(self, local: list, layouts: list) -> list:
        """The parameters' local gradients as DTensors: in the parameters' layouts, or, accumulating without sync,
        pending (Partial) where the program left them so."""
        out = []
        for i, (g, layout) in enumerate(zip(local, layouts)):
            pending = self.grad_placements[i]
            if g is None:
                out.append(None)
            elif pending is None or pending == tuple(self.entries[i].planned):
                out.append(local_as(layout, g))
            else:
                shape = torch.Size(self.entries[i].shape)
                out.append(DTensor.from_local(g, self.mesh, pending, run_check=False, shape=shape,
                                              stride=global_stride(g, shape, pending, self.mesh)))
        return out


    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        # parameters (first in entries) have the layout the plan gave them: their layouts are known
        n_params = self.n_params
        if self._reads_sizes:  # the symbols' values in this call (a traced program: the ones it holds)
            self.bindings = self.dynamic.bindings(self.global_shapes(args))
        if self._graph_step is None and "backward" in self.graphs:
            self._graph_step = direct_graphs(self)
        if self._graph_step and torch.is_grad_enabled() and not any(
                isinstance(a, DTensor) for a in args[n_params:]):
            outs = GraphStep.apply(self, *args)
            return [from_local(o, self.mesh, self.plan.outputs[k], self._at_sizes(v)) if self.as_dtensor[k] else o
                    for k, (o, v) in enumerate(zip(outs, self.out_vals))]
        locals_ = list(args)
        if n_params and torch.is_grad_enabled():
            locals_[:n_params] = _ParamLocals.apply(self, *args[:n_params]) \
                if self._any_pending else LocalsOf.apply(*args[:n_params])
        elif n_params:  # no gradients to route back: the local tensors themselves
            locals_[:n_params] = self.parameter_locals(args[:n_params])
        dtensor_pos = [i for i in range(n_params, len(args)) if isinstance(args[i], DTensor)]
        if dtensor_pos:
            picked = [args[i] for i in dtensor_pos]
            for i, t in zip(dtensor_pos, LocalsOf.apply(*picked)):
                locals_[i] = t
        # backward formulas may make plain tensors of a DTensor's global shape (zeros of sgn's gradient, the
        # factories of cumprod's): whole values, which DTensor takes as replicated here
        with implicit_replication():
            outs = self._run(*locals_, *self.constants)
        return [
            from_local(o, self.mesh, self.plan.outputs[k], self._at_sizes(v)) if self.as_dtensor[k] else o
            for k, (o, v) in enumerate(zip(outs, self.out_vals))
        ]


class _ConstantsAsInputs(torch.fx.Interpreter):
    """Runs a captured graph with its constant tensors (get_attr nodes of a tensor value, in graph order) taken
    from ``constants``, as :class:`ParallelProgram` passes them (so AOTAutograd traces them as inputs)."""

    def __init__(self, gm: torch.fx.GraphModule, constants, regions: dict | None = None):
        super().__init__(gm)
        self.constants = iter(constants)
        self.regions = regions or {}  # each op's checkpoint region (ParallelProgram._regions)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
            return next(self.constants)
        region = self.regions.get(n)
        if region is None:
            return super().run_node(n)
        with self._set_current_node(n), in_region(region):  # (as Interpreter.run_node, in the node's region)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return getattr(self, n.op)(n.target, args, kwargs)




class _Enter(torch.autograd.Function):
    """This rank's piece of an input as a DTensor in the layout it arrives in. Its gradient goes back in that layout
    with pending sums reduced (as DTensor.from_local's does), also when a backward formula made it a plain tensor
    of the global shape (sgn's zeros): a whole value, of which this rank keeps its piece.

    With ``record`` (a parameter in a program that accumulates without sync, or one whose gradient a stage-2
    sharded optimizer reduce-scatters itself), its gradient goes back pending (Partial) over the mesh dims where
    the parameter is whole, resolved only where it is split (a sharded parameter's gradient is reduce-scattered as
    ever, never held whole); the placements it goes back in are noted in ``record[i]`` while the program is traced
    (the same on every later call)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape, record, i):
        ctx.mesh, ctx.placements, ctx.dtype = mesh, gradient_placements(placements), local.dtype
        ctx.record, ctx.i = record, i
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=global_stride(local, shape, placements, mesh))

    @staticmethod
    def backward(ctx, grad):
        grad = as_dtensor(grad, ctx.mesh, ctx.placements)
        target = ctx.placements
        if ctx.record is not None:
            target = tuple(g if g.is_partial() and p.is_replicate() else p for g, p in zip(grad.placements, target))
            ctx.record[ctx.i] = target
        if tuple(grad.placements) != target:
            grad = redistributed(grad, target)
        return grad.to_local().to(ctx.dtype), None, None, None, None, None


class _Exit(torch.autograd.Function):
    """An output's piece on this rank (``to_local()``), whose gradient goes back as a DTensor of the output's global
    shape and strides in the piece's order. DTensor's own to_local backward scales the piece's strides by the mesh
    size, which for uneven pieces is no tensor's of that shape, and differs on the rank with an empty piece (a
    per-rank size in a simulated world, where reading it fails: a circular pad's output split 9 ways in 4)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mesh, ctx.placements, ctx.shape = x.device_mesh, gradient_placements(x.placements), x.shape
        local = local_of(x)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape,
                                  stride=global_stride(grad, ctx.shape, ctx.placements, ctx.mesh))






class _ParamLocals(torch.autograd.Function):
    """:class:`LocalsOf` for the parameters of a program that accumulates without sync: their gradients go back
    as the program left them (:meth:`ParallelProgram.parameter_grads`)."""

    @staticmethod
    def forward(ctx, program, *params: DTensor):
        ctx.program, ctx.layouts = program, [layout_of(p) for p in params]
        return tuple(local_of(p).detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.program.parameter_grads(list(grads), ctx.layouts))


class _Backward(torch.autograd.Function):
    """``step(*inputs)`` run under autograd inside one node, whose backward differentiates it (the graph kept
    from forward) under DTensor's implicit replication."""

    @staticmethod
    def forward(ctx, step, *inputs):
        # an output nothing read (a model's logits or cache beside its loss) gets no gradient, not zeros that
        # would run back through the program, summed with the real ones as DTensors
        ctx.set_materialize_grads(False)
        with torch.enable_grad():
            ctx.inputs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
            ctx.outputs = step(*ctx.inputs)
        return tuple(o.detach() for o in ctx.outputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.inputs, ctx.outputs
        ctx.inputs = ctx.outputs = None
        wanted = [x for x in inputs if x.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        found = iter([None] * len(wanted))
        if pairs and wanted:
            with implicit_replication():
                found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                                 allow_unused=True))
        return (None, *(next(found) if x.requires_grad else None for x in inputs))


class GraphStep(torch.autograd.Function):
    """One cached call with gradients, run on the traced graphs without AOTAutograd's runtime wrapper: DTensor
    parameters in (their local tensors fed to the forward graph), backward graph out, parameter gradients wrapped
    as DTensors in the parameters' layouts. Saves the per-call bookkeeping of two autograd nodes."""

    @staticmethod
    def forward(ctx, program: ParallelProgram, *args):
        n_params = program.n_params
        out = program.runners["forward"]([*program.parameter_locals(args[:n_params]), *args[n_params:],
                                          *program.constants])
        n_out = len(program.out_vals)
        ctx.save_for_backward(*out[n_out:])
        ctx.program, ctx.layouts, ctx.n_args = program, program.layouts, len(args)
        return tuple(out[:n_out])

    @staticmethod
    def backward(ctx, *grads):
        program = ctx.program
        inputs = [*ctx.saved_tensors, *(g.contiguous() for g in grads)]
        release_saved(ctx)  # the graph frees each saved tensor after its last use
        local = program.runners["backward"](inputs)
        wrapped = program.parameter_grads(local[:len(ctx.layouts)], ctx.layouts)
        return (None, *wrapped, *local[len(wrapped):ctx.n_args])


def lower(captured: CapturedGraph, plan: Plan, mesh: DeviceMesh) -> ParallelProgram:
    """The program that runs ``plan`` (made for ``captured``) on this rank of ``mesh``. On real process groups
    it is traced into local forward/backward graphs on its first call; in a simulated world, and for a program
    for every size (whose traced graphs would hold one size), it is interpreted over DTensors on every call
    (``ParallelProgram.traced``: one traced for every size, or at the sizes of a call)."""
    keep_linalg_error_checks()
    traced = local_tensor_mode() is None and captured.dynamic is None
    return ParallelProgram(captured, plan, mesh, traced)


def _regions(captured: CapturedGraph, plan: Plan) -> dict[torch.fx.Node, int]:
    """Each op's activation-checkpoint region: one the user checkpointed (torch.utils.checkpoint), or one the plan
    recomputes (``plan.recompute``: its ops by name), numbered in program order as the partitioner wants them (the
    value leaving a region for the next is kept, not computed again): by the region's last op read, since graph
    order may hoist a layer's ops on inputs alone (a mask) ahead of earlier layers."""
    chosen = {name: r.region for r in plan.recompute for name in r.nodes}
    keys: dict[torch.fx.Node, Any] = {}
    last: dict[Any, int] = {}
    for i, node in enumerate(captured.gm.graph.nodes):
        user = checkpoint_region(node)
        if user is not None:
            keys[node] = ("checkpoint", user)
        elif node.name in chosen and node.op == "call_function":
            keys[node] = ("plan", chosen[node.name])
        if node in keys and node.users:  # (an unread item of a multi-output op may trail the graph)
            last[keys[node]] = i
    numbers = {key: k + 1 for k, key in enumerate(sorted(set(keys.values()), key=lambda k: last.get(k, -1)))}
    return {node: numbers[key] for node, key in keys.items()}


