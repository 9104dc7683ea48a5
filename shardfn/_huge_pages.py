"""numpy's huge pages turned off while a plan is searched.

numpy advises the kernel to back each large array with 2 MiB pages (madvise(MADV_HUGEPAGE)); where the kernel's
transparent huge pages defragment on such advice (``/sys/kernel/mm/transparent_hugepage/defrag``: madvise, the
common default), a fault in a fresh region may stall on compacting memory first. The search allocates a few GB of
short-lived matrices (pricing's edges, the solver's sums): on a host up for hours, Llama-3.1-405B's shape priced
in 6.4 s with the advice, 2.4 s of it in the kernel, against 4.0 s (0.4 in the kernel) without. Arrays made
inside keep the 4 KiB pages; numpy's setting is restored on the way out."""

from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["huge_pages_off"]


def _setter():
    """numpy's switch (private in numpy 1 and 2 alike; None where a numpy lacks it: nothing to turn off)."""
    for module in ("_core", "core"):
        setter = getattr(getattr(getattr(np, module, None), "multiarray", None), "_set_madvise_hugepage", None)
        if setter is not None:
            return setter
    return None


@contextlib.contextmanager
def huge_pages_off():
    """numpy's huge-page advice off inside, as it was on the way out."""
    setter = _setter()
    was_on = setter(False) if setter is not None else None
    try:
        yield
    finally:
        if was_on:
            setter(True)
