"""A program's step traced into per-rank forward and backward graphs (AOTAutograd), cleaned up (exec.passes) and
compiled by Inductor where SHARDFN_COMPILE says; and whether a call can run those graphs itself."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx

from ..strategy_search.buckets import bucket_unit
from ._graph_internals import boxed_graph, keeping_annotations
from ._inductor_internals import compile_graph
from ._inductor_internals import decompositions as inductor_decompositions
from .direct_calls import direct_calls
from .for_every_size import ForEverySize
from .gate import gate
from .passes import keep_pieces, recompute_checkpointed, regather_in_backward, restore_replayable, simplify
from .replay import replayed

__all__ = ["direct_graphs", "traced_program", "use_inductor"]

_log = logging.getLogger("shardfn")


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


def traced_program(program, step: Callable) -> Callable:
    """``step`` traced by AOTAutograd into this rank's forward and backward graphs (``program.graphs``), run
    by Inductor's code of them where SHARDFN_COMPILE says, else by the graphs themselves."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    inductor = use_inductor(program.mesh.device_type)

    def keep(name, inference=False):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            # Inductor plans its own buffers: the graph it gets stays functional (no in-place rewrites);
            # gloo runs one collective at a time (passes._one_in_flight)
            # a backward graph's gradient buckets are checked against the plan's (passes.check_buckets), but for
            # a program for every size traced at other sizes than its plan's (an input's gradient's bytes differ)
            planned = name == "backward" and getattr(program.captured, "dynamic", None) is None
            program.graphs[name] = simplify(restore_replayable(gm), in_place=not inductor,
                                         one_in_flight=program.mesh.device_type == "cpu",
                                         plan=program.plan if planned else None,
                                         n_params=program.n_params if name == "forward" else 0,
                                         units=[bucket_unit(e.name) for e in program.entries if e.kind == "param"])
            if not inductor:
                if name == "forward":  # a cached call's agreement may still be in flight up to here (exec.gate)
                    program.graphs[name], program.gated = gate(program.graphs[name]), True
                program.runners[name] = _saying_where(boxed_graph(direct_calls(program.graphs[name])), program.name,
                                                   name)
                return program.runners[name]
            start = time.perf_counter()
            code, cached = compile_graph(gm, example_inputs)
            boxed = _in_traced_strides(code, example_inputs)
            if inference and program.mesh.size() == 1:  # (a world of one: no collectives to capture)
                boxed = replayed(boxed, program.graphs[name], program.mesh.device_type, note=program.notes.append)
            program.compile_s[name] = time.perf_counter() - start
            done = f"loaded the {name} graph from its cache" if cached else f"compiled the {name} graph"
            _log.info("shardfn: Inductor %s in %.1f s", done, program.compile_s[name])
            program.notes.append(f"Inductor {done} in {program.compile_s[name]:.1f} s (first call of this signature)")
            program.runners[name] = _saying_where(boxed, program.name, name)
            return program.runners[name]

        return compiler

    # the min-cut partitioner saves what the default one recomputes (the CPU flash-attention forward)
    # Inductor lowers only the ops its decompositions leave (as under torch.compile)
    decompositions = inductor_decompositions() if inductor else None
    made_whole = any(n.run == "whole" for n in program.plan.nodes.values())

    def partition(joint, joint_inputs, **kwargs):
        if made_whole:
            joint = keep_pieces(joint)
        if program.plan.reshard_after_forward:
            joint = regather_in_backward(joint, program.n_params)
        if program._checkpointed:
            joint = recompute_checkpointed(joint, program.n_params, program._keeping_reduced)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def traced(*args):  # the nodes traced keep their checkpoint regions
        with keeping_annotations():
            return step(*args)

    def per_rank(*args):
        # at one call's sizes the traced graphs are DTensor's dispatch as traced (their collectives and strides
        # as proven on every release); for every size, the ops on pieces of the interpreted calls, their sizes
        # computed inside the trace from the capture's symbols (program.bindings: the trace's sizes), where
        # DTensor's propagation computes sizes outside it (torch then records a size made from such a size as
        # its own input: a RecursionError)
        interpreter, running = program.interpreter, program.bindings
        if program.symbolic:
            program.bindings = program.dynamic.bindings(program.global_shapes(args), symbolic=True)
            interpreter.sizes_traced = True
        else:
            interpreter.on_pieces = False
        try:
            return (traced if program._checkpointed else step)(*args)
        finally:
            interpreter.on_pieces, interpreter.sizes_traced, program.bindings = True, False, running

    compilers = dict(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                     inference_compiler=keep("forward", inference=True), partition_fn=partition,
                     decompositions=decompositions)
    if program.symbolic:
        return ForEverySize(per_rank, program.dynamic.dims, compilers, fallback=program.interpreted)
    return aot_function(per_rank, **compilers)


def direct_graphs(program) -> bool:
    """After the first traced call: can a call run the forward/backward graphs itself (:class:`GraphStep`)?

    Yes when the graphs have the plain shape AOTAutograd gives a functional program: forward returns the
    outputs then the values saved for backward, backward takes those values then one gradient per output and
    returns one gradient per input. Anything else (aliased outputs, non-float outputs) keeps AOT's runtime.
    """
    fw, bw = program.graphs.get("forward"), program.graphs.get("backward")
    if fw is None or bw is None or not all(v.is_floating_point() for v in program.out_vals):
        return False
    fw_in = [n for n in fw.graph.nodes if n.op == "placeholder"]
    fw_out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    bw_in = [n.name for n in bw.graph.nodes if n.op == "placeholder"]
    bw_out = next(n for n in bw.graph.nodes if n.op == "output").args[0]
    n_out, n_saved = len(program.out_vals), len(fw_out) - len(program.out_vals)
    tangents = [name for name in bw_in if name.startswith("tangents")]
    return (len(fw_in) == len(program.entries) + len(program.constants) and len(tangents) == n_out
            and bw_in[n_saved:] == tangents
            and len(bw_in) == n_saved + n_out and len(bw_out) == len(fw_in))
