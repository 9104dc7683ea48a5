"""Every OpInfo operator through shardfn on 4 simulated ranks: outputs and gradients against single-device eager.

    python bench/opinfo_sweep.py [--modes decide,split4,split2] [--ops 0:100 | --ops add,nn.functional.pad]
                                 [--limit-s 60] [--json out.json] [-v]

For each entry of torch's op_db (name.variant), the first float32 sample on CPU is called through
``sf.shard(fn, in_strategy)`` inside ``shardfn.runtime.simulated_world(4)`` and compared with eager rank by rank,
outputs and the gradients of every input that requires grad (tests/parity.check_parity). ``fn`` takes the
sample's tensors as positional arguments, in flat order. Modes:

  decide  every input left to the search (in_strategy all None);
  split4  the first tensor input split 4 ways on its first dim of a size divisible by 4 (the others None);
  split2  the same, 2 ways.

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

MODES = ("decide", "split4", "split2")
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


def _first_sample(info):
    import torch

    if torch.float32 not in info.supported_dtypes("cpu"):
        return None
    grad = bool(info.supports_autograd)
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=grad):
        return sample
    return None


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


def run_one(info, mode: str) -> tuple[str, str]:
    """(result, detail) for one op in one mode; result 'n/a' where the op is not counted."""
    import torch
    import torch.utils._pytree as pytree

    from tests.parity import Call, _loss

    if info.name in UNINITIALISED:
        return "n/a", "uninitialised memory"
    sample = _first_sample(info)
    if sample is None:
        return "n/a", "no float32 sample"
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

    try:  # eager, with gradients, on the same sample
        torch.manual_seed(1)
        out = fn(*make().args)
        if any(t.requires_grad for t in tensors) and any(
                o.requires_grad for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)):
            _loss(out).backward()
    except Exception as e:  # noqa: BLE001
        return "n/a", f"eager: {type(e).__name__}"

    strategy = [None] * len(tensors)
    if mode != "decide":
        found = _split_strategy(tensors, 4 if mode == "split4" else 2)
        if found is None:
            return "n/a", "no dim to split"
        strategy[found[0]] = found[1]
    try:
        parity(fn, make, tuple(strategy))
    except Exception as e:  # noqa: BLE001 - classified
        return classify(e), _describe(e)
    return "pass", ""


def parity(fn, make, strategy, world: int = 4, tol: float = 1e-4) -> None:
    """tests/parity.check_parity, where NaN equals NaN (a sample outside an op's domain gives NaN in eager too)."""
    import torch

    import shardfn as sf
    from shardfn.runtime import simulated_world
    from tests.harness import on_rank
    from tests.parity import _clone, _loss, tensors_of

    def same(a, b):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)

    with simulated_world(world):
        torch.manual_seed(0)
        call = make()
        ref_call = _clone(call)
        torch.manual_seed(1)
        out = sf.shard(fn, strategy)(*call.args)
        torch.manual_seed(1)
        ref = fn(*ref_call.args)
        outs, refs = tensors_of(out), tensors_of(ref)
        assert len(outs) == len(refs)
        for r in range(world):
            for o, e in zip(outs, refs):
                same(on_rank(o, r), on_rank(e, r))
        inputs = [a for a in call.args if isinstance(a, torch.Tensor)]
        if any(a.requires_grad for a in inputs) and any(o.requires_grad for o in refs):
            _loss(out).backward()
            _loss(ref).backward()
            for a, e in zip(inputs, ref_call.args):
                if e.grad is not None:
                    assert a.grad is not None, "an input got no gradient"
                    for r in range(world):
                        same(on_rank(a.grad, r), on_rank(e.grad, r))


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
            result, detail = run_one(db[index], mode)
        except BaseException as e:  # noqa: BLE001 - reported, the worker goes on
            result, detail = "other", _describe(e)
        conn.send((result, detail, time.monotonic() - t0))


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

    def run(self, index: int, mode: str, limit_s: float) -> tuple[str, str, float]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.monotonic()
        self.conn.send((index, mode))
        # the first op of a fresh worker also pays for its imports
        if self.conn.poll(limit_s + (60 if self.fresh else 0)):
            try:
                self.fresh = False
                return self.conn.recv()
            except EOFError:
                pass
        alive = self.proc.is_alive()
        self.close(kill=True)
        if alive:
            return "timeout", f"over {limit_s:.0f} s", time.monotonic() - t0
        return "other", f"worker died (exit code {self.proc.exitcode})", time.monotonic() - t0

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
    """The named ops in this process (no worker, no time limit): {mode: {op name: (result, detail, seconds)}}."""
    db = _op_db()
    results = {m: {} for m in modes}
    for i in select(db, ",".join(names)):
        for m in modes:
            t0 = time.monotonic()
            r, detail = run_one(db[i], m)
            results[m][op_name(db[i])] = (r, detail, time.monotonic() - t0)
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
        c = collections.Counter(r for r, _, _ in per_op.values())
        counted = sum(v for k, v in c.items() if k != "n/a")
        counts[mode] = dict(c)
        share = 100 * c["pass"] / counted if counted else 0
        print(f"{mode:7s} pass {c['pass']:4d}  error {c['error']:3d}  other {c['other']:3d}  WRONG {c['WRONG']:2d}  "
              f"timeout {c['timeout']:2d}  (of {counted}, {share:.1f}% pass; {c['n/a']} not counted)", file=out)
    for mode, per_op in results.items():
        groups = collections.defaultdict(list)
        for name, (r, detail, _) in per_op.items():
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
                r, detail, secs = pool.run(i, m, a.limit_s)
                results[m][op_name(db[i])] = (r, detail, secs)
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
