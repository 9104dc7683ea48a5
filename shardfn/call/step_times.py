"""The measured step time of one program: its calls' wall times, handed to its plan when the plan is read.

Each call of a sharded callable notes when it began (before its signature is read: shardfn's own work per call is
in the step, as a user timing the step sees it) and when its program's forward returned, and, where its outputs
need gradients, when their first gradient arrived and when that backward pass ended (a callback autograd's engine
runs once the whole pass is done). A step is forward + backward of one call; the plan shows the median of the last
:data:`KEPT` completed steps of the program, its first call (the one that captured, planned and traced it) left
out. What runs between the forward and the backward (the loss, the caller's own ops) is not in it; the backward's
end is the end of the whole backward pass, so the backward of ops before the call is in it.

Cost per call: two clock readings and a gradient hook on each output that needs one (a few microseconds). On the
CPU the clock is ``time.perf_counter``; on CUDA a call records CUDA events instead (no synchronize on the hot
path), whose times are read (waiting for the last of them) only when the plan is read.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import torch

__all__ = ["KEPT", "StepTimes", "mark"]

KEPT = 20  # the last steps the median is taken over


class _Step:
    __slots__ = ("forward", "backward", "grad")

    def __init__(self, forward: tuple, grad: bool):
        self.forward, self.backward, self.grad = forward, None, grad  # (start, end) marks


def mark(cuda: bool):
    """A point in time: ``time.perf_counter()``, or on CUDA an event recorded on the current stream."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class StepTimes:
    """The wall times of one program's calls (see the module's doc)."""

    def __init__(self):
        self.calls = 0
        self.cuda = False
        self.steps: collections.deque[_Step] = collections.deque(maxlen=KEPT)

    def ran(self, start, outs) -> None:
        """The call begun at ``start`` (a :func:`mark`) returned ``outs`` from the program: its forward's time, and
        a hook for its backward's."""
        self.cuda = not isinstance(start, float)
        end = mark(self.cuda)
        self.calls += 1
        if self.calls == 1:  # it captured, planned and traced: not a step
            return
        needs = [o for o in outs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        step = _Step((start, end), bool(needs))
        self.steps.append(step)
        if not needs:
            return
        begun = []

        def arrived(_grad) -> None:  # the first of the outputs' gradients: the call's backward begins
            if begun:
                return
            begun.append(mark(self.cuda))

            def done() -> None:
                step.backward = (begun[0], mark(self.cuda))

            torch.autograd.Variable._execution_engine.queue_callback(done)

        for o in needs:  # (a tensor hook each: a few microseconds, a sixth of register_multi_grad_hook's)
            o.register_hook(arrived)

    def measured(self) -> tuple[float, str] | None:
        """The median step time and what it is, or None while no step has completed."""
        whole = [s for s in self.steps if s.backward is not None]
        if whole:
            times = [_seconds(*s.forward) + _seconds(*s.backward) for s in whole]
            what = "forward+backward"
        else:
            times = [_seconds(*s.forward) for s in self.steps if not s.grad]
            what = "forward (no gradients)"
        if not times:
            return None
        clock = "CUDA events" if self.cuda else "wall clock"
        return statistics.median(times), (f"{what} of the last {len(times)} calls, median ({clock}; the first call, "
                                          "which captured, planned and traced, left out)")

    def on(self, plan):
        """``plan`` with the measured step time (``measured_s``, ``measured``), where a step has completed."""
        found = self.measured()
        if found is None:
            return plan
        return dataclasses.replace(plan, measured_s=found[0], measured=found[1])
