"""The charts' recent past: the feed's per-backend figures sampled about once a second, in a ring of fixed size."""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

# What each chart draws (dashboard.js CHARTS has the same ids), and where it is in a backend's row of the feed.
FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ttft_p50", ("overall", "ttft_ms", "p50")),
    ("ttft_p99", ("overall", "ttft_ms", "p99")),
    ("itl_p50", ("overall", "itl_ms", "p50")),
    ("output_tps", ("overall", "output_tps")),
    ("rps", ("overall", "rps")),
    ("error_rate", ("overall", "error_rate")),
    ("waiting", ("load", "waiting")),
    ("in_flight", ("in_flight",)),
)
INTERVAL_S = 1.0  # the feed's own resolution: the page polls it once a second
SPAN_S = 600.0  # ten minutes: what a page shows as soon as it opens
# Backends kept per point: with the ring's length, this bounds the memory (600 x 64 x 8 doubles, 2.5 MB at most;
# a few backends take some 100 KB).
MAX_BACKENDS = 64

Point = tuple[float, tuple[str, ...], array]  # (the feed's wall-clock `now`, backend ids, FIELDS per id in a row)


def _figure(row: Mapping[str, Any], path: tuple[str, ...]) -> float:
    v: Any = row
    for key in path:
        if not isinstance(v, Mapping):
            return math.nan
        v = v.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return math.nan
    return float(f"{v:.4g}")  # four figures are what a chart can show; the reply is half as long


class FeedHistory:
    """The last SPAN_S of the feed, one point per INTERVAL_S, taken on a timer (never per request)."""

    def __init__(self, span_s: float = SPAN_S, interval_s: float = INTERVAL_S,
                 max_backends: int = MAX_BACKENDS) -> None:
        self.interval_s = interval_s
        self.span_s = span_s
        self._max_backends = max_backends
        self._points: deque[Point] = deque(maxlen=max(int(span_s / interval_s), 1))
        self._next = 0.0  # time.monotonic() at which the next point is due
        self._failing = False
        self._scope: object = None  # the feed's own `scope` (which processes its figures cover)

    def __len__(self) -> int:
        return len(self._points)

    def add(self, feed: Mapping[str, Any]) -> None:
        """One point from a feed payload (as /dashboard/feed serves it)."""
        rows = [b for b in feed.get("backends") or () if isinstance(b, Mapping) and isinstance(b.get("id"), str)]
        rows = rows[:self._max_backends]
        ids = tuple(b["id"] for b in rows)
        if self._points and self._points[-1][1] == ids:
            ids = self._points[-1][1]  # one tuple shared by every point while the backends stay the same
        values = array("d", (_figure(b, path) for b in rows for _, path in FIELDS))
        self._points.append((float(feed["now"]), ids, values))
        self._scope = feed.get("scope")

    def sample(self, feed: Callable[[], Mapping[str, Any]], now_m: float) -> None:
        """Take a point from `feed()` if one is due at `now_m` (time.monotonic()); called on a timer. A feed
        that fails leaves a gap in the charts, as it does on the page, and is logged once per failing spell."""
        if now_m < self._next:
            return
        self._next += self.interval_s
        if self._next <= now_m:  # late (or the first point): the next one an interval from now
            self._next = now_m + self.interval_s
        try:
            self.add(feed())
        except Exception:
            if not self._failing:
                log.exception("the dashboard's history could not sample the feed; its charts show a gap")
            self._failing = True
            return
        self._failing = False

    def report(self) -> dict[str, Any]:
        """The ring as columns: `t` (wall clock), and per backend per field one value or null per point."""
        fields = [name for name, _ in FIELDS]
        n, width = len(self._points), len(FIELDS)
        series: dict[str, dict[str, list[float | None]]] = {}
        times: list[float] = []
        for i, (t, ids, values) in enumerate(self._points):
            times.append(t)
            for j, bid in enumerate(ids):
                per = series.get(bid)
                if per is None:
                    per = series[bid] = {name: [None] * n for name in fields}
                for k, name in enumerate(fields):
                    v = values[j * width + k]
                    if v == v:  # not NaN
                        per[name][i] = v
        return {"now": time.time(), "scope": self._scope, "interval_s": self.interval_s, "span_s": self.span_s,
                "fields": fields, "t": times, "backends": series}
