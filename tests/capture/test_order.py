"""The captured graph's canonical order: ranks whose Python ran independent work in another order (a set of
strings iterates by the process's hash seed) capture the same graph, names and all; ops whose order is what they
do (random draws, writes into inputs) keep it."""

import torch
import torch.nn.functional as F

from shardfn.capture import capture

EXAMPLE = (torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True))


def _code(fn, args=EXAMPLE):
    return capture(fn, args, {}).gm.code


def tables(x, w, order):
    """Per-kind tables computed in ``order`` (as transformers' Gemma 3 does for its attention types)."""
    made = {}
    for kind in order:
        made[kind] = torch.sin(x) @ w if kind == "global" else torch.cos(x) * 2
    return made["global"].sum() + made["local"].sum()


def test_independent_work_in_another_order_is_the_same_graph():
    a = _code(lambda x, w: tables(x, w, ["global", "local"]))
    b = _code(lambda x, w: tables(x, w, ["local", "global"]))
    assert a == b


def test_random_draws_keep_their_order():
    # which draw feeds which output is part of what fn computes
    a = _code(lambda x, w: (torch.rand_like(x) * 2, torch.rand_like(w)))
    b = _code(lambda x, w: (torch.rand_like(w), torch.rand_like(x) * 2)[::-1])
    assert a != b
    assert _code(lambda x, w: (F.dropout(x, 0.5), F.dropout(w, 0.5))) == \
        _code(lambda x, w: (F.dropout(x, 0.5), F.dropout(w, 0.5)))


def test_writes_into_inputs_stay_after_their_readers():
    # functionalization writes an updated input back at the end (copy_): every read of the old value comes first
    def update(x, w, running):
        reads = [running * k for k in range(1, 9)] + [torch.sin(running), running.exp(), running.sum().expand(6),
                                                     running.view(2, 3).t().reshape(6) * 3]  # through views too
        running.mul_(0.9).add_(x.mean(0) * 0.1)
        return x @ w, sum(reads)

    gm = capture(update, (*EXAMPLE, torch.zeros(6)), {}).gm
    x, w = (t.detach() for t in EXAMPLE)
    running, expected_running = torch.randn(6), None
    expected_running = running.clone()
    expected = update(x, w, expected_running)
    out = gm(x, w, running)
    torch.testing.assert_close(out[1], expected[1])  # read before the write
    torch.testing.assert_close(running, expected_running)  # and written


def test_ranks_on_their_own_devices_hold_one_graph():
    # each rank traces on its own device (cuda:0, cuda:1, ...; here cpu:0 and cpu:1 stand in): factory ops carry
    # it, and ranks must still hold one program as they compare it, in one order
    def tables_on(device):
        def fn(x):
            return [x * k for k in range(1, 5)] + [torch.arange(n, device=device, dtype=torch.float32) + n
                                                   for n in range(2, 10)]
        return fn

    a, b = (capture(tables_on(torch.device("cpu", i)), (torch.randn(4, 6),), {}) for i in (0, 1))
    assert a.gm.code != b.gm.code and "index=0" in a.gm.code  # each its own device
    assert a.code_across_ranks() == b.code_across_ranks()
