"""Plan -> ParallelProgram: the per-rank program that runs the captured graph as planned.

The program is a function of plain local tensors (:meth:`ParallelProgram.local_step`): it wraps each input as a
DTensor in the layout the caller holds it in and lays it out as planned, interprets the captured graph over
DTensors (before each node every tensor input is redistributed to the placement the plan chose for it, the
node runs through DTensor's dispatch or, for shardfn's own and fallback rules, on local shards, and its result
is put in the planned placement), and returns the local tensors of the results. On a real process group that
function is traced once by AOTAutograd into per-rank local forward and backward aten graphs with functional
collectives (``program.graphs``), so a call runs two flat graphs, not Python per op. Inside a simulated world
(LocalTensorMode) it runs eagerly under autograd. With SHARDFN_COMPILE (on CUDA by default) Inductor compiles those
graphs, collectives included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import Shard

from .._simulation_internals import local_tensor_mode
from ..capture.graph import CapturedGraph, checkpoint_region, is_getitem, is_in_place, is_view
from ._dtensor_internals import is_masked_sum, layout_of, local_as, local_of
from ._graph_internals import (annotated_as, boxed_graph, in_region, keep_linalg_error_checks, keeping_annotations,
                               release_saved)
from ._inductor_internals import compile_graph
from ._inductor_internals import decompositions as inductor_decompositions
from ..strategy_search.plan import NodePlan, Plan
from .direct_calls import direct_calls
from .passes import recompute_checkpointed, regather_in_backward, simplify
from .pieces import (VIEW_CALLS, as_dtensor, conform, contiguous, from_local, gradient_placements, local_piece,
                     map_leaves, piece_shape, placed, redistribute, runs_on_pieces, settled, view_of_piece,
                     view_on_pieces)
from .run import LocalsOf, global_stride

__all__ = ["ParallelProgram", "lower", "use_inductor"]

aten = torch.ops.aten
_log = logging.getLogger("shardfn")
_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def use_inductor(device_type: str) -> bool:
    """SHARDFN_COMPILE: compile the per-rank graphs with Inductor. "auto" (the default): on CUDA, where fused
    kernels pay for the compile time; off on the CPU, where a first call would wait tens of seconds for C++
    builds. "1" always, "0" never."""
    setting = os.environ.get("SHARDFN_COMPILE", "auto").lower()
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"SHARDFN_COMPILE must be auto, 0 or 1, got {setting!r}")
    return device_type == "cuda" if setting == "auto" else setting == "1"


def _in_traced_strides(boxed: Callable, example_inputs: list) -> Callable:
    """Inductor's code assumes the strides its graph was traced with; a call's signature does not fix strides
    (a transposed input of the same shape is the same signature), so inputs laid out otherwise are copied into
    the traced strides first (a write into an input still lands: AOTAutograd copies it back to the caller's)."""
    strides = [tuple(e.stride()) if isinstance(e, torch.Tensor) else None for e in example_inputs]

    def run(args: list) -> Any:
        for i, (a, stride) in enumerate(zip(args, strides)):
            if stride is not None and isinstance(a, torch.Tensor) and a.stride() != stride:
                args[i] = torch.empty_strided(a.shape, stride, dtype=a.dtype, device=a.device).copy_(a)
        return boxed(args)

    run._boxed_call = True  # AOTAutograd's calling convention: one list, which the callee may clear
    return run


def _saying_where(run: Callable, program: str, graph: str) -> Callable:
    """``run`` (a boxed graph; ``.graph``: the graph it runs, where it has one) whose errors also say which sharded
    callable's graph raised them, in which of its calls on this rank: a collective that times out names only its
    transport's source line, and each rank prints its own, so ranks stuck in different calls (or in one) show in
    their reports."""
    calls = 0

    def saying(args: list) -> Any:
        nonlocal calls
        calls += 1
        try:
            return run(args)
        except Exception as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
                e.add_note(f"shardfn: {rank}raised in the {graph} graph of {program}, its call {calls} here")
            raise

    saying._boxed_call, saying.graph = True, getattr(run, "graph", None)
    return saying


class ParallelProgram:
    """Callable on the graph inputs as the caller holds them (DTensor parameters, whole tensors, batch slices,
    DTensors, in the order of ``plan.inputs``); returns the flat tensor outputs: DTensors where
    ``plan.returns_dtensor`` says so, else plain local tensors (a whole value, or this rank's batch slice)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, mesh: DeviceMesh, traced: bool):
        self.captured, self.plan, self.mesh, self.name = captured, plan, mesh, plan.name
        # a mixed precision policy (config.Precision): floating parameters and inputs enter in its param_dtype (the
        # graph was captured so), parameters' gradients are reduced in its reduce_dtype, outputs leave in its
        # output_dtype
        self.precision = plan.precision
        # gradients left pending (plan.pending: accumulation without sync, a stage-2 sharded optimizer's): a
        # parameter's gradient is not reduced over the mesh dims where the parameter is whole; it leaves pending
        # there (Partial), summed locally by autograd until someone reduces it once. Each parameter's gradient
        # placements, as traced (None: its own).
        self.entries, self.as_dtensor = plan.inputs, plan.returns_dtensor
        self.n_params = sum(e.kind == "param" for e in self.entries)
        self.grad_placements: list[tuple | None] = [None] * self.n_params
        self._any_pending = plan.accumulate or bool(plan.pending_grads)
        # each op's decisions; the ops run as they are (no decisions): getitems, and a program for every size's
        # size computations (sym_size: numbers, not tensors)
        self.node_plans, self._as_is = _node_plans(captured.gm.graph, plan)
        self.notes: list[str] = []  # what running it found (Inductor's compile times): explain() shows them
        self.graphs: dict[str, torch.fx.GraphModule] = {}  # the traced per-rank graphs, after the passes
        self.runners: dict[str, Callable] = {}  # what runs each: the graph itself, or Inductor's code of it
        self.compile_s: dict[str, float] = {}  # seconds Inductor took for each (and a note of it: self.notes)
        self.out_vals = [n.meta["val"] for n in captured.output_nodes]
        # a program for every size of some dims (capture.dynamic): the symbols' values of the running call, from
        # which every value's shape at this call's sizes follows
        self.dynamic = captured.dynamic
        self._bindings: dict = {}
        # (a world of one runs the graph on whole tensors: only DTensor outputs need their sizes)
        self._reads_sizes = self.dynamic is not None and (mesh.size() > 1 or any(self.as_dtensor))
        # the graph's constant tensors (made inside fn, or read from outside it): extra inputs of the traced
        # program, read from their objects at every call
        self.constants = [getattr(captured.gm, n.target) for n in captured.gm.graph.nodes
                          if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)]
        # a mixed precision policy casts each parameter where an op reads it (after the program entered it in its
        # own dtype), so that a gradient is cast to reduce_dtype before any reduction of it: the ids of this
        # call's parameters as the program entered them (interpret)
        self._cast_where_read: set[int] = set()
        self._written_elsewhere = [k for k in captured.writes if self.entries[k].held != self.entries[k].planned]
        self._written = {n.args[0] for n in captured.gm.graph.nodes if is_in_place(n.target)}
        # activation checkpointing: backward computes these regions again (recompute_checkpointed): the user's and
        # those the plan recomputes, each op's region numbered in program order
        self._regions = _regions(captured, plan)
        self._checkpointed = bool(self._regions)
        # one rank holds everything: the captured graph itself runs, with nothing to lay out
        step = self.whole_step if mesh.size() == 1 else self.local_step
        # a world of one runs the captured graph itself: untraced, with its ops called through torch's bindings
        self._whole_graph = captured.gm if traced or mesh.size() > 1 else direct_calls(captured.gm)
        if traced:  # traced into forward/backward graphs; whether a call can run them directly: after the first
            self._run, self._graph_step = self._compile(step), None
        else:
            self._run, self._graph_step = (self.whole_step if mesh.size() == 1 else self._interpreted), False
        self._locals: list[torch.Tensor] = []
        self.layouts: list = []  # the parameters' layouts as their local tensors were read (parameter_locals)
        self._locals_of: list[DTensor] = []
        self._on_pieces = True  # (off while AOTAutograd traces the per-rank graphs: _compile)
        self._shared: dict | None = None  # (interpret)
        self._layouts_now: dict | None = None
        # DTensor keeps a masked sum's mask in one buffer that every equal placement shares (and compares a new mask
        # with the one it holds: on real ranks a data-dependent read while tracing): two gathers from one split
        # table left pending at once would share it, so each is reduced as soon as its op made it
        self._masked = {n for n, np_ in self.node_plans.items()
                        if any(is_masked_sum(p) for pl in np_.outputs if pl for p in pl)}
        self._piecewise = {n for n, np_ in self.node_plans.items()
                           if np_.rule == "dtensor" and runs_on_pieces(n, np_.inputs, np_.outputs)}
        # views run on pieces; not where the graph writes in place (a write through a view must reach its base
        # through autograd's view tracking, which a piece's view run apart from its DTensor does not keep)
        self._piece_views = set() if self._written else {
            n for n, np_ in self.node_plans.items()
            if np_.rule == "dtensor" and view_on_pieces(n, np_.inputs, np_.outputs)}

    # --- interpretation -----------------------------------------------------------------------------------

    def _run_node(self, node: torch.fx.Node, env: dict) -> Any:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        if node in self._as_is:  # one output of a multi-output node, or a number: as it is
            return node.target(*args, **kwargs)
        # its checkpoint region, for the partitioner (recompute_checkpointed)
        with annotated_as(node, self._regions.get(node)):
            out = self._compute(node, args, kwargs)
            if node in self._masked:
                out = _masks_reduced(out)
            return self._settled_result(node, out)

    def _settled_result(self, node: torch.fx.Node, out: Any) -> Any:
        # a view hands its gradient's pending sum on to the value it views, which sums it with its other readers'
        # and resolves it once; a result a later op writes into stays as autograd made it
        if node.target in VIEW_CALLS or is_view(node.target) or node in self._written:
            return out
        return type(out)(settled(o) for o in out) if isinstance(out, (tuple, list)) else settled(out)

    def _compute(self, node: torch.fx.Node, args, kwargs) -> Any:
        """``node``'s result, its inputs laid out as planned and the result put in its planned placement."""
        np_ = self.node_plans[node]
        leaves: list[torch.Tensor] = []  # the tensor operands, in pytree's order (the plan's)

        def laid_out(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            slot = len(leaves)
            if id(leaf) in self._cast_where_read and self._cast(leaf, "param"):
                leaf = self._read_as_used(leaf, np_.inputs[slot])
            else:
                leaf = placed(leaf, np_.inputs[slot], self.mesh)
            leaves.append(leaf)
            return leaf

        args, kwargs = map_leaves(laid_out, (args, kwargs))
        val = self._at_sizes(node.meta.get("val"))
        if node.target in VIEW_CALLS:
            args = (contiguous(args[0]), *args[1:])

        if np_.rule == "factory":
            return placed(node.target(*args, **kwargs), np_.outputs[0], self.mesh)
        if np_.rule == "random":
            shape_of = args[0]
            whole = torch.empty(shape_of.shape, dtype=shape_of.dtype, device=self.mesh.device_type)
            return placed(node.target(whole, *args[1:], **kwargs), np_.outputs[0], self.mesh)
        if self._on_pieces and node in self._piece_views:
            out = view_of_piece(node, args, kwargs, np_, val, self.mesh)
            if out is not None:
                return out
        # on the pieces where they are even (uneven ones: DTensor's way, which keeps each rank's shapes apart)
        on_pieces = self._on_pieces and node in self._piecewise and all(
            piece_shape(t.shape, t.placements, self.mesh) is not None for t in leaves if isinstance(t, DTensor)) \
            and all(piece_shape(v.shape, p, self.mesh) is not None
                    for v, p in zip(val if isinstance(val, (tuple, list)) else [val], np_.outputs))
        if np_.rule == "local" or on_pieces:
            piece = local_piece(np_.outputs, self._shared)
            local_args, local_kwargs = map_leaves(lambda a: piece(a) if isinstance(a, DTensor) else a,
                                                   (args, kwargs))
            out = node.target(*local_args, **local_kwargs)
            if isinstance(out, torch.Tensor):
                return from_local(out, self.mesh, np_.outputs[0], val, self._layouts_now)
            if not isinstance(out, (tuple, list)):  # None, or a Python value (an op run for its checks)
                return out
            return type(out)(
                from_local(o, self.mesh, p, v, self._layouts_now) if isinstance(o, torch.Tensor) and p is not None
                else o
                for o, p, v in zip(out, np_.outputs, val)
            )
        out = node.target(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(conform(o, p) for o, p in zip(out, np_.outputs))
        return conform(out, np_.outputs[0])


    def interpret(self, inputs: list[DTensor], constants: list[torch.Tensor]) -> list[Any]:
        # the pieces of this call's values, shared by their readers (not where the graph writes in place: a
        # value written is read afterwards through its new autograd history)
        self._shared = None if self._written or not self._on_pieces else {}
        self._layouts_now = {} if self._on_pieces else None  # the layouts of this call's values (from_local)
        try:
            return self._interpret(inputs, constants)
        finally:
            self._shared = self._layouts_now = None

    def _interpret(self, inputs: list[DTensor], constants: list[torch.Tensor]) -> list[Any]:
        env: dict[torch.fx.Node, Any] = {}
        it, consts = iter(inputs), iter(constants)
        if self.precision is not None:
            self._cast_where_read = {id(x) for x in inputs[:self.n_params]}
        for node in self.captured.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "call_function":
                env[node] = self._run_node(node, env)
            elif node.op == "get_attr":
                env[node] = next(consts) if isinstance(node.meta.get("val"), torch.Tensor) else \
                    getattr(self.captured.gm, node.target)
            elif node.op == "output":
                return [conform(placed(env[o], p, self.mesh), p) for o, p in zip(node.args[0], self.plan.outputs)]
        raise AssertionError("graph has no output node")

    def local_step(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """The whole call on this rank's local tensors (then the graph's constants): entry, program, exit."""
        inputs = []
        for i, (x, e) in enumerate(zip(locals_, self.entries)):
            pending = e.kind == "param" and self.plan.pending(e.name)
            record = self.grad_placements if pending else None
            d = _Enter.apply(x, self.mesh, e.held, self._global_shape(i, e), record, i)
            if e.kind != "param" or not self._cast(d, e.kind):
                d = self._used(d, e.kind)
            inputs.append(d if e.held == e.planned else redistribute(d, e.planned))
        outs = [self._returned(_Exit.apply(o)) for o in self.interpret(inputs, list(locals_[len(self.entries):]))]
        for k in self._written_elsewhere:  # updated in place in another layout than the caller's: written back
            locals_[k].copy_(redistribute(inputs[k], self.entries[k].held).to_local())
        return outs

    def whole_step(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """A world of one: the captured graph on the whole tensors, as fn ran at capture (traced into forward and
        backward graphs on a process group, eager in a simulated world). The graph holds torch.autocast's casts
        already; they are not applied twice."""
        n = len(self.entries)
        used = locals_[:n] if self.precision is None else [self._used(x, e.kind) for x, e in zip(locals_, self.entries)]
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
        return outs if self.precision is None else [self._returned(o) for o in outs]

    # --- sizes that change (capture.dynamic) ------------------------------------------------------------

    def _at_sizes(self, val: Any) -> Any:
        """A node's value as at this call's sizes."""
        return val if self.dynamic is None else self.dynamic.concrete(val, self._bindings)

    def _global_shape(self, i: int, e) -> torch.Size:
        """Input ``i``'s global shape in this call."""
        if self.dynamic is None or i not in self.dynamic.dims:
            return torch.Size(e.shape)
        symbolic = self.captured.placeholders[i].meta["val"].shape
        return torch.Size(self.dynamic.size(s, self._bindings) for s in symbolic)

    def _global_shapes(self, args) -> dict[int, tuple[int, ...]]:
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
        bindings = self.dynamic.bindings(self._global_shapes([None] * n_state + list(args)))
        return self.dynamic.rejects(bindings)

    def traced_at_these_sizes(self) -> ParallelProgram:
        """This program for every size, traced into local graphs at the sizes of its first call (real ranks
        trace a size met again: shardfn.programs)."""
        return ParallelProgram(self.captured, self.plan, self.mesh, traced=True)

    def _used(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """A floating parameter or input as the program uses it (mixed precision: in param_dtype; a parameter's
        gradient then goes back through reduce_dtype, in which it is reduced)."""
        p = self.precision
        if not self._cast(x, kind):
            return x
        if kind == "param":
            return _UsedAs.apply(x, p.param_dtype, p.reduce_dtype or p.param_dtype)
        return x.to(p.param_dtype)

    def _cast(self, x: torch.Tensor, kind: str) -> bool:
        """Whether a mixed precision policy casts this parameter or input."""
        p = self.precision
        return not (p is None or p.param_dtype is None or kind == "buffer" or not x.dtype.is_floating_point
                    or x.dtype == p.param_dtype)

    def _read_as_used(self, x: DTensor, placements) -> DTensor:
        """A parameter as an op reads it under a mixed precision policy: cast to param_dtype, then laid out as the
        op reads it (a level-1 parameter gathered in param_dtype); its gradient goes back cast to reduce_dtype
        first, then reduced (the gather's reduce-scatter in reduce_dtype, as FSDP2's)."""
        p = self.precision
        target = tuple(Replicate() if q.is_partial() and not c.is_partial() else q
                       for c, q in zip(x.placements, placements))
        if target == tuple(x.placements):
            return _UsedAs.apply(x, p.param_dtype, p.reduce_dtype or p.param_dtype)
        return _LaidOutAs.apply(x, target, p.param_dtype, p.reduce_dtype or p.param_dtype)

    def _returned(self, out: Any) -> Any:
        p = self.precision
        if p is None or p.output_dtype is None or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point():
            return out
        return out.to(p.output_dtype)

    def _interpreted(self, *locals_: torch.Tensor) -> list[torch.Tensor]:
        """The program interpreted over DTensors (simulated worlds). With gradients, its backward runs inside
        this program too (:class:`_Backward`), where DTensor may take plain tensors as replicated."""
        if torch.is_grad_enabled() and any(x.requires_grad for x in locals_):
            return list(_Backward.apply(self.local_step, *locals_))
        return self.local_step(*locals_)

    # --- compilation --------------------------------------------------------------------------------------

    def _compile(self, step: Callable) -> Callable:
        from functorch.compile import aot_function, min_cut_rematerialization_partition

        inductor = use_inductor(self.mesh.device_type)

        def keep(name):
            def compiler(gm: torch.fx.GraphModule, example_inputs):
                # Inductor plans its own buffers: the graph it gets stays functional (no in-place rewrites);
                # gloo runs one collective at a time (passes._one_in_flight)
                self.graphs[name] = simplify(gm, in_place=not inductor,
                                             one_in_flight=self.mesh.device_type == "cpu")
                if not inductor:
                    self.runners[name] = _saying_where(boxed_graph(direct_calls(self.graphs[name])), self.name,
                                                       name)
                    return self.runners[name]
                start = time.perf_counter()
                code, cached = compile_graph(gm, example_inputs)
                boxed = _in_traced_strides(code, example_inputs)
                self.compile_s[name] = time.perf_counter() - start
                done = f"loaded the {name} graph from its cache" if cached else f"compiled the {name} graph"
                _log.info("shardfn: Inductor %s in %.1f s", done, self.compile_s[name])
                self.notes.append(f"Inductor {done} in {self.compile_s[name]:.1f} s (first call of this signature)")
                self.runners[name] = _saying_where(boxed, self.name, name)
                return self.runners[name]

            return compiler

        # the min-cut partitioner saves what the default one recomputes (the CPU flash-attention forward)
        # Inductor lowers only the ops its decompositions leave (as under torch.compile)
        decompositions = inductor_decompositions() if inductor else None
        def partition(joint, joint_inputs, **kwargs):
            if self.plan.reshard_after_forward:
                joint = regather_in_backward(joint, self.n_params)
            if self._checkpointed:
                joint = recompute_checkpointed(joint)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def traced(*args):  # the nodes traced keep their checkpoint regions
            with keeping_annotations():
                return step(*args)

        def through_dtensor(*args):
            # the traced per-rank graphs are DTensor's dispatch as traced (their collectives and strides as
            # proven on every release); ops on pieces are for the interpreted calls, which pay DTensor's
            # propagation on every call
            self._on_pieces = False
            try:
                return (traced if self._checkpointed else step)(*args)
            finally:
                self._on_pieces = True

        return aot_function(through_dtensor, fw_compiler=keep("forward"),
                            bw_compiler=keep("backward"), inference_compiler=keep("forward"),
                            partition_fn=partition, decompositions=decompositions)

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
                                              stride=global_stride(g, shape)))
        return out

    def _direct_graphs(self) -> bool:
        """After the first traced call: can a call run the forward/backward graphs itself (:class:`GraphStep`)?

        Yes when the graphs have the plain shape AOTAutograd gives a functional program: forward returns the
        outputs then the values saved for backward, backward takes those values then one gradient per output and
        returns one gradient per input. Anything else (aliased outputs, non-float outputs) keeps AOT's runtime.
        """
        fw, bw = self.graphs.get("forward"), self.graphs.get("backward")
        if fw is None or bw is None or not all(v.is_floating_point() for v in self.out_vals):
            return False
        fw_in = [n for n in fw.graph.nodes if n.op == "placeholder"]
        fw_out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        bw_in = [n.name for n in bw.graph.nodes if n.op == "placeholder"]
        bw_out = next(n for n in bw.graph.nodes if n.op == "output").args[0]
        n_out, n_saved = len(self.out_vals), len(fw_out) - len(self.out_vals)
        tangents = [name for name in bw_in if name.startswith("tangents")]
        return (len(fw_in) == len(self.entries) + len(self.constants) and len(tangents) == n_out
                and bw_in[n_saved:] == tangents
                and len(bw_in) == n_saved + n_out and len(bw_out) == len(fw_in))

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        # parameters (first in entries) have the layout the plan gave them: their layouts are known
        n_params = self.n_params
        if self._reads_sizes:  # the symbols' values in this call (a traced program: the ones it holds)
            self._bindings = self.dynamic.bindings(self._global_shapes(args))
        if self._graph_step is None and "backward" in self.graphs:
            self._graph_step = self._direct_graphs()
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


def _masks_reduced(out: Any) -> Any:
    """``out`` with each masked pending sum reduced (whole where it was pending)."""
    def reduced(o):
        if not isinstance(o, DTensor) or not any(is_masked_sum(p) for p in o.placements):
            return o
        return redistribute(o, tuple(Replicate() if is_masked_sum(p) else p for p in o.placements))

    return type(out)(reduced(o) for o in out) if isinstance(out, (tuple, list)) else reduced(out)


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
                                  stride=global_stride(local, shape))

    @staticmethod
    def backward(ctx, grad):
        grad = as_dtensor(grad, ctx.mesh, ctx.placements)
        target = ctx.placements
        if ctx.record is not None:
            target = tuple(g if g.is_partial() and p.is_replicate() else p for g, p in zip(grad.placements, target))
            ctx.record[ctx.i] = target
        if tuple(grad.placements) != target:
            grad = grad.redistribute(ctx.mesh, target)
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
                                  stride=global_stride(grad, ctx.shape))


class _UsedAs(torch.autograd.Function):
    """A parameter cast to the dtype the program uses it in (mixed precision); its gradient goes back in
    ``reduce_dtype``, pending sums included, so the reduction where the parameter entered runs in that dtype."""

    @staticmethod
    def forward(ctx, x, dtype, reduce_dtype):
        ctx.reduce_dtype = reduce_dtype
        return x.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.reduce_dtype), None, None


class _LaidOutAs(torch.autograd.Function):
    """A parameter cast to ``dtype`` and redistributed to ``placements`` (a level-1 parameter gathered in
    param_dtype); its gradient goes back the other way: cast to ``reduce_dtype``, then redistributed (the gather's
    reduce-scatter in reduce_dtype). One node for both: between two, autograd would cast the gradient back to the
    dtype of the value between them."""

    @staticmethod
    def forward(ctx, x, placements, dtype, reduce_dtype):
        ctx.mesh, ctx.reduce_dtype = x.device_mesh, reduce_dtype
        ctx.held, ctx.placements = gradient_placements(x.placements), gradient_placements(placements)
        return contiguous(x.to(dtype)).redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        grad = contiguous(as_dtensor(grad, ctx.mesh, ctx.placements).to(ctx.reduce_dtype))
        return contiguous(grad.redistribute(ctx.mesh, ctx.held)), None, None, None


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
    (``ParallelProgram.traced_at_these_sizes``: one traced at the sizes of a call)."""
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


def _node_plans(graph: torch.fx.Graph, plan: Plan) -> tuple[dict[torch.fx.Node, NodePlan], set[torch.fx.Node]]:
    """The plan's decisions by the graph's own nodes, resolved once, and the ops that run as they are: a
    getitem (one output of a multi-output op) and an op with no tensor value (a size computed from the
    symbols of a program for every size: the search planned the graph at its sizes, without them). Every other
    op has decisions; a plan made for another graph is refused by name."""
    found, as_is, missing = {}, set(), []
    for node in graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        if node.name in plan.nodes and not is_getitem(node):
            found[node] = plan.nodes[node.name]
        elif node.op == "call_function":
            val = node.meta.get("val")
            tensors = any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (tuple, list)) else [val]))
            if is_getitem(node) or not tensors:
                as_is.add(node)
            else:
                missing.append(node.name)
    if missing:
        raise ValueError(f"{plan.name}: the plan has no decisions for {len(missing)} of the graph's ops "
                         f"({', '.join(missing[:5])}): it was made for another graph")
    return found, as_is
