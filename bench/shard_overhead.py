"""What shardfn costs on top of the program it runs, on 4 real gloo ranks (CPU).

    python bench/shard_overhead.py [--dim 768 --heads 12 --batch 4 --seq 128] [--world 4] [--calls 30]
                                   [--tiny-calls 300] [--no-tiny] [--steps 20] [--warmup 3]
                                   [--optimizer foreach|loop|fused] [--profile]

Launch: the script starts its own ranks. ``python bench/shard_overhead.py`` spawns ``--world`` processes (default
4) with ``torch.multiprocessing.start_processes(..., start_method="spawn")``; each sets the torchrun variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>), OMP_NUM_THREADS=1 and
``torch.set_num_threads(1)``, and joins the gloo world through ``sf.init()``. Every rank runs every measurement
(collectives keep them in lockstep); rank 0 times and prints. No torchrun is needed. shardfn is imported from
this checkout (or from PYTHONPATH, to measure another tree); the first line printed says which.

Model: a GPT-2-small-sized transformer block (hidden 768, 12 heads, MLP 3072; batch 4, sequence 128 by default).
It is tests/models.GPTBlock with the head split written ``view(b, t, -1, head_dim)`` (the same arithmetic and the
same parameter names and initialisation order), so the identical class can also run under DTensor's
parallelize_module and, with local shards, by hand.

Measured, all in one run (about 1.5 minutes on 2 cores; all three parts for the same shapes):

1. first call of a freshly sharded block: ``sf.shard(...)`` itself, the first ``block(x)`` with grad (capture +
   plan + AOT lowering) and the first ``block(x)`` under no_grad (a second input signature, so the same again
   for the inference graph). "cold" is the first shard in the process (it also pays torch's one-time imports and
   lazy initialisation), "warm" a second fresh block of the same shape (engines share nothing).
2. cached per-call overhead, under torch.no_grad() and with grad (forward only; with grad after one backward,
   as in training, so a call runs the traced graphs directly):
     block(x)           the whole public path (nn.Module.__call__ -> ShardedModule.forward -> Engine.__call__)
     program(*args)     the cached ParallelProgram on exactly the arguments Engine.__call__ hands it (recorded
                        on a real call): DTensor parameters in, the AOT runtime wrapper, outputs out
     fw graph(*locals)  ``program.graphs["forward"]``, the AOT forward fx graph, on the plain local tensors the
                        AOT runtime passes it (the arguments of the AOT-compiled function, flattened as AOT does:
                        a DTensor becomes its local tensor and its DeviceMesh), under no_grad. It holds the
                        functional collectives, so it includes the communication.
   The three are interleaved every iteration, and all three results are asserted equal first. Overhead =
   block(x) - graph, as the median of the per-iteration differences, in wall time and in this thread's CPU
   time (time.thread_time). On this machine a 4-rank gloo all_reduce takes ~5 ms of wall time (4 processes on
   2 cores), so wall differences are noise; CPU time leaves the waiting out and is the number to read.
   Then the pieces of each call: perf_counter wrappers, installed only for that loop, around whichever of
   these callables exist in the shardfn being measured (so the table follows the engine as it changes):
   ShardedModule.forward, Engine.__call__, capturing, check_not_transformed, runtime.resolve_device,
   runtime.init, Engine.signature, Engine.state,
   ParallelProgram.__call__, LocalsOf.apply, program._run (the AOT-compiled function), DTensor.redistribute /
   from_local / to_local; inclusive times per call path, with each piece's "self" time outside its children.
   Each wrapper adds ~0.5-1 us. The same table follows for a tiny block (hidden 64, 4 heads, batch 1, seq 8)
   where compute is ~0, so the overhead is not lost in a 20 ms forward.
3. training step (forward + backward + AdamW step + zero_grad), the same Megatron tensor-parallel plan run
   three ways, interleaved step by step: shardfn with a parameter_plan (q/k/v and fc column-parallel, proj and
   out row-parallel, the rest pinned replicated); hand-written torch.distributed (local weight shards, heads
   split, Megatron's f/g autograd functions around explicit dist.all_reduce); DTensor's parallelize_module with
   ColwiseParallel / RowwiseParallel. Step-1 losses are asserted equal to each other and to single-process
   eager; the losses after the last step are printed too. Wall and CPU time per phase, and the ratios.
   All three use the same AdamW implementation (``--optimizer``): foreach by default, torch's default on GPUs
   and what DTensor parameters need; ``--optimizer loop`` (torch's default on CPU) runs every op of every
   parameter through DTensor's dispatch for shardfn and parallelize_module (~25 us per op), which the
   hand-written code's plain tensors do not pay.

``--profile`` adds rank 0's cProfile of the tiny block's cached calls (top functions by own and cumulative time).
``--world 1`` (or 2) measures the same without oversubscribing the 2 cores: the per-call overhead without
contention (a world of one runs the single-rank plan, so its graph has no collectives).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and (inherited) in every spawned rank

import argparse  # noqa: E402
import copy  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

# Measure the shardfn of this checkout (an editable install may point elsewhere): its root goes on sys.path
# after any PYTHONPATH entries (so PYTHONPATH=/some/other/tree still selects another version). Spawned ranks
# inherit this sys.path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(min(len(sys.path), 1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])),
                    _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

pc = time.perf_counter
tt = time.thread_time  # this thread's CPU time: excludes waiting for the other ranks


# --- the model ------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        # k has no bias (as in tests/models.py): its gradient is zero in exact arithmetic
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        y = y.transpose(1, 2)
        return self.proj(y.reshape(b, t, y.shape[2] * y.shape[3]))


class GPTBlock(nn.Module):
    def __init__(self, dim: int = 768, heads: int = 12, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.dropout(self.out(F.gelu(self.fc(self.ln2(x)))))


def megatron_plan(world: int) -> dict:
    """shardfn parameter_plan: q/k/v and fc column-parallel, proj and out row-parallel, the rest replicated."""
    col, row, rep1 = (world, 1), (1, world), (1,)
    return {
        "attn.q.weight": col, "attn.q.bias": (world,), "attn.k.weight": col,
        "attn.v.weight": col, "attn.v.bias": (world,),
        "attn.proj.weight": row, "attn.proj.bias": rep1,
        "fc.weight": col, "fc.bias": (world,),
        "out.weight": row, "out.bias": rep1,
        "ln1.weight": rep1, "ln1.bias": rep1, "ln2.weight": rep1, "ln2.bias": rep1,
    }


# --- hand-written Megatron ------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward (before column-parallel)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (after row-parallel), identity backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class MegatronBlock(nn.Module):
    """GPTBlock on this rank's weight shards: heads and MLP columns split over the world."""

    def __init__(self, ref: GPTBlock, rank: int, world: int):
        super().__init__()
        dim = ref.ln1.weight.shape[0]
        self.head_dim = ref.attn.head_dim
        self.ln1, self.ln2 = copy.deepcopy(ref.ln1), copy.deepcopy(ref.ln2)

        def rows(t):  # column-parallel: this rank's output features
            n = t.shape[0] // world
            return nn.Parameter(t.detach()[rank * n:(rank + 1) * n].clone())

        def cols(t):  # row-parallel: this rank's input features
            n = t.shape[1] // world
            return nn.Parameter(t.detach()[:, rank * n:(rank + 1) * n].clone())

        a = ref.attn
        self.wq, self.bq, self.wk = rows(a.q.weight), rows(a.q.bias), rows(a.k.weight)
        self.wv, self.bv = rows(a.v.weight), rows(a.v.bias)
        self.wproj, self.bproj = cols(a.proj.weight), nn.Parameter(a.proj.bias.detach().clone())
        self.wfc, self.bfc = rows(ref.fc.weight), rows(ref.fc.bias)
        self.wout, self.bout = cols(ref.out.weight), nn.Parameter(ref.out.bias.detach().clone())
        self.local_dim = dim // world

    def forward(self, x):
        b, t, _ = x.shape
        h = _CopyToTP.apply(self.ln1(x))
        split = lambda y: y.view(b, t, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = F.linear(h, self.wq, self.bq), F.linear(h, self.wk), F.linear(h, self.wv, self.bv)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        y = F.linear(y.transpose(1, 2).reshape(b, t, self.local_dim), self.wproj)
        x = x + (_ReduceFromTP.apply(y) + self.bproj)
        h = _CopyToTP.apply(self.ln2(x))
        h = F.linear(F.gelu(F.linear(h, self.wfc, self.bfc)), self.wout)
        return x + (_ReduceFromTP.apply(h) + self.bout)


def dtensor_tp(model: GPTBlock, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel(),
    })


# --- timing helpers -------------------------------------------------------------------------------------------


def med(xs):
    return statistics.median(xs)


def iqr(xs):
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def us(s):
    return f"{s * 1e6:10.1f}"


def ms(s):
    return f"{s * 1e3:10.2f}"


def loc(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def compiled_for(block, x, grad: bool):
    """The cached _Compiled that ``block(x)`` runs in this grad mode, and what ``Engine.__call__`` hands to its
    ``program(...)`` and the program to its AOT-compiled function ``program._run`` on that cached call (recorded,
    not rebuilt, so this follows the engine as it changes), and block(x)'s value."""
    import shardfn as sf
    from shardfn.exec.lower import ParallelProgram

    rec = {}
    orig_call = ParallelProgram.__call__

    def spy_call(self, *a, **k):
        rec["program"], rec["args"], rec["run_args"] = self, a, a
        orig_run = getattr(self, "_run", None)
        if orig_run is None:  # no separate AOT-compiled function: assume the graph takes the program's inputs
            return orig_call(self, *a, **k)

        def spy_run(*ra, **rk):
            rec["run_args"] = ra
            return orig_run(*ra, **rk)

        self._run = spy_run
        try:
            return orig_call(self, *a, **k)
        finally:
            self._run = orig_run

    ParallelProgram.__call__ = spy_call
    try:
        with torch.set_grad_enabled(grad):
            y = block(x)
    finally:
        ParallelProgram.__call__ = orig_call
    cache = sf.engine_of(block).programs
    (compiled,) = [c for c in cache.values() if c.program is rec["program"]]
    return compiled, rec["args"], rec["run_args"], y


def graph_inputs(gm: torch.fx.GraphModule, inputs):
    """The AOT forward graph's inputs for these inputs of the AOT-compiled function,
    flattened as AOTAutograd's runtime does: a tensor
    subclass (DTensor) becomes its ``__tensor_flatten__`` attributes in order (its local tensor, then its
    DeviceMesh, an opaque object in torch 2.13), a plain tensor stays itself. Checked against the placeholders."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    flat = []

    def add(t):
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for a in attrs:
                add(getattr(t, a))
        else:
            flat.append(t.detach() if isinstance(t, torch.Tensor) else t)

    for t in inputs:
        add(t)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(flat):
        raise RuntimeError(f"forward graph has {len(phs)} placeholders, the program's inputs flatten to {len(flat)}")
    for n, t in zip(phs, flat):
        v = n.meta.get("val")
        if isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor) and (
                tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype):
            raise RuntimeError(f"placeholder {n.name}: graph wants {tuple(v.shape)} {v.dtype}, "
                               f"input is {tuple(t.shape)} {t.dtype}")
    return flat


class Spans:
    """perf_counter around named callables of shardfn (and DTensor) while installed: per call, the inclusive
    seconds of each call path ("Engine.__call__/program(...)/LocalsOf.apply"), summed over repeats, and the
    count. Only callables that exist are wrapped, so this follows the engine as it changes."""

    def __init__(self):
        self.cur: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.order: dict[str, int] = {}
        self.stack: list[str] = []
        self.patches: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        import inspect

        if owner is None or not hasattr(owner, attr):
            return
        static = inspect.getattr_static(owner, attr)
        orig = getattr(owner, attr)
        spans = self

        def timed(*a, **k):
            path = (spans.stack[-1] + "/" if spans.stack else "") + label
            spans.order.setdefault(path, len(spans.order))
            spans.stack.append(path)
            t0 = pc()
            try:
                return orig(*a, **k)
            finally:
                dt = pc() - t0
                spans.stack.pop()
                spans.cur[path] = spans.cur.get(path, 0.0) + dt
                spans.count[path] = spans.count.get(path, 0) + 1

        own = vars(owner)
        self.patches.append((owner, attr, attr in own, own.get(attr)))
        is_cls = isinstance(owner, type)
        setattr(owner, attr, staticmethod(timed) if is_cls and isinstance(static, (classmethod, staticmethod))
                else timed)

    def restore(self) -> None:
        for owner, attr, had, saved in reversed(self.patches):
            if had:
                setattr(owner, attr, saved)
            else:
                delattr(owner, attr)
        self.patches.clear()

    def take(self) -> tuple[dict, dict]:
        cur, count = self.cur, self.count
        self.cur, self.count = {}, {}
        return cur, count


def install_spans(program) -> Spans:
    import importlib

    from torch.distributed.tensor import DTensor

    def mod(name):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None

    engine, sharded, runtime, lower, run = (mod(f"shardfn.{m}") for m in
                                            ("call.engine", "call.sharded", "runtime", "exec.lower", "exec.run"))
    sp = Spans()
    sp.wrap(sharded.ShardedModule, "forward", "ShardedModule.forward")
    sp.wrap(engine.Engine, "__call__", "Engine.__call__")
    sp.wrap(engine, "capturing", "capturing")
    sp.wrap(engine, "check_not_transformed", "check_not_transformed")
    sp.wrap(runtime, "resolve_device", "runtime.resolve_device")
    sp.wrap(runtime, "init", "runtime.init")
    sp.wrap(engine.Engine, "signature", "Engine.signature")
    sp.wrap(engine.Engine, "state", "Engine.state")
    sp.wrap(getattr(lower, "ParallelProgram", None), "__call__", "program(...)")
    sp.wrap(getattr(run, "LocalsOf", None), "apply", "LocalsOf.apply")
    if "_run" in vars(program):
        sp.wrap(program, "_run", "program._run (AOT runtime wrapper + fw graph)")
    sp.wrap(DTensor, "redistribute", "DTensor.redistribute")
    sp.wrap(DTensor, "from_local", "DTensor.from_local")
    sp.wrap(DTensor, "to_local", "DTensor.to_local")
    return sp


# --- the measurements -----------------------------------------------------------------------------------------


def first_call(sf, dim, heads, batch, seq, world):
    """Seconds for sf.shard(...), the first grad-mode call and the first no_grad call."""
    torch.manual_seed(0)
    model = GPTBlock(dim, heads)
    x = torch.randn(batch, seq, dim)
    dist.barrier()
    t0 = pc()
    block = sf.shard(model, in_strategy=(None,), parameter_plan=megatron_plan(world))
    t1 = pc()
    y = block(x)
    t2 = pc()
    with torch.no_grad():
        block(x)
    t3 = pc()
    dist.barrier()
    return block, x, y, {"sf.shard(...)": t1 - t0, "first block(x), grad": t2 - t1,
                         "first block(x), no_grad": t3 - t2}


def per_call(block, x, calls: int, warmup: int = 5):
    """Per grad mode: per-iteration seconds of block(x), program(*args) and the forward graph on local tensors
    (interleaved), then, in a second loop with Spans installed, the pieces of each call."""
    results = {}
    for grad in (False, True):
        compiled, args, run_args, y_call = compiled_for(block, x, grad)
        program = compiled.program
        # the traced forward graph; in a world of one the program runs the captured graph itself, eagerly
        gm = program.graphs.get("forward", compiled.captured.gm)
        with torch.set_grad_enabled(grad):
            y_prog = loc(program(*args)[0])
        if grad:  # one backward first, as in training: later calls run the traced graphs directly
            block(x).sum().backward()
            block.zero_grad(set_to_none=True)
        local = graph_inputs(gm, run_args) if "forward" in program.graphs else \
            [a.to_local().detach() if isinstance(a, DTensor) else a.detach() for a in args]

        def graph(xs):  # a traced graph takes one list of its inputs, which it empties (boxed)
            return gm(list(xs)) if getattr(gm, "_boxed_call", False) else gm(*xs)

        with torch.no_grad():
            y_graph = graph(local)[0]
        torch.testing.assert_close(y_call.detach(), y_prog.detach())  # the same values three ways
        torch.testing.assert_close(y_call.detach(), y_graph)
        times = {k: [] for k in ("call", "program", "graph", "call_cpu", "program_cpu", "graph_cpu")}
        dist.barrier()
        for i in range(warmup + calls):
            with torch.set_grad_enabled(grad):
                a, ac = pc(), tt()
                block(x)
                bc, b = tt(), pc()
                program(*args)
                cc, c = tt(), pc()
            with torch.no_grad():
                graph(local)
            dc, d = tt(), pc()
            if i >= warmup:
                for k, v in (("call", b - a), ("program", c - b), ("graph", d - c),
                             ("call_cpu", bc - ac), ("program_cpu", cc - bc), ("graph_cpu", dc - cc)):
                    times[k].append(v)
        dist.barrier()
        pieces: list[dict] = []
        spans = install_spans(program)
        try:
            for i in range(warmup + calls):
                with torch.set_grad_enabled(grad):
                    a = pc()
                    y_ins = block(x)
                    b = pc()
                cur, count = spans.take()
                if i >= warmup:
                    cur["block(x)"], count["block(x)"] = b - a, 1
                    pieces.append((cur, count))
        finally:
            order = dict(spans.order)
            spans.restore()
        torch.testing.assert_close(y_ins.detach(), y_call.detach())
        dist.barrier()
        results[grad] = (times, pieces, order)
    return results


def profile_calls(block, x, calls: int) -> str:
    out = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for _ in range(5):
                block(x)
            dist.barrier()
            prof = cProfile.Profile() if dist.get_rank() == 0 else None
            if prof:
                prof.enable()
            for _ in range(calls):
                block(x)
            if prof:
                prof.disable()
                s = io.StringIO()
                st = pstats.Stats(prof, stream=s)
                st.sort_stats("tottime").print_stats(30)
                st.sort_stats("cumulative").print_stats(45)
                out.append(f"\n=== cProfile, {calls} cached block(x) calls, grad={grad} (per-call = time / {calls}) "
                           f"===\n{s.getvalue()}")
    dist.barrier()
    return "".join(out)


def train(sf, dim, heads, batch, seq, world, mesh, steps, warmup, optimizer="foreach", lr=1e-4):
    """Step times of the three tensor-parallel versions, interleaved; and their step-1 losses."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = GPTBlock(dim, heads)
    x = torch.randn(batch, seq, dim)
    with torch.no_grad():
        eager_loss = ref(x).square().mean().item()
    models = {
        "shardfn": sf.shard(copy.deepcopy(ref), in_strategy=(None,), parameter_plan=megatron_plan(world)),
        "hand-written": MegatronBlock(ref, rank, world),
        "parallelize_module": dtensor_tp(copy.deepcopy(ref), mesh),
    }
    def adamw(m):
        from torch.distributed.tensor import DTensor

        # one param group per kind: a foreach/fused kernel takes DTensors or plain tensors, not both
        # (parallelize_module leaves the LayerNorms plain); the update is the same
        params = list(m.parameters())
        groups = [{"params": g} for g in ([p for p in params if isinstance(p, DTensor)],
                                          [p for p in params if not isinstance(p, DTensor)]) if g]
        impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[optimizer]
        return torch.optim.AdamW(groups, lr=lr, **impl)

    opts = {k: adamw(m) for k, m in models.items()}
    losses = {k: [] for k in models}
    times = {k: {p: [] for p in ("step", "fwd", "bwd", "opt", "cpu", "fwd_cpu", "bwd_cpu", "opt_cpu")}
             for k in models}
    dist.barrier()
    for i in range(warmup + steps):
        for name, model in models.items():
            opt = opts[name]
            a, ac = pc(), tt()
            loss = model(x).square().mean()
            bc, b = tt(), pc()
            loss.backward()
            cc, c = tt(), pc()
            opt.step()
            opt.zero_grad()
            dc, d = tt(), pc()
            losses[name].append(loss.item())
            if i >= warmup:
                for k, v in (("step", d - a), ("fwd", b - a), ("bwd", c - b), ("opt", d - c), ("cpu", dc - ac),
                             ("fwd_cpu", bc - ac), ("bwd_cpu", cc - bc), ("opt_cpu", dc - cc)):
                    times[name][k].append(v)
    dist.barrier()
    compiled = compiled_for(models["shardfn"], x, True)[0]
    return times, losses, eager_loss, compiled


def collective_summary(compiled) -> str:
    counts: dict[tuple, list] = {}
    for c in compiled.plan.collectives:
        counts.setdefault((c.phase, c.kind), []).append(c.nbytes)
    return ", ".join(f"{ph} {kind} x{len(v)} ({sum(v) / 2**20:.2f} MiB)" for (ph, kind), v in sorted(counts.items()))


def print_per_call(title, res):
    print(f"\n{title}")
    print("  median per call, microseconds [IQR]; differences are medians of per-iteration differences.")
    print("  wall = perf_counter; cpu = this thread's CPU time (time.thread_time), which leaves out waiting for")
    print("  the other ranks in collectives (a 4-rank gloo all_reduce takes ~5 ms of wall time on 2 cores)")
    print(f"  {'mode':<13}{'block(x)':>21}{'program(*args)':>21}{'fw graph(*locals)':>21}"
          f"{'call-graph':>12}{'call-program':>14}{'program-graph':>15}")
    for grad in (False, True):
        for clock in ("wall", "cpu"):
            t = res[grad][0]
            sfx = "" if clock == "wall" else "_cpu"
            C, P, G = t["call" + sfx], t["program" + sfx], t["graph" + sfx]
            dcg = med([a - b for a, b in zip(C, G)])
            dcp = med([a - b for a, b in zip(C, P)])
            dpg = med([a - b for a, b in zip(P, G)])
            mode = ("grad" if grad else "no_grad") + " " + clock
            cell = lambda v: f"{us(med(v))} [{us(iqr(v)).strip():>7}]"  # noqa: E731
            print(f"  {mode:<13}{cell(C)}{cell(P)}{cell(G)}{us(dcg):>12}{us(dcp):>14}{us(dpg):>15}")
    print("  pieces (perf_counter wrappers around the named callables; inclusive time, median microseconds per")
    print("  call; 'self' = a piece's time outside its listed children; n = calls per block(x))")
    print(f"  {'piece':<64}{'no_grad':>10}{'n':>4}{'grad':>10}{'n':>4}")
    paths = sorted({p for grad in (False, True) for p in res[grad][2]},
                   key=lambda p: (res[True][2].get(p, res[False][2].get(p, 0)), p))
    paths = ["block(x)"] + [("block(x)/" + p) for p in paths]

    def stat(grad, path):
        key = path[len("block(x)/"):] if path != "block(x)" else path
        vals = [cur.get(key, 0.0) for cur, _ in res[grad][1]]
        n = med([count.get(key, 0) for _, count in res[grad][1]])
        kids = [q for q in {k for cur, _ in res[grad][1] for k in cur}
                if q.startswith(key + "/") and "/" not in q[len(key) + 1:]] if key != "block(x)" else \
               [q for q in {k for cur, _ in res[grad][1] for k in cur} if "/" not in q and q != "block(x)"]
        selfs = [cur.get(key, 0.0) - sum(cur.get(q, 0.0) for q in kids) for cur, _ in res[grad][1]] if kids else None
        return med(vals), n, (med(selfs) if selfs is not None else None)

    for path in paths:
        depth = path.count("/")
        name = path.rsplit("/", 1)[-1]
        cols, scol = "", ""
        has_self = False
        for grad in (False, True):
            v, n, sv = stat(grad, path)
            cols += f"{us(v)}{n:>4.0f}" if n else f"{'-':>10}{'':>4}"
            scol += f"{us(sv)}{'':>4}" if sv is not None else f"{'':>14}"
            has_self |= sv is not None
        print(f"  {'  ' * depth + name:<64}{cols}")
        if has_self:
            print(f"  {'  ' * (depth + 1) + '(self)':<64}{scol}")


def worker(rank: int, args, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import shardfn as sf

    mesh = sf.init(device="cpu")
    world = dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    t_start = pc()
    say(f"shardfn overhead benchmark: {world} gloo ranks (CPU, 1 thread each, {os.cpu_count()} cores), "
        f"torch {torch.__version__}, shardfn from {os.path.dirname(sf.__file__)}")
    say(f"block: hidden {args.dim}, {args.heads} heads, MLP {4 * args.dim}; input batch {args.batch} x seq {args.seq}")

    # 1. first call ------------------------------------------------------------------------------------------
    # cold: the first shard in this process (it also pays one-time imports and lazy initialisation of torch's
    # DTensor / AOTAutograd machinery); warm: a second, fresh block of the same shape (its own capture, plan and
    # lowering: nothing is shared between engines)
    _, _, _, cold = first_call(sf, args.dim, args.heads, args.batch, args.seq, world)
    block, x, _, warm = first_call(sf, args.dim, args.heads, args.batch, args.seq, world)
    say("\n1. first call of a freshly sharded block, seconds (every rank captures, plans and lowers at once)")
    say(f"  {'':<28}{'cold':>8}{'warm':>8}")
    for k in cold:
        say(f"  {k:<28}{cold[k]:8.3f}{warm[k]:8.3f}")
    say(f"  plan: {collective_summary(compiled_for(block, x, True)[0])}")

    # 2. per-call overhead --------------------------------------------------------------------------------------
    res = per_call(block, x, args.calls)
    if rank == 0:
        print_per_call(f"2. cached per-call overhead, the block above ({args.calls} calls per mode)", res)
    tiny = None
    if not args.no_tiny:
        tiny, tx, _, tfirst = first_call(sf, 64, 4, 1, 8, world)
        tres = per_call(tiny, tx, args.tiny_calls)
        if rank == 0:
            print_per_call(f"2b. the same for a tiny block (hidden 64, 4 heads, batch 1, seq 8; {args.tiny_calls} "
                           f"calls; first grad call {tfirst['first block(x), grad']:.2f} s)", tres)
    if args.profile:
        target, tgt_x = (tiny, tx) if tiny is not None else (block, x)
        say(profile_calls(target, tgt_x, args.tiny_calls))

    # 3. training step -----------------------------------------------------------------------------------------
    times, losses, eager_loss, compiled = train(sf, args.dim, args.heads, args.batch, args.seq, world, mesh,
                                                args.steps, args.warmup, optimizer=args.optimizer)
    names = list(times)
    first_losses = torch.tensor([losses[n][0] for n in names])
    torch.testing.assert_close(first_losses, torch.full_like(first_losses, eager_loss), rtol=1e-5, atol=1e-6)
    if rank == 0:
        print(f"\n3. training step (forward + backward + AdamW({args.optimizer}) + zero_grad), "
              f"Megatron TP over {world} ranks; "
              f"median of {args.steps} steps after {args.warmup} warm-up, milliseconds (IQR in brackets)")
        print(f"  step-1 loss: eager {eager_loss:.6f}; " + ", ".join(f"{n} {losses[n][0]:.6f}" for n in names)
              + "  (asserted close)")
        last = [losses[n][-1] for n in names]
        finals = ", ".join(f"{n} {v:.6f}" for n, v in zip(names, last))
        print(f"  loss after {args.warmup + args.steps} steps: " + finals
              + f"  (max spread {max(last) - min(last):.2e})")
        print(f"  shardfn plan: {collective_summary(compiled)}")
        print("  wall = perf_counter; cpu = rank 0's thread CPU time, which leaves out waiting in collectives")
        print(f"  {'':<20}{'--------------------- wall ---------------------':>50}"
              f"{'---------------- cpu ----------------':>40}")
        print(f"  {'version':<20}{'step [IQR]':>20}{'forward':>10}{'backward':>10}{'optimizer':>10}"
              f"{'step':>10}{'forward':>10}{'backward':>10}{'optimizer':>10}")
        for n in names:
            t = {k: med(v) for k, v in times[n].items()}
            print(f"  {n:<20}{ms(t['step'])} [{ms(iqr(times[n]['step'])).strip():>7}]"
                  f"{ms(t['fwd']):>10}{ms(t['bwd']):>10}{ms(t['opt']):>10}"
                  f"{ms(t['cpu']):>10}{ms(t['fwd_cpu']):>10}{ms(t['bwd_cpu']):>10}{ms(t['opt_cpu']):>10}")
        for other in ("hand-written", "parallelize_module"):
            r = med(times["shardfn"]["step"]) / med(times[other]["step"])
            rc = med(times["shardfn"]["cpu"]) / med(times[other]["cpu"])
            print(f"  ratio shardfn / {other + ':':<20} step {r:.3f}   step cpu {rc:.3f}")
        print(f"\ntotal {pc() - t_start:.1f} s")
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--calls", type=int, default=30, help="timed cached calls per grad mode (GPT-2-small block)")
    p.add_argument("--tiny-calls", type=int, default=300, help="timed cached calls per grad mode (tiny block)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-block overhead table")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps first (step 1 compiles)")
    p.add_argument("--profile", action="store_true", help="print cProfile of rank 0's cached calls")
    p.add_argument("--optimizer", choices=("foreach", "loop", "fused"), default="foreach",
                   help="AdamW's implementation, the same for all three versions: foreach (default; torch's "
                        "default on GPUs, and what DTensor parameters want: one dispatch per op for all of them), "
                        "loop (torch's default on CPU: every op of every parameter dispatched on its own, through "
                        "DTensor for DTensor parameters) or fused")
    args = p.parse_args(argv)
    if args.dim % args.heads or args.heads % args.world:
        p.error("--heads must divide --dim, and --world must divide --heads")
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(args, free_port()), nprocs=args.world, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
