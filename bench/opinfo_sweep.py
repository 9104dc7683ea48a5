"""Every OpInfo operator through shardfn on 4 simulated ranks: outputs and gradients against single-device eager.

    python bench/opinfo_sweep.py [--modes decide,split4,split2] [--ops 0:100 | --ops add,nn.functional.pad]
                                 [--limit-s 60] [--json out.json] [-v]

For each entry of torch's op_db (name.variant), the first float32 sample on CPU is called through
``sf.shard(fn, in_strategy)`` inside ``shardfn.runtime.simulated_world(4)`` and compared with eager rank by rank,
outputs and the gradients of every input that requires grad (tests/parity.check_parity). ``fn`` takes the
sample's tensors as positional arguments, in flat order. Modes:

  decide  every input left to the search (in_strategy all None);
  split4  the first tensor input split 4 ways on its first dim of a size divisible by 4 (the others None);
  split2  the same, 2 ways;
  dim0    as a user who keeps tensors split: every input split 4 ways on dim 0 and every output asked for split
          so (out_strategy; a dim of another size whole), the sample tiled to sizes divisible by 4 on that dim
          (each tensor repeated 4 times along it, where eager still runs on the tiled sample);
  last    the same on each tensor's last dim;
  dp      dataset_strategy="data_parallel": each rank is handed its quarter (dim 0) of every input, tiled as
          for dim0, and compared with its quarter of eager's outputs and gradients on the whole sample.

An op counts as run sharded where its plan runs at least one op (not an input) with a split or pending operand or
result (read from ``sf.explain`` of the call); the per-mode line says how many passing ops did.

An op eager cannot run on its sample, or with no dim to split in a split mode, is not counted. Each result is one
of: pass; error (a clear one: ValueError, TypeError, NotImplementedError, CaptureError); other (any other
exception, or a crash of the worker process); WRONG (numbers differ from eager); timeout (over --limit-s). Ops run
in a worker process, restarted after a crash or a timeout. Per-mode counts and the failures grouped by exception
are printed; ``--json`` writes every result.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODES = ("decide", "split4", "split2", "dim0", "last", "dp")
FORCED = ("dim0", "last", "dp")  # modes that split every input they can
# outputs of uninitialised memory: no two runs agree, eager with itself included
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
CLEAR = ("ValueError", "TypeError", "NotImplementedError", "CaptureError")


def _op_db():
    import torch.testing._internal.common_methods_invocations as cmi

    # Random ops' OpInfos call torch.manual_seed(42) inside the op: a Python side effect that tracing runs once,
    # not on each call. check_parity seeds eager and the sharded call alike instead.
    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    return cmi.op_db


def op_name(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def _samples(info, forced: bool = False, tries: int = 10):
    """The op's float32 samples to try: its first; in a forcing mode, its first ``tries`` (OpInfo often starts with
    0-dim or size-1 ones, which no split reaches)."""
    import torch

    if torch.float32 not in info.supported_dtypes("cpu"):
        return
    grad = bool(info.supports_autograd)
    torch.manual_seed(0)  # OpInfo draws its samples: the same ones whatever ran before in this worker
    for k, sample in enumerate(info.sample_inputs("cpu", torch.float32, requires_grad=grad)):
        if k >= (tries if forced else 1):
            return
        yield sample


def _split_strategy(tensors, n: int):
    for i, t in enumerate(tensors):
        for d, size in enumerate(t.shape):
            if size >= n and size % n == 0:
                return i, tuple(n if k == d else 1 for k in range(t.dim()))
        return None  # the first tensor input only
    return None


def _wrong(exc: BaseException) -> bool:
    """A mismatch found by the comparison itself (not an assert inside torch or shardfn)."""
    if not isinstance(exc, AssertionError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1].filename if frames else ""
    return os.path.abspath(last) == os.path.abspath(__file__) or os.path.join("torch", "testing") in last


def classify(exc: BaseException | None) -> str:
    if exc is None:
        return "pass"
    if _wrong(exc):
        return "WRONG"
    return "error" if type(exc).__name__ in CLEAR else "other"


def _tiled(t, dims, n: int = 4):
    """``t`` repeated ``n`` times along each of ``dims`` whose size (over 1) is not divisible by ``n``."""
    import torch

    ascending = t.dim() == 1 and t.numel() > 1 and bool((t[1:] >= t[:-1]).all())
    if ascending and not (t.is_floating_point() or t.is_complex()):
        return t  # ascending integers (embedding_bag's offsets, searchsorted's boundaries) stay ascending
    out = t.detach()
    for d in dims:
        if out.shape[d] > 1 and out.shape[d] % n:
            out = torch.cat([out] * n, d)
    return out.requires_grad_(t.requires_grad) if out is not t.detach() else t


def _forced(tensors, mode: str, runs) -> tuple[list, tuple] | None:
    """(the sample's tensors, tiled where eager still runs on them, and the in_strategy splitting each one 4 ways
    on its dim that the mode names); None where no tensor can be split."""
    def dim_of(t):
        return 0 if mode in ("dim0", "dp") else t.dim() - 1

    if mode == "dp" and any(t.dim() == 0 for t in tensors):
        return None  # data_parallel hands every positional tensor over by its batch dim

    # every dim of a size not divisible by 4 tiled (sizes equal before stay equal: matmuls, broadcasts), else
    # only the mode's dim, else the sample as it is
    for candidate in ([_tiled(t, range(t.dim())) for t in tensors], [_tiled(t, [dim_of(t)][:t.dim()]) for t in tensors],
                      list(tensors)):
        if candidate is not tensors and not runs(candidate):
            continue
        strategy = tuple(tuple(4 if k == dim_of(t) else 1 for k in range(t.dim()))
                         if t.dim() and t.shape[dim_of(t)] and t.shape[dim_of(t)] % 4 == 0 else None
                         for t in candidate)
        if any(s is not None for s in strategy):
            return candidate, strategy
    return None


def _same_twice(a, b) -> bool:
    """Whether eager ran on a tiled sample and gave the same numbers twice: tiling may break a sample's premise
    (embedding_bag's offsets no longer ascending), and an op then reads memory it never wrote."""
    import torch

    from tests.parity import tensors_of

    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    xs, ys = tensors_of(a), tensors_of(b)
    def same(x, y):
        if x.is_floating_point() or x.is_complex():
            x, y = x.nan_to_num(), y.nan_to_num()
        return x.shape == y.shape and torch.equal(x, y)

    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def _out_strategy(outs, mode: str) -> tuple:
    """Each output split 4 ways on the mode's dim where its size there is divisible by 4, else whole."""
    def split(t):
        d = 0 if mode == "dim0" else t.dim() - 1
        return tuple(4 if k == d and t.shape[d] % 4 == 0 else 1 for k in range(t.dim()))

    return tuple(split(t) for t in outs)


def ran_sharded(plan) -> bool:
    """Whether a plan runs at least one op (not an input, a constant or a factory) on split or pending operands or
    results; a program of no ops (contiguous, conj of a real tensor) where a split input is returned as it is,
    with no collective but the gather of a whole input's gradient as backward hands it back (every op that runs
    split has it in the forcing modes of full_batch inputs)."""
    ops = [n for n in plan.nodes.values() if n.rule in ("dtensor", "local", "random")]
    if not ops:
        moved = [c for c in plan.collectives if not (c.phase == "backward" and c.where.endswith(" (entry)"))]
        return not moved and any(not p.is_replicate() for i in plan.inputs for p in i.planned)
    return any(not p.is_replicate() for n in ops for pl in (*n.inputs, *(o for o in n.outputs if o)) for p in pl)


def run_one(info, mode: str) -> tuple[str, str] | tuple[str, str, bool]:
    """(result, detail[, ran sharded]) for one op in one mode; result 'n/a' where the op is not counted. A forcing
    mode takes the first sample that has a dim to split."""
    if info.name in UNINITIALISED:
        return "n/a", "uninitialised memory"
    found = "n/a", "no float32 sample"
    for sample in _samples(info, forced=mode in FORCED):
        found = _run_sample(info, sample, mode)
        if found[:2] != ("n/a", "no dim to split"):
            return found
    return found


def _run_sample(info, sample, mode: str) -> tuple[str, str] | tuple[str, str, bool]:
    import torch
    import torch.utils._pytree as pytree

    from tests.parity import Call, _loss

    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in where]
    if not tensors:
        return "n/a", "no tensor input"

    def fn(*ts):
        flat = list(leaves)
        for i, t in zip(where, ts):
            flat[i] = t
        inp, args, kwargs = pytree.tree_unflatten(flat, spec)
        return info.op(inp, *args, **kwargs)

    def make():
        return Call(tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors))

    def eager(ts):  # eager, with gradients, on the sample's tensors ts; its outputs, or the exception
        try:
            torch.manual_seed(1)
            ts = [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]
            out = fn(*ts)
            if any(t.requires_grad for t in ts) and any(
                    o.requires_grad for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)):
                _loss(out).backward()
            return out
        except Exception as e:  # noqa: BLE001
            return e

    out = eager(tensors)
    if isinstance(out, Exception):
        return "n/a", f"eager: {type(out).__name__}"

    strategy: tuple = (None,) * len(tensors)
    kwargs = {}
    if mode in FORCED:
        found = _forced(tensors, mode, lambda ts: _same_twice(eager(ts), eager(ts)))
        if found is None:
            return "n/a", "no dim to split"
        tensors, strategy = found
        if mode == "dp":
            kwargs["dataset_strategy"] = "data_parallel"
        else:
            from tests.parity import tensors_of

            kwargs["out_strategy"] = _out_strategy(tensors_of(eager(tensors)), mode)
    elif mode != "decide":
        found = _split_strategy(tensors, 4 if mode == "split4" else 2)
        if found is None:
            return "n/a", "no dim to split"
        strategy = tuple(found[1] if i == found[0] else None for i in range(len(tensors)))
    try:
        sharded = parity(fn, make, strategy, **kwargs)
    except Exception as e:  # noqa: BLE001 - classified
        return classify(e), _describe(e)
    return "pass", "", sharded


def _piece(t, r: int, world: int):
    """Rank ``r``'s quarter of ``t`` along dim 0 as DTensor cuts it (torch.chunk's pieces, then empty ones)."""
    pieces = t.chunk(world, 0)
    return pieces[r] if r < len(pieces) else t[t.shape[0]:]


def parity(fn, make, strategy, world: int = 4, tol: float = 1e-4, out_strategy=None,
           dataset_strategy: str = "full_batch") -> bool:
    """tests/parity.check_parity, where NaN equals NaN (a sample outside an op's domain gives NaN in eager too);
    outputs asked for split are gathered; under data_parallel each rank takes its quarter of every input and is
    compared with its quarter of the outputs and gradients. Returns whether the plan ran an op sharded."""
    import torch
    from torch.distributed.tensor import DTensor

    import shardfn as sf
    from shardfn.runtime import simulated_world
    from shardfn._simulation_internals import local_tensor_mode
    from tests.harness import on_rank
    from tests.parity import _clone, tensors_of

    dp = dataset_strategy == "data_parallel"

    def same(a, b):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)

    def expected(e, r):  # rank r's share of an eager value
        return _piece(e, r, world) if dp and e.dim() else e

    def weights(e):  # the loss's fixed, non-uniform weights of an eager output
        return torch.linspace(-1, 1, e.numel()).reshape(e.shape)

    with simulated_world(world):
        torch.manual_seed(0)
        call = make()
        ref_call = _clone(call)
        args = call.args
        if dp:
            mode = local_tensor_mode()
            args = tuple(mode.rank_map(lambda r, a=a: _piece(on_rank(a, r), r, world).detach().clone())
                         .requires_grad_(a.requires_grad) if a.dim() else a for a in call.args)
        sharded = sf.shard(fn, strategy, out_strategy=out_strategy, dataset_strategy=dataset_strategy)
        torch.manual_seed(1)
        out = sharded(*args)
        torch.manual_seed(1)
        ref = fn(*ref_call.args)
        outs = [o.full_tensor() if isinstance(o, DTensor) else o for o in tensors_of(out)]
        refs = tensors_of(ref)
        assert len(outs) == len(refs)
        for r in range(world):
            for o, e in zip(outs, refs):
                same(on_rank(o, r), expected(on_rank(e, r), r))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        # the outputs eager differentiates (a batch norm's saved statistics it does not; shardfn's decomposed graph
        # would)
        pairs = [(o, e) for o, e in zip(outs, refs)
                 if e.is_floating_point() and e.requires_grad and (e.dim() or not dp)]
        if any(a.requires_grad for a in inputs) and any(e.requires_grad for _, e in pairs):
            if dp:  # each rank's loss weighs its quarter of the outputs as the whole loss does
                mode = local_tensor_mode()
                sum((o * mode.rank_map(lambda r, e=e: _piece(weights(e), r, world))).sum() for o, e in pairs).backward()
            else:
                sum((o * weights(e)).sum() for o, e in pairs).backward()
            sum((e * weights(e)).sum() for _, e in pairs).backward()
            for a, e in zip(inputs, ref_call.args):
                if e.grad is not None:
                    assert a.grad is not None, "an input got no gradient"
                    for r in range(world):
                        same(on_rank(a.grad, r), expected(on_rank(e.grad, r), r))
        return ran_sharded(sf.explain(sharded, *args))


def _describe(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def group_key(detail: str) -> str:
    """A failure's group: its exception and message with numbers, shapes and names of values blurred."""
    key = re.sub(r"\d+", "N", detail)
    key = re.sub(r"'[^']*'", "'…'", key) if not key.startswith("KeyError") else key
    return key[:160]


# --- worker process ---------------------------------------------------------------------------------------------

def _worker(conn):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    db = _op_db()
    while True:
        task = conn.recv()
        if task is None:
            return
        index, mode = task
        t0 = time.monotonic()
        try:
            result, detail, *sharded = run_one(db[index], mode)
        except BaseException as e:  # noqa: BLE001 - reported, the worker goes on
            result, detail, sharded = "other", _describe(e), []
        conn.send((result, detail, time.monotonic() - t0, bool(sharded and sharded[0])))


class Pool:
    """One worker process running ops in turn; restarted after a crash or a timeout."""

    def __init__(self):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.proc = None

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        self.fresh = True

    def run(self, index: int, mode: str, limit_s: float) -> tuple[str, str, float, bool]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.monotonic()
        self.conn.send((index, mode))
        # the first op of a fresh worker also pays for its imports
        if self.conn.poll(limit_s + (60 if self.fresh else 0)):
            try:
                self.fresh = False
                return self.conn.recv()
            except EOFError:  # the worker died: waited for, so a crash is not read as a timeout
                self.proc.join(10)
        alive = self.proc.is_alive()
        self.close(kill=True)
        if alive:
            return "timeout", f"over {limit_s:.0f} s", time.monotonic() - t0, False
        return "other", f"worker died (exit code {self.proc.exitcode})", time.monotonic() - t0, False

    def close(self, kill: bool = False):
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def run_inline(names: list[str], modes=MODES) -> dict:
    """The named ops in this process (no worker, no time limit): {mode: {op name: (result, detail, seconds, ran
    sharded)}}."""
    db = _op_db()
    results = {m: {} for m in modes}
    for i in select(db, ",".join(names)):
        for m in modes:
            t0 = time.monotonic()
            r, detail, *sharded = run_one(db[i], m)
            results[m][op_name(db[i])] = (r, detail, time.monotonic() - t0, bool(sharded and sharded[0]))
    return results


def select(db, spec: str | None) -> list[int]:
    if not spec:
        return list(range(len(db)))
    if re.fullmatch(r"\d*:\d*", spec):
        a, b = spec.split(":")
        return list(range(len(db)))[int(a or 0):int(b) if b else None]
    names = set(spec.split(","))
    return [i for i, info in enumerate(db) if op_name(info) in names or info.name in names]


def report(results: dict, out=sys.stdout, verbose: bool = False) -> dict:
    """Print per-mode counts and failures grouped by exception; return the counts."""
    counts = {}
    for mode, per_op in results.items():
        c = collections.Counter(r for r, *_ in per_op.values())
        counted = sum(v for k, v in c.items() if k != "n/a")
        sharded = sum(r == "pass" and bool(rest[-1]) for r, *rest in per_op.values() if len(rest) > 2)
        counts[mode] = {**c, "pass, ran sharded": sharded}
        share = 100 * c["pass"] / counted if counted else 0
        print(f"{mode:7s} pass {c['pass']:4d} (ran sharded {sharded:4d})  error {c['error']:3d}  other "
              f"{c['other']:3d}  WRONG {c['WRONG']:2d}  timeout {c['timeout']:2d}  (of {counted}, {share:.1f}% pass; "
              f"{c['n/a']} not counted)", file=out)
    for mode, per_op in results.items():
        groups = collections.defaultdict(list)
        for name, (r, detail, *_) in per_op.items():
            if r not in ("pass", "n/a"):
                groups[(r, group_key(detail))].append(name)
        if not groups:
            continue
        print(f"\n== {mode}: failures by exception", file=out)
        for (r, key), names in sorted(groups.items(), key=lambda kv: (kv[0][0] != "WRONG", -len(kv[1]))):
            shown = names if verbose or len(names) <= 8 else names[:8] + [f"... {len(names) - 8} more"]
            print(f"  [{r}] {len(names):3d}  {key}\n         {', '.join(shown)}", file=out)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ops", default=None, help="a slice of op_db (10:60) or op names, comma-separated")
    p.add_argument("--limit-s", type=float, default=60.0, help="time limit per op and mode")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    assert all(m in MODES for m in modes), modes
    db = _op_db()
    indices = select(db, a.ops)
    start = time.monotonic()
    results = {m: {} for m in modes}
    pool = Pool()
    try:
        for k, i in enumerate(indices):
            if k and k % 50 == 0:
                print(f"... {k}/{len(indices)} ops, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            for m in modes:
                r, detail, secs, sharded = pool.run(i, m, a.limit_s)
                results[m][op_name(db[i])] = (r, detail, secs, sharded)
                if a.verbose or r in ("WRONG", "timeout"):
                    print(f"{op_name(db[i]):40s} {m:7s} {r:8s} {secs:6.1f}s {detail[:120]}", flush=True)
    finally:
        pool.close()
    counts = report(results, verbose=a.verbose)
    print(f"\n{len(indices)} ops, {time.monotonic() - start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"counts": counts, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
