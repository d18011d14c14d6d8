"""The order waiting requests leave the queue in: priority first, then a weighted fair share across keys, then, within
one key, the soonest first-token target. Pure and synchronous: no clock, no I/O (the caller brings the times)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Final, Iterator

MAX_IDLE_KEYS: Final = 4096  # keys remembered per level before the idle ones are forgotten


class Waiter:
    """One waiting request as the order sees it; `item` is whatever the caller keeps with it."""

    __slots__ = ("level", "key", "due", "seq", "item", "gone")

    def __init__(self, level: int, key: str, due: float, seq: int, item: Any) -> None:
        self.level = level  # 0 first
        self.key = key
        self.due = due  # when its first-token target (or its client's deadline) ends: sooner goes first in its key
        self.seq = seq  # arrival order: ties go to the earlier
        self.item = item
        self.gone = False  # taken out (granted, refused, or its client left): skipped where still listed

    def __lt__(self, other: Waiter) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


class _Key:
    """One key's waiting requests at one priority, and the service it was given there (its virtual time)."""

    __slots__ = ("heap", "vt", "count")

    def __init__(self, vt: float) -> None:
        self.heap: list[Waiter] = []
        self.vt = vt  # service given, divided by the key's weight: the least served key goes first
        self.count = 0  # waiters still in it (the heap may also hold ones that are gone)


class FairOrder:
    """Waiters by priority level; within a level, start-time fair queueing over keys: each grant adds 1/weight to
    its key's virtual time, and a key that starts waiting again resumes at the level's virtual time, so a key
    that sends many requests waits behind the keys that send few, and one that was idle banks no credit."""

    def __init__(self, levels: int, weight: Callable[[str], float]) -> None:
        self._levels: list[dict[str, _Key]] = [{} for _ in range(levels)]
        self._vtime = [0.0] * levels  # per level: the virtual time of the latest grant
        self._weight = weight
        self._seq = itertools.count()
        self.length = 0

    def add(self, level: int, key: str, due: float, item: Any) -> Waiter:
        keys = self._levels[level]
        k = keys.get(key)
        if k is None:
            if len(keys) >= MAX_IDLE_KEYS:
                self._forget_idle(level)
            k = keys[key] = _Key(self._vtime[level])
        elif k.count == 0:
            k.vt = max(k.vt, self._vtime[level])  # idle meanwhile: no credit banked
        w = Waiter(level, key, due, next(self._seq), item)
        heapq.heappush(k.heap, w)
        k.count += 1
        self.length += 1
        return w

    def remove(self, w: Waiter) -> None:
        """Take a waiter out without serving it (refused, or its client left): its key is not charged."""
        if w.gone:
            return
        w.gone = True
        self.length -= 1
        k = self._levels[w.level][w.key]
        k.count -= 1
        if k.count == 0:
            k.heap.clear()  # only the gone were left

    def grant(self, w: Waiter) -> None:
        """Serve a waiter: out of the order, its key charged one request over its weight."""
        keys = self._levels[w.level]
        k = keys[w.key]
        self._vtime[w.level] = max(self._vtime[w.level], k.vt)
        k.vt += 1.0 / self._weight(w.key)
        self.remove(w)

    def _forget_idle(self, level: int) -> None:
        """Keys with nothing waiting whose charge the level's virtual time has caught up with: they would come
        back at that time anyway."""
        keys, vt = self._levels[level], self._vtime[level]
        for name in [n for n, k in keys.items() if k.count == 0 and k.vt <= vt]:
            del keys[name]

    def in_order(self) -> Iterator[Waiter]:
        """Every waiter, first to be served first. A caller that grants one must start again (the order changed)."""
        for keys in self._levels:
            if not keys:
                continue
            waiting = [(k.vt, _head(k).seq, k) for k in keys.values() if k.count]
            for _, _, k in sorted(waiting, key=lambda t: t[:2]):
                yield from sorted(w for w in k.heap if not w.gone)

    def level_lengths(self) -> list[int]:
        return [sum(k.count for k in keys.values()) for keys in self._levels]

    def key_lengths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for keys in self._levels:
            for name, k in keys.items():
                if k.count:
                    out[name] = out.get(name, 0) + k.count
        return out


def _head(k: _Key) -> Waiter:
    """A key's first live waiter (the ones gone are dropped from the heap's top on the way)."""
    while k.heap[0].gone:
        heapq.heappop(k.heap)
    return k.heap[0]
