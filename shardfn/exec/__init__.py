"""Stage 3: Plan -> ParallelProgram -> results."""

from .lower import ParallelProgram, lower

__all__ = ["ParallelProgram", "lower"]
