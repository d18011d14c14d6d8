"""Breaker openings one process saw, held by every replica: an engine that failed on one is kept off by all for the
rest of the opener's cool-down (gateway/ops/replica_sync.py carries them through one Redis hash)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import orjson

from gateway.errors import MAX_RETRY_AFTER_S
from gateway.ops.replica_checks import MALFORMED
from gateway.stats.share import wall_time

if TYPE_CHECKING:
    from gateway.fleet.pool import Pool

log = logging.getLogger("shapegate.replicas")

BREAKER_KEY: Final = "breakers"  # a hash: a field per backend, the latest opening any process saw there
BREAKER_KEEP_S: Final = 180.0  # longer than any hold (an engine's Retry-After is capped at 120 s; see max_hold_s)


class BreakerShare:
    """A breaker that opens here is written to one Redis hash (a field per backend); the others' openings are
    applied once each (see Breaker.hold): they keep requests off the engine for the rest of the opener's hold."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.pending: dict[str, float] = {}  # backend -> opened_until (monotonic), not yet written to Redis
        self._seq = 0
        self._seen: dict[str, bytes] = {}  # backend -> the field's value last read (each opening applies once)
        self.wake = asyncio.Event()

    def opened(self, backend: str, until: float) -> None:
        """Breaker.on_open, on the request path: take note and wake the loop; the write happens there."""
        self.pending[backend] = until
        self.wake.set()

    def outgoing(self, now_wall: float, now_mono: float) -> dict[str, bytes]:
        out = {}
        for bid, until in list(self.pending.items()):
            if until <= now_mono:
                del self.pending[bid]  # over before it could be told: nothing to tell
                continue
            self._seq += 1
            out[bid] = orjson.dumps({"by": self.me, "n": self._seq, "at": now_wall, "hold_s": until - now_mono})
        return out

    def sent(self, written: Mapping[str, bytes], until: Mapping[str, float]) -> None:
        for bid in written:
            if self.pending.get(bid) == until.get(bid):
                del self.pending[bid]  # unless it opened again meanwhile

    def apply(self, rows: Mapping[str, bytes], pool: Pool, now_wall: float, now_mono: float,
              max_hold: float = MAX_RETRY_AFTER_S) -> int:
        """Apply the openings other processes wrote since the last read; returns how many held a breaker open.

        An entry is read as a client's input: its hold is cut to `max_hold` (the longest this gateway holds a
        breaker open on its own: max_hold_s), one written in the future is left out, and when an entry goes
        (or another replaces it) the hold it applied ends with it (Breaker.end_hold)."""
        applied = 0
        for bid in [bid for bid in self._seen if bid not in rows]:
            del self._seen[bid]
            self._end_hold(pool, bid, now_mono)
        for bid, raw in rows.items():
            if self._seen.get(bid) == raw:
                continue
            if bid in self._seen:
                self._end_hold(pool, bid, now_mono)
            self._seen[bid] = raw
            try:
                left = self._left(raw, now_wall, max_hold)
            except MALFORMED as err:
                log.warning("ignoring a malformed breaker entry for %r: %r", bid, err)
                continue
            b = pool.get(bid)
            if b is None or left is None or left <= 0:
                continue
            if b.breaker.hold(now_mono + left, now_mono):
                applied += 1
                log.info("breaker of %s held open for %.1f s: it opened on another replica", bid, left)
        return applied

    def _left(self, raw: bytes, now_wall: float, max_hold: float) -> float | None:
        """What is left of another process's opening (None: it is this process's own)."""
        e = orjson.loads(raw)
        by, at, hold_s = e["by"], wall_time(e["at"], now_wall), e["hold_s"]
        if not isinstance(by, str):
            raise TypeError("no opener")
        if at is None:
            raise ValueError(f"opened at {e['at']!r}, not a time of the last while")
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not math.isfinite(hold_s):
            raise ValueError(f"a hold of {hold_s!r}")
        if by == self.me:
            return None
        return min(float(hold_s), max_hold) - max(now_wall - at, 0.0)

    @staticmethod
    def _end_hold(pool: Pool, bid: str, now_mono: float) -> None:
        b = pool.get(bid)
        if b is not None and b.breaker.end_hold(now_mono):
            log.info("breaker of %s no longer held open: the other replica's entry is gone", bid)
