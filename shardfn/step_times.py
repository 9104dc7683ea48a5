"""The measured step time of one program: its calls' wall times, handed to its plan when the plan is read.

Each call of a program (one per call signature: shardfn.programs) notes when its forward began and ended, and,
where its outputs need gradients, when their first gradient arrived and when that backward pass ended (a callback
autograd's engine runs once the whole pass is done). A step is forward + backward of one call; the plan shows the
median of the last :data:`KEPT` completed steps, the program's first call (the one that captured, planned and
traced it) left out. What runs between the forward and the backward (the loss, the caller's own ops) is not in
it; the backward's end is the end of the whole backward pass, so the backward of ops before the call is in it.

Cost per call: two clock readings and a gradient hook on the outputs. On the CPU the clock is
``time.perf_counter``; on CUDA a call records CUDA events instead (no synchronize on the hot path), whose times are
read (waiting for the last of them) only when the plan is read.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import torch

__all__ = ["KEPT", "StepTimes"]

KEPT = 20  # the last steps the median is taken over


class _Step:
    __slots__ = ("forward", "backward", "grad")

    def __init__(self, forward: tuple, grad: bool):
        self.forward, self.backward, self.grad = forward, None, grad  # (start, end) marks


class StepTimes:
    """The wall times of one program's calls (see the module's doc)."""

    def __init__(self):
        self.calls = 0
        self.cuda = False
        self.steps: collections.deque[_Step] = collections.deque(maxlen=KEPT)

    def start(self):
        """A mark where a call begins."""
        return self._mark()

    def ran(self, start, outs) -> None:
        """The call begun at ``start`` returned ``outs``: its forward's time, and a hook for its backward's."""
        end = self._mark()
        self.calls += 1
        if self.calls == 1:  # it captured, planned and traced: not a step; it says where the program runs
            self.cuda = any(isinstance(o, torch.Tensor) and o.device.type == "cuda" for o in outs)
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
            begun.append(self._mark())

            def done() -> None:
                step.backward = (begun[0], self._mark())

            torch.autograd.Variable._execution_engine.queue_callback(done)

        for o in needs:  # (a tensor hook each: a few microseconds, a sixth of register_multi_grad_hook's)
            o.register_hook(arrived)

    def measured(self) -> tuple[float, str] | None:
        """The median step time and what it is, or None while no step has completed."""
        whole = [s for s in self.steps if s.backward is not None]
        if whole:
            times = [self._seconds(*s.forward) + self._seconds(*s.backward) for s in whole]
            what = "forward+backward"
        else:
            times = [self._seconds(*s.forward) for s in self.steps if not s.grad]
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

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(start, end) -> float:
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
