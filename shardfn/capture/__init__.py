"""Stage 1: fn + example inputs -> CapturedGraph."""

from .graph import CapturedGraph, GraphInput
from .trace import CaptureError, capture, capturing, check_not_transformed

__all__ = ["CaptureError", "CapturedGraph", "GraphInput", "capture", "capturing", "check_not_transformed"]
