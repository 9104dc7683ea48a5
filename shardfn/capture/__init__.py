"""Stage 1: fn + example inputs -> CapturedGraph."""

from .graph import CapturedGraph, GraphInput, is_in_place
from .trace import CaptureError, capture, capturing, check_not_transformed, input_names

__all__ = ["CaptureError", "CapturedGraph", "GraphInput", "capture", "capturing", "check_not_transformed",
           "input_names", "is_in_place"]
