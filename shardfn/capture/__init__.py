"""Stage 1: fn + example inputs -> CapturedGraph."""

from .graph import CaptureError, CapturedGraph, GraphInput, is_in_place
from .trace import argument_name, capture, capturing, check_not_transformed, split_arguments

__all__ = ["CaptureError", "CapturedGraph", "GraphInput", "argument_name", "capture", "capturing",
           "check_not_transformed", "is_in_place", "split_arguments"]
