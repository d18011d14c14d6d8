"""The event loop's own health: how late its timers fire (lag) and how long garbage collections hold it."""

from __future__ import annotations

import asyncio
import gc
from time import perf_counter
from typing import Any, Callable

TICK_S = 0.05  # the lag probe's period: 20 wake-ups a second cost nothing measurable


async def watch_lag(observe: Callable[[float], None], gc_watch: GcWatch | None = None) -> None:
    """Forever: sleep TICK_S and record how much later than asked the loop woke this task up (and hand the
    collections timed meanwhile to their histogram)."""
    while True:
        t = perf_counter()
        await asyncio.sleep(TICK_S)
        observe(max(perf_counter() - t - TICK_S, 0.0))
        if gc_watch is not None:
            gc_watch.drain()


class GcWatch:
    """A gc callback timing each collection; installed once per process, removed at shutdown.

    The callback only appends to a list: a collection can start inside any allocation, also inside a metric's
    observe() holding that metric's (non-reentrant) lock, so observing from the callback could deadlock. The
    lag task hands the pauses to `observe` between ticks.
    """

    MAX_PENDING = 10_000

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._start = 0.0
        self._pending: list[tuple[int, float]] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = perf_counter()
        elif len(self._pending) < self.MAX_PENDING:
            self._pending.append((info["generation"], perf_counter() - self._start))

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for generation, seconds in pending:
            self._observe(generation, seconds)

    def install(self) -> None:
        gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


# Tracked objects allocated (net of those freed) between young collections. Python's 700 is less than what
# 64 requests in flight hold alive: at c=64 a young collection ran every ~40 requests. At 10,000 one runs
# when the live state really grows (while thousands of streams open), which also leaves fewer objects
# promoted to the old generations and so fewer full collections.
YOUNG_THRESHOLD = 10_000
_thresholds: tuple[int, int, int] | None = None


def settle_heap() -> None:
    """Before serving: what start-up made (modules, config, pools) leaves the collector's view, and the young
    generation is sized for a server's requests in flight (YOUNG_THRESHOLD).

    A full collection walks every tracked object; with the ~70,000 that importing the gateway and its
    libraries leaves, each one held the loop for 20-90 ms under load (several a second at c=64), which was
    the p99 of non-streamed requests. Frozen, they are never walked again; garbage is collected first so
    that none of it is kept.
    """
    global _thresholds
    gc.collect()
    gc.freeze()
    if _thresholds is None:
        _thresholds = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, *_thresholds[1:])


def release_heap() -> None:
    """At shutdown: frozen objects become collectable again and the thresholds are as they were (tests run many
    gateways in one process)."""
    global _thresholds
    gc.unfreeze()
    if _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None
