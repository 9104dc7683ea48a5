"""A small inference graph replayed as a CUDA graph once its calls settle.

A decoding step of a few layers (generate() with a StaticCache) is a hundred small kernels whose launches cost
more than their work; torch.compile's "reduce-overhead" replays them as one CUDA graph. exec does the same for
the Inductor code of an inference graph in a world of one (no collectives to capture), where the graph's values
are small (``_MOST_BYTES``: the graph's memory pool stays held while the program lives).

A CUDA graph reads and writes fixed addresses. Which inputs keep theirs is learnt from the calls: an input at
the same address (and shape, strides, dtype) in the two calls before the capture is *static* (parameters, a
StaticCache's tensors): the graph reads it where it lies, and the replayer holds it, so that its memory is not
given to another tensor while the graph may read it. Every other input is copied into a buffer of the graph's
own before each replay. A static input met at another address later is learnt again: the graph is captured
anew (a new cache for another generate(), parameters replaced), and a small input that moved (one made anew for
each call, that came back at the same address as the caching allocator gave its block back) is copied from
then on; after ``_STRIKES`` captures that did not replay twice, the runner stops capturing and runs its code.
Outputs are copied out of the graph's pool, which the next replay overwrites.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.fx

from ..strategy_search.cost_model import is_view_op

__all__ = ["replayed"]

_MOST_BYTES = 256 * 2**20  # the graph's values together at most (its pool's size, bounded above)
_STRIKES = 3
_SMALL = 2**20  # an input of at most these bytes that moved after a capture is copied from then on


def replayed(run: Callable, gm: torch.fx.GraphModule, device: str = "cuda",
             capture: Callable | None = None, note: Callable[[str], None] | None = None) -> Callable:
    """``run`` (a boxed inference graph's code on ``device``, the graph ``gm``) replayed as a CUDA graph where it
    can be; ``run`` itself where SHARDFN_CUDA_GRAPHS=0 or the graph's values are large. ``capture(fn, inputs) ->
    (graph, outputs)`` records ``fn`` on ``inputs`` (tests stand a CPU recorder in for CUDA's); ``note`` is told
    each capture and why capturing stopped (the program's notes, which explain() shows)."""
    note = note or (lambda line: None)
    if (device != "cuda" and capture is None) or os.environ.get("SHARDFN_CUDA_GRAPHS", "1") == "0":
        return run
    made = _values_bytes(gm)
    if made > _MOST_BYTES:
        note(f"the inference graph is not replayed as a CUDA graph: its values take {made / 2**20:.0f} MiB, over "
             f"{_MOST_BYTES >> 20} MiB")
        return run
    replayer = _Replayer(run, capture or _cuda_capture, device, note)
    replayer._boxed_call = True
    return replayer


def _values_bytes(gm: torch.fx.GraphModule) -> int:
    """The bytes of the values the graph makes (views, a weight's transpose among them, make none)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "call_function" and not is_view_op(n)]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _cuda_capture(fn: Callable, inputs: list) -> tuple[Any, list]:
    """``fn`` run once on a side stream (lazy initialisations: cuBLAS workspaces), then captured. A capture that
    fails raises (torch.AcceleratorError is a RuntimeError)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(list(inputs))
    torch.cuda.current_stream().wait_stream(side)
    # (thread_local: other threads' CUDA calls, NCCL's watchdog polling its events, do not void the capture)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn(list(inputs))
    return graph, outputs


def _where(x: Any, device: str) -> tuple | None:
    """What a graph captured on ``x`` assumes of it; None: not a tensor on the graph's device (a CPU scalar's
    value would be fixed in the graph)."""
    if not isinstance(x, torch.Tensor) or x.device.type != device:
        return None
    return x.data_ptr(), x.shape, x.stride(), x.dtype


def _storages(xs: list) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in xs if isinstance(x, torch.Tensor)}


class _Replayer:
    def __init__(self, run: Callable, capture: Callable, device: str, note: Callable[[str], None]):
        self.run, self.capture, self.device, self.note = run, capture, device, note
        self.last: list | None = None  # where the last call's inputs were
        self.graph = None
        self.held: dict[int, tuple] = {}  # static input -> (the tensor, where it was captured)
        self.buffers: dict[int, torch.Tensor] = {}  # copied input -> the graph's buffer for it
        self.outputs: list = []
        self.replays = 0
        self.captures = 0
        self.strikes = 0
        self.moved: set[int] = set()  # inputs that were static for a capture and moved after it: copied since

    def __call__(self, args: list) -> Any:
        if self.graph is not None:
            moved = {i for i, (_, where) in self.held.items()
                     if args[i].data_ptr() != where[0] or args[i].stride() != where[2]}
            # a copied input of another shape or dtype than its buffer's (copy_ would broadcast a row into the
            # captured rows, or refuse): this graph is not for it
            reshaped = any(args[i].shape != b.shape or args[i].dtype != b.dtype for i, b in self.buffers.items())
            if not moved and not reshaped:
                return self._replay(args)
            # a small tensor made anew for each call that came back at the same address: copied from now on
            self.moved |= {i for i in moved if args[i].numel() * args[i].element_size() <= _SMALL}
            self._release()
        if self.strikes >= _STRIKES:
            return self.run(args)
        where = [_where(a, self.device) for a in args]
        if None in where:  # (a graph would fix its value): never captured
            i = where.index(None)
            what = type(args[i]).__name__ if not isinstance(args[i], torch.Tensor) else f"a tensor on {args[i].device}"
            return self._stop(args, f"its input {i} is {what}, not a tensor on {self.device}")
        last, self.last = self.last, where
        if last is None or len(last) != len(where):
            return self.run(args)
        try:
            self._capture(args, [w == v and i not in self.moved for i, (w, v) in enumerate(zip(where, last))])
        except RuntimeError as e:  # (an op the capture refuses, a CPU synchronisation): this runner never captures
            return self._stop(args, f"its capture raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        inputs = [t for t, _ in self.held.values()] + list(self.buffers.values())
        if _storages(self.outputs) & _storages(inputs):  # an output that is an input's view: its aliasing kept
            return self._stop(args, "an output is a view of an input")
        self.note(f"the inference graph replays as a CUDA graph: {len(self.held)} inputs read where they lie, "
                  f"{len(self.buffers)} copied in (capture {self.captures})")
        return self._replay(args)

    def _stop(self, args: list, why: str) -> Any:
        self.strikes = _STRIKES
        self._release()
        self.note(f"the inference graph is not replayed as a CUDA graph: {why}")
        return self.run(args)

    def _capture(self, args: list, static: list[bool]) -> None:
        self.held = {i: (a, _where(a, self.device)) for i, (a, s) in enumerate(zip(args, static)) if s}
        self.buffers = {i: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                        for i, (a, s) in enumerate(zip(args, static)) if not s}
        inputs = [self.held[i][0] if i in self.held else self.buffers[i] for i in range(len(args))]
        for i, b in self.buffers.items():
            b.copy_(args[i])
        self.graph, self.outputs = self.capture(self.run, inputs)
        self.replays, self.captures = 0, self.captures + 1

    def _replay(self, args: list) -> list:
        for i, b in self.buffers.items():
            b.copy_(args[i])
        args.clear()
        self.graph.replay()
        self.replays += 1
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]

    def _release(self) -> None:
        if self.graph is not None and self.replays < 2:
            self.strikes += 1
            if self.strikes == _STRIKES:
                self.note(f"the inference graph is not replayed as a CUDA graph: {_STRIKES} captures did not "
                          "replay twice (an input read where it lay moved each time)")
        self.graph, self.held, self.buffers, self.outputs, self.last = None, {}, {}, [], None
