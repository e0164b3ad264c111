"""A sorted list kept in blocks, for the indices with one entry per queued job
or finished run: an insertion or removal moves one block of at most
``2 x LOAD`` entries, not the whole queue. Duplicates are allowed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any, Generic, TypeVar

__all__ = ["SortedKeys"]

K = TypeVar("K")

LOAD = 512  # a block is split once it holds twice this many keys


class SortedKeys(Generic[K]):
    """Keys in ascending order; ``add`` and ``remove`` cost O(log n + LOAD)."""

    __slots__ = ("_blocks", "_maxes", "_len")

    def __init__(self, keys: Iterable[K] = ()) -> None:
        if keys == ():  # a new empty lane: the common case, kept cheap
            self._blocks: list[list[Any]] = []
            self._maxes: list[Any] = []
            self._len = 0
            return
        ordered: list[Any] = sorted(keys)  # type: ignore[type-var]
        self._blocks = [ordered[i:i + LOAD] for i in range(0, len(ordered), LOAD)]
        self._maxes = [b[-1] for b in self._blocks]
        self._len = len(ordered)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self._blocks)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SortedKeys):
            return self._len == other._len and list(self) == list(other)
        if isinstance(other, list):
            return self._len == len(other) and list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"SortedKeys({list(self)!r})"

    def __getitem__(self, i: int) -> K:
        """The ``i``-th key (O(number of blocks); for the median, not hot paths)."""
        if i == 0 and self._len:  # the head: what decisions ask for
            return self._blocks[0][0]  # type: ignore[no-any-return]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("SortedKeys index out of range")
        for block in self._blocks:
            if i < len(block):
                return block[i]  # type: ignore[no-any-return]
            i -= len(block)
        raise IndexError("SortedKeys index out of range")  # unreachable: lengths agree

    def rank(self, key: K) -> int:
        """How many keys are below ``key``: O(number of blocks + log LOAD)."""
        i = bisect.bisect_left(self._maxes, key)
        below = sum(map(len, self._blocks[:i]))
        if i < len(self._blocks):
            below += bisect.bisect_left(self._blocks[i], key)
        return below

    def iter_from(self, key: Any, after: bool = False) -> Iterator[K]:
        """The keys from the first at or above ``key`` (above, with ``after``)
        on; the keys must not change while it is read."""
        blocks, maxes = self._blocks, self._maxes
        find = bisect.bisect_right if after else bisect.bisect_left
        i = find(maxes, key)
        if i == len(blocks):
            return iter(())
        j = find(blocks[i], key)
        return chain(blocks[i][j:], chain.from_iterable(blocks[i + 1:]))

    def add(self, key: K) -> None:
        blocks, maxes = self._blocks, self._maxes
        self._len += 1
        if not blocks:
            blocks.append([key])
            maxes.append(key)
            return
        i = bisect.bisect_right(maxes, key)
        if i == len(maxes):  # past every key: the common case of a newest job
            i -= 1
            block = blocks[i]
            block.append(key)
            maxes[i] = key
        else:
            block = blocks[i]
            bisect.insort_right(block, key)
        if len(block) > 2 * LOAD:
            blocks[i:i + 1] = [block[:LOAD], block[LOAD:]]
            maxes[i:i + 1] = [block[LOAD - 1], block[-1]]

    def remove(self, key: K) -> bool:
        """Remove one ``key``; False (changing nothing) when there is none."""
        maxes = self._maxes
        i = bisect.bisect_left(maxes, key)
        if i == len(maxes):
            return False
        block = self._blocks[i]
        j = bisect.bisect_left(block, key)
        if j == len(block) or block[j] != key:
            return False
        del block[j]
        self._len -= 1
        if not block:
            del self._blocks[i], maxes[i]
        elif j == len(block):
            maxes[i] = block[-1]
        return True
