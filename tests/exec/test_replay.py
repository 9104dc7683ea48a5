"""replay: an inference graph's code replayed as a recorded graph gives what the code gives at every call.

A CUDA graph reads its inputs at the addresses it was captured with and writes its outputs into its own pool.
The recorder here does the same on the CPU (it runs the code on the very tensors it was captured on, and copies
the results into the outputs of the capture), so an input not copied where the graph reads it, or an output
handed out of the pool and overwritten by the next replay, shows as a wrong value.
"""

import sys

import torch
import torch.fx

from shardfn.exec import replay
from shardfn.exec.replay import replayed


class _Recorded:
    """A stand-in for torch.cuda.CUDAGraph: replay() runs ``fn`` on the captured tensors into the captured outputs."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs, self.replays = fn, inputs, outputs, 0

    def replay(self):
        self.replays += 1
        for o, new in zip(self.outputs, self.fn(list(self.inputs))):
            o.copy_(new)


def _unwritten(t):
    return t.fill_(float("nan") if t.is_floating_point() else -7)


class _Recorder:
    def __init__(self):
        self.graphs: list[_Recorded] = []

    def __call__(self, fn, inputs):
        # what fn returned while captured: in the pool and unwritten, or a view of an input
        outputs = [o if replay._storages([o]) & replay._storages(inputs) else _unwritten(o)
                   for o in fn(list(inputs))]
        self.graphs.append(_Recorded(fn, inputs, outputs))
        return self.graphs[-1], outputs


def _code(args):
    """A boxed inference graph's code: a layer reading a weight, a cache and a token; the cache's next value."""
    w, cache, token = args
    args.clear()
    return [token @ w + cache.sum(0), torch.cat([cache[1:], token @ w])]


def _graph(nbytes=0, viewed=0):
    """A graph whose one op makes ``nbytes``, and a view of its input of ``viewed`` bytes (which makes none)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    t = g.call_function(torch.ops.aten.t.default, (x,))
    add = g.call_function(torch.ops.aten.add.Tensor, (t, 1))
    g.output(add)
    t.meta["val"] = torch.empty(viewed // 4, device="meta")
    add.meta["val"] = torch.empty(nbytes // 4, device="meta")
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _decode(run, w, cache, steps, tokens=None):
    """generate()'s loop: a new token every call, the weight updated in place now and then, the cache written
    back in place (as AOTAutograd writes a mutated input back); each call's outputs against the code's own."""
    outs, made = [], []
    for step in range(steps):
        token = torch.randn(1, 4) if tokens is None else tokens(step)
        if tokens is None:  # each token at an address of its own (freed, the next may land where it lay: then it
            made.append(token)  # reads as static, as an allocator's block does; the tests that want that say so)
        if step == 3:
            w.mul_(2)  # an optimizer's step between calls: read where it lies
        want = _code([w, cache.clone(), token])
        got = run([w, cache, token])
        for g, x in zip(got, want):
            torch.testing.assert_close(g, x)
        cache.copy_(got[1])
        del token, want
        outs.append((got, [g.clone() for g in got]))
    for got, then in outs:  # what was handed out is the caller's own: no later replay wrote it
        for g, t in zip(got, then):
            assert torch.equal(g, t)
    return [got for got, _ in outs]


def test_a_small_static_input_that_moved_is_copied_from_then_on():
    recorder = _Recorder()
    run = replayed(_code, _graph(), "cpu", recorder)
    w = torch.randn(4, 4)
    _decode(run, w, torch.randn(3, 4), steps=3)
    _decode(run, w, torch.randn(3, 4), steps=5)  # another generate(), another cache
    assert len(recorder.graphs) == 2 and recorder.graphs[1].inputs[0] is w and recorder.graphs[1].replays == 4


def test_replays_after_two_calls_and_copies_what_moves():
    recorder, notes = _Recorder(), []
    run = replayed(_code, _graph(), "cpu", recorder, notes.append)
    w, cache = torch.randn(4, 4), torch.randn(3, 4)
    outs = _decode(run, w, cache, steps=8)
    assert len(recorder.graphs) == 1 and recorder.graphs[0].replays == 7
    graph = recorder.graphs[0]
    assert graph.inputs[0] is w and graph.inputs[1] is cache and graph.inputs[2] is not None  # token: a buffer
    assert notes == ["the inference graph replays as a CUDA graph: 2 inputs read where they lie, 1 copied in "
                     "(capture 1)"]
    assert all(not any(o is p for p in graph.outputs) for out in outs for o in out)


def test_an_input_back_at_the_same_address_by_chance_is_copied_from_the_next_capture():
    recorder = _Recorder()
    run = replayed(_code, _graph(), "cpu", recorder)
    reused = torch.randn(1, 4)

    def tokens(step):  # the first two tokens in one buffer (an allocator giving a freed block back), then new ones
        if step < 2:
            return reused.copy_(torch.randn(1, 4))
        return torch.randn(1, 4)

    _decode(run, torch.randn(4, 4), torch.randn(3, 4), steps=8, tokens=tokens)
    assert len(recorder.graphs) == 2
    assert recorder.graphs[1].inputs[2] is not reused and recorder.graphs[1].replays == 5


class _Allocator:
    """CUDA's caching allocator, for a token: its one block handed out again whenever no one holds it."""

    def __init__(self, recorder):
        self.block = torch.empty(1, 4)
        self.free = sys.getrefcount(self.block)
        self.handed = 0
        self.recorder = recorder  # (whose graphs a test reads after they are let go of)

    def __call__(self, step):
        kept = sum(x is self.block for g in self.recorder.graphs for x in g.inputs)
        if sys.getrefcount(self.block) == self.free + kept:
            self.handed += 1
            return self.block.copy_(torch.randn(1, 4))
        return torch.randn(1, 4)


def test_an_input_made_anew_that_comes_back_at_one_address_is_learnt_once():
    recorder = _Recorder()
    run = replayed(_code, _graph(), "cpu", recorder)
    allocator = _Allocator(recorder)
    _decode(run, torch.randn(4, 4), torch.randn(3, 4), steps=12, tokens=allocator)
    assert allocator.handed > 3  # (the block came back at calls after the graph let go of it)
    assert len(recorder.graphs) == 2 and recorder.graphs[1].replays == 12 - 3


def test_a_new_static_input_each_few_calls_stops_capturing(monkeypatch):
    monkeypatch.setattr(replay, "_SMALL", 0)  # (a weight and a cache of the sizes that are not copied)
    recorder, notes = _Recorder(), []
    run = replayed(_code, _graph(), "cpu", recorder, notes.append)
    for _ in range(2 * replay._STRIKES + 2):  # a new cache every second call: no graph replays twice
        _decode(run, torch.randn(4, 4), torch.randn(3, 4), steps=2)
    assert len(recorder.graphs) == replay._STRIKES
    assert notes[-1].startswith("the inference graph is not replayed as a CUDA graph: 3 captures did not replay")


def test_left_alone_where_turned_off_large_or_aliasing(monkeypatch):
    notes = []
    assert replayed(_code, _graph(2 * replay._MOST_BYTES), "cpu", _Recorder(), notes.append) is _code
    assert notes == ["the inference graph is not replayed as a CUDA graph: its values take 512 MiB, over 256 MiB"]
    # a weight's transpose is a view: a decoding step of large weights is still small
    assert replayed(_code, _graph(4096, viewed=2 * replay._MOST_BYTES), "cpu", _Recorder()) is not _code
    monkeypatch.setenv("SHARDFN_CUDA_GRAPHS", "0")
    assert replayed(_code, _graph(), "cpu", _Recorder()) is _code
    monkeypatch.delenv("SHARDFN_CUDA_GRAPHS")

    def viewing(args):  # an output that is a view of an input: AOTAutograd rebuilds its alias from it
        w, cache, token = args
        args.clear()
        return [cache[1:], token @ w]

    recorder = _Recorder()
    run = replayed(viewing, _graph(), "cpu", recorder)
    w, cache = torch.randn(4, 4), torch.randn(3, 4)
    for _ in range(4):
        out = run([w, cache, torch.randn(1, 4)])
        assert out[0].data_ptr() == cache[1:].data_ptr()
    assert len(recorder.graphs) == 1 and recorder.graphs[0].replays == 0


def test_a_capture_that_raises_runs_the_code(monkeypatch):
    def refusing(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    notes = []
    run = replayed(_code, _graph(), "cpu", refusing, notes.append)
    _decode(run, torch.randn(4, 4), torch.randn(3, 4), steps=4)
    assert notes == ["the inference graph is not replayed as a CUDA graph: its capture raised RuntimeError: "
                     "operation not permitted when stream is capturing"]


def test_inputs_off_the_device_are_never_captured():
    recorder = _Recorder()

    def code(args):
        w, s = args
        args.clear()
        return [w * s]

    notes = []
    run = replayed(code, _graph(), "cpu", recorder, notes.append)
    w = torch.randn(4)
    for s in range(4):  # an int's value would be fixed in the graph
        torch.testing.assert_close(run([w, s])[0], w * s)
    assert not recorder.graphs
    assert notes == ["the inference graph is not replayed as a CUDA graph: its input 1 is int, not a tensor on cpu"]
    assert replay._where(torch.tensor(1.0), "cuda") is None  # nor a CPU scalar's, in a graph on the GPU


def test_an_input_of_another_shape_is_never_copied_into_the_captured_buffer():
    # a buffer of 2 rows took a 1-row input by broadcasting it (2 rows out, both wrong), and refused 3 rows
    def code(args):
        w, x = args
        args.clear()
        return [x @ w]

    recorder = _Recorder()
    run = replayed(code, _graph(), "cpu", recorder)
    w = torch.randn(4, 4)
    for rows in (2, 2, 2, 1, 3, 3, 3, 2):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(run([w, x])[0], x @ w)
    assert [g.replays for g in recorder.graphs] == [2, 3]  # (captured for 2 rows, then for 3)
