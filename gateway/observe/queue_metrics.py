"""The queue's metrics: its length per priority and per configured key, and how each wait ended and how long it
took. Labels are bounded: three priorities, five outcomes, the configuration's key ids (any other key is "other")."""

from __future__ import annotations

from typing import Any, Callable, Final, Iterable

from prometheus_client import CollectorRegistry, Gauge

from gateway.config_queue import PRIORITIES

WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
OUTCOMES: Final = ("served", "left", "timeout", "deadline", "full")


class QueueMetrics:
    """Set when the queue changes (never on the path of a request that does not wait)."""

    def __init__(self, histogram: Callable[..., Any], counter: Callable[..., Any], registry: CollectorRegistry,
                 key_ids: Callable[[], Iterable[str]]) -> None:
        self.wait = histogram("shapegate_queue_wait_seconds", "Time requests waited in the gateway's queue for a "
                              "seat, by priority and how the wait ended (served, left, timeout, deadline, full)",
                              ["priority", "outcome"], WAIT_BUCKETS)
        self.length = Gauge("shapegate_queue_length", "Requests waiting in the gateway's queue, by priority",
                            ["priority"], registry=registry, multiprocess_mode="livesum")
        self.by_key = Gauge("shapegate_queue_length_by_key", "Requests waiting in the gateway's queue, by configured "
                            "key (run-time keys: other)", ["key"], registry=registry, multiprocess_mode="livesum")
        self._key_ids = key_ids
        self._lit: set[str] = set()
        for p in PRIORITIES:
            self.length.labels(p).set(0)

    def ended(self, priority: str, outcome: str, waited: float) -> None:
        self.wait.labels(priority, outcome).observe(waited)

    def changed(self, queue: Any) -> None:
        for p, n in zip(PRIORITIES, queue.order.level_lengths()):
            self.length.labels(p).set(n)
        named = set(self._key_ids())
        counts: dict[str, int] = {}
        for key, n in queue.order.key_lengths().items():
            label = key if key in named else "other"
            counts[label] = counts.get(label, 0) + n
        for label in self._lit - counts.keys():
            self.by_key.labels(label).set(0)  # (a key no longer waiting reads 0, not its last length)
        for label, n in counts.items():
            self.by_key.labels(label).set(n)
        self._lit = set(counts)
