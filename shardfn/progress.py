"""A plan's progress on the ``shardfn`` logger: each stage (the capture, then the search's steps) says what it
starts on as it starts, and what it made and in how long when it ends.

INFO for a large call (arguments and parameters of over 100 M elements: a model whose plan takes seconds) or once
the plan has taken over a second, DEBUG before (a small function's plans stay quiet; their lines come out at INFO
if the plan turns slow)."""

from __future__ import annotations

import logging
import time
from typing import Callable

__all__ = ["Progress"]

log = logging.getLogger("shardfn")
_LARGE = 10**8  # elements of a call whose plan reports from its start
_SLOW_S = 1.0  # seconds after which any plan reports


class Progress:
    """Runs, times and reports the stages of one plan."""

    def __init__(self, elements: int = 0):
        self.start = time.perf_counter()
        self.loud = elements >= _LARGE
        self.quiet: list[str] = []  # the lines said at DEBUG only so far

    def say(self, line: str) -> None:
        if not self.loud and time.perf_counter() - self.start > _SLOW_S:
            self.loud = True
            for earlier in self.quiet:
                log.info("shardfn %s", earlier)
            self.quiet = []
        if self.loud:
            log.info("shardfn %s", line)
        else:
            log.debug("shardfn %s", line)
            self.quiet.append(line)

    def __call__(self, stage: str, run: Callable, describe: Callable, starting: str = ""):
        """``run()``, said as it starts (with ``starting``) and as it ends (with ``describe(result)``)."""
        self.say(f"{stage}: started{', ' + starting if starting else ''}")
        began = time.perf_counter()
        result = run()
        self.say(f"{stage}: {describe(result)} in {time.perf_counter() - began:.2f} s")
        return result
