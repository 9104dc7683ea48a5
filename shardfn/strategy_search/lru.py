"""A bounded memo: what the search keeps between plans (DTensor's answers per op and shapes, FLOP counts)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["LRU"]


class LRU:
    """Keeps the ``maxsize`` entries used last; ``get(key, make)`` returns the entry, made by ``make()`` once."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        try:
            self._entries.move_to_end(key)
            return self._entries[key]
        except KeyError:
            value = self._entries[key] = make()
            if len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
            return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
