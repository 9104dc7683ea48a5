"""Gradient all-reduce fusion: which gradient reductions share one collective.

One rule for both stages: the plan lists each gradient reduction's bucket (explain), and exec fuses the traced
backward graph's reductions with it. A bucket holds reductions of one process group and dtype, taken in the
order their gradients are ready, until the next would take it over the size limit (DDP's rule; its default
25 MB too). Split parameters' all-gathers and their gradients' reduce-scatters (FSDP's) bucket so too, within
one unit (:func:`bucket_unit`): a bucket of several layers would hold them all whole at once.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable, Sequence

__all__ = ["assign_buckets", "bucket_bytes", "bucket_unit", "in_buckets"]


def bucket_bytes() -> int:
    """The size limit of one fused gradient all-reduce: SHARDFN_BUCKET_MB (default 25, as DDP's; 0 turns
    fusion off)."""
    return int(float(os.environ.get("SHARDFN_BUCKET_MB", "25")) * 2**20)


def bucket_unit(name: str) -> str:
    """The unit whose parameters' gathers and gradients' reduce-scatters may share a bucket, as FSDP2 users wrap
    one: a parameter's path up to its first index (``model.layers.3``), else "" (the model's other parameters
    together)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def assign_buckets(items: Sequence[tuple[Hashable, int]], limit: int) -> list[int]:
    """The bucket of each ``(kind, nbytes)`` item, items in the order they are ready; buckets are numbered in
    the order they open. ``kind`` (group and dtype) never mixes within a bucket."""
    numbers: list[int] = []
    open_by_kind: dict[Hashable, tuple[int, int]] = {}  # kind -> (bucket number, bytes in it)
    count = 0
    for kind, nbytes in items:
        current = open_by_kind.get(kind)
        if current is None or current[1] + nbytes > limit:
            current = (count, 0)
            count += 1
        open_by_kind[kind] = (current[0], current[1] + nbytes)
        numbers.append(current[0])
    return numbers


def in_buckets(items: Sequence[Any], kind: Callable[[Any], Hashable], nbytes: Callable[[Any], int],
               limit: int) -> list[list[Any]]:
    """``items`` grouped into buckets by :func:`assign_buckets`' rule, the buckets in the order they open (the
    same on every rank for the same items)."""
    numbers = assign_buckets([(kind(x), nbytes(x)) for x in items], limit)
    buckets: list[list[Any]] = [[] for _ in range(max(numbers, default=-1) + 1)]
    for x, number in zip(items, numbers):
        buckets[number].append(x)
    return buckets
