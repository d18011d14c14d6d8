"""Engines' seat counts that one process learned, known to every replica and to the processes that come later.

A seat count that is configured or read from llama.cpp's slots is known from the start; vLLM's and SGLang's are
learned from their load scrapes (gateway/queueing/seats.py), which takes a fresh process seconds of overload, and
until then it sends an engine more than it runs (they wait in the engine's first-come queue). So each process
writes what it learned of an engine (the most it saw running, and the most it saw running while the engine queued
more: BackendState.peak_running and full_at) into one Redis hash, a field per backend, beside the engine's URL, and
takes the larger of its own and the hash's. Both are the engine's own figures (its running count covers every replica's requests), so the largest any
process saw is the truest.

An entry is read as a client's input: one that is malformed, past MAX_SEATS or for another URL (the backend id now
names another engine) is left out, and the writers' next round replaces it."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

import orjson

from gateway.ops.replica_checks import MALFORMED

if TYPE_CHECKING:
    from gateway.fleet.pool import BackendState

log = logging.getLogger("shapegate.replicas")

SEATS_KEY: Final = "seats"  # a hash: a field per backend
# Kept a day after the last write or refresh: every process refreshes it each round while it knows a count, so it
# outlives restarts of the whole fleet, not the engines' redeployments long after.
SEATS_KEEP_S: Final = 86400.0
MAX_SEATS: Final = 4096  # far more than any engine runs at once: a larger figure is not one a process wrote


class Entry:
    """What one field says: the engine's URL, and the two counts."""

    __slots__ = ("url", "full", "peak")

    def __init__(self, url: str, full: int, peak: int) -> None:
        self.url, self.full, self.peak = url, full, peak

    @classmethod
    def read(cls, raw: bytes) -> Entry:
        e = orjson.loads(raw)
        url, full, peak = e["url"], e["full"], e["peak"]
        if not isinstance(url, str):
            raise TypeError("no URL")
        for n in (full, peak):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_SEATS:
                raise ValueError(f"a count of {n!r}")
        if full > peak:
            raise ValueError(f"full at {full} beyond the most seen running ({peak})")
        return cls(url, full, peak)


class SeatShare:
    """The counts as last read from Redis, what to write, and what to take."""

    def __init__(self) -> None:
        self._read: dict[str, Entry] = {}  # backend -> its entry as last read (readable ones)
        self._refused: dict[str, bytes] = {}  # backend -> the entry left out (logged once per value)

    def outgoing(self, backends: Iterable[BackendState]) -> dict[str, bytes]:
        """The entries to write: a backend this process knows more of than the hash said at the last read."""
        out = {}
        for b in backends:
            # (as written: an engine that reported more running than MAX_SEATS is not written again every round)
            full, peak = min(b.full_at, MAX_SEATS), min(b.peak_running, MAX_SEATS)
            if not peak:
                continue  # nothing learned yet
            known = self._read.get(b.id)
            if known is not None and known.url == b.cfg.url and known.full >= full and known.peak >= peak:
                continue
            out[b.id] = orjson.dumps({"url": b.cfg.url, "full": full, "peak": peak})
        return out

    def take(self, rows: Mapping[str, bytes], backends: Mapping[str, BackendState]) -> int:
        """Raise each backend's counts to its entry's; returns how many backends learned something."""
        self._read = {}
        learned = 0
        for bid, raw in rows.items():
            try:
                entry = Entry.read(raw)
            except MALFORMED as e:
                if self._refused.get(bid) != raw:
                    log.warning("ignoring a malformed seat count entry for %r: %r", bid, e)
                    self._refused[bid] = raw
                continue
            self._refused.pop(bid, None)
            self._read[bid] = entry
            b = backends.get(bid)
            if b is None or entry.url != b.cfg.url:
                continue
            grew = False
            if entry.peak > b.peak_running:
                b.peak_running, grew = entry.peak, True
            if entry.full > b.full_at:
                b.full_at, grew = entry.full, True
            learned += grew
        for bid in [bid for bid in self._refused if bid not in rows]:
            del self._refused[bid]
        return learned
