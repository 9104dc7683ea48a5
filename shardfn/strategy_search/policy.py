"""What each ``level`` decides, in one place: the search, the read-out, recompute and the call site read it here.

Level 0 maximises the compute sharding saves per second of communication; level 1 minimises per-rank memory, then
time (FSDP's trade: parameters stored split and gathered again in backward, recompute wherever it lowers the
peak); level 2 minimises step time within the device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LevelPolicy", "level_policy"]


@dataclass(frozen=True)
class LevelPolicy:
    level: int
    objective: str  # what the solve minimises: "ratio" (the inverse of level 0's), "memory" or "time"
    said: str  # the objective in words (the plan page)
    # split parameters gathered again in backward instead of kept whole from forward (FSDP's reshard)
    regathers: bool
    # recompute chosen wherever it lowers the peak, not only where a plan would not fit without it
    recomputes_to_lower_peak: bool
    # data parallelism leaves parameters no one placed to the search (stored split, as FSDP), not whole (as DDP)
    searches_data_parallel_parameters: bool
    # where the read-out's walk finds a plan over the memory, the solve runs again within a lower budget
    # (level 1 is already the least memory: there is nothing lower to try)
    solves_again_lower: bool


_POLICIES = {
    0: LevelPolicy(0, "ratio", "maximise compute saved per second of communication", regathers=False,
                   recomputes_to_lower_peak=False, searches_data_parallel_parameters=False, solves_again_lower=True),
    1: LevelPolicy(1, "memory", "minimise per-rank memory, then time", regathers=True,
                   recomputes_to_lower_peak=True, searches_data_parallel_parameters=True, solves_again_lower=False),
    2: LevelPolicy(2, "time", "minimise step time within the device's memory", regathers=False,
                   recomputes_to_lower_peak=False, searches_data_parallel_parameters=False, solves_again_lower=True),
}


def level_policy(level: int) -> LevelPolicy:
    try:
        return _POLICIES[level]
    except KeyError:
        raise ValueError(f"level={level!r}: use 0 (compute per communication), 1 (least memory) or 2 (fastest "
                         "step)") from None
