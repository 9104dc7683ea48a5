"""Stage 3: Plan -> ParallelProgram -> results."""

from .lower import ParallelProgram, lower
from .run import Entry

__all__ = ["Entry", "ParallelProgram", "lower"]
