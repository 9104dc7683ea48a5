"""The signals library code reads to tell that it is being traced (private torch state, kept here alone).

transformers, torch.utils.checkpoint and others skip value-dependent shortcuts when ``torch.compiler.
is_compiling()`` is true, and pick trace-friendly paths when a non-strict (make_fx-based) trace is running.
torch.export's non-strict mode sets both while it runs the user's code; capture sets them the same way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.compiler

__all__ = ["looks_like_tracing"]

_FLAGS = ("_is_compiling_flag", "_is_non_strict_tracing_flag")


@contextlib.contextmanager
def looks_like_tracing() -> Iterator[None]:
    """While it is active, ``torch.compiler.is_compiling()`` is true, as inside torch.compile/torch.export."""
    present = [f for f in _FLAGS if hasattr(torch.compiler, f)]
    old = {f: getattr(torch.compiler, f) for f in present}
    try:
        for f in present:
            setattr(torch.compiler, f, True)
        yield
    finally:
        for f, v in old.items():
            setattr(torch.compiler, f, v)
