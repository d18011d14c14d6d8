"""Requests, refusals and tokens per API key id over the stats window, in bounded memory, merged across processes."""

from __future__ import annotations

import logging
from typing import Final

from gateway.contracts import ENGINE_ERROR, Outcome

log = logging.getLogger("shapegate.stats")

# The window is cut into this many slots: a sum covers the window to within one slot (4 s of the default 60 s).
SLOTS: Final = 15
# Distinct key ids counted at once; the rest of the window's traffic is counted under OTHER. Keys are few (the
# key store holds at most 10,000) and only those used within the window are kept: this bounds the memory.
MAX_KEYS: Final = 1000
OTHER: Final = "(other keys)"  # not a valid key id (gateway/keys/keystore.py ID_PATTERN): never one's name
# A row's counters, in the order of a summary's lists.
FIELDS: Final = ("requests", "engine_errors", "refused", "prompt_tokens", "completion_tokens")
MAX_COUNT: Final = 2 ** 53


class KeyUsage:
    """Per key id: attempts on backends (as the feed counts requests), their engine errors, requests refused
    before any backend, and the tokens the engines reported. Written by the record stage (off the request path)
    and on refusals; read by this process's stats summary about once a second."""

    def __init__(self, window_s: float, max_keys: int = MAX_KEYS) -> None:
        self._max_keys = max_keys
        self._window_s = window_s
        self._slot_s = window_s / SLOTS
        # id -> its slots, oldest first, each [slot number, *FIELDS counts]; at most SLOTS + 1 of them.
        self._rows: dict[str, list[list[int]]] = {}
        self._swept = -1  # the slot in which keys idle for a window were last dropped when the cap was reached

    def _restart(self, window_s: float) -> None:
        self._window_s = window_s
        self._slot_s = window_s / SLOTS
        self._rows = {}
        self._swept = -1

    def _sweep(self, slot: int) -> None:
        """Drop the keys with nothing in the window ending at `slot`."""
        first = slot - SLOTS + 1
        for key in [k for k, row in self._rows.items() if row[-1][0] < first]:
            del self._rows[key]

    def _slot(self, key: str, now: float) -> list[int]:
        slot = int(now / self._slot_s)
        row = self._rows.get(key)
        if row is None:
            if len(self._rows) >= self._max_keys and key != OTHER:
                if self._swept != slot:  # at most one sweep a slot, however many new keys come
                    self._swept = slot
                    self._sweep(slot)
                if len(self._rows) >= self._max_keys:
                    return self._slot(OTHER, now)
            row = self._rows[key] = []
        if row and row[-1][0] == slot:
            return row[-1]
        counts = [slot, 0, 0, 0, 0, 0]
        row.append(counts)
        if len(row) > SLOTS + 1:
            del row[0]
        return counts

    def add(self, key: str, o: Outcome, now: float) -> None:
        """One attempt on a backend by `key` ended (`now`: time.monotonic())."""
        counts = self._slot(key, now)
        counts[1] += 1
        if o.result == ENGINE_ERROR:
            counts[2] += 1
        counts[4] += o.prompt_tokens
        counts[5] += o.completion_tokens

    def refuse(self, key: str, now: float) -> None:
        """A request of `key` was refused before any backend was tried (its rate limit, no backend, ...)."""
        self._slot(key, now)[3] += 1

    def summary(self, now: float, window_s: float) -> dict[str, list[int]]:
        """Each key's FIELDS over the window; keys without any drop out of memory here."""
        if window_s != self._window_s:
            # Slots of another length do not add up with the new ones: the counts start again ([stats] reloaded).
            self._restart(window_s)
        first = int(now / self._slot_s) - SLOTS + 1
        out: dict[str, list[int]] = {}
        idle: list[str] = []
        for key, row in self._rows.items():
            total = [0, 0, 0, 0, 0]
            for counts in row:
                if counts[0] >= first:
                    for i in range(5):
                        total[i] += counts[i + 1]
            if any(total):
                out[key] = total
            else:
                idle.append(key)
        for key in idle:
            del self._rows[key]
        return out


def read_usage(raw: object) -> dict[str, list[int]]:
    """A summary's per-key figures as another process wrote them, checked as a client's input would be
    (ValueError, TypeError otherwise)."""
    if not isinstance(raw, dict) or len(raw) > MAX_KEYS + 1:
        raise ValueError("not a table of at most MAX_KEYS keys")
    out: dict[str, list[int]] = {}
    for key, counts in raw.items():
        if not isinstance(key, str) or not isinstance(counts, list) or len(counts) != len(FIELDS):
            raise ValueError(f"a row {str(key)[:64]!r} of {type(counts).__name__}")
        for n in counts:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
                raise ValueError(f"a count of {n!r}")
        out[key] = counts
    return out


def merge_usage(summaries: list[dict]) -> dict[str, dict[str, int]]:
    """The per-key figures of several processes' summaries added up ({id: {field: n}}); a process whose figures
    are malformed is left out (and logged), as merge.py leaves out a malformed summary."""
    totals: dict[str, list[int]] = {}
    for s in summaries:
        try:
            usage = read_usage(s.get("keys", {}))
        except (ValueError, TypeError) as e:
            log.warning("ignoring the per-key figures of worker %s: %s", s.get("worker"), e)
            continue
        for key, counts in usage.items():
            into = totals.setdefault(key, [0] * len(FIELDS))
            for i, n in enumerate(counts):
                into[i] = min(into[i] + n, MAX_COUNT)
    return {key: dict(zip(FIELDS, counts)) for key, counts in totals.items()}
